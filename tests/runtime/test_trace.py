"""The measured timeline's parts that need no Ray: workers recording their stage calls, the driver's spans
and the trace.json it writes (the e2e run with --trace: tests/e2e/test_job.py)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import torch

from rlhfc.runtime.worker.stages import stage_call
from rlhfc.runtime.worker.trace import Timeline, TracedWorker, work_of


def _roll(prompt_lengths, response_lengths):
    batch = SimpleNamespace(prompt_lengths=torch.tensor(prompt_lengths),
                            response_lengths=torch.tensor(response_lengths))
    return SimpleNamespace(batch=batch)


class Worker(TracedWorker):
    threads = 2

    @stage_call
    def logprobs(self, rollout, *, temperature: float = 1.0):
        return self.inner(rollout)

    @stage_call
    def inner(self, rollout):   # a stage method another one calls: recorded once, as the outer call
        return rollout

    @stage_call
    def generate_chunks(self, prompts, *, chunk: int):
        for i in range(0, len(prompts), chunk):
            yield _roll([2] * len(prompts[i:i + chunk]), [3] * len(prompts[i:i + chunk]))


def test_worker_records_its_calls_only_while_tracing_with_rows_and_tokens():
    w = Worker()
    roll = _roll([3, 4], [5, 1])
    w.logprobs(roll)
    assert w.trace_spans() == []            # not tracing: nothing kept
    assert w.trace_start()["pid"] > 0
    w.logprobs(roll, threads=1)
    gen = w.generate_chunks(["a", "b", "c"], chunk=2)
    next(gen)
    time.sleep(0.02)                         # the consumer holds the first chunk: time the worker was not working
    list(gen)
    spans = w.trace_spans()
    assert [s["method"] for s in spans] == ["logprobs", "generate_chunks"]
    assert spans[0]["rows"] == 2 and spans[0]["tokens"] == 13 and spans[0]["threads"] == 1
    assert spans[1]["rows"] == 3 and spans[1]["tokens"] == 15 and [n for _, n in spans[1]["chunks"]] == [2, 1]
    assert all(s["t1"] >= s["t0"] for s in spans)
    # what the span's wall time was: the call's own CPU time, and a streamed call's time suspended at its yields
    assert all(0 <= s["cpu_ms"] <= (s["t1"] - s["t0"]) * 1e3 + 1.0 for s in spans)
    assert spans[1]["yield_ms"] >= 19.0 and "yield_ms" not in spans[0]
    assert w.trace_spans() == []            # drained


def test_work_of_counts_rows_and_tokens_of_what_stages_pass():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert work_of(SimpleNamespace(mask=mask)) == {"rows": 2, "tokens": 3}
    assert work_of(SimpleNamespace(rollout=_roll([1], [2]))) == {"rows": 1, "tokens": 3}
    assert work_of((torch.zeros(4, 5), torch.zeros(4, 5))) == {"rows": 4}
    assert work_of(["p", "q"]) == {"rows": 2}
    assert work_of(None) == {}


def test_timeline_writes_valid_trace_events_with_driver_sync_and_worker_tracks(tmp_path):
    import time

    from rlhfc.contract import plan as contract

    plan = SimpleNamespace(module="m", placement=SimpleNamespace(workers={"actor": None, "actor_gen": None}),
                           graph=contract.GraphPlan("g", {}, (
                               contract.StagePlan("roll", "generate", "actor", ("prompts",), ("roll",)),
                               contract.StagePlan("adv", "compute.gae", None, ("roll",), ("adv",)),
                               contract.StagePlan("sync_actor", "sync", "actor", (), ()))))
    tl = Timeline(str(tmp_path), plan, "job")
    t = tl.begin_step(0)
    tl.driver("adv", time.perf_counter(), "compute", value=(torch.zeros(3, 2),))
    tl.driver("sync_actor", time.perf_counter(), "sync", extra={"bytes": 10, "buckets": 1})
    tl.driver("roll", time.perf_counter(), "wait")
    tl.span(tl.pid["actor"], 0, "roll", "generate", t, t + 0.5, {"stage": "roll", "rows": 4})
    tl.end_step(0, t, {})
    tl.write()
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
             and e["name"] in ("process_name", "thread_name")}
    assert names[(1, None)] == "driver" and names[(2, None)] == "syncs"
    assert names[(10, None)] == "worker actor" and names[(11, None)] == "worker actor_gen"
    assert names[(2, 1)] == "sync_actor"
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans["adv"]["tid"] == 2 and spans["adv"]["args"]["rows"] == 3
    assert spans["sync_actor"]["pid"] == 2 and spans["sync_actor"]["args"]["bytes"] == 10
    assert spans["wait roll"]["cat"] == "wait" and spans["step 0"]["tid"] == 1
    assert spans["roll"]["dur"] == 500000.0
    # resume: a new timeline keeps the earlier session's spans of steps before the checkpoint
    again = Timeline(str(tmp_path), plan, "job")
    again.start({}, resumed_at=1)
    assert {e["name"] for e in again.events if e["ph"] == "X"} == set(spans)
