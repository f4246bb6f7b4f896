"""Both RLHFuse passes end to end: tests/e2e/tiny_fused.rlhf, whose actor and critic both train in two
megatron-core pipeline stages on the same two cores (gloo), run with ``tail_migrate`` (the actor's generation on
its two ranks, streamed to the forwards, the tails on one rank) and ``fuse_training`` (actor and critic trained
as one interleaved schedule), against the same job with neither.

* The same token ids and metrics within 1e-4 (a moved row's log-probs come from a prefill; streamed forwards run
  over fewer rows). Fused training alone is bit for bit unfused training: tests/runtime/test_fused_train.py.
* The measured trace shows the fused schedule: each training call's forward and backward steps as nested spans;
  on each device (the actor's stage ``d`` and the critic's stage ``1 − d``, its ranks pinned to the cores in
  reverse) they ran in the order the pass wrote, the two models' steps interleaved.
"""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.contract.plan import load_plan
from rlhfc.ir.plan import Fused
from rlhfc.runtime.job import run_job

from .conftest import HERE, close, compile_job, job_step, recording, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("shared_ray"),
              pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None,
                                 reason="megatron-core is an optional extra: pip install -e '.[megatron]'")]

PROGRAM = os.path.join(HERE, "tiny_fused.rlhf")
PASSES = ["dce", "parallelize", "placement{strategy=flatten}"]
BOTH = ["dce", "parallelize", "stream{chunk=2}", "placement{strategy=flatten}", "tail_migrate", "fuse_training"]
NO_DECODE_STEPS = lambda rows: [{k: v for k, v in r.items() if k != "decode_steps"} for r in rows]  # noqa: E731


def test_both_rlhfuse_passes_train_as_neither_and_each_device_runs_the_fused_order(tmp_path):
    runs = {}
    for name, passes in (("both", BOTH), ("plain", PASSES)):
        job = compile_job(PROGRAM, str(tmp_path / f"job_{name}"), level=None, passes=passes)
        samples: list = []
        rows = run_job(job, recording(job_step(job), samples), out=str(tmp_path / f"run_{name}"), progress=False,
                       trace=name == "both")
        runs[name] = (untimed(rows, layout=True), samples, job)
    code = open(os.path.join(runs["both"][2], "main.py")).read()
    assert "tail={'ranks': w.actor.ranks" in code and "fused=job.fused(0, [" in code
    assert runs["both"][1] == runs["plain"][1]   # the same token ids
    assert close(NO_DECODE_STEPS(runs["both"][0]), NO_DECODE_STEPS(runs["plain"][0]))
    plan = load_plan(os.path.join(runs["both"][2], "plan.json"))
    assert plan.placement.workers["critic"].reversed_stages and not plan.placement.workers["actor"].reversed_stages
    line = next(x for x in code.splitlines() if "actor_train = " in x)
    orders = Fused(0, "critic_train", tuple(eval(line.split("job.fused(0, ", 1)[1].rsplit("))", 1)[0]))
                   ).device_orders()
    with open(tmp_path / "run_both" / "trace.json") as fh:
        trace = json.load(fh)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    pid = {model: p for p, n in names.items() for model in ("actor", "critic") if n == f"worker {model}"}
    for step in range(2):
        for d, order in enumerate(orders):
            ran = sorted((e["ts"], 0 if e["pid"] == pid["actor"] else 1, e["args"]["fused"], e["args"]["micro"])
                         for e in trace["traceEvents"]
                         if e.get("cat") == "fused" and e["args"].get("schedule") == 0
                         and (e["pid"], e["tid"]) in ((pid["actor"], d), (pid["critic"], 1 - d))
                         and _step_of(trace, e) == step)
            assert [(m, k, j) for _, m, k, j in ran] == order, (step, d)
            roles = [m for _, m, _, _ in ran]
            assert roles != sorted(roles)   # interleaved, not one model's steps then the other's


def _step_of(trace: dict, event: dict) -> int:
    steps = [(e["ts"], e["ts"] + e["dur"], int(e["name"].split()[1])) for e in trace["traceEvents"]
             if e.get("ph") == "X" and e.get("name", "").startswith("step ")]
    return next(n for a, b, n in steps if a <= event["ts"] <= b)
