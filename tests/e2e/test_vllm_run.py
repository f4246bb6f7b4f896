"""End to end: a GRPO job with ``--rollout vllm`` trains on Ray with the actor's generation on a vLLM engine
(issue #15): at -O2 its generate streams finished samples in chunks to the reference forward, the engine
is refitted every step in memory (``refit_s``), its log-probs stay
within 1e-3 of the trainer's, the reward rises, and vLLM's files stay inside the run folder. And with -O3's
passes, ``overcommit`` named (the program stating ``staleness = 0``: synchronous) on vLLM: samples are carried over, a resumed run regenerates the uninterrupted run's steps
exactly, and an engine killed mid-generation stops the run with an error naming the model's engine, the
last checkpoint intact (slow: two engine starts). Skipped without vLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm")

from rlhfc.cli import main  # noqa: E402
from rlhfc.passes.pipelines import PIPELINES  # noqa: E402
from rlhfc.runtime.job import JobError, run_job  # noqa: E402

# ~40 s, but the issue asks CI to run it: not slow-marked
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("shared_ray")]

PROGRAM = """
cluster local { devices = cpu:2 }
model actor = llama(layers = 2, hidden = 128, heads = 2, vocab = 96, max_seq = 64) trainable
model ref   = copy(actor) frozen
data prompts = synthetic(count = 4096, min_len = 4, max_len = 12)
pipeline grpo(batch = 8) {
  roll     = actor.generate(prompts, n = 4, max_new_tokens = 16, temperature = 1.0)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  scores   = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv      = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, logp, adv, ref_logp, kl_coef = 0.02, tis_cap = 2.0), lr = 1e-3, minibatches = 2)
}
run { steps = 10; seed = 0 }
"""

#: steps per window of the learning check: the mean reward of the last window exceeds the first's by more than
#: twice the standard error of the difference (each window's steps as its samples)
WINDOW = 3


def _window(rows: list[dict]) -> tuple[float, float]:
    """(mean, standard error of the mean) of the rows' ``reward_mean``."""
    import statistics

    values = [r["reward_mean"] for r in rows]
    return statistics.mean(values), statistics.stdev(values) / len(values) ** 0.5


def test_grpo_trains_with_rollout_vllm_streamed_and_refitted_every_step(tmp_path, monkeypatch):
    monkeypatch.delenv("RLHFC_VLLM_CACHE", raising=False)   # no shared cache: every file in the run folder
    (tmp_path / "grpo_vllm.rlhf").write_text(PROGRAM)
    out = str(tmp_path / "run")
    from rlhfc.passes import PIPELINES

    # the -O2 pipeline with the chunk given: the placement search keeps streaming it asked for (on this tiny
    # batch it prices one chunk as cheaper and would drop the streaming this test is about)
    passes = ",".join("stream{chunk=4}" if n == "stream" else n for n in PIPELINES["O2"])
    assert main(["run", str(tmp_path / "grpo_vllm.rlhf"), "--passes", passes, "--rollout", "vllm", "--out", out,
                 "--no-progress"]) in (0, None)
    with open(os.path.join(out, "job", "plan.json")) as fh:
        assert json.load(fh)["run"]["rollout"] == "vllm"
    main_py = open(os.path.join(out, "job", "main.py")).read()
    assert "generate_chunks" in main_py and "refit_mb=64" in main_py   # streamed; refit buckets of 64 MiB
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert len(rows) == 10 and rows[0]["engine_start_s"] > 0
    assert all(r["refit_s"] > 0 for r in rows[1:])   # the new weights reached the engine every step
    assert all(r["rollout_logprob_diff_max"] < 1e-3 for r in rows)
    # it learns: the last steps' mean reward above the first steps' by more than two standard errors
    (first, se_first), (last, se_last) = _window(rows[:WINDOW]), _window(rows[-WINDOW:])
    assert last - first > 2 * (se_first ** 2 + se_last ** 2) ** 0.5, [r["reward_mean"] for r in rows]
    assert os.path.isfile(os.path.join(out, "vllm", "actor", "hf", "config.json"))
    assert os.path.isdir(os.path.join(out, "vllm", "actor", "cache"))


OVERCOMMIT = """
cluster local { devices = cpu:2 }
model actor = llama(layers = 2, hidden = 128, heads = 2, vocab = 96, max_seq = 64) trainable
data prompts = synthetic(count = 4096, min_len = 4, max_len = 12)
pipeline rpp(batch = 8) {
  roll   = actor.generate(prompts, max_new_tokens = 40, temperature = 1.0)
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores, method = reinforce_pp)
  actor.train(ppo_clip(roll, logp, adv, tis_cap = 2.0), lr = 1e-3, minibatches = 2)
}
run { steps = 3; seed = 0; checkpoint_every = 1; staleness = 0 }
"""


def _exact(rows: list[dict]) -> list[dict]:
    """Metric rows without what is timed (seconds, rates, padding efficiencies)."""
    return [{k: v for k, v in r.items() if not (k.endswith("_s") or k.startswith("pad_eff"))} for r in rows]


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]


