"""Per-stage time and memory: catalog, layouts, lengths, formulas, transfers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhfc.cost import CATALOG, CostConfig, CostModel, Layout, device_spec, sync_time, stage_layout
from rlhfc.cost.lengths import PromptLengths, geometric, lognormal, response_dist

from .helpers import annotate, example, gpu_ppo, mesh

GB = 1e9


def test_catalog_has_the_published_figures():
    assert CATALOG["A100-80GB"].peak_flops == 312e12 and CATALOG["A100-80GB"].memory == 80 * GB
    assert CATALOG["A100-40GB"].memory == 40 * GB and CATALOG["A100-40GB"].hbm_bw == pytest.approx(1.555e12)
    assert CATALOG["H100-80GB"].peak_flops == 989e12 and CATALOG["H100-80GB"].hbm_bw == pytest.approx(3.35e12)
    assert CATALOG["H200"].hbm_bw == pytest.approx(4.8e12) and CATALOG["H200"].memory == 141 * GB
    assert CATALOG["H100-80GB"].intra_bw > CATALOG["A100-80GB"].intra_bw > CATALOG["A100-80GB"].inter_bw
    assert device_spec("cpu").source == "uncalibrated"
    with pytest.raises(KeyError):
        device_spec("TPUv9")


def test_layout_defaults_and_annotations():
    m = gpu_ppo(nodes=2)
    roll = m.graph.stage("roll")
    assert stage_layout(m, roll) == Layout(0, 16, 16, 1, 1)
    roll.annotations.update(mesh={"first": 8, "count": 8}, parallel={"tp": 4}, microbatches=2, recompute="full")
    lay = stage_layout(m, roll)
    assert (lay.first, lay.count, lay.dp, lay.tp, lay.pp, lay.microbatches, lay.recompute) == (8, 8, 2, 4, 1, 2, "full")
    assert lay.nodes(8) == [1] and not lay.tp_inter_node(8) and not lay.dp_inter_node(8)
    assert Layout(4, 8, 1, 8, 1).tp_inter_node(8)          # a tp group straddling two nodes


def test_length_distributions():
    g = geometric(64, 1 / 96)
    assert abs(sum(g.pmf) - 1) < 1e-9 and g.T == 64
    # the longest of many samples is near the maximum; of one sample, near the mean
    assert g.expected_max(64) > 60 and g.expected_max(1) == pytest.approx(g.mean(), rel=1e-9)
    order = g.order_stats(16)
    assert np.all(np.diff(order) >= -1e-9) and order[-1] == pytest.approx(g.expected_max(16), rel=1e-9)
    assert g.kth_running(16, 16) == pytest.approx(g.p_running(16))
    # overcommitment: waiting for the first 12 of 16 is shorter than for all 16
    assert g.kth_running(12, 16).sum() < g.p_running(16).sum()
    tail = lognormal(1024, 0.25, 1.0)
    assert abs(sum(tail.pmf) - 1) < 1e-9
    assert tail.mean() < 0.4 * 1024 and tail.expected_max(512) > 0.99 * 1024   # the batch waits for stragglers
    assert response_dist("max", 8, vocab=10, pretrained=False).expected_max(4) == 8
    assert response_dist("auto", 32, vocab=96, pretrained=True).mean() < 16
    with pytest.raises(ValueError):
        response_dist("zipf", 8, vocab=10, pretrained=False)
    p = PromptLengths(5, 13)
    assert p.mean() == 9 and 12 < p.expected_max(16) <= 13 and p.expected_max(1) == pytest.approx(9)


def test_tiny_example_costs_are_positive_and_sourced():
    cm = CostModel(example("ppo_tiny"))
    costs = cm.all_costs()
    assert all(c.time_s > 0 for c in costs.values())
    assert costs["roll"].source == "analytic" and costs["adv"].source == "driver" and costs["adv"].layout is None
    assert costs["prompts"].model is None and costs["roll"].model == "actor"
    # the torch backend pads responses to max_new_tokens
    assert costs["logp"].work["response"] == 24
    assert costs["actor_train"].state_bytes > costs["actor_train"].weights_bytes   # grads + Adam moments


def test_gpu_scaling_laws():
    m = gpu_ppo(batch=256, new=256)
    cm = CostModel(m, CostConfig(dispatch_s=0.0))
    base = {s: cm.stage_cost(m.graph.stage(s)) for s in ("roll", "logp", "actor_train")}
    # generation of 7B is memory-bandwidth bound; forwards and training compute bound
    assert base["roll"].bound == "memory" and base["logp"].bound == "compute" and base["actor_train"].bound == "compute"
    # twice the batch: the forward costs ~2x, decoding far less than 2x (weights are read once per step)
    m2 = gpu_ppo(batch=512, new=256)
    cm2 = CostModel(m2, CostConfig(dispatch_s=0.0))
    assert cm2.stage_cost(m2.graph.stage("logp")).time_s == pytest.approx(2 * base["logp"].time_s, rel=0.05)
    assert cm2.stage_cost(m2.graph.stage("roll")).time_s < 1.6 * base["roll"].time_s
    # H100 is faster than A100 for the same plan
    a100 = gpu_ppo(gpu="A100-80GB")
    assert CostModel(a100).stage_cost(a100.graph.stage("logp")).time_s > 2 * base["logp"].time_s
    # full recomputation costs one more forward (8N vs 6N FLOPs); selective +20 %
    train = m.graph.stage("actor_train")
    t = {rc: cm.stage_cost(train, Layout(0, 8, 8, 1, 1, 1, rc)).parts["compute"]
         for rc in ("none", "selective", "full")}
    assert t["full"] / t["none"] == pytest.approx(4 / 3, rel=1e-6)
    assert t["selective"] / t["none"] == pytest.approx(1.2, rel=1e-6)


def test_memory_formulas_match_techniques():
    """weights 2N, grads 2N, Adam 12N sharded over dp (a distributed optimizer), divided by tp*pp."""
    m = gpu_ppo()
    cm = CostModel(m)
    n = m.models["actor"].params
    c = cm.stage_cost(m.graph.stage("actor_train"), Layout(0, 8, 2, 2, 2))
    assert c.weights_bytes == pytest.approx(2 * n / 4)
    assert c.state_bytes == pytest.approx(2 * n / 4 + 12 * n / 8)
    # KV cache: 2 (K,V) * layers * kv_dim * 2 bytes per token, split over tp
    gen = cm.stage_cost(m.graph.stage("roll"), Layout(0, 8, 1, 8, 1))
    gen2 = cm.stage_cost(m.graph.stage("roll"), Layout(0, 8, 1, 4, 2))
    assert gen.transient_bytes > 0 and gen2.weights_bytes == gen.weights_bytes
    # recomputation shrinks training activations
    full = cm.stage_cost(m.graph.stage("actor_train"), Layout(0, 8, 8, 1, 1, 1, "full")).transient_bytes
    none = cm.stage_cost(m.graph.stage("actor_train"), Layout(0, 8, 8, 1, 1, 1, "none")).transient_bytes
    assert full < none


def test_long_tail_and_batching():
    m = gpu_ppo(batch=256, new=512)
    tail = CostModel(m, CostConfig(response_lengths="lognormal:0.25:1.0"))
    full = CostModel(m, CostConfig(response_lengths="max"))
    roll = m.graph.stage("roll")
    t_tail, t_full = tail.stage_cost(roll).time_s, full.stage_cost(roll).time_s
    # shorter responses on average, but the batch still waits for the longest: well over a quarter of full time
    assert 0.25 * t_full < t_tail < t_full
    static = CostModel(m, CostConfig(response_lengths="lognormal:0.25:1.0", batching="static"))
    assert static.stage_cost(roll).time_s > t_tail          # finished rows keep their slot in a static batch
    # microbatches on generate = waves one after another: more waves, more time
    waves = tail.stage_cost(roll, Layout(0, 8, 8, 1, 1, 8)).time_s
    assert waves > t_tail
    offsets = tail.stage_cost(roll).finish_offsets
    assert len(offsets) == 256 and list(offsets) == sorted(offsets) and offsets[-1] <= t_tail


def test_overcommit_shortens_generation():
    m = gpu_ppo(batch=256, new=512)
    cfg = CostConfig(response_lengths="lognormal:0.25:1.0")
    base = CostModel(m, cfg).stage_cost(m.graph.stage("roll")).time_s
    m.graph.stage("roll").annotations["overcommit"] = {"delta": 32}
    assert CostModel(m, cfg).stage_cost(m.graph.stage("roll")).time_s < base


def test_sync_time():
    spec = CATALOG["H100-80GB"]
    nbytes = 140e9
    same = Layout(0, 8, 1, 8, 1)
    assert sync_time(nbytes, same, same, spec, 8) == 0.0
    # tp8 -> tp4 pp2 inside one node: each device fetches half of what it lacked over NVLink
    intra = sync_time(nbytes, same, Layout(0, 8, 1, 4, 2), spec, 8)
    # the same move to another node goes over the network: slower
    inter = sync_time(nbytes, same, Layout(8, 8, 1, 4, 2), spec, 8)
    assert 0.03 < intra < inter
    assert inter == pytest.approx(0.03 + nbytes / 8 / (spec.inter_bw * spec.net_eff), rel=1e-6)
    # a device that already holds its shard receives nothing
    assert sync_time(nbytes, Layout(0, 8, 1, 8, 1), Layout(0, 8, 1, 8, 1, 2), spec, 8) == 0.0


def test_cpu_layout_counts_threads_not_ranks():
    m = example("ppo_tiny")
    annotate(m, {"logp": mesh(0, 1)})
    cm = CostModel(m)
    one = cm.stage_cost(m.graph.stage("logp"))
    two = cm.stage_cost(m.graph.stage("ref_logp"))
    assert one.layout.count == 1 and two.layout.count == 2
    assert math.isfinite(one.time_s) and one.time_s >= two.time_s * 0.99


def test_importing_the_cost_model_imports_neither_torch_nor_jax():
    import subprocess
    import sys

    code = "import sys, rlhfc.cost, rlhfc.explain; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_cpu_worker_groups_are_priced_as_processes_with_their_collectives():
    """On a CPU cluster, a layout the run's trainer runs as a group of processes (fsdp, megatron) is priced
    as dp × tp × pp ranks of one core each, with their gloo collectives; under ``trainer = torch`` the same
    layout is one process whose threads are the mesh's cores (no collectives)."""
    import os
    import re

    from rlhfc.frontend import compile_source

    path = os.path.join(os.path.dirname(__file__), "..", "e2e", "mixed_layouts.rlhf")
    text = open(path).read()
    groups, _ = compile_source(text.replace("trainer = auto", "trainer = megatron"), path)
    torch_, _ = compile_source(re.sub(r" layout\([^)]*\)", "", text).replace("; trainer = auto", ""), path)
    fwd, train = groups.graph.stage("logp"), groups.graph.stage("actor_train")
    for stage in (fwd, train):   # the actor's fixed layout is dp2: two processes, one core each
        assert CostModel(groups, CostConfig(dispatch_s=0.0))._processes(stage, Layout(0, 2, 2)).size == 2
        assert CostModel(torch_, CostConfig(dispatch_s=0.0))._processes(
            torch_.graph.stage(stage.name), Layout(0, 2, 2)) is None
    from dataclasses import replace

    cm, one = CostModel(groups, CostConfig(dispatch_s=0.0)), CostModel(torch_, CostConfig(dispatch_s=0.0))
    one.spec = replace(one.spec, thread_speedup=(1.0, 2.0))   # two threads twice one's speed
    tp2 = Layout(0, 2, 1, 2, 1)
    critic = groups.graph.stage("values")   # critic: layout(tp = 2) under megatron
    assert cm.stage_cost(critic, tp2).parts["comm"] > 0
    assert one.stage_cost(torch_.graph.stage("values"), tp2).parts["comm"] == 0
    dp2_train = cm.stage_cost(train, Layout(0, 2, 2))
    assert dp2_train.parts["comm"] > 0   # the gradient all-reduce over the two ranks
    # each rank computes half the rows on one core: the work matches one process on two perfectly scaling cores
    assert dp2_train.parts["compute"] == pytest.approx(one.stage_cost(torch_.graph.stage("actor_train"),
                                                                      Layout(0, 2, 2)).parts["compute"], rel=1e-6)
