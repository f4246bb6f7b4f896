"""Baselines as plans (issue #20): ``placement = "baseline:NAME"`` builds the plan DeepSpeed-Chat, OpenRLHF,
verl or NeMo-Aligner would run, priced with the costs that make each slow; ``explain --compare``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfc.cli import main
from rlhfc.cli.load import load
from rlhfc.cli.optimise import optimise
from rlhfc.cost import CostModel, simulate
from rlhfc.cost.baselines import SYSTEMS, BaselineCostModel
from rlhfc.ir import CompileError, parse_ir, plan, print_module, verify

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))


def _compile(path, name: str):
    module, _ = load(str(path), [])
    return optimise(module, None, None, placement=f"baseline:{name}").module   # memory checked, as compile


def _stages(module):
    return [s for s in module.graph.stages if s.target in module.models and s.op != "sync"
            and plan.on_worker(module, s)]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_baseline_compiles_every_example(path):
    for name in SYSTEMS:
        out = _compile(path, name)
        assert plan.strategy(out) == f"baseline:{name}"
        assert isinstance(CostModel(out), BaselineCostModel)
        for s in out.graph.stages:   # what these systems do not do is taken back
            assert not plan.streams(s) and not plan.flag(s, "unpad")
        if out.cluster.device != "cpu":
            per = out.cluster.per_node
            for s in _stages(out):
                m, lay = out.models[s.target], plan.stage_layout(out, s)
                assert not plan.layout_problems(lay, per_node=per, heads=m.heads, kv_heads=m.kv_heads,
                                                layers=m.layers), (name, s.name, lay)
        assert simulate(out, steps=1).step_time_s > 0
        text = print_module(out)                       # the plan is IR: it prints, parses back and verifies
        again = parse_ir(text)
        verify(again)
        assert print_module(again) == text


def _costs(module):
    cm = CostModel(module)
    return {s.name: cm.stage_cost(s) for s in _stages(module)}


def test_dschat_colocates_everything_with_zero3_gathers_and_hybrid_engine():
    out = _compile(ROOT / "examples" / "ppo_7b.rlhf", "dschat")
    n = out.cluster.num_devices
    costs = _costs(out)
    for s in _stages(out):
        lay = plan.stage_layout(out, s)
        assert (lay.first, lay.count) == (0, n)
        assert plan.overlap_group(s) is None                     # one stage at a time
        assert costs[s.name].work["baseline_s"] > 0              # gathers (forward/train), resharding (generate)
        if s.op != "generate":
            assert (lay.dp, lay.tp, lay.pp) == (n, 1, 1)         # ZeRO-3 data parallel
    roll = costs["roll"]
    wave = roll.work["rows"] / roll.work["waves"]
    assert roll.work["decode_rows"] == wave                      # static batching: no row leaves the batch
    same = out.clone()   # the same plan priced without the system's terms is faster
    plan.set_strategy(same, "flatten")
    plain = CostModel(same)
    assert type(plain) is CostModel
    assert plain.stage_cost(out.graph.stage("actor_train")).time_s < costs["actor_train"].time_s


def test_openrlhf_generates_apart_on_vllm_and_trains_each_model_apart():
    out = _compile(ROOT / "examples" / "ppo_70b.rlhf", "openrlhf")
    meshes = {}
    for s in _stages(out):
        lay = plan.stage_layout(out, s)
        key = "generate" if s.op == "generate" else s.target
        meshes.setdefault(key, set()).update(lay.devices)
    names = list(meshes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not meshes[a] & meshes[b], (a, b)              # every model (and the engines) on its own GPUs
    assert any(s.op == "sync" for s in out.graph.stages)         # weights broadcast to the engines each step
    costs = _costs(out)
    roll = costs["roll"].work
    assert roll["decode_rows"] < roll["rows"] / roll["waves"]     # continuous batching (vLLM)
    assert costs["actor_train"].work["baseline_s"] > 0            # ZeRO-3


def test_verl_colocates_3d_layouts_and_reshards_only_for_generation():
    out = _compile(ROOT / "examples" / "ppo_70b.rlhf", "verl")
    costs = _costs(out)
    for s in _stages(out):
        assert plan.stage_layout(out, s).count == out.cluster.num_devices
        if s.op != "generate":
            assert costs[s.name].work["baseline_s"] == 0          # Megatron: no per-forward gathers
    train = plan.stage_layout(out, out.graph.stage("actor_train"))
    assert train.tp * train.pp > 1
    assert costs["roll"].work["baseline_s"] > 0                   # 3D-HybridEngine resharding


def test_nemo_runs_actor_and_critic_servers_apart_with_generation_on_the_actor():
    out = _compile(ROOT / "examples" / "ppo_70b.rlhf", "nemo")
    mesh = {s.name: set(plan.stage_layout(out, s).devices) for s in _stages(out)}
    assert mesh["roll"] == mesh["actor_train"] == mesh["ref_logp"]
    assert mesh["critic_train"] == mesh["values"] == mesh["scores"]
    assert not mesh["actor_train"] & mesh["critic_train"]
    roll = _costs(out)["roll"]
    assert roll.work["decode_rows"] == roll.work["rows"] / roll.work["waves"] and roll.work["baseline_s"] > 0


def test_explain_compare_prints_rlhfc_beside_each_baseline(capsys):
    code = main(["explain", str(ROOT / "examples" / "ppo_tiny.rlhf"), "--compare", "-O1", "--no-profile"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[3].split()[:2] == ["rlhfc", "rlhfc"] and "1.00x" in out.splitlines()[3]
    for name, system in SYSTEMS.items():
        row = next(line for line in out.splitlines() if line.startswith(f"baseline:{name} "))
        assert system.title.split()[0] in row and row.rstrip().endswith("x")
        assert f"baseline:{name} ({system.title}):" in out
    assert "%roll" in out
    code = main(["explain", str(ROOT / "examples" / "ppo_tiny.rlhf"), "--compare", "-O1", "--no-profile",
                 "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and [p["name"] for p in data["plans"]] == ["rlhfc"] + [f"baseline:{b}" for b in SYSTEMS]
    assert data["plans"][0]["ratio"] == 1.0 and all(p["step_s"] > 0 and p["stages"] for p in data["plans"])


def test_unknown_baseline_lists_the_names(capsys):
    code = main(["explain", str(ROOT / "examples" / "ppo_tiny.rlhf"), "--placement", "baseline:deepspeed"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown baseline 'deepspeed'" in err
    assert "baseline:dschat, baseline:openrlhf, baseline:verl, baseline:nemo" in err
    with pytest.raises(CompileError):
        optimise(load(str(ROOT / "examples" / "ppo_tiny.rlhf"), [])[0], None, None, placement="baseline:x")


@pytest.mark.parametrize("name", ["dschat", "nemo"])
def test_a_static_batching_baseline_prices_a_vllm_rollout(tmp_path, monkeypatch, name):
    """A program that asks for ``rollout = vllm`` under a baseline whose own generation batches statically:
    the vLLM stage is priced with continuous batching (the engine does it, whatever the baseline), and pricing
    it does not fail (it raised a TypeError: the baseline's ``generation_work`` lacked ``continuous``)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    src = (ROOT / "examples" / "ppo_7b.rlhf").read_text().replace("optimize = O2 }", "optimize = O2; rollout = vllm }")
    src = src.replace("batch = 512", "batch = 64")   # the engine's KV cache fits beside a co-located trainer
    path = tmp_path / "vllm.rlhf"
    path.write_text(src)
    out = _compile(path, name)
    cm = BaselineCostModel(out)
    roll = next(s for s in out.graph.stages if s.op == "generate")
    assert plan.stage_engine(out, roll) == "vllm"
    work = cm.stage_cost(roll).work
    assert cm.generation_work(roll, 1, continuous=True).get("static") is None
    assert simulate(out).step_time_s > 0
    assert work


def test_the_opt_shapes_priced_against_deepspeed_chat_have_opts_published_sizes():
    """benchmarks/baselines.py --dschat prices OPT as GPT-2's layer shape: the counts are OPT's (Zhang et al.
    2022: 6.7B, 13B, 30B, 66B; 350M within its projections' 7 %)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import baselines as bench
    finally:
        sys.path.pop(0)
    from rlhfc.ir.arch import param_count

    published = {"350M": 0.331e9, "6.7B": 6.66e9, "13B": 12.85e9, "30B": 29.97e9, "66B": 65.7e9}
    for size, fields in bench.OPT.items():
        f = {k: int(v) for k, v in (x.split(" = ") for x in fields.split(", "))}
        n = param_count("gpt2", f["layers"], f["hidden"], f["heads"], f["heads"], f["ffn"], f["vocab"], f["max_seq"])
        assert n == pytest.approx(published[size], rel=0.08 if size == "350M" else 0.005), size
    assert {s for _, _, _, s, _ in bench.DSCHAT_PUBLISHED} | {s for s, *_ in bench.DSCHAT_FIGURE6} <= set(bench.OPT)
