"""The ``tail_migrate`` pass end to end: a policy generating on two FSDP ranks (tests/e2e/tiny_tail.rlhf, 40-token
responses of a random policy: a long tail), streamed in chunks of 4 to the reference and critic forwards.

* With and without the pass the job samples the same token ids and its metrics agree within the stated
  tolerance (1e-4 relative or 1e-6 absolute: a moved row decodes from its KV cache in another batch); the engine's step count (``decode_steps``) is a fact of the calls, not compared.
* The measured trace shows the migration: a rank's generate ends while the other's still runs (its process
  freed), the first rank continues the moved rows in a call of its own, and the forwards of finished chunks run
  before the last sample finishes.
"""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.runtime.job import run_job

from .conftest import HERE, close, compile_job, job_step, recording, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

PROGRAM = os.path.join(HERE, "tiny_tail.rlhf")
PASSES = ["dce", "unpad", "reuse_logprobs", "parallelize", "stream{chunk=4}", "placement", "recompute", "offload",
          "realloc", "threads"]


def _spans(trace: dict, name: str, step: int) -> list[tuple[float, float, int]]:
    return sorted((e["ts"], e["ts"] + e["dur"], e["tid"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("name") == name and e.get("args", {}).get("step") == step)


def test_the_tail_moves_to_one_rank_freeing_the_other_and_the_job_trains_as_without(tmp_path):
    runs = {}
    for name, passes in (("moved", PASSES[:6] + ["tail_migrate{move=kv}"] + PASSES[6:]), ("kept", PASSES)):
        job = compile_job(PROGRAM, str(tmp_path / f"job_{name}"), level=None, passes=passes)
        code = open(os.path.join(job, "main.py")).read()
        # moved with their KV caches through the driver (at this shape a re-prefill is priced the cheaper, and
        # move=auto takes it: tests/test_tail_migrate.py; re-prefilled tails: tests/runtime/test_tail.py)
        assert ("tail={'ranks': w.actor.ranks, 'below': 4, 'move': 'kv'}" in code) == (name == "moved")
        samples: list = []
        rows = run_job(job, recording(job_step(job), samples), out=str(tmp_path / f"run_{name}"), progress=False,
                       trace=name == "moved")
        runs[name] = ([{k: v for k, v in r.items() if k != "decode_steps"} for r in untimed(rows, layout=True)],
                      samples)
    assert runs["moved"][1] == runs["kept"][1]   # the same token ids, row by row, every step
    assert close(runs["moved"][0], runs["kept"][0]), (runs["moved"][0], runs["kept"][0])
    with open(tmp_path / "run_moved" / "trace.json") as fh:
        trace = json.load(fh)
    moved = 0
    for step in range(2):
        gens, refs = _spans(trace, "roll", step), _spans(trace, "ref_logp", step)
        end = max(b for _, b, _ in gens)
        assert any(a < end for a, _, _ in refs)   # a forward of finished rows before the last row finishes
        if len(gens) == 3:   # both ranks' own calls, then the first rank's continuation of the moved rows
            (a0, b0, _), (a1, b1, _), (a2, b2, t2) = sorted(gens, key=lambda g: g[1])
            assert b0 < a2 and b1 <= a2 + 1e3 and b2 == end   # the continuation starts once both ranks stopped
            assert min(b0, b1) < b2 - 1e3                     # one rank's process was free while the tail ran
            moved += 1
    assert moved >= 1


def test_the_rank_taking_the_tail_dying_stops_the_job_naming_the_stage_and_keeps_the_run(tmp_path):
    """Fault injection: the first rank dies as the driver hands it the other ranks' tails (step 1). The job stops
    at once with an error naming the generate and the death, and the run folder keeps the step it finished (the
    hint says where; resuming after a dead rank: tests/e2e/test_parallel_run.py)."""
    import ray

    from rlhfc.runtime.errors import JobError

    job = compile_job(PROGRAM, str(tmp_path / "job"), level=None,
                      passes=PASSES[:6] + ["tail_migrate{move=kv}"] + PASSES[6:])
    step = job_step(job)
    handed: list = []

    def killing(job_, w):
        if job_.step == 1:
            stream = job_.stream

            def migrating(stage, launch, *args, **kwargs):
                def launching(prompts, carry, **more):
                    if carry:   # the continuation of every rank's tail: its rank dies first
                        handed.append(len(carry))
                        ray.kill(w.actor.ranks[0], no_restart=True)
                    return launch(prompts, carry, **more)
                return stream(stage, launching, *args, **kwargs)

            job_.stream = migrating
        return step(job_, w)

    out = tmp_path / "run"
    with pytest.raises(JobError) as exc:
        run_job(job, killing, out=str(out), progress=False)
    assert handed and handed[0] > 0
    assert "roll" in exc.value.message and "died" in exc.value.message, exc.value.message
    # no checkpoint yet (every 2 steps): the hint says so and where the metrics are
    assert "no checkpoint was written yet" in exc.value.hint and str(out) in exc.value.hint, exc.value.hint
    with open(out / "metrics.jsonl") as fh:
        assert [json.loads(line)["step"] for line in fh] == [0]
