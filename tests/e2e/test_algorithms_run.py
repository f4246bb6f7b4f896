"""End to end: the DAPO-flavoured example trains a few steps and its new options reach the runtime."""

from __future__ import annotations

import json
import math
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.runtime.job import run_job
from rlhfc.runtime.rl.algorithms import lr_factor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRAM = os.path.join(ROOT, "examples", "dapo_tiny.rlhf")

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("shared_ray")]


def test_dapo_example_trains_with_its_options(tmp_path):
    module, _, _ = load_file(PROGRAM)
    job_dir = str(tmp_path / "job")
    emit_job(module, job_dir, source_path=PROGRAM, opt_level="O1")
    with open(os.path.join(job_dir, "main.py")) as fh:
        driver = fh.read()
    for option in ("clip_high=0.28", "loss_agg='seq_mean_token_mean'", "filter_groups=True", "compute.overlong",
                   "lr_schedule='cosine'", "warmup_steps=2", "total_steps=40",
                   "job.refill('adv', sample_round, w, groups=8, group=4, max_rounds=4)"):
        assert option in driver, option
    rows = run_job(job_dir, out=str(tmp_path / "run"), steps=3, progress=False)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the cosine schedule over the program's 40 steps, after 2 warmup steps, as the worker applied it
    assert [r["policy_lr"] for r in rows] == pytest.approx([1e-3 * lr_factor(s, "cosine", 2, 40) for s in range(3)])
    for r in rows:
        # dynamic sampling with refill: rounds of 8 prompts until 8 groups of unequal scores (at most 4 rounds);
        # every sampled group is dropped, trained on, or a surplus of the last round
        assert 1 <= r["sample_rounds"] <= 4 and r["sampled_groups"] == 8 * r["sample_rounds"]
        assert r["kept_samples"] == 32 or r["sample_rounds"] == 4
        assert r["dropped_groups"] + r["kept_samples"] / 4 <= r["sampled_groups"]
        assert r["dropped_groups"] + r["kept_samples"] / 4 > 8 * (r["sample_rounds"] - 1)
        assert r["samples"] == r["kept_samples"]                  # the later stages see the kept groups only
        if r["kept_samples"]:
            assert math.isfinite(r["policy_loss"]) and math.isfinite(r["policy_grad_norm"])
        assert math.isfinite(r["reward_mean"])
    # seed 0: step 2's first round has a group of equal scores, so the step samples a second round (refill)
    assert [r["sample_rounds"] > 1 for r in rows] == [r["dropped_groups"] > 0 for r in rows] and \
        any(r["dropped_groups"] for r in rows)
    with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as fh:
        assert len([json.loads(line) for line in fh]) == 3
