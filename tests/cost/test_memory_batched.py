"""The memory check passes call, and batched evaluation of many layouts (NumPy; JAX when installed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlhfc.cost import CostConfig, CostModel, Layout, candidate_layouts, check_memory, evaluate, memory_issues
from rlhfc.cost.memory import suggest_layout
from rlhfc.ir import DiagnosticSink

from .helpers import annotate, example, gpu_ppo, mesh


def test_overflow_is_a_located_error_with_a_hint():
    m = example("ppo_70b")
    sink = DiagnosticSink()
    issues = check_memory(m, sink)
    assert issues and sink.errors
    d = sink.errors[0]
    assert re.match(r"stage %\w+ needs [\d.]+ GiB on device \d+ but it has 74\.5 GiB", d.message), d.message
    assert d.loc is not None and d.loc.file.endswith("ppo_70b.rlhf")
    assert "@actor weights" in d.hint and "mesh = {first = I, count = N}" in d.hint
    # a stage that would fit when sharded more gets that layout in its hint
    m7 = annotate(gpu_ppo(gpu="A100-40GB"), {s: mesh(0, 8) for s in ("roll", "logp", "ref_logp", "values",
                                                                         "scores", "actor_train", "critic_train")})
    hints = [i.hint for i in memory_issues(m7)]
    assert hints and all("parallel = {dp" in h or "no other" in h for h in hints)
    assert "devices 0-127 alike" in d.message          # 128 identical devices: one diagnostic
    warn = DiagnosticSink()
    check_memory(m, warn, severity="warning")
    assert not warn.errors and warn.warnings


def test_a_sharded_plan_fits_and_the_hint_names_one():
    m = gpu_ppo(gpu="A100-80GB")
    tiny_budget = suggest_layout(CostModel(m), m, "actor_train", 30 * 2 ** 30)
    assert tiny_budget is not None
    lay, need = tiny_budget
    assert lay.tp * lay.pp > 1 and need <= 30 * 2 ** 30
    # give each model its own two devices with tp 2: no overflow
    plan = {"roll": mesh(0, 2, tp=2, microbatches=4), "logp": mesh(0, 2, tp=2),
            "actor_train": mesh(0, 2, tp=2, microbatches=8, recompute="selective"),
            "ref_logp": mesh(2, 2, tp=2), "values": mesh(4, 2, tp=2),
            "critic_train": mesh(4, 2, tp=2, microbatches=8, recompute="selective"), "scores": mesh(6, 2, tp=2)}
    assert memory_issues(annotate(gpu_ppo(gpu="A100-80GB"), plan)) == []


def test_candidate_layouts_respect_heads_nodes_and_layers():
    cands = candidate_layouts(0, 16, per_node=8, heads=32, layers=32)
    assert all(c.dp * c.tp * c.pp == 16 and c.tp <= 8 and 32 % c.tp == 0 for c in cands)
    assert Layout(0, 16, 16, 1, 1) in cands and Layout(0, 16, 1, 8, 2) in cands
    assert all(c.tp != 16 for c in cands)


@pytest.mark.parametrize("stage", ["roll", "logp", "actor_train"])
def test_batched_numpy_equals_one_at_a_time(stage):
    m = gpu_ppo(nodes=2)
    cm = CostModel(m, CostConfig(response_lengths="lognormal:0.25:1.0"))
    cands = candidate_layouts(0, 16, per_node=8, heads=32, layers=32, microbatches=(1, 4),
                              recompute=("none", "full"))
    res = evaluate(m, stage, cands, cost_model=cm)
    for i, lay in enumerate(cands):
        one = cm.stage_cost(m.graph.stage(stage), lay)
        assert res["total"][i] == pytest.approx(one.time_s, rel=1e-12)
        assert res["weights_bytes"][i] + res["state_bytes"][i] + res["transient_bytes"][i] == \
            pytest.approx(one.total_bytes, rel=1e-12)
    with pytest.raises(ValueError, match="driver"):
        evaluate(m, "adv", cands[:1])


@pytest.mark.parametrize("stage", ["roll", "logp", "actor_train"])
def test_jax_gives_the_numpy_numbers(stage):
    pytest.importorskip("jax")
    m = gpu_ppo(nodes=2)
    cm = CostModel(m, CostConfig(response_lengths="lognormal:0.25:1.0"))
    cands = candidate_layouts(0, 16, per_node=8, heads=32, layers=32, microbatches=(1, 2),
                              recompute=("none", "selective"))
    a = evaluate(m, stage, cands, cost_model=cm)
    b = evaluate(m, stage, cands, cost_model=cm, backend="jax")
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-12, atol=0)


def test_jax_on_a_profiled_cpu_program():
    pytest.importorskip("jax")
    from rlhfc.cost import Profile

    m = example("ppo_tiny")
    prof = Profile("cpu", "test cpu", 2, host={"matmul_flops_1": 5e10, "thread_speedup": [1.0, 1.8]},
                   models={"llama-L2-h64-a4-kv4-f192-v96-lm": {"threads": 2, "fit": {
                       "generate": [1e-3, 1e-6, 2e-3, 1e-5, 1e-8], "forward": [3e-3, 5e-6, 1e-8],
                       "train": [1e-2, 1e-5, 1e-7], "optimizer": 3e-3,
                       "forward_grid": {"B": [4, 16, 64], "S": [16, 64], "ratio": [[1.1, 0.9], [1.0, 1.2], [0.8, 1.0]]},
                       "train_grid": {"B": [2, 32], "S": [16, 64], "ratio": [[1.0, 1.3], [0.7, 1.0]]}}}})
    cm = CostModel(m, CostConfig(profile=prof))
    cands = [Layout(0, 1), Layout(0, 2), Layout(0, 2, 2, 1, 1, 2)]
    for stage in ("roll", "logp", "actor_train"):
        a = evaluate(m, stage, cands, cost_model=cm)
        b = evaluate(m, stage, cands, cost_model=cm, backend="jax")
        np.testing.assert_allclose(b["total"], a["total"], rtol=1e-12)
        assert cm.stage_cost(m.graph.stage(stage)).source == "profile"
