"""What the README says about the examples' models, checked on the models the compiled job builds."""

from __future__ import annotations

import os

import torch

from rlhfc.codegen import emit_job
from rlhfc.contract.plan import load_plan
from rlhfc.frontend import load_file
from rlhfc.runtime.data.prompts import prompt_source_from_spec
from rlhfc.runtime.worker.base import ModelWorker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ppo_tiny_reward_model_scores_untrained_responses_near_zero(tmp_path):
    """README: the reward model is a fixed arbitrary function of the text, scores of mean ≈ 0 and std ≈ 0.8
    over the untrained policy's responses (128 of them: 8 batches of ppo_tiny's 16 prompts)."""
    path = os.path.join(ROOT, "examples", "ppo_tiny.rlhf")
    module, _, _ = load_file(path)
    emit_job(module, str(tmp_path / "job"), source_path=path, opt_level="O0", passes=[])
    plan = load_plan(str(tmp_path / "job" / "plan.json"))
    models, seed = plan.models, plan.run.seed
    actor = ModelWorker("actor", models["actor"].spec.as_dict(), models["actor"].init.as_dict(), seed=seed)
    reward = ModelWorker("reward", models["reward"].spec.as_dict(), models["reward"].init.as_dict(), seed=seed)
    prompts = prompt_source_from_spec(plan.data["prompts"].as_spec())
    scores = torch.cat([reward.score(actor.generate(prompts.next_batch(16), max_new_tokens=24, temperature=1.0,
                                                    top_p=1.0)) for _ in range(8)])
    assert abs(float(scores.mean())) < 0.15 and 0.6 < float(scores.std()) < 1.0, (scores.mean(), scores.std())
