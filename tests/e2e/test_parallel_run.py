"""``run { trainer = fsdp }``: every model runs as a data-parallel group of FSDP2 ranks (two here, one per
core of ``cpu:2``) and trains like the single-process job: the same sampled tokens, every metric of the
first steps within 1e-3 relative (float rounding: rows and minibatches split over the ranks); its
checkpoint resumes under the other layout."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.frontend import compile_source
from rlhfc.runtime.job import run_job

from .conftest import HERE, compile_job, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _run(tmp_path, trainer: str, steps: int = 2, resume_from: str | None = None, step_fn=None):
    text = open(os.path.join(HERE, "tiny_ppo.rlhf")).read().replace(
        "run { steps = 4; seed = 3; checkpoint_every = 2 }",
        f"run {{ steps = 4; seed = 3; checkpoint_every = 2; trainer = {trainer} }}")
    module, _ = compile_source(text, os.path.join(HERE, f"tiny_ppo_{trainer}.rlhf"))
    job = compile_job(module, str(tmp_path / f"job_{trainer}"), level="O1")
    out = resume_from or str(tmp_path / f"run_{trainer}")
    if step_fn is not None:   # wraps the job's own step function
        import importlib.util

        spec = importlib.util.spec_from_file_location(f"m_{trainer}", os.path.join(job, "main.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        step_fn = step_fn(mod.step)
    rows = run_job(job, step_fn, out=out, steps=steps, progress=False, resume=resume_from is not None)
    with open(os.path.join(job, "plan.json")) as fh:
        plan = json.load(fh)
    return untimed(rows, layout=True), plan


def test_fsdp_groups_train_like_one_process_and_resume_in_another_layout(tmp_path):
    one, plan1 = _run(tmp_path, "torch", steps=4)
    dp, plan2 = _run(tmp_path, "fsdp", steps=2)
    assert {w["ranks"] for w in plan1["placement"]["workers"].values()} == {1}
    assert {w["ranks"] for w in plan2["placement"]["workers"].values()} == {2}   # dp = the 2 cores
    assert [r["response_len_mean"] for r in dp] == [r["response_len_mean"] for r in one[:2]]   # same tokens
    _agree(one[:2], dp)
    assert os.path.isfile(tmp_path / "run_fsdp" / "checkpoints" / "step_2" / "actor" / "weights.safetensors")
    # the dp2 run's checkpoint (full tensors) resumes as one process per model and goes on like the
    # uninterrupted single-process run
    resumed, _ = _run(tmp_path, "torch", steps=4, resume_from=str(tmp_path / "run_fsdp"))
    _agree(one[2:], resumed[-2:])


def test_a_dead_rank_stops_the_job_naming_it_and_the_run_resumes(tmp_path):
    """One rank of the critic's dp2 group dies in step 2 (after the step-2 checkpoint): the job stops at
    once with an error naming the stage, the model and the rank, keeps what it wrote, and the resumed run
    goes on like the uninterrupted one (the single-process run; 1e-3 as above)."""
    import ray

    from rlhfc.runtime.errors import JobError

    calls = {"n": 0}

    def killing(step):
        def step_fn(job, w):
            calls["n"] += 1
            if calls["n"] == 3:
                ray.kill(w.critic.ranks[1], no_restart=True)
            return step(job, w)
        return step_fn

    one, _ = _run(tmp_path, "torch", steps=4)
    with pytest.raises(JobError) as exc:
        _run(tmp_path, "fsdp", steps=4, step_fn=killing)
    assert "stage %values" in exc.value.message and "critic" in exc.value.message
    assert "rank 1 of worker group 'critic' died" in exc.value.message
    assert "step_2" in exc.value.hint and "--resume" in exc.value.hint
    out = tmp_path / "run_fsdp"
    with open(out / "metrics.jsonl") as fh:
        assert [json.loads(line)["step"] for line in fh] == [0, 1]
    resumed, _ = _run(tmp_path, "fsdp", steps=4, resume_from=str(out))
    _agree(one[2:], resumed[-2:])


def _agree(rows_a: list[dict], rows_b: list[dict]) -> None:
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for a, b in zip(rows_a, rows_b):
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (k, a, b)
