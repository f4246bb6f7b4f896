"""Memory per device and the memory check placement passes call.

:func:`check_memory` simulates one step of an annotated module and reports
each device whose peak (resident weights + gradients/optimizer state of the
models placed on it + activations / KV cache of the stages running at the
peak) exceeds its capacity, as::

    stage %actor_train needs 290.4 GiB on device 0 but it has 74.5 GiB
      hint: ... what it holds ...; e.g. parallel = {dp = 16, tp = 8, pp = 1} needs ...

It is not a verifier check (before placement the default plan of a 70B program
does not fit, and that is not an error of the program): a placement pass calls
it after deciding, and ``rlhfc explain`` reports what it finds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhfc.ir import DiagnosticSink, Module, plan, where

from .batched import candidate_layouts, evaluate
from rlhfc.ir.plan import RECOMPUTE_POLICIES, Layout
from .model import CostConfig, CostModel
from .quick import exclusive_peaks
from .simulator import simulate

GiB = 1024 ** 3


@dataclass
class MemoryIssue:
    stage: str
    device: int
    devices: list
    need_bytes: float
    capacity_bytes: float
    message: str
    hint: str


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def memory_issues(module: Module, config: CostConfig | None = None, *, sim=None,
                  cost_model: CostModel | None = None) -> list[MemoryIssue]:
    """Every group of devices whose simulated peak exceeds capacity (one issue per culprit stage).

    ``sim``: a :func:`~rlhfc.cost.simulate` result of this module to reuse (else one step is simulated)."""
    cm = cost_model or CostModel(module, config)
    result = sim or simulate(module, steps=1, cost_model=cm)
    over = [d for d in result.devices if d.peak_memory_bytes > d.capacity_bytes]
    groups: dict[tuple, list] = {}
    for d in over:
        stage = _culprit(result, d)
        groups.setdefault((stage, round(d.peak_memory_bytes)), []).append(d)
    issues = []
    for (stage, _), devs in groups.items():
        d = devs[0]
        ids = [x.index for x in devs]
        more = f" (devices {_ranges(ids)} alike)" if len(ids) > 1 else ""
        message = (f"stage %{stage} needs {_gib(d.peak_memory_bytes)} on device {d.index} but it has "
                   f"{_gib(d.capacity_bytes)}{more}")
        issues.append(MemoryIssue(stage, d.index, ids, d.peak_memory_bytes, d.capacity_bytes, message,
                                  _hint(cm, module, result, stage, d)))
    return issues


def fits(module: Module, config: CostConfig | None = None, *, sim=None, cost_model: CostModel | None = None) -> bool:
    """Whether every device's simulated peak is within its capacity: ``not memory_issues(...)`` without
    building the issues' hints (what a placement search asks of every candidate). On devices that run one
    task at a time the peaks need no timeline (:func:`rlhfc.cost.quick.exclusive_peaks`)."""
    cm = cost_model or CostModel(module, config)
    if sim is None and not cm.spec.is_cpu:
        return all(peak <= cm.spec.memory for peak in exclusive_peaks(module, cm))
    result = sim or simulate(module, steps=1, cost_model=cm)
    return not any(d.peak_memory_bytes > d.capacity_bytes for d in result.devices)


def check_memory(module: Module, sink: DiagnosticSink, config: CostConfig | None = None, *,
                 severity: str = "error", sim=None) -> list[MemoryIssue]:
    """Report memory overflows to ``sink`` (``error`` by default; ``warning`` to only inform)."""
    issues = memory_issues(module, config, sim=sim)
    for issue in issues:
        try:
            loc = where(module.graph.stage(issue.stage))
        except KeyError:
            loc = None
        report = sink.error if severity == "error" else sink.warning
        report(issue.message, loc, issue.hint)
    return issues


def _culprit(result, dev) -> str:
    """The stage to blame on a device: the largest transient at the peak, else the largest resident model."""
    running = [name.lstrip("%").split("@")[0] for name in dev.peak_stages]
    if running:
        return max(running, key=lambda s: result.costs[s].total_bytes)
    if dev.static:
        model = max(dev.static, key=dev.static.get).split()[0].lstrip("@")
        for name, c in result.costs.items():
            if c.model == model and c.layout is not None and dev.index in c.layout.devices:
                return name
    return next(iter(result.costs))


def _size(x: float) -> str:
    return _gib(x) if x >= GiB else f"{x / 2 ** 20:.1f} MiB"


def _ranges(ids: list[int]) -> str:
    ids = sorted(ids)
    out, start, prev = [], ids[0], ids[0]
    for x in ids[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _hint(cm: CostModel, module: Module, result, stage: str, dev) -> str:
    held = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(dev.static.items(), key=lambda kv: -kv[1]))
    cost = result.costs[stage]
    parts = [f"device {dev.index} holds {held or 'nothing resident'}"]
    if cost.transient_bytes:
        parts[0] += f"; %{stage} adds {_gib(cost.transient_bytes)} of activations/KV cache while it runs"
    # what the candidate layouts of this stage re-price: the model's weights (and its training state when the
    # stage is its train stage); everything else on the device stays
    repriced = _own_static(dev, cost.model, with_state=bool(cost.state_bytes))
    suggestion = suggest_layout(cm, module, stage, dev.capacity_bytes - (sum(dev.static.values()) - repriced))
    if suggestion is not None and cost.layout is not None and suggestion[0] == cost.layout:
        suggestion = None
    engines = [k.split()[0] for k in dev.static if k.endswith(" vllm engine")]
    if engines:   # the vLLM engine's own weights copy and KV-cache reservation (CostModel.engine_bytes)
        parts.append(f"the vLLM engine of {', '.join(engines)} keeps its own copy of the weights and its KV cache "
                     "(VLLM_CPU_KVCACHE_SPACE GiB on CPU) on the device for the whole run: rollout = torch needs "
                     "neither")
    fix = _recompute_fix(cm, module, stage, dev)
    if fix:
        parts.append(fix)
    if suggestion is not None:
        lay, need = suggestion
        parts.append(f"shard @{cost.model} more: parallel = {{dp = {lay.dp}, tp = {lay.tp}, pp = {lay.pp}}}"
                     + (f", recompute = \"{lay.recompute}\"" if lay.recompute != "none" else "")
                     + f" needs {_gib(need)} per device for it")
    else:
        parts.append(f"no other (dp, tp, pp) split of its {cost.layout.count if cost.layout else 0} devices fits "
                     f"@{cost.model} beside what else they hold: give models separate meshes "
                     "(mesh = {first = I, count = N}), more micro-batches, more devices, or offload")
    return "; ".join(parts)


def _recompute_fix(cm: CostModel, module: Module, stage: str, dev) -> str:
    """For a train stage that keeps all its activations: whether recomputing them would make it fit."""
    st = module.graph.stage(stage)
    if st.op != "train" or plan.recompute_decision(st) is not None:
        return ""
    lay = cm.layout(st)
    full = cm.stage_cost(st, replace(lay, recompute="full")).transient_bytes
    if sum(dev.static.values()) + full > dev.capacity_bytes:
        return ""
    return (f"recomputing its activations makes it fit ({_gib(full)} of activations instead of "
            f"{_gib(cm.stage_cost(st, lay).transient_bytes)}): the recompute pass (in -O2 and -O3) chooses what "
            "to keep")


def _own_static(dev, model: str | None, with_state: bool) -> float:
    if not model:
        return 0.0
    keys = [f"@{model} weights"] + ([f"@{model} grads+optimizer"] if with_state else [])
    return sum(dev.static.get(k, 0.0) for k in keys)


def suggest_layout(cm: CostModel, module: Module, stage: str, budget: float) -> tuple[Layout, float] | None:
    """The fastest (dp, tp, pp) on the stage's own mesh whose memory for this model fits in ``budget``."""
    st = module.graph.stage(stage)
    model = module.models.get(st.target or "")
    if model is None or budget <= 0 or cm.spec.is_cpu:
        return None
    lay = cm.layout(st)
    cands = candidate_layouts(lay.first, lay.count, per_node=module.cluster.per_node, heads=model.heads,
                              kv_heads=model.kv_heads, layers=model.layers, microbatches=(lay.microbatches,),
                              recompute=RECOMPUTE_POLICIES if st.op == "train" else ("none",))
    if not cands:
        return None
    res = evaluate(module, stage, cands, cost_model=cm)
    need = res["weights_bytes"] + res["state_bytes"] + res["transient_bytes"]
    ok = [i for i in range(len(cands)) if need[i] <= budget]
    if not ok:
        return None
    best = min(ok, key=lambda i: (res["total"][i], need[i]))
    return cands[best], float(need[best])


