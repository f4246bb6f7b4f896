"""The plans other RLHF systems would run for the same program (``placement = "baseline:NAME"``).

Each builder gives every model stage the mesh and split that system uses, marks the module's strategy
``baseline:NAME`` (so :mod:`rlhfc.cost.baselines` prices the system's own costs: ZeRO-3 gathers, resharding
before generation, static batching) and undoes what the system does not do (overlap of independent stages
where it runs them one after another, streaming, unpadded compute). The sources and what each plan
leaves out are in docs/benchmarks.md ("Baselines").

- ``dschat`` (DeepSpeed-Chat): every model on every device, ZeRO-3 data parallel (dp = devices); the actor
  generates through the Hybrid Engine: its shards gathered into a tensor-parallel layout (the smallest tp
  that holds the weights beside what the devices keep), HF-style static batches, as many waves as the KV
  cache allows; stages one after another; gradient checkpointing.
- ``openrlhf`` (OpenRLHF): vLLM engines on their own devices (continuous batching, the smallest tp that
  holds the weights), each model on its own share trained/run with DeepSpeed ZeRO-3, in OpenRLHF's
  proportions (vLLM : actor : critic = 1 : 1 : 1, reference and reward half each: 4 : 4 : 4 : 2 : 2 on 16
  GPUs) where the devices split so, else by work; weights broadcast to the engines after each train step
  (``realloc``'s sync); independent stages concurrent.
- ``verl`` (verl / HybridFlow): every model on every device in the split the cost model finds fastest
  (Megatron 3D parallel), vLLM generation in its own split on the same devices (3D-HybridEngine
  resharding), stages one after another.
- ``nemo`` (NeMo-Aligner): an actor server (actor + reference) and a critic server (critic + reward) on
  disjoint node-aligned shares, Megatron splits, TRT-LLM generation on the actor's devices (refit each
  step), static batches limited by the KV cache; the two servers run concurrently.
"""

from __future__ import annotations

from rlhfc.cost import CostModel, memory_issues
from rlhfc.cost.baselines import SYSTEMS
from rlhfc.ir import Module, plan
from rlhfc.ir.plan import Layout

from .layouts import apply_fitting, set_meshes
from .strategies import separate, work_per_model, work_shares

#: annotations of passes the baseline systems do not have
UNDONE = ("stream", "stream_from", "unpad", "logprobs")
#: the passes a baseline's plan is compiled with (``--placement baseline:NAME`` at any -O level): the
#: systems recompute log-probs, pad, and do not stream; ``parallelize`` marks what may overlap (kept only
#: by systems that overlap)
PIPELINE = ["dce", "parallelize", "placement", "realloc"]


def is_baseline(name: str | None) -> bool:
    return bool(name) and str(name).startswith("baseline:")


def build(module: Module, name: str) -> Module:
    """Annotate ``module`` with the plan of baseline ``name`` (``dschat``, ``openrlhf``, ``verl``, ``nemo``)."""
    system = SYSTEMS[name]
    plan.set_strategy(module, f"baseline:{name}")
    for s in module.graph.stages:
        plan.unset(s, *UNDONE)
        if not system.overlap:
            plan.set_overlap(s, None)
    if module.cluster.device == "cpu":
        set_meshes(module, {s.name: (0, module.cluster.num_devices) for s in _model_stages(module)})
        return module
    {"dschat": _dschat, "openrlhf": _openrlhf, "verl": _verl, "nemo": _nemo}[name](module)
    for s in _model_stages(module):   # gradient checkpointing, as each system's large-model recipes run
        if s.op == "train":
            lay = plan.stage_layout(module, s)
            plan.set_layout(s, Layout(lay.first, lay.count, lay.dp, lay.tp, lay.pp, lay.microbatches, "full"))
    if system.zero3:   # plans not chosen by layouts.apply (which sizes micro-batches and waves itself)
        _micro_batches(module)
        _kv_waves(module)
    return module


def _kv_waves(module: Module) -> None:
    """Generation in as many waves as the KV cache needs (the fewest, up to 128, whose cache fits beside the
    weights and optimizer state the devices hold): static batches one after another, or the concurrency a
    paged KV cache (vLLM) admits."""
    for gen in (s for s in _model_stages(module) if s.op == "generate"):
        cm = CostModel(module)
        lay = plan.stage_layout(module, gen)
        held = _resident(module, lay.devices, skip=gen.target) + max(
            (cm.stage_cost(s).weights_bytes + cm.stage_cost(s).state_bytes
             for s in module.graph.stages_on(gen.target) if s.op != "generate" and plan.on_worker(module, s)
             and set(plan.stage_layout(module, s).devices) & set(lay.devices)), default=0.0)
        for waves in (1, 2, 4, 8, 16, 32, 64, 128):
            trial = Layout(lay.first, lay.count, lay.dp, lay.tp, lay.pp, waves)
            c = cm.stage_cost(gen, trial)
            if held + c.weights_bytes + c.transient_bytes <= cm.spec.memory:
                break
        plan.set_layout(gen, trial)


def _model_stages(module: Module) -> list:
    return [s for s in module.graph.stages if s.target in module.models and plan.on_worker(module, s)
            and s.op != "sync"]


def _micro_batches(module: Module) -> None:
    """Each forward and train stage with the fewest micro-batches (1..16) whose activations fit beside what
    its devices hold (every model's weights and optimizer state there)."""
    for s in _model_stages(module):
        if s.op == "generate":
            continue
        cm = CostModel(module)
        lay = plan.stage_layout(module, s)
        held = _resident(module, lay.devices)
        for mb in (1, 2, 4, 8, 16):
            trial = Layout(lay.first, lay.count, lay.dp, lay.tp, lay.pp, mb, lay.recompute)
            if held + cm.stage_cost(s, trial).transient_bytes <= cm.spec.memory:
                break
        plan.set_layout(s, trial)


