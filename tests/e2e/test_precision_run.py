"""End to end: ``run { precision = bf16; log_samples = 2 }`` reaches the Ray workers (bf16 autocast, fp32
weights) and the run folder gets two samples a step."""

from __future__ import annotations

import json
import math
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.runtime.job import Job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROGRAM = """
cluster local { devices = cpu:1 }
model actor = llama(layers = 1, hidden = 32, heads = 2, vocab = 64, max_seq = 32) trainable
data prompts = synthetic(count = 64, min_len = 3, max_len = 6)
pipeline grpo(batch = 2) {
  roll   = actor.generate(prompts, n = 2, max_new_tokens = 6)
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3, minibatches = 2)
}
run { steps = 2; seed = 1; precision = bf16; log_samples = 2 }
"""


def test_bf16_run_trains_on_workers_under_bf16_and_logs_two_samples_a_step(tmp_path):
    (tmp_path / "bf16.rlhf").write_text(PROGRAM)
    module, _, _ = load_file(str(tmp_path / "bf16.rlhf"))
    job_dir = str(tmp_path / "job")
    emit_job(module, job_dir, source_path=str(tmp_path / "bf16.rlhf"), opt_level="O0", passes=[])
    with open(os.path.join(job_dir, "plan.json")) as fh:
        assert json.load(fh)["run"]["precision"] == "bf16"
    import importlib.util

    spec = importlib.util.spec_from_file_location("bf16_main", os.path.join(job_dir, "main.py"))
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    job = Job(job_dir, out=str(tmp_path / "run"), progress=False)
    try:
        history = job.run(main.step)
        info = job.worker_info["actor"]
    finally:
        job.shutdown()
    ranks = info if isinstance(info, list) else [info]
    assert [r["precision"] for r in ranks] == ["bf16"]
    assert [m["step"] for m in history] == [0, 1] and all(math.isfinite(m["policy_loss"]) for m in history)
    with open(tmp_path / "run" / "samples.jsonl") as fh:
        samples = [json.loads(line) for line in fh]
    assert [(s["step"], s["row"]) for s in samples] == [(0, 0), (0, 2), (1, 0), (1, 2)]   # rows i * 4 // 2
    from safetensors.torch import load_file as load_tensors

    weights = load_tensors(str(tmp_path / "run" / "checkpoints" / "step_2" / "actor" / "weights.safetensors"))
    assert {str(t.dtype) for t in weights.values()} == {"torch.float32"}   # master weights stay float32
