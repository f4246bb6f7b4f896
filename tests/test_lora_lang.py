"""LoRA in the language: the lora(...) clause lowers to the IR's lora = {...}, the checks, and the price."""

from __future__ import annotations

import importlib.util

import pytest

from rlhfc.cost import CostModel
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError
from rlhfc.ir.lora import lora_params

PROGRAM = """cluster local {{ devices = cpu:2 }}
model actor = {arch}(layers = 2, hidden = 64, heads = 4, vocab = 96, max_seq = 64) {lora} trainable
data prompts = synthetic(count = 64, min_len = 4, max_len = 8)
pipeline grpo(batch = 4) {{
  roll   = actor.generate(prompts, n = 4, max_new_tokens = 8, temperature = 1.0)
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-2)
}}
run {{ steps = 4; seed = 0{run} }}
"""


def _module(arch="llama", lora="lora()", run=""):
    module, _ = compile_source(PROGRAM.format(arch=arch, lora=lora, run=run), "p.rlhf")
    return module


def test_lora_clause_defaults_and_adapter_count():
    m = _module().models["actor"]
    assert m.lora == {"alpha": 16, "rank": 8, "targets": ["q_proj", "v_proj"]}
    assert lora_params(m) == 2 * 8 * 2 * (64 + 64)                       # 2 layers, q and v: r (in + out) each
    g = _module("gpt2", "lora(rank = 2, alpha = 4, targets = [c_attn, c_proj])").models["actor"]
    assert lora_params(g) == 2 * 2 * ((64 + 192) + (64 + 64) + (256 + 64))   # gpt2's c_proj: attention and MLP
    assert _module(lora="").models["actor"].lora is None


def test_optimizer_state_is_priced_for_the_adapters_only():
    def state(module):
        cm = CostModel(module)
        return cm.stage_cost(next(s for s in module.graph.stages if s.op == "train")).state_bytes

    module = _module()
    m = module.models["actor"]
    assert state(module) / state(_module(lora="")) == pytest.approx(lora_params(m) / m.params)


@pytest.mark.parametrize("lora, run, message, hint", [
    ("lora(rank = 0)", "", "the LoRA rank must be a positive integer, got 0", "rank = 8"),
    ("lora(rank = 4, bias = 1)", "", "unknown LoRA setting 'bias'", "settings: rank, alpha, targets"),
    ("lora()", "; trainer = fsdp", "model @actor has LoRA adapters, which only the torch trainer runs, not fsdp",
     "trainer = torch"),
])
def test_lora_mistakes_are_located_errors(lora, run, message, hint):
    with pytest.raises(CompileError) as exc:
        _module(lora=lora, run=run)
    (d,) = [d for d in exc.value.diagnostics if d.severity == "error"]
    assert message in d.message and hint in d.hint and d.loc is not None


def test_lora_without_peft_says_how_to_install_it(monkeypatch):
    from rlhfc.ir.plan import check

    real = importlib.util.find_spec
    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(CompileError) as exc:
        _module()
    (d,) = exc.value.diagnostics
    assert "model @actor has LoRA adapters, but the peft library is not installed" in d.message
    assert "pip install -c constraints.txt -e '.[lora]'" in d.hint and d.loc.line == 2
