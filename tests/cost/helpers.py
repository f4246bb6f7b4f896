"""Helpers for the cost-model tests: compile small programs, annotate stages."""

from __future__ import annotations

import os
from pathlib import Path

from rlhfc.frontend import compile_source, load_file
from rlhfc.ir import verify
from rlhfc.passes import PassManager, parse_pipeline

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = ROOT / "examples"


def example(name: str):
    """An example compiled at -O1 (no placement/overlap passes: the plan as written)."""
    module, _, _ = load_file(str(EXAMPLES / f"{name}.rlhf"))
    return PassManager(parse_pipeline("dce")).run(module)


def program(text: str):
    module, _ = compile_source(text, "<test>")
    return module


def annotate(module, plan: dict):
    for stage, ann in plan.items():
        module.graph.stage(stage).annotations.update(ann)
    verify(module)
    return module


def mesh(first, count, dp=None, tp=1, pp=1, **extra):
    dp = dp if dp is not None else count // (tp * pp)
    return {"mesh": {"first": first, "count": count}, "parallel": {"dp": dp, "tp": tp, "pp": pp}, **extra}


GPU_PPO = """
cluster pod {{ gpu = "{gpu}"; nodes = {nodes}; gpus_per_node = 8 }}
model actor  = llama(size = 7B) trainable
model critic = like(actor) head = value trainable
model ref    = copy(actor) frozen
model reward = llama(size = 7B) head = score frozen
data prompts = synthetic(count = 1000, min_len = 64, max_len = 256)
pipeline ppo(batch = {batch}) {{
  roll     = actor.generate(prompts, max_new_tokens = {new})
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp)
  actor.train(ppo_clip(roll, logp, adv), minibatches = 4)
  critic.train(value_loss(roll, values, ret), minibatches = 4)
}}
"""


def gpu_ppo(gpu="H100-80GB", nodes=1, batch=256, new=256):
    return program(GPU_PPO.format(gpu=gpu, nodes=nodes, batch=batch, new=new))


def have_chromium() -> bool:
    return os.path.exists("/usr/bin/chromium")
