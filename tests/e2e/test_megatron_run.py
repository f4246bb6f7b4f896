"""Mixed trainers in one job (``trainer = auto`` and a ``layout(...)`` per model): the actor as two FSDP2
ranks, the critic as two tensor-parallel and the reference as two pipeline-parallel megatron-core ranks,
the reward model as one process — seven processes on ``cpu:4`` — train like the same job with every model
in one process: the same sampled tokens and every metric of the first two steps within 1e-3 relative. The
actor's group reshards into full copies after each train stage (``realloc``'s reshard sync), and
generates on them."""

from __future__ import annotations

import json
import os
import re

import pytest

from rlhfc.frontend import compile_source
from rlhfc.passes import PIPELINES
from rlhfc.runtime.job import run_job

from .conftest import HERE, TIMING, compile_job, job_step, recording

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

#: what the plan must run: (trainer, dp, tp, pp) per model
LAYOUTS = {"actor": ("fsdp", 2, 1, 1), "critic": ("megatron", 1, 2, 1), "ref": ("megatron", 1, 1, 2),
           "reward": ("torch", 1, 1, 1)}


def _job(tmp_path, name: str, layouts: bool) -> str:
    text = open(os.path.join(HERE, "mixed_layouts.rlhf")).read()
    if not layouts:   # the same job, every model in one process
        text = re.sub(r" layout\([^)]*\)", "", text).replace("; trainer = auto", "")
    module, _ = compile_source(text, os.path.join(HERE, f"mixed_{name}.rlhf"))
    passes = PIPELINES["O1"] + ["realloc"]   # realloc: the generating actor's group reshards after training
    job = compile_job(module, str(tmp_path / name), level="O1", passes=passes, source="mixed_layouts.rlhf")
    main = open(os.path.join(job, "main.py")).read()
    assert ("job.reshard('actor_reshard'" in main) == layouts, main
    workers = json.load(open(os.path.join(job, "plan.json")))["placement"]["workers"]
    for w in workers.values():
        want = LAYOUTS[w["model"]] if layouts else ("torch", 1, 1, 1)
        assert (w["trainer"], w["dp"], w["tp"], w["pp"], w["ranks"]) == (*want, want[1] * want[2] * want[3]), w
    return job


def _rows(job: str, out: str, sizes: dict, samples: list) -> list[dict]:
    """The run's metric rows (no timings); ``sizes``: the ranks of each model's group; ``samples``: each
    step's sampled [(prompt, token ids)]."""
    own = job_step(job)

    def step(job, w):   # records how many ranks each model's group runs
        sizes.update({name: group.size for name, group in job.workers.items()})
        return own(job, w)

    return [{k: v for k, v in r.items() if k not in TIMING and not isinstance(v, dict)}
            for r in run_job(job, recording(step, samples), out=out, progress=False)]


def test_mixed_trainers_train_like_one_process_each(tmp_path):
    sizes_one, sizes, tok_one, tok_mixed = {}, {}, [], []
    one = _rows(_job(tmp_path, "one", False), str(tmp_path / "run_one"), sizes_one, tok_one)
    mixed = _rows(_job(tmp_path, "mixed", True), str(tmp_path / "run_mixed"), sizes, tok_mixed)
    assert set(sizes_one.values()) == {1}
    assert sizes == {"actor": 2, "critic": 2, "ref": 2, "reward": 1}
    with open(tmp_path / "run_mixed" / "metrics.jsonl") as fh:
        assert json.loads(fh.readline())["ranks"] == sizes   # each metrics row says what ran
    assert [r["step"] for r in mixed] == [0, 1]
    assert tok_mixed == tok_one and len(tok_one) == 2   # the same sampled token ids, row by row
    for a, b in zip(one, mixed):
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (k, a, b)
