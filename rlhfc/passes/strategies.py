"""The placement strategies' plans: ``flatten``, ``interleave`` and ``separate`` (see :mod:`rlhfc.passes.placement`).

A plan is ``{stage name: (first, count)}`` (:mod:`rlhfc.passes.layouts` applies it). ``interleave`` gives models
exclusive node-aligned shares sized by their work (:func:`work_per_model`, :func:`work_shares`), ``separate``
puts generation on devices of its own, ``flatten`` puts everything everywhere; :func:`respect_fixed` keeps a
model whose layout the program fixes on one mesh of its dp·tp·pp devices. The placement search starts from these
plans (:mod:`rlhfc.passes.search`), and the baseline systems' plans are built from them
(:mod:`rlhfc.passes.baselines`).
"""

from __future__ import annotations

from rlhfc.cost import CostModel, candidate_layouts, evaluate
from rlhfc.ir import Module, plan

from .layouts import apply, mesh_of, model_stages


def fixed_sizes(module: Module) -> dict[str, int]:
    """Devices of each model whose layout the program fixes (dp·tp·pp), when the cluster has them."""
    n = module.cluster.num_devices
    out = {}
    for name, m in module.models.items():
        fixed = plan.fixed_layout(m)
        if fixed is not None and fixed.size <= n:
            out[name] = fixed.size
    return out


def respect_fixed(module: Module, assign: dict) -> dict:
    """``assign`` with every stage of a fixed-layout model on one mesh of exactly its dp·tp·pp devices:
    starting where its train stage (else its first stage) was put, moved back to fit the cluster (a value may
    be a pinned layout: :func:`rlhfc.passes.layouts.apply`)."""
    n = module.cluster.num_devices
    out = dict(assign)
    for model, size in fixed_sizes(module).items():
        stages = [s for s in module.graph.stages_on(model) if s.name in out]
        if not stages:
            continue
        anchor = next((s for s in stages if s.op == "train"), stages[0])
        first = min(mesh_of(out[anchor.name])[0], n - size)
        for s in stages:
            out[s.name] = (first, size)
    return out


def flatten(module: Module) -> dict[str, tuple[int, int]]:
    n = module.cluster.num_devices
    return {s.name: (0, n) for stages in model_stages(module).values() for s in stages}


def _flat_stage_seconds(module: Module) -> dict[str, float]:
    """Seconds per model stage when every stage has the whole cluster (cost model, catalog rates)."""
    trial = module.clone()
    apply(trial, flatten(trial), layouts=False)
    cm = CostModel(trial)
    return {s.name: cm.stage_cost(s).time_s for s in trial.graph.stages if s.target in trial.models}


def work_per_model(module: Module) -> dict[str, float]:
    """Seconds of work per model with the whole cluster to itself (cost model)."""
    seconds = _flat_stage_seconds(module)
    return {name: sum(seconds[s.name] for s in stages) for name, stages in model_stages(module).items()}


