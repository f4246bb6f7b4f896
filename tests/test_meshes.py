"""Hardware-aware meshes and memory counted once (issue #20).

Every layout a placement strategy chooses obeys the hardware rules of :mod:`rlhfc.ir.plan.hardware`
(node-aligned meshes, tp inside a node dividing heads and kv heads, pp dividing layers, dp·tp·pp = mesh),
on every example and a table of clusters; and a stage's memory budget is what its devices have left after
the other models, not an equal share of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfc.cost import memory_issues, simulate
from rlhfc.ir import plan
from rlhfc.passes import placement as P
from rlhfc.passes.layouts import apply
from rlhfc.passes.search import candidate_meshes
from rlhfc.passes.strategies import flatten, interleave, respect_fixed, separate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))
#: (nodes, gpus per node): one node, several, a big pod, 4-GPU nodes, and odd sizes
CLUSTERS = [(1, 8), (2, 8), (4, 8), (16, 8), (3, 4), (1, 6), (5, 8), (3, 6)]


def _load(path: Path, nodes: int | None = None, per: int | None = None):
    from rlhfc.cli.load import load

    module, _ = load(str(path), [])
    if nodes is not None:
        module.cluster.device = module.cluster.device if module.cluster.device != "cpu" else "H100-80GB"
        module.cluster.nodes, module.cluster.per_node = nodes, per
    return module


def _assert_rules(module, where: str) -> None:
    per = module.cluster.per_node
    for s in module.graph.stages:
        if s.target not in module.models or not plan.on_worker(module, s):
            continue
        m = module.models[s.target]
        lay = plan.stage_layout(module, s)
        bad = plan.layout_problems(lay, per_node=per, heads=m.heads, kv_heads=m.kv_heads, layers=m.layers)
        assert not bad, f"{where}: %{s.name} {lay}: {bad}"


def test_rules_name_what_breaks():
    lay = plan.Layout(0, 128, dp=3, tp=1, pp=23)   # what separate gave the 70B actor before
    bad = plan.layout_problems(lay, per_node=8, heads=64, kv_heads=8, layers=80)
    assert any("pp = 23 does not divide the 80 layers" in b for b in bad)
    assert any("dp·tp·pp = 69" in b for b in bad)
    assert plan.layout_problems(plan.Layout(0, 36, dp=9, tp=4), per_node=8, heads=32, kv_heads=32, layers=32) \
        == ["mesh 0..35 straddles nodes of 8 devices (a mesh lies inside one node or is whole nodes)"]
    assert "tp = 4 groups cross" in plan.layout_problems(plan.Layout(2, 4, tp=4), per_node=4, heads=8,
                                                         kv_heads=8, layers=2)[-1]
    assert plan.layout_problems(plan.Layout(8, 16, dp=2, tp=8), per_node=8, heads=64, kv_heads=8, layers=80) == []


@pytest.mark.parametrize("nodes,per", CLUSTERS)
def test_search_meshes_are_node_aligned(nodes, per):
    meshes = candidate_meshes(nodes * per, per)
    assert all(plan.mesh_aligned(f, c, per) for f, c in meshes), meshes


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_strategies_obey_hardware_rules_on_every_cluster(path):
    """flatten, interleave and separate on every cluster of the table: each stage's layout obeys the rules
    (the plan need not fit in memory here: a 70B model on 6 GPUs does not)."""
    for nodes, per in CLUSTERS:
        module = _load(path, nodes, per)
        for name, strategy in (("flatten", flatten), ("interleave", interleave), ("separate", separate)):
            trial = module.clone()
            apply(trial, respect_fixed(trial, strategy(trial)))
            _assert_rules(trial, f"{path.stem} on {nodes}x{per} {name}")


def test_examples_compile_to_rule_abiding_plans():
    """The issue's cases: 70B actor pp must divide 80 layers, generation on whole nodes."""
    module = _load(ROOT / "examples" / "ppo_70b.rlhf")
    for strategy in ("separate", "interleave"):
        out = P.Placement(strategy=strategy).run(module.clone())
        _assert_rules(out, strategy)
        roll = plan.stage_layout(out, out.graph.stage("roll"))
        assert roll.first % 8 == 0 and roll.count % 8 == 0, roll
    small = _load(ROOT / "examples" / "ppo_7b.rlhf", 2, 8)   # the search's plans obey them too
    _assert_rules(P.Placement(strategy="search", candidates=60).run(small), "search on 2x8")


def test_flatten_counts_memory_once():
    """ppo_7b on one node of 34 GiB devices: before, each stage was budgeted a quarter of a device (four
    models) and the plan of the flatten strategy overflowed at squeeze 1 (%roll 53.1 GiB on 34 GiB, so
    search priced it ×3 as not fitting) and the pass settled, halving budgets, on a 93.7 s step; now the
    stages share what the devices have, the plan fits near capacity and steps faster."""
    module = _load(ROOT / "examples" / "ppo_7b.rlhf")
    module.cluster.memory = 34 * 2 ** 30
    trial = module.clone()
    apply(trial, flatten(trial))
    sim = simulate(trial, steps=1)
    assert not memory_issues(trial, sim=sim)
    peak = max(d.peak_memory_bytes for d in sim.devices)
    assert 0.8 * module.cluster.memory < peak <= module.cluster.memory   # it uses what it has, once
    out = P.Placement(strategy="flatten").run(module.clone())
    assert simulate(out, steps=3).step_time_s < 90.0
