"""benchmarks/step_profile.py: where a step's time goes, read from a measured trace (rlhfc's side)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _profile():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks" / "step_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat, ts, dur, pid=10, tid=0):
    return {"ph": "X", "cat": cat, "name": cat, "pid": pid, "tid": tid, "ts": ts * 1e6, "dur": dur * 1e6,
            "args": {"step": 0}}


def test_families_are_unions_of_their_spans_and_idle_is_what_no_span_covers(tmp_path):
    events = [
        _x("step", 0, 10), _x("step", 10, 10),
        # step 0: generation on two ranks (overlapping: 0-4 and 1-5 cover 5 s), a forward streamed beside it
        _x("generate", 0, 4, tid=0), _x("generate", 1, 4, tid=1), _x("forward", 3, 3, pid=11),
        _x("train", 7, 2), _x("sync", 9, 0.5, pid=2), _x("compute", 6, 0.5, pid=1), _x("wait", 0, 10, pid=1),
        # step 1: a span running across the boundary counts in each step for its part
        _x("train", 9.5, 1.5), _x("generate", 12, 6),
        {"ph": "M", "name": "process_name", "pid": 10, "args": {"name": "actor"}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    prof = _profile()
    both = prof.trace_split(str(path), skip=0)   # medians of the two steps
    # step 0: generation 0-5, forwards 3-6, training 7-9 and 9.5-10, transfers 9-9.5, driver 6-6.5;
    # covered: 0-6.5 and 7-10 -> idle 0.5. step 1: training 10-11, generation 12-18 -> idle 3
    assert both["generation"] == pytest.approx((5 + 6) / 2) and both["training"] == pytest.approx((2.5 + 1) / 2)
    assert both["idle"] == pytest.approx((0.5 + 3) / 2)
    last = prof.trace_split(str(path), skip=1)
    assert last == {"step": pytest.approx(10), "generation": pytest.approx(6), "forwards": 0, "training": pytest.approx(1),
                    "transfers": 0, "driver": 0, "idle": pytest.approx(3)}
    assert prof.format_split(last, ("generation", "idle")) == "generation 6.00 s (60 %), idle 3.00 s (30 %)"