def unfittable(module: Module, sink: DiagnosticSink, config: CostConfig | None = None) -> list[str]:
    """Report each model stage that fits no plan at all: spread over every device of the cluster, in the
    (dp, tp, pp) split, micro-batches (up to 8) and recomputation that need the least memory, alone on its
    devices, it still needs more than a device has (what ``rlhfc check`` rejects whatever the -O level)."""
    cm = CostModel(module, config)
    n, cap = module.cluster.num_devices, cm.spec.memory
    bad = []
    for st in module.graph.stages:
        model = module.models.get(st.target or "")
        if model is None or st.op.split(".", 1)[0] not in ("generate", "forward", "train"):
            continue
        best = None
        for mb in (1, 2, 4, 8):
            cands = candidate_layouts(0, n, per_node=module.cluster.per_node, heads=model.heads,
                                      kv_heads=model.kv_heads, layers=model.layers, microbatches=(mb,), recompute=("full",) if st.op == "train" else ("none",))
            if not cands:
                continue
            res = evaluate(module, st.name, cands, cost_model=cm)
            need = float((res["weights_bytes"] + res["state_bytes"] + res["transient_bytes"]).min())
            best = need if best is None else min(best, need)
        if best is not None and best > cap:
            bad.append(st.name)
            on_vllm = st.op == "generate" and cm.own_weights(st)
            sink.error(f"stage %{st.name} fits no plan: even over all {n} devices with the least memory "
                       f"(sharded, 8 micro-batches{', full recompute' if st.op == 'train' else ''}) it needs "
                       f"{_size(best)} per device but a device has {_size(cap)}", where(st),
                       ("its vLLM engine takes its gpu_memory_utilization share of the device while it generates: "
                        "run { rollout = torch }, or " if on_vllm else "")
                       + "more or larger devices (cluster memory / gpu kind), a smaller batch or shorter sequences")
    return bad