def work_shares(module: Module, work: dict[str, float]) -> dict[str, tuple[int, int]]:
    """Exclusive node-aligned device ranges sized by work (a fixed-layout model's: its dp·tp·pp, when all fit
    side by side): models heavy enough for a node or more get whole nodes, the others share nodes, packed by
    longest-processing-time, each node's devices split by work (on one device, models share it)."""
    n, per = module.cluster.num_devices, max(module.cluster.per_node, 1)
    names = sorted(work, key=lambda m: (-work[m], m))
    fixed = {m: k for m, k in fixed_sizes(module).items() if m in work}
    if fixed and sum(fixed.values()) + len(names) - len(fixed) <= n:
        return _fixed_shares(names, work, fixed, n)
    nodes = n // per
    total = sum(work.values()) or 1.0
    least = _least_devices(module, names)
    big = [m for m in names if nodes > 1 and (n * work[m] / total >= per / 2 or least[m] >= per)]
    while big:
        small = [m for m in names if m not in big]
        small_nodes = max(1, round(sum(n * work[m] / total for m in small) / per)) if small else 0
        if len(big) <= nodes - small_nodes:
            break
        big.pop()                                          # too few nodes: the lightest joins the shared ones
    small = [m for m in names if m not in big]
    small_nodes = min(nodes, max(1, round(sum(n * work[m] / total for m in small) / per))) if small else 0
    out = {}
    counts = _sized(big, work, nodes - small_nodes, least={m: -(-least[m] // per) for m in big})
    for m, (first, k) in _side_by_side(big, counts).items():
        out[m] = (first * per, k * per)
    base = (nodes - small_nodes) * per
    bins = [[] for _ in range(small_nodes)]
    load = [0.0] * small_nodes
    for m in small:                                        # longest-processing-time over the shared nodes
        i = min(range(small_nodes), key=lambda b: (load[b], b))
        bins[i].append(m)
        load[i] += work[m]
    for i, ms in enumerate(bins):
        first = base + i * per
        if per < len(ms):
            devs = [[] for _ in range(per)]
            dload = [0.0] * per
            for m in ms:
                j = min(range(per), key=lambda b: (dload[b], b))
                devs[j].append(m)
                dload[j] += work[m]
            out.update({m: (first + j, 1) for j, group in enumerate(devs) for m in group})
        else:
            counts = _sized(ms, work, per, least=least)
            if module.cluster.device != "cpu":   # CPU meshes are one process's threads: no splits to even out
                counts = _divisor_sized(ms, counts, per)
            order = sorted(ms, key=lambda m: -counts[m])   # largest first: every share starts at a multiple of it
            for m, (f, k) in _side_by_side(order, counts).items():
                out[m] = (first + f, k)
    return out


def _divisor_sized(names: list[str], counts: dict[str, int], per: int) -> dict[str, int]:
    """``counts`` (summing to at most ``per``) rounded down to divisors of ``per`` (a share of a node that
    splits evenly: tp groups and pipeline stages of equal size), then the freed devices handed back, each
    share growing to its next divisor while they last (heaviest first)."""
    divisors = [d for d in range(1, per + 1) if per % d == 0]
    out = {m: max(d for d in divisors if d <= counts[m]) for m in names}
    grown = True
    while grown:
        grown = False
        for m in names:
            nxt = [d for d in divisors if d > out[m]]
            if nxt and sum(out.values()) - out[m] + nxt[0] <= per:
                out[m], grown = nxt[0], True
                break
    return out


def _least_devices(module: Module, names: list[str]) -> dict[str, int]:
    """The fewest devices (a node-aligned mesh size) on which each model's stages fit alone in memory, in
    the split that needs least (8 micro-batches, full recompute); the cluster's size when none does."""
    n, per = module.cluster.num_devices, module.cluster.per_node
    if module.cluster.device == "cpu":
        return {m: 1 for m in names}
    trial = module.clone()
    apply(trial, flatten(trial), layouts=False)
    cm = CostModel(trial)
    stages = model_stages(trial)
    out = {}
    for m in names:
        model = trial.models[m]
        out[m] = n
        for size in plan.aligned_sizes(n, per):
            need = 0.0
            for st in stages.get(m, []):
                cands = candidate_layouts(0, size, per_node=per, heads=model.heads, kv_heads=model.kv_heads,
                                          layers=model.layers, microbatches=(8,),
                                          recompute=("full",) if st.op == "train" else ("none",))
                res = evaluate(trial, st.name, cands, cost_model=cm)
                need = max(need, float((res["weights_bytes"] + res["state_bytes"] + res["transient_bytes"]).min()))
            if need <= cm.spec.memory:
                out[m] = size
                break
    return out


def _fixed_shares(names: list[str], work: dict[str, float], fixed: dict[str, int], n: int) -> dict:
    """Side-by-side ranges: fixed-layout models get their size, the others the rest sized by work."""
    rest = [m for m in names if m not in fixed]
    return _side_by_side(names, {**_sized(rest, work, n - sum(fixed.values())), **fixed})


def _sized(names: list[str], work: dict[str, float], n: int, least: dict[str, int] | None = None) -> dict[str, int]:
    """Device counts for ``names`` out of ``n``, in proportion to their work (at least ``least[m]``, else one,
    each, while the total allows; the largest shares trimmed, spare devices handed to the heaviest first)."""
    if not names:
        return {}
    floor = {m: 1 for m in names}
    if least and sum(least.get(m, 1) for m in names) <= n:
        floor = {m: max(1, least.get(m, 1)) for m in names}
    total = sum(work[m] for m in names) or 1.0
    counts = {m: max(floor[m], int(n * work[m] / total)) for m in names}
    while sum(counts.values()) > n:                       # trim the largest shares above their floor
        over = [m for m in counts if counts[m] > floor[m]] or list(counts)
        big = max(over, key=lambda m: counts[m])
        counts[big] -= 1
    spare = n - sum(counts.values())
    for m in names:                                       # hand spare devices to the heaviest
        if spare <= 0:
            break
        counts[m] += 1
        spare -= 1
    return counts


def _side_by_side(names: list[str], counts: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Consecutive device ranges of the given sizes, in ``names`` order."""
    out, first = {}, 0
    for m in names:
        out[m] = (first, counts[m])
        first += counts[m]
    return out


def interleave(module: Module) -> dict[str, tuple[int, int]]:
    share = work_shares(module, work_per_model(module))
    return {s.name: share[m] for m, stages in model_stages(module).items() for s in stages}


def separate(module: Module) -> dict[str, tuple[int, int]]:
    """Generation on the first devices (sized by its share of the work: whole nodes on a multi-node
    cluster, else a share of the node that divides it), everything else on the rest."""
    n, per = module.cluster.num_devices, max(module.cluster.per_node, 1)
    if n < 2:
        return flatten(module)
    seconds = _flat_stage_seconds(module)
    gen = sum(t for name, t in seconds.items() if module.graph.stage(name).op == "generate")
    rest = sum(seconds.values()) - gen
    share = gen / max(gen + rest, 1e-9)
    nodes = n // per
    if nodes >= 2:
        k = per * min(nodes - 1, max(1, round(nodes * share)))
    elif module.cluster.device != "cpu":   # part of one node, a share that divides it (tp/pp split evenly)
        k = min((d for d in range(1, n) if n % d == 0), key=lambda d: (abs(d - n * share), d))
    else:
        k = min(n - 1, max(1, round(n * share)))
    out = {}
    for stages in model_stages(module).values():
        for s in stages:
            out[s.name] = (0, k) if s.op == "generate" else (k, n - k)
    return out
