"""The cost model prices the vLLM rollout engine and ``run { rollout = auto }`` picks an engine per generating
model from those prices (issue #15). Synthetic profiles stand in for ``rlhfc profile``'s vLLM measurements,
so nothing here needs vLLM (its real measurement: tests/runtime/test_vllm_profile.py)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from rlhfc.cost import CostConfig, CostModel, Profile, load_profile
from rlhfc.cost.profile import merge_profiles
from rlhfc.cost.engine import fit_vllm_entry, vllm_features
from rlhfc.cost.profile import model_key, refit

PROGRAM = """cluster local {{ devices = cpu:1 }}
model actor = llama(layers = 2, hidden = 128, heads = {heads}, vocab = 96) trainable
data prompts = synthetic(count = 64, min_len = 4, max_len = 8)
pipeline grpo(batch = 8) {{
  roll = actor.generate(prompts, n = 4, max_new_tokens = 32)
  logp = actor.logprobs(roll)
  actor.train(ppo_clip(roll, logp, group_advantages(roll, rule("rlhfc.runtime.rewards:vowel_count", roll))), lr = 1e-3)
}}
run {{ steps = 2; rollout = {rollout} }}
"""

#: the torch engine's generate fit of the synthetic profiles (a + b*B*P + T*(c + d*B + e*B*ctx) seconds)
TORCH_GEN = [1e-3, 1e-6, 2e-3, 2e-4, 1e-8]


def _load(tmp_path, name="p", heads=2, rollout="auto"):
    from rlhfc.frontend import load_file

    path = tmp_path / f"{name}.rlhf"
    path.write_text(PROGRAM.format(heads=heads, rollout=rollout))
    return load_file(str(path))[0]


def _profile(module, *, vllm_scale: float | None, kv_tokens: int | None = None, seqs: int = 256,
             refit_layer_s: float = 0.004) -> Profile:
    """A CPU profile of the actor's shape: the torch engine at ``TORCH_GEN``; the vLLM engine (when
    ``vllm_scale`` is given) at that fraction of the torch engine's per-token and per-step rates."""
    entry = refit({"spec": {}, "threads": 1, "points": {}})
    entry["fit"] = {"generate": TORCH_GEN, "forward": [1e-3, 1e-6, 0.0], "train": [3e-3, 3e-6, 0.0],
                    "optimizer": 1e-3}
    if vllm_scale is not None:
        entry["vllm"] = {"fit": {"generate": [x * vllm_scale for x in TORCH_GEN], "refit_layer_s": refit_layer_s},
                         "max_num_seqs": seqs, **({"kv_tokens": kv_tokens} if kv_tokens else {})}
    return Profile("cpu", "test cpu", 1, host={"matmul_flops_1": 5e10, "thread_speedup": [1.0], "copy_bw": 1e10},
                   models={model_key(module.models["actor"]): entry})


