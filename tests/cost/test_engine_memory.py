"""The vLLM rollout engine in the memory model and in the batched prices (issue #15): its own weights copy
and KV cache count on its devices (resident on CPU, while generating on CUDA, where it sleeps between calls),
and a placement search's batched prices include the refit as the per-stage prices do."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfc.cost import CostConfig, CostModel, simulate
from rlhfc.cost.batched import candidate_layouts, evaluate
from rlhfc.cost.engine import VLLM_CPU_KV_BYTES, VLLM_GPU_MEMORY_FRACTION
from rlhfc.cost.memory import memory_issues
from rlhfc.frontend import compile_source

PROGRAM = """cluster local {{ {cluster} }}
model actor = llama(layers = 2, hidden = 128, heads = 2, vocab = 96) trainable
data prompts = synthetic(count = 64, min_len = 4, max_len = 8)
pipeline grpo(batch = 8) {{
  roll = actor.generate(prompts, n = 4, max_new_tokens = 32)
  logp = actor.logprobs(roll)
  actor.train(ppo_clip(roll, logp, group_advantages(roll, rule("rlhfc.runtime.rewards:vowel_count", roll))), lr = 1e-3)
}}
run {{ steps = 2 }}
"""


def _module(cluster: str = "devices = cpu:1"):
    module, _ = compile_source(PROGRAM.format(cluster=cluster))
    return module


def _static(module, engine: str) -> dict:
    cm = CostModel(module, CostConfig(engine=engine))
    return simulate(module, steps=1, cost_model=cm).devices[0].static


def test_cpu_engine_holds_its_weights_copy_and_kv_cache_for_the_whole_run():
    module = _module()
    torch_held, vllm_held = _static(module, "torch"), _static(module, "vllm")
    copy = module.models["actor"].params * CostModel(module).spec.bytes_per_param
    assert "@actor vllm engine" not in torch_held
    assert vllm_held["@actor vllm engine"] == pytest.approx(copy + VLLM_CPU_KV_BYTES)
    assert sum(vllm_held.values()) - sum(torch_held.values()) == pytest.approx(copy + VLLM_CPU_KV_BYTES)


def test_a_device_that_fits_torch_rejects_the_vllm_engine_naming_it():
    module = _module('devices = cpu:1; memory = "0.5GB"')
    assert memory_issues(module, CostConfig(engine="torch")) == []
    issues = memory_issues(module, CostConfig(engine="vllm"))
    assert issues and issues[0].device == 0 and issues[0].need_bytes > issues[0].capacity_bytes
    assert issues[0].message.startswith("stage %actor_")
    assert "@actor vllm engine 1.0 GiB" in issues[0].hint
    assert "the vLLM engine of @actor keeps its own copy of the weights and its KV cache" in issues[0].hint


def test_cuda_engine_sleeps_between_generates_so_it_holds_memory_only_while_generating():
    module = _module('gpu = "A100-80GB"; nodes = 1; gpus_per_node = 1')
    assert "@actor vllm engine" not in _static(module, "vllm")
    cm = CostModel(module, CostConfig(engine="vllm"))
    gen = next(s for s in module.graph.stages if s.op == "generate")
    assert cm.stage_cost(gen).transient_bytes == pytest.approx(VLLM_GPU_MEMORY_FRACTION * cm.spec.memory)
    torch_cm = CostModel(module, CostConfig(engine="torch"))
    assert torch_cm.stage_cost(gen).transient_bytes < cm.stage_cost(gen).transient_bytes


@pytest.mark.parametrize("cluster", ["devices = cpu:2", 'gpu = "A100-80GB"; nodes = 1; gpus_per_node = 4'])
def test_batched_prices_include_the_refit_and_engine_memory_as_the_stage_price(cluster):
    module = _module(cluster)
    cm = CostModel(module, CostConfig(engine="vllm"))
    gen = next(s for s in module.graph.stages if s.op == "generate")
    model = module.models["actor"]
    lay = cm.layout(gen)
    cands = candidate_layouts(lay.first, lay.count, per_node=module.cluster.per_node, heads=model.heads,
                              kv_heads=model.kv_heads, layers=model.layers)
    assert len(cands) >= 2
    res = evaluate(module, gen.name, cands, cost_model=cm)
    for i, c in enumerate(cands):
        one = cm.stage_cost(gen, c)
        assert one.parts["refit"] > 0
        assert res["total"][i] == pytest.approx(one.time_s, rel=1e-12)
        assert res["transient_bytes"][i] == pytest.approx(one.transient_bytes, rel=1e-12)
    torch_res = evaluate(module, gen.name, cands, cost_model=CostModel(module, CostConfig(engine="torch")))
    assert np.all(res["total"] != torch_res["total"])


def test_auto_keeps_torch_where_the_engine_would_not_fit(monkeypatch):
    """``rollout = auto`` with a vLLM measured 10x faster: picked on a device with room for the engine, not on
    one that fits the torch engine only (the choice says why)."""
    import importlib.util

    from rlhfc.passes.engine import choose_engines

    from .test_engine_price import _profile

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    picked = {}
    for memory in ("8GB", "0.5GB"):
        module, _ = compile_source(PROGRAM.format(cluster=f'devices = cpu:1; memory = "{memory}"')
                                   .replace("steps = 2", "steps = 2; rollout = auto"))
        (choice,) = choose_engines(module, (), CostConfig(profile=_profile(module, vllm_scale=0.1)))
        picked[memory] = choice.engine
        assert choice.prices["vllm"] < choice.prices["torch"]
    assert picked == {"8GB": "vllm", "0.5GB": "torch"}
    assert "do not fit where torch's do" in choice.why


def test_check_says_a_cuda_engine_leaves_no_room_for_the_generating_weights():
    """A 7B model on one 80 GB GPU: torch can generate (its train stage alone cannot fit), but vLLM's 90 % share
    beside the trainer's 13 GB copy cannot; the diagnostic names the engine and the way out."""
    from rlhfc.cost.memory import unfittable
    from rlhfc.ir import DiagnosticSink

    module, _ = compile_source(PROGRAM.format(cluster='gpu = "A100-80GB"; nodes = 1; gpus_per_node = 1')
                               .replace("llama(layers = 2, hidden = 128, heads = 2, vocab = 96)", "llama(size = 7B)"))
    bad, hints = {}, {}
    for engine in ("torch", "vllm"):
        sink = DiagnosticSink()
        bad[engine] = unfittable(module, sink, CostConfig(engine=engine))
        hints[engine] = [d.hint for d in sink.errors if d.message.startswith("stage %roll ")]
    assert "roll" not in bad["torch"] and "roll" in bad["vllm"]
    assert hints["vllm"] and "vLLM engine" in hints["vllm"][0] and "rollout = torch" in hints["vllm"][0]
