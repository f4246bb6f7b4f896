"""``placement``: which devices each model uses, and its parallel layout (Ant's strategies, ReaL's search).

Strategies (``placement{strategy=...}``, the program's ``run { placement = ... }``
or ``--placement``):

- ``flatten`` — every model on every device, one layout (DeepSpeed-Chat style).
- ``interleave`` — models get exclusive device shares sized by their work (whole nodes for a model
  heavy enough, or too large in memory, for one; the others share nodes, each node split by work into
  shares dividing it) and run concurrently; with fewer devices than models, models are packed into
  shares by longest-processing-time (on 2 CPU cores: the actor alone on one
  core, critic + reference + reward on the other).
- ``separate`` — generation on its own devices (whole nodes on a multi-node cluster), apart from training and the
  other forwards (a shadow copy of the actor serves generation; ``realloc``
  inserts the weight transfer after each train step).
- ``search`` (the default on clusters of more than one device) — start from the
  best of the three, then a Metropolis (MCMC) walk over per-model meshes
  (aligned power-of-two device ranges) and generation meshes, each plan priced
  as the compile emits it (placed, then the passes after this one, then
  simulated as ``explain`` does: :mod:`rlhfc.passes.search`); plans that
  overflow memory cost ×3 (as ReaL); each baseline system's plan is a seed, and
  a layout search after the walk pins stages to other layouts than the greedy
  choice (and tries the plan without streaming). Returns the fastest plan that fits. The
  search is bounded by ``candidates`` (plans priced, seeded by ``seed``), never
  by wall-clock time: the same program compiles to the same plan on an idle and
  on a busy machine.

Every mesh is node-aligned (inside one node, or whole nodes) and every split obeys the hardware rules of
:mod:`rlhfc.ir.plan.hardware` (tp inside a node dividing heads and kv heads, pp dividing layers); memory is
counted once (:mod:`rlhfc.passes.layouts`).

Each model stage gets ``mesh = {first, count}`` and ``parallel = {dp, tp, pp}``:
the fastest split of its mesh (cost model) whose memory fits beside the other
models there, among the splits the run's trainer can run (``fsdp``: dp only;
``megatron``/``auto``: tp dividing heads, kv_heads, ffn and vocab, pp dividing
layers). A model whose layout the program fixes (``layout(...)``) keeps it:
every strategy gives all its stages one mesh of exactly dp·tp·pp devices (its
generation is not split off), and search only moves that mesh. A plan that cannot fit is a compile error naming the stage, the
device, bytes needed vs available, and what would make it fit.

Exact: placement decides where and how stages run, not what they compute (on
CPU every worker keeps one torch thread per core, so results are bitwise equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.ir import DiagnosticSink, Module, plan
from rlhfc.ir.diagnostics import error
from rlhfc.ir.plan import STRATEGIES

from .base import Pass, register_pass
from .layouts import apply, apply_fitting, mesh_of

#: whether search may put a model's generation on other devices than its training (needs realloc)
SPLIT_GENERATION = True
#: a plan's key (never a stage name) whose value ``False`` says the plan runs without the ``stream`` pass's
#: chunked generation (its ``stream``/``stream_from`` annotations taken back): the baseline systems' plans do
#: not stream, and on some meshes streaming costs more than it overlaps, so the search prices both
STREAMS = "(streams)"
#: a plan's key whose value ``False`` says the plan recomputes the policy's old log-probs with a forward, as the
#: program wrote it (``reuse_logprobs``' decision taken back: :func:`rlhfc.passes.reuse_logprobs.take_back`,
#: the stages regrouped by the pipeline's ``parallelize``): the baseline systems recompute them, and on some
#: clusters (2 CPU cores) the forward beside the others costs less than keeping them during generation
OLD_LOGPROBS = "(sampled logprobs)"


@register_pass
@dataclass(frozen=True)
class Placement(Pass):
    name = "placement"
    description = "place models on devices: flatten | interleave | separate | search (cost-model MCMC)"
    exact = True
    strategy: str = field(default="auto", metadata={"doc": "flatten, interleave, separate, search, auto, or "
                                                            "baseline:dschat|openrlhf|verl|nemo"})
    candidates: int = field(default=400, metadata={"doc": "plans the search may price (its budget; no time limit)"})
    seed: int = field(default=0, metadata={"doc": "seed of the search's random walk"})
    profile: str = field(default="", metadata={
        "doc": "measured profile the search prices with (a path, as explain's --profile; empty: catalog rates)"})
    response_lengths: str = field(default="auto", metadata={
        "doc": "response-length law the search prices (as explain's --response-lengths: auto, max, "
               "geometric:P, lognormal:F:S)"})

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError("candidates must be >= 1 (the number of plans the search may price)")
        from rlhfc.cost import response_dist

        try:
            response_dist(self.response_lengths, 8, vocab=100, pretrained=False)
        except (ValueError, IndexError) as exc:
            raise ValueError(f"bad response_lengths {self.response_lengths!r}: {exc} (e.g. max or "
                             "lognormal:0.25:1.0)") from None
        if self.strategy not in plan.PLACEMENTS:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)} or auto")

    def run(self, module: Module) -> Module:
        return self.run_in_pipeline(module, [])

    def run_in_pipeline(self, module: Module, downstream: list, upstream: list = ()) -> Module:
        """Place ``module``; ``downstream``: the passes the pipeline runs after this one (the search prices
        every candidate plan as they will leave it: :mod:`rlhfc.passes.search`); ``upstream``: those that ran
        before it (a plan that takes ``reuse_logprobs``' decision back is regrouped by their ``parallelize``)."""
        strategy = self.strategy if self.strategy != "auto" else module.run.placement
        if strategy.startswith("baseline:"):   # another system's plan, as it would run (passes/baselines.py)
            from .baselines import build

            return build(module, strategy.split(":", 1)[1])
        if strategy == "auto":
            strategy = "search" if module.cluster.num_devices > 1 else "flatten"
        assign_fn = {"flatten": flatten, "interleave": interleave, "separate": separate}.get(strategy)
        if assign_fn is not None:
            assign = respect_fixed(module, assign_fn(module))
        else:
            from rlhfc.cost import CostConfig, ProfileError, load_profile

            from .search import search

            try:
                prof = load_profile(self.profile) if self.profile else None
            except ProfileError as exc:
                raise error(f"placement: {exc}", None, "give a file `rlhfc profile` wrote, or no profile") from None
            regroup = next((p for p in upstream if p.name == "parallelize"), None)
            assign, report = search(module, self.candidates, self.seed, downstream,
                                    CostConfig(profile=prof, response_lengths=self.response_lengths), upstream)
            module.search_report = report   # not IR: what explain reports about the search
        from rlhfc.cost import check_memory, memory_issues

        place(module, assign, strategy, regroup if assign_fn is None else None)
        if memory_issues(module) and not memory_issues(with_full_recompute(module)):
            return module   # it fits once the trained models recompute their activations: the recompute pass decides
        sink = DiagnosticSink()
        check_memory(module, sink)
        sink.raise_if_errors()
        return module


def place(module: Module, assign: dict, strategy: str, regroup=None) -> None:
    """Annotate ``module`` with the plan ``assign`` (meshes, or pinned layouts, per stage; :data:`STREAMS`,
    :data:`OLD_LOGPROBS`) as the pass emits it: each stage's layout (:func:`apply`), each stage's memory budget
    tightened until the devices' totals fit, the strategy. ``regroup``: the pipeline's ``parallelize`` pass
    (None if it has none), run again when the plan takes ``reuse_logprobs``' decision back."""
    from rlhfc.cost import fits

    if assign.get(OLD_LOGPROBS) is False:
        from .reuse_logprobs import take_back

        take_back(module)
        if regroup is not None:
            regroup.run(module)
        assign = {**assign, **_restored_meshes(module, assign)}
    if assign.get(STREAMS) is False:
        for s in module.graph.stages:
            plan.unset(s, "stream", "stream_from")
    # each stage's memory budget tightened until the devices' totals fit
    apply_fitting(module, assign, lambda m: m.cluster.device == "cpu" or fits(m))
    plan.set_strategy(module, strategy)


def _restored_meshes(module: Module, assign: dict) -> dict:
    """A mesh for each model stage ``assign`` does not place (a forward :data:`OLD_LOGPROBS` restored): its
    model's mesh for stages other than generation (as the search places a model's stages together)."""
    out = {}
    stages = [s for group in _model_stages(module).values() for s in group]
    for s in stages:
        if s.name not in assign:
            siblings = [mesh_of(assign[o.name]) for o in stages if o.target == s.target and o.name in assign]
            others = [mesh_of(assign[o.name]) for o in stages if o.target == s.target and o.name in assign
                      and o.op != "generate"]
            if others or siblings:
                out[s.name] = (others or siblings)[0]
    return out


def with_full_recompute(module: Module) -> Module:
    """A copy of ``module`` whose train stages recompute everything (the least activation memory)."""
    trial = module.clone()
    for s in trial.graph.stages:
        if s.op == "train":
            plan.set_recompute(s, plan.Recompute("full"))
    return trial


# -- plans: {stage name: (first, count)} --------------------------------------------------------------------

def _model_stages(module: Module) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in module.graph.stages:
        if s.target in module.models:
            out.setdefault(s.target, []).append(s)
    return out


def _fixed_sizes(module: Module) -> dict[str, int]:
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
    for model, size in _fixed_sizes(module).items():
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
    return {s.name: (0, n) for stages in _model_stages(module).values() for s in stages}


def _flat_stage_seconds(module: Module) -> dict[str, float]:
    """Seconds per model stage when every stage has the whole cluster (cost model, catalog rates)."""
    from rlhfc.cost import CostModel

    trial = module.clone()
    apply(trial, flatten(trial), layouts=False)
    cm = CostModel(trial)
    return {s.name: cm.stage_cost(s).time_s for s in trial.graph.stages if s.target in trial.models}


def _work(module: Module) -> dict[str, float]:
    """Seconds of work per model with the whole cluster to itself (cost model)."""
    seconds = _flat_stage_seconds(module)
    return {name: sum(seconds[s.name] for s in stages) for name, stages in _model_stages(module).items()}


def _shares(module: Module, work: dict[str, float]) -> dict[str, tuple[int, int]]:
    """Exclusive node-aligned device ranges sized by work (a fixed-layout model's: its dp·tp·pp, when all fit
    side by side): models heavy enough for a node or more get whole nodes, the others share nodes, packed by
    longest-processing-time, each node's devices split by work (on one device, models share it)."""
    n, per = module.cluster.num_devices, max(module.cluster.per_node, 1)
    names = sorted(work, key=lambda m: (-work[m], m))
    fixed = {m: k for m, k in _fixed_sizes(module).items() if m in work}
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
    from rlhfc.cost import CostModel, candidate_layouts, evaluate

    n, per = module.cluster.num_devices, module.cluster.per_node
    if module.cluster.device == "cpu":
        return {m: 1 for m in names}
    trial = module.clone()
    apply(trial, flatten(trial), layouts=False)
    cm = CostModel(trial)
    stages = _model_stages(trial)
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
    share = _shares(module, _work(module))
    return {s.name: share[m] for m, stages in _model_stages(module).items() for s in stages}


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
    for stages in _model_stages(module).values():
        for s in stages:
            out[s.name] = (0, k) if s.op == "generate" else (k, n - k)
    return out


def _meshes(n: int, per_node: int) -> list[tuple[int, int]]:
    """Aligned power-of-two ranges (within a node, or whole nodes), and the whole cluster."""
    out = []
    size = 1
    while size <= n:
        if size <= per_node or size % per_node == 0:
            out += [(first, size) for first in range(0, n - size + 1, size)
                    if plan.mesh_aligned(first, size, per_node)]
        size *= 2
    if (0, n) not in out:
        out.append((0, n))
    return out


