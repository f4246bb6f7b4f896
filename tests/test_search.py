"""The placement search (issue #20): deterministic compiles (a budget of candidates, never seconds), cost-model
failures as located compile errors, ``--response-lengths`` reaching the search, one pricing path (the searched
plan's price is ``explain``'s price of the compiled job), and a search that explores."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, print_module
from rlhfc.passes import PassManager, parse_pipeline

#: small models on one node of 8 GPUs: the search has a real space and runs in a second
GPU_PROGRAM = """
cluster node {{ gpu = "A100-80GB"; nodes = 1; gpus_per_node = 8 }}

model actor  = llama(layers = 4, hidden = 512, heads = 8, vocab = 1024) trainable
model critic = like(actor) head = value trainable
model ref    = copy(actor) frozen
model reward = llama(layers = 2, hidden = 256, heads = 4, vocab = 1024) head = score frozen

data prompts = synthetic(count = 4096, min_len = 16, max_len = 64)

pipeline ppo(batch = {batch}) {{
  roll     = actor.generate(prompts, max_new_tokens = 256)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-5, minibatches = 4)
  critic.train(value_loss(roll, values, ret), lr = 1e-5, minibatches = 4)
}}

run {{ steps = 2; seed = 0 }}
"""


def gpu_module(batch: int = 256):
    module, _ = compile_source(GPU_PROGRAM.format(batch=batch), "gpu.rlhf")
    return module


def run_passes(module, pipeline: str):
    return PassManager(parse_pipeline(pipeline)).run(module)


# -- 1. deterministic compiles -------------------------------------------------------------------------------

SEARCH = "dce,parallelize,stream,placement{strategy=search,candidates=120},realloc"


def test_search_budget_is_candidates_not_seconds():
    from rlhfc.passes import get_pass

    options = {f.name for f in get_pass("placement").options()}
    assert "candidates" in options and "seconds" not in options
    with pytest.raises(CompileError, match="candidates must be >= 1"):
        parse_pipeline("placement{candidates=0}")


def test_same_plan_on_a_busy_machine():
    """The same program compiles to the same IR on an idle machine and while two processes burn the CPU."""
    idle = print_module(run_passes(gpu_module(), SEARCH))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = print_module(run_passes(gpu_module(), SEARCH))
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert busy == idle


@pytest.mark.parametrize("bad", ["raise", "nan"])
def test_stream_cost_model_failure_is_a_located_error(monkeypatch, bad):
    """``stream`` never falls back to a made-up estimate: a failing cost model is a compile error at the
    generate stage whose chunk size it was choosing."""
    from rlhfc.cost import model as cost_model

    def broken(self, stage, layout=None, rows=None):
        if bad == "raise":
            raise ZeroDivisionError("float division by zero")
        return cost_model.StageCost(stage.name, stage.op, stage.target, layout, math.nan)

    monkeypatch.setattr(cost_model.CostModel, "stage_cost", broken)
    with pytest.raises(CompileError) as info:
        run_passes(gpu_module(), "dce,stream")
    diag = next(d for d in info.value.diagnostics if "stream:" in d.message)
    assert "%roll" in diag.message and diag.loc is not None and diag.loc.line == 12
    assert "stream{chunk=N}" in diag.hint
    assert ("ZeroDivisionError" in diag.message) if bad == "raise" else ("nan s" in diag.message)