@pytest.mark.slow
def test_overcommit_on_vllm_resumes_exactly_and_a_killed_engine_keeps_the_last_checkpoint(tmp_path):
    import ray

    (tmp_path / "oc.rlhf").write_text(OVERCOMMIT)
    job = str(tmp_path / "job")
    # -O3's passes with overcommit named (-O3 itself keeps it only where it is predicted 5 % faster)
    o3 = ",".join("overcommit" if p.startswith("overcommit") else p for p in PIPELINES["O3"])
    assert main(["compile", str(tmp_path / "oc.rlhf"), "--passes", o3, "--rollout", "vllm", "--emit", "job",
                 "-o", job]) == 0
    full = str(tmp_path / "full")
    rows = run_job(job, out=full, progress=False)
    assert [r["samples"] for r in rows] == [8] * 3
    assert all(r["carried"] > 0 for r in rows[1:]) and all(r["rollout_logprob_diff_max"] < 1e-3 for r in rows)
    step1 = json.load(open(os.path.join(full, "checkpoints", "step_1", "job.json")))
    assert any(state["carry"] for state in step1["overcommit"].values())   # the interruption falls mid-carry

    # the same run folder rolled back to step_1 (carried samples in it), resumed with a fresh engine, whose
    # engine core is shut down in the middle of step 2's generation
    part = str(tmp_path / "part")
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("ray", "step_2", "step_3"))
    with open(os.path.join(part, "checkpoints", "latest"), "w") as fh:
        fh.write("step_1")
    spec = importlib.util.spec_from_file_location("oc_main", os.path.join(job, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def kill_engine(worker) -> None:
        """In the actor's process (pickled by value: nested): its vLLM engine core shuts down at the third
        engine step from now, in the middle of the generation."""
        engine = worker.rollout_engine.engine.llm.llm_engine
        real, calls = engine.step, [0]

        def step():
            calls[0] += 1
            if calls[0] == 3:
                engine.engine_core.shutdown()
            return real()

        engine.step = step

    def killing(job_, w):
        if job_.step == 2:
            ray.get(w.actor.ranks[0].__ray_call__.remote(kill_engine))
        return mod.step(job_, w)

    with pytest.raises(JobError) as exc:
        run_job(job, step_fn=killing, out=part, resume=True, progress=False)
    assert exc.value.message.startswith("stage %roll (generate on model 'actor') failed: EngineError: the vLLM "
                                        "engine of model 'actor' failed during generate"), exc.value.message
    assert f"last good checkpoint: {part}/checkpoints/step_2" in exc.value.hint and "--resume" in exc.value.hint
    assert open(os.path.join(part, "checkpoints", "latest")).read().strip() == "step_2"
    got, want = _exact(_rows(part)), _exact(_rows(full))[:2]
    assert got == want, [(r["step"], k, a.get(k), r.get(k)) for r, a in zip(got, want) for k in a if a.get(k) != r.get(k)]
    # (step 1 regenerated from the carried samples exactly)
    for name in ("weights", "state"):   # and the checkpoint it wrote is the uninterrupted run's, bit for bit
        a = load_file(os.path.join(part, "checkpoints", "step_2", "actor", f"{name}.safetensors"))
        b = load_file(os.path.join(full, "checkpoints", "step_2", "actor", f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = json.load(open(os.path.join(part, "checkpoints", "step_2", "job.json")))
    assert meta["overcommit"] == json.load(open(os.path.join(full, "checkpoints", "step_2", "job.json")))["overcommit"]


FSDP = OVERCOMMIT.replace("max_new_tokens = 40", "max_new_tokens = 16").replace(
    "staleness = 0 }", "staleness = 0; trainer = fsdp; rollout = vllm }")


@pytest.mark.slow
def test_fsdp_dp2_trains_on_an_engine_per_rank_and_resumes_exactly(tmp_path):
    """trainer = fsdp on cpu:2: the actor runs as two ranks, each generating its share of the rows on its own
    vLLM engine, refitted from the gathered shards at the plan's reshard stage (-O2); a run resumed from its
    step-1 checkpoint (fresh engines, refitted from the checkpoint's weights) repeats the uninterrupted
    run's steps exactly, and writes the same checkpoint bit for bit."""
    (tmp_path / "dp2.rlhf").write_text(FSDP)
    job = str(tmp_path / "job")
    assert main(["compile", str(tmp_path / "dp2.rlhf"), "-O2", "--emit", "job", "-o", job]) == 0
    with open(os.path.join(job, "plan.json")) as fh:
        plan = json.load(fh)
    assert plan["placement"]["workers"]["actor"]["ranks"] == 2
    assert "job.reshard(" in open(os.path.join(job, "main.py")).read()
    full = str(tmp_path / "full")
    rows = run_job(job, out=full, progress=False)
    assert len(rows) == 3 and rows[0]["engine_start_s"] > 0 and all(r["refit_s"] > 0 for r in rows)
    assert all(r["rollout_logprob_diff_max"] < 1e-3 for r in rows)
    assert os.listdir(os.path.join(full, "vllm", "actor", "hf")) == ["config.json"]   # weights came in memory

    part = str(tmp_path / "part")
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("ray", "step_2", "step_3"))
    with open(os.path.join(part, "checkpoints", "latest"), "w") as fh:
        fh.write("step_1")
    run_job(job, out=part, resume=True, progress=False)
    got, want = _exact(_rows(part)), _exact(_rows(full))
    assert got == want, [(r["step"], k, a.get(k), r.get(k)) for r, a in zip(got, want) for k in a if a.get(k) != r.get(k)]
    a = load_file(os.path.join(part, "checkpoints", "step_3", "actor", "weights.safetensors"))
    b = load_file(os.path.join(full, "checkpoints", "step_3", "actor", "weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