def _generation_tp(module: Module, gen, count: int, resident: float) -> int:
    """The smallest tp (dividing the node, heads and kv heads) whose weight shard and one KV sequence fit
    beside ``resident`` bytes per device."""
    cm = CostModel(module)
    m = module.models[gen.target]
    per = min(module.cluster.per_node, count)
    ok = [t for t in range(1, per + 1) if per % t == 0 and count % t == 0 and m.heads % t == 0
          and m.kv_heads % t == 0]
    for t in ok:
        c = cm.stage_cost(gen, Layout(0, count, count // t, t, 1, 1))
        if resident + c.weights_bytes < cm.spec.memory * 0.9:
            return t
    return ok[-1]


def _zero3(module: Module, stages: list, first: int, count: int) -> None:
    """ZeRO-3 data parallelism over the mesh (DeepSpeed): dp = devices."""
    for s in stages:
        if s.op != "generate":
            plan.set_layout(s, Layout(first, count, count, 1, 1, 1, "full" if s.op == "train" else "none"))


def _resident(module: Module, devices: range, skip: str | None = None) -> float:
    """Weights and optimizer state per device of the models on ``devices`` under their current layouts."""
    cm = CostModel(module)
    held: dict[str, float] = {}
    for s in _model_stages(module):
        lay = plan.stage_layout(module, s)
        if s.op == "generate" or s.target == skip or not set(lay.devices) & set(devices):
            continue
        c = cm.stage_cost(s)
        held[s.target] = max(held.get(s.target, 0.0), c.weights_bytes + c.state_bytes)
    return sum(held.values())


def _dschat(module: Module) -> None:
    n = module.cluster.num_devices
    stages = _model_stages(module)
    _zero3(module, stages, 0, n)
    for gen in (s for s in stages if s.op == "generate"):
        tp = _generation_tp(module, gen, n, _resident(module, range(n)))
        plan.set_layout(gen, Layout(0, n, n // tp, tp, 1))


def _openrlhf(module: Module) -> None:
    n, per = module.cluster.num_devices, module.cluster.per_node
    stages = _model_stages(module)
    gens = [s for s in stages if s.op == "generate"]
    split = _openrlhf_split(module, n)
    if split is not None and gens:
        k, shares = split
    else:   # no even split: vLLM on the separate strategy's generation mesh, the rest by work
        gen_mesh = next((m for name, m in separate(module).items() if module.graph.stage(name).op == "generate"),
                        (0, n))
        k = gen_mesh[1] if gen_mesh[1] < n else 0
        rest = module.clone()
        rest.cluster.nodes, rest.cluster.per_node = ((n - k) // per, per) if k % per == 0 and k else (1, n - k)
        shares = work_shares(rest, work_per_model(rest)) if n - k > 1 else {m: (0, 1) for m in module.models}
    for s in stages:
        if s.op == "generate":
            continue
        first, count = shares.get(s.target, (0, n - k))
        _zero3(module, [s], k + first, count)
    for gen in gens:
        if not k:
            plan.set_layout(gen, Layout(0, n, n, 1, 1))
            continue
        tp = _generation_tp(module, gen, k, 0.0)
        plan.set_layout(gen, Layout(0, k, k // tp, tp, 1))


def _openrlhf_split(module: Module, n: int) -> tuple[int, dict[str, tuple[int, int]]] | None:
    """OpenRLHF's own allocation rule (its performance guide: vLLM : actor : critic = 1 : 1 : 1; its scripts
    give the frozen reference and reward half of that each, e.g. 4 : 4 : 4 : 2 : 2 on 16 GPUs): the vLLM
    engines' devices and each other model's (first, count) after them, in units of n / (2 per trained model
    and the engines, 1 per frozen model); None when the devices do not split so."""
    models = [m for m in module.models if any(s.target == m for s in _model_stages(module) if s.op != "generate")]
    units = {m: 2 if module.models[m].trainable else 1 for m in models}
    total = 2 + sum(units.values())
    if n % total:
        return None
    unit = n // total
    shares, at = {}, 0
    for m in sorted(models, key=lambda m: -units[m]):   # trained models first, in program order
        shares[m] = (at, units[m] * unit)
        at += units[m] * unit
    return 2 * unit, shares


def _apply_fitting(module: Module, assign: dict) -> None:
    """:func:`~rlhfc.passes.layouts.apply`, its budgets tightened (as the placement pass does) until the plan fits, if
    it can."""
    apply_fitting(module, assign, lambda m: not memory_issues(m))


def _verl(module: Module) -> None:
    _apply_fitting(module, {s.name: (0, module.cluster.num_devices) for s in _model_stages(module)})


def _nemo(module: Module) -> None:
    n, per = module.cluster.num_devices, max(module.cluster.per_node, 1)
    stages = _model_stages(module)
    work = work_per_model(module)
    actor = next((s.target for s in stages if s.op == "generate"), None)
    policy_side = {actor} | {m for m in module.models if m != actor and not module.models[m].trainable
                             and module.models[m].head == "lm"}
    side_work = sum(w for m, w in work.items() if m in policy_side)
    share = side_work / max(sum(work.values()), 1e-9)
    nodes = n // per
    if nodes >= 2:
        k = per * min(nodes - 1, max(1, round(nodes * share)))
    elif n > 1:   # a share of the node that divides it
        k = min((d for d in range(1, n) if n % d == 0), key=lambda d: (abs(d - n * share), d))
    else:
        k = n
    assign = {s.name: ((0, k) if s.target in policy_side or k == n else (k, n - k)) for s in stages}
    _apply_fitting(module, assign)
