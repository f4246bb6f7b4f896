"""``run { trainer = fsdp }``: every model runs as a data-parallel group of FSDP2 ranks (two here, one per
core of ``cpu:2``) and trains like the single-process job: the same sampled tokens, every metric of the
first steps within 1e-3 relative (float rounding: rows and minibatches split over the ranks), the
checkpointed weights within 1e-4 and Adam moments within 1e-3 of their norm; a checkpoint of either layout
resumes under the other and goes on like the uninterrupted run. The single-process run is shared."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from rlhfc.frontend import compile_source
from rlhfc.runtime.job import run_job

from .conftest import HERE, compile_job, job_step, recording, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


def _run(tmp_path, trainer: str, steps: int = 2, resume_from: str | None = None, step_fn=None, samples=None):
    """Train tiny_ppo under ``trainer``: (metric rows without timings, plan.json); ``samples``: a list the
    sampled [(prompt, token ids)] of each step are appended to."""
    text = open(os.path.join(HERE, "tiny_ppo.rlhf")).read().replace(
        "run { steps = 4; seed = 3; checkpoint_every = 2 }",
        f"run {{ steps = 4; seed = 3; checkpoint_every = 2; trainer = {trainer} }}")
    module, _ = compile_source(text, os.path.join(HERE, f"tiny_ppo_{trainer}.rlhf"))
    job = compile_job(module, str(tmp_path / f"job_{trainer}"), level="O1")
    out = resume_from or str(tmp_path / f"run_{trainer}")
    step = job_step(job)
    if step_fn is not None:   # wraps the job's own step function
        step = step_fn(step)
    if samples is not None:
        step = recording(step, samples)
    rows = run_job(job, step, out=out, steps=steps, progress=False, resume=resume_from is not None)
    with open(os.path.join(job, "plan.json")) as fh:
        plan = json.load(fh)
    return untimed(rows, layout=True), plan


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run every claim here compares with: 4 steps, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("one_process")
    samples: list = []
    rows, plan = _run(tmp, "torch", steps=4, samples=samples)
    return rows, plan, samples, str(tmp / "run_torch")


def _rewind(run: str, copy: str, step: int) -> str:
    """A copy of run folder ``run`` as it was right after checkpoint ``step`` (what a resume starts from)."""
    shutil.copytree(run, copy)
    for name in os.listdir(os.path.join(copy, "checkpoints")):
        if name.startswith("step_") and int(name[5:]) > step:
            shutil.rmtree(os.path.join(copy, "checkpoints", name))
    with open(os.path.join(copy, "checkpoints", "latest"), "w") as fh:
        fh.write(f"step_{step}\n")
    for log in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(copy, log)
        if os.path.isfile(path):
            with open(path) as fh:
                kept = [line for line in fh if json.loads(line)["step"] < step]
            with open(path, "w") as fh:
                fh.writelines(kept)
    return copy


def _state(run: str, step: int) -> dict:
    """Each model's weights and AdamW moments at checkpoint ``step`` (full tensors, whatever trained them)."""
    from safetensors.torch import load_file

    root = os.path.join(run, "checkpoints", f"step_{step}")
    out = {}
    for model in sorted(m for m in os.listdir(root) if os.path.isdir(os.path.join(root, m))):
        opt = load_file(os.path.join(root, model, "state.safetensors"))
        out[model] = {**load_file(os.path.join(root, model, "weights.safetensors")),
                      **{k: v for k, v in opt.items() if k.endswith((".exp_avg", ".exp_avg_sq"))}}
    return out


def _same_state(a: dict, b: dict) -> None:
    """Weights within 1e-4 absolute, each Adam moment within 1e-3 of its norm (float rounding of the split)."""
    import torch

    assert a.keys() == b.keys()
    for model, tensors in a.items():
        assert tensors.keys() == b[model].keys(), model
        assert any(k.endswith(".exp_avg") for k in tensors) == (model in ("actor", "critic")), model
        for k, t in tensors.items():
            if k.startswith("opt."):
                assert float((t - b[model][k]).norm()) <= 1e-3 * float(b[model][k].norm()) + 1e-12, (model, k)
            else:
                torch.testing.assert_close(t, b[model][k], rtol=0, atol=1e-4, msg=f"{model} {k}")


def test_fsdp_groups_train_like_one_process_and_resume_in_another_layout(tmp_path, one_process):
    one, plan1, tok1, run1 = one_process
    tok2: list = []
    dp, plan2 = _run(tmp_path, "fsdp", steps=2, samples=tok2)
    assert {w["ranks"] for w in plan1["placement"]["workers"].values()} == {1}
    assert {w["ranks"] for w in plan2["placement"]["workers"].values()} == {2}   # dp = the 2 cores
    assert tok2 == tok1[:2]   # the same sampled token ids, row by row
    _agree(one[:2], dp)
    _same_state(_state(str(tmp_path / "run_fsdp"), 2), _state(run1, 2))
    # the dp2 run's checkpoint (full tensors) resumes as one process per model and goes on like the
    # uninterrupted single-process run: its metrics, and its weights and Adam moments after the step
    resumed, _ = _run(tmp_path, "torch", steps=4, resume_from=str(tmp_path / "run_fsdp"))
    _agree(one[2:], resumed[-2:])
    _same_state(_state(str(tmp_path / "run_fsdp"), 4), _state(run1, 4))
    # and the single process's checkpoint resumes in the dp2 groups, each rank taking its shards
    back = _rewind(run1, str(tmp_path / "run_torch_then_fsdp"), 2)
    again, _ = _run(tmp_path, "fsdp", steps=4, resume_from=back)
    _agree(one[2:], again[-2:])
    _same_state(_state(back, 4), _state(run1, 4))


def test_a_dead_rank_stops_the_job_naming_it_and_the_run_resumes(tmp_path, one_process):
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

    one = one_process[0]
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