@pytest.fixture
def vllm_installed(monkeypatch):
    """The engine pass's "vLLM is installed" answer, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))


def test_fit_vllm_entry_recovers_the_engines_rates_and_refit_per_layer():
    true = [5e-3, 2e-6, 1e-3, 4e-5, 1e-8]
    pts = []
    for B in (4, 24):
        for P in (6, 16):
            for steps, tokens in ((8, 0.9 * 8 * B), (32, 0.7 * 32 * B)):
                pts.append([B, P, steps, tokens, float(np.dot(vllm_features(B, P, steps, tokens), true))])
    copy_bw = 1e10
    refits = [[2e6, 2, 2 * 2e6 / copy_bw + 2 * 0.01], [8e6, 4, 2 * 8e6 / copy_bw + 4 * 0.01]]
    entry = fit_vllm_entry({"copy_bw": copy_bw, "points": {"generate": pts, "refit": refits}})
    np.testing.assert_allclose(entry["fit"]["generate"], true, rtol=1e-6, atol=1e-12)
    assert entry["fit"]["refit_layer_s"] == pytest.approx(0.01)


def test_old_profiles_load_and_vllm_is_priced_by_the_catalog_assumption(tmp_path, vllm_installed):
    from rlhfc.cost.engine import VLLM_REFIT_LAYER_S, VLLM_STEP_S

    module = _load(tmp_path, rollout="vllm")
    old = _profile(module, vllm_scale=None)
    path = old.save(str(tmp_path / "old.json"))
    data = json.loads(open(path).read())
    assert "vllm" not in json.dumps(data["models"])   # a profile as rlhfc wrote it before the vLLM section
    prof = load_profile(path)
    gen = module.graph.stage("roll")
    vllm = CostModel(module, CostConfig(profile=prof)).stage_cost(gen)
    torch_ = CostModel(module, CostConfig(profile=prof, engine="torch")).stage_cost(gen)
    assert vllm.work["engine_source"] == "assumed" and vllm.work["refit_source"] == "assumed"
    assert vllm.parts["refit"] > 2 * VLLM_REFIT_LAYER_S["cpu"]   # two layers re-processed, plus the bytes
    # the assumption: the torch engine's rates, continuous batching, vLLM's per-step overhead
    assert vllm.work["expected_steps"] * VLLM_STEP_S["cpu"] < vllm.time_s
    assert "refit" not in torch_.parts
    # a later profile with vLLM measurements merges over it and keeps them
    merged = merge_profiles(prof, _profile(module, vllm_scale=0.5))
    assert merged.models[model_key(module.models["actor"])]["vllm"]["fit"]["refit_layer_s"] == 0.004


def test_vllm_rows_cost_their_own_tokens_and_the_kv_cache_limits_concurrency(tmp_path, vllm_installed):
    module = _load(tmp_path, rollout="vllm")
    gen = module.graph.stage("roll")
    prof = _profile(module, vllm_scale=1.0)
    cost = {law: CostModel(module, CostConfig(profile=prof, response_lengths=law)).stage_cost(gen)
            for law in ("auto", "geometric:0.1", "max")}
    torch_ = CostModel(module, CostConfig(profile=prof, engine="torch")).stage_cost(gen)
    # continuous batching: the tokens computed are the samples' own (random weights: long-tailed lengths)
    assert CostModel.padding_efficiency(cost["auto"]) > 0.95 > CostModel.padding_efficiency(torch_)
    refit = cost["auto"].parts["refit"]
    assert cost["auto"].work["engine_source"] == "profile" and cost["auto"].work["refit_source"] == "profile"
    # short rows (mean ~10 of 32 tokens) cost their own tokens: well under every row decoding to the end
    assert cost["geometric:0.1"].time_s - refit < 0.8 * (cost["max"].time_s - refit)
    # 32 rows; a KV cache of 8 requests at prompt + max_new_tokens tokens: 4 waves one after another
    small = _profile(module, vllm_scale=1.0, kv_tokens=8 * (8 + 32))
    tight = CostModel(module, CostConfig(profile=small)).stage_cost(gen)
    seqs = CostModel(module, CostConfig(profile=_profile(module, vllm_scale=1.0, seqs=8))).stage_cost(gen)
    assert tight.work["waves"] == 4 and tight.time_s > 1.5 * cost["auto"].time_s
    assert seqs.time_s == pytest.approx(tight.time_s)


def _compile(module, tmp_path, prof: Profile | None, level="O2"):
    from rlhfc.cli.optimise import optimise

    path = prof.save(str(tmp_path / "profile.json")) if prof is not None else None
    return optimise(module, level, None, profile=path).module


def test_auto_picks_vllm_where_its_measured_speed_is_higher_and_torch_otherwise_at_every_level(tmp_path, vllm_installed):
    from rlhfc.codegen.plan import placement
    from rlhfc.explain.report import build_report
    from rlhfc.ir import parse_ir, print_module

    picked = {}
    for name, scale in (("fast", 0.1), ("slow", 3.0)):
        module = _load(tmp_path, name)
        prof = _profile(module, vllm_scale=scale)
        out = _compile(module, tmp_path, prof)
        gen = out.graph.stage("roll")
        picked[name] = gen.annotations.get("engine", "torch")
        at_o0 = _compile(_load(tmp_path, name + "0"), tmp_path, prof, "O0").graph.stage("roll")
        assert at_o0.annotations.get("engine", "torch") == picked[name]   # every level runs the same engine
        text = print_module(out)
        assert print_module(parse_ir(text)) == text   # the choice is canonical IR
        ops = [s.op for s in out.graph.stages]
        workers = placement(out).workers
        notes = build_report(out, config=CostConfig(profile=prof)).notes
        choice = next(n for n in notes if n.startswith("rollout = auto runs @actor"))
        assert "on vllm (refit included)" in choice and "on torch" in choice   # both prices
        assert "the engine pass chose it before placement: vllm" in choice   # and the pass's own comparison
        assert "log-prob forward its sampling log-probs replace" in choice   # torch is credited with reuse
        if picked[name] == "vllm":   # the trainer's log-prob forward stays; the worker starts the engine
            assert 'engine = "vllm"' in text and "forward.logprobs" in ops and gen.annotations["refit_mb"] == 64
            assert [w.engine for w in workers.values()] == ["vllm"]
        else:   # torch reuses its sampling log-probs; nothing new is printed
            assert "engine =" not in text and "compute.sample_logprobs" in ops
            assert all(w.engine == "torch" for w in workers.values())
    assert picked == {"fast": "vllm", "slow": "torch"}


def test_auto_falls_back_to_torch_with_a_note_where_vllm_cannot_run(tmp_path, monkeypatch, vllm_installed):
    from rlhfc.explain.report import build_report

    module = _compile(_load(tmp_path, "h16", heads=8), tmp_path, None, "O1")   # head size 16
    assert "engine" not in module.graph.stage("roll").annotations
    notes = build_report(module).notes
    assert any(n.startswith("rollout = auto keeps @actor on torch: vLLM cannot run its head size 16") for n in notes)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    fast = _load(tmp_path, "missing")
    module = _compile(fast, tmp_path, _profile(fast, vllm_scale=0.1))   # faster, but not installed: no error
    assert "engine" not in module.graph.stage("roll").annotations
    assert any("vLLM is not installed" in n for n in build_report(module).notes)
