"""``placement``: which devices each model uses, and its parallel layout (Ant's strategies, ReaL's search).

Strategies (``placement{strategy=...}``, the program's ``run { placement = ... }``
or ``--placement``):

- ``flatten`` — every model on every device, one layout (DeepSpeed-Chat style).
- ``interleave`` — models get exclusive device shares sized by their work and
  run concurrently; with fewer devices than models, models are packed into
  shares by longest-processing-time (on 2 CPU cores: the actor alone on one
  core, critic + reference + reward on the other).
- ``separate`` — generation on its own devices, apart from training and the
  other forwards (a shadow copy of the actor serves generation; ``realloc``
  inserts the weight transfer after each train step).
- ``search`` (the default on clusters of more than one device) — start from the
  best of the three, then a Metropolis (MCMC) walk over per-model meshes
  (aligned power-of-two device ranges) and generation meshes, each plan priced
  as the compile emits it (placed, then the passes after this one, then
  simulated as ``explain`` does: :mod:`rlhfc.passes.search`); plans that
  overflow memory cost ×3 (as ReaL). Returns the fastest plan that fits. The
  search is bounded by ``candidates`` (plans priced, seeded by ``seed``), never
  by wall-clock time: the same program compiles to the same plan on an idle and
  on a busy machine.

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
from rlhfc.ir.plan import STRATEGIES, Layout

from .base import Pass, register_pass

#: whether search may put a model's generation on other devices than its training (needs realloc)
SPLIT_GENERATION = True


@register_pass
@dataclass(frozen=True)
class Placement(Pass):
    name = "placement"
    description = "place models on devices: flatten | interleave | separate | search (cost-model MCMC)"
    exact = True
    strategy: str = field(default="auto", metadata={"doc": "flatten, interleave, separate, search, or auto"})
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

    def run_in_pipeline(self, module: Module, downstream: list) -> Module:
        """Place ``module``; ``downstream``: the passes the pipeline runs after this one (the search prices
        every candidate plan as they will leave it: :mod:`rlhfc.passes.search`)."""
        strategy = self.strategy if self.strategy != "auto" else module.run.placement
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
            assign, report = search(module, self.candidates, self.seed, downstream,
                                    CostConfig(profile=prof, response_lengths=self.response_lengths))
            module.search_report = report   # not IR: what explain reports about the search
        from rlhfc.cost import check_memory, memory_issues

        place(module, assign, strategy)
        if memory_issues(module) and not memory_issues(with_full_recompute(module)):
            return module   # it fits once the trained models recompute their activations: the recompute pass decides
        sink = DiagnosticSink()
        check_memory(module, sink)
        sink.raise_if_errors()
        return module


def place(module: Module, assign: dict[str, tuple[int, int]], strategy: str) -> None:
    """Annotate ``module`` with the plan ``assign`` (meshes per stage) as the pass emits it: each stage's
    layout (:func:`apply`), each stage's memory budget tightened until the devices' totals fit, the strategy."""
    from rlhfc.cost import fits

    for squeeze in (1, 2, 4, 8):   # tighten each stage's memory budget until the devices' totals fit
        apply(module, assign, squeeze=squeeze)
        if module.cluster.device == "cpu" or fits(module):
            break
    plan.set_strategy(module, strategy)


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


def respect_fixed(module: Module, assign: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``assign`` with every stage of a fixed-layout model on one mesh of exactly its dp·tp·pp devices:
    starting where its train stage (else its first stage) was put, moved back to fit the cluster."""
    n = module.cluster.num_devices
    out = dict(assign)
    for model, size in _fixed_sizes(module).items():
        stages = [s for s in module.graph.stages_on(model) if s.name in out]
        if not stages:
            continue
        anchor = next((s for s in stages if s.op == "train"), stages[0])
        first = min(out[anchor.name][0], n - size)
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
    """Exclusive device ranges sized by work (a fixed-layout model's: its dp·tp·pp, when all fit side by
    side); packed by longest-processing-time when devices are few."""
    n = module.cluster.num_devices
    names = sorted(work, key=lambda m: (-work[m], m))
    fixed = {m: k for m, k in _fixed_sizes(module).items() if m in work}
    if fixed and sum(fixed.values()) + len(names) - len(fixed) <= n:
        return _fixed_shares(names, work, fixed, n)
    if n < len(names):
        bins = [[] for _ in range(n)]
        load = [0.0] * n
        for m in names:
            i = min(range(n), key=lambda b: (load[b], b))
            bins[i].append(m)
            load[i] += work[m]
        return {m: (i, 1) for i, ms in enumerate(bins) for m in ms}
    return _side_by_side(names, _sized(names, work, n))


def _fixed_shares(names: list[str], work: dict[str, float], fixed: dict[str, int], n: int) -> dict:
    """Side-by-side ranges: fixed-layout models get their size, the others the rest sized by work."""
    rest = [m for m in names if m not in fixed]
    return _side_by_side(names, {**_sized(rest, work, n - sum(fixed.values())), **fixed})


def _sized(names: list[str], work: dict[str, float], n: int) -> dict[str, int]:
    """Device counts for ``names`` out of ``n``, in proportion to their work (at least one each; the
    largest shares trimmed, spare devices handed to the heaviest first)."""
    total = sum(work[m] for m in names) or 1.0
    counts = {m: max(1, int(n * work[m] / total)) for m in names}
    while sum(counts.values()) > n:                       # trim the largest shares
        big = max(counts, key=lambda m: counts[m])
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
    """Generation on the first devices (sized by its share of the work), everything else on the rest."""
    n = module.cluster.num_devices
    if n < 2:
        return flatten(module)
    seconds = _flat_stage_seconds(module)
    gen = sum(t for name, t in seconds.items() if module.graph.stage(name).op == "generate")
    rest = sum(seconds.values()) - gen
    k = min(n - 1, max(1, round(n * gen / max(gen + rest, 1e-9))))
    out = {}
    for stages in _model_stages(module).values():
        for s in stages:
            out[s.name] = (0, k) if s.op == "generate" else (k, n - k)
    return out


def _meshes(n: int, per_node: int) -> list[tuple[int, int]]:
    """Aligned power-of-two ranges (within a node, or whole nodes)."""
    out = []
    size = 1
    while size <= n:
        if size <= per_node or size % per_node == 0:
            out += [(first, size) for first in range(0, n - size + 1, size)]
        size *= 2
    if (0, n) not in out:
        out.append((0, n))
    return out


# -- applying a plan ----------------------------------------------------------------------------------------

def _runnable(module: Module, model, lay: Layout) -> bool:
    """Whether the run's trainer can run ``model`` in ``lay``'s split: a fixed layout only as fixed; under
    fsdp dp only; under megatron (or auto picking it) tp dividing heads, kv_heads, ffn and vocab, pp dividing
    layers. ``torch`` runs one process whatever the split (the split only prices the plan)."""
    fixed = plan.fixed_layout(model)
    if fixed is not None:
        return (lay.dp, lay.tp, lay.pp) == (fixed.dp, fixed.tp, fixed.pp)
    trainer = plan.resolve_trainer(module.run.trainer, plan.Parallel(lay.dp, lay.tp, lay.pp))
    if trainer == "fsdp":
        return lay.tp == 1 and lay.pp == 1
    if trainer == "megatron":
        return all(v % lay.tp == 0 for v in (model.heads, model.kv_heads, model.ffn, model.vocab)) \
            and model.layers % lay.pp == 0
    return True


def apply(module: Module, assign: dict[str, tuple[int, int]], layouts: bool = True, squeeze: int = 1) -> None:
    """Annotate every model stage with its mesh and the fastest parallel split that fits (a fixed-layout
    model's stages: its layout, on a mesh of its size)."""
    for s in module.graph.stages:
        if s.name not in assign:
            continue
        first, count = assign[s.name]
        fixed = plan.fixed_layout(module.models.get(s.target or ""))
        if fixed is not None and fixed.size == count:
            plan.set_layout(s, Layout(first, count, fixed.dp, fixed.tp, fixed.pp))
        else:
            plan.set_layout(s, Layout(first, count, dp=count))
    if not layouts or module.cluster.device == "cpu":
        return
    from rlhfc.cost import CostModel

    cm = CostModel(module)
    meshes: dict[str, set] = {}
    for name, (first, count) in assign.items():
        meshes.setdefault(module.graph.stage(name).target, set()).update(range(first, first + count))
    # a group of processes runs one split: beyond torch (one process), a model's stages on one mesh share
    # the split its train stage (else its first stage there) gets
    one_split = module.run.trainer != "torch"
    stages = sorted(module.graph.stages, key=lambda s: s.op != "train") if one_split else module.graph.stages
    chosen: dict[tuple, tuple[int, int, int]] = {}
    for s in stages:
        if s.name not in assign or s.op.split(".")[0] not in ("generate", "forward", "train"):
            continue
        model = module.models[s.target]
        first, count = assign[s.name]
        # a fair share of each device: every model living on these devices keeps its weights there
        mine = set(range(first, first + count))
        sharing = sum(1 for devs in meshes.values() if devs & mine) or 1
        capacity = cm.spec.memory / sharing / squeeze
        key = (s.target, first, count)
        cands, mem, order = _layout_table(module, cm, s, first, count, chosen.get(key) if one_split else None)
        if not cands:
            continue
        fits = [i for i in order if mem[i] <= capacity]
        pick = cands[(fits or sorted(range(len(cands)), key=lambda i: mem[i]))[0]]
        plan.set_layout(s, pick)
        chosen.setdefault(key, (pick.dp, pick.tp, pick.pp))


def _layout_table(module: Module, cm, s, first: int, count: int, split: tuple | None) -> tuple[list, list, list]:
    """The layouts the trainer can run for stage ``s`` on devices ``first..first+count-1`` (only ``split``'s
    (dp, tp, pp) when given), their memory per device, and their indices fastest first (the cost model, NumPy
    on every machine: whether JAX is installed must not change a plan). Kept in the cost model's cache: a
    placement search asks again for every candidate that puts the stage there."""
    from rlhfc.cost import candidate_layouts, evaluate

    key = ("layout-table", s.name, first, count, split, repr(plan.recompute_decision(s)))
    if key in cm._cache:
        return cm._cache[key]
    model = module.models[s.target]
    train = s.op == "train"
    cands = candidate_layouts(first, count, per_node=module.cluster.per_node, heads=model.heads,
                              layers=model.layers, microbatches=(1, 2, 4, 8),
                              recompute=plan.RECOMPUTE_POLICIES if train else ("none",))
    cands = [c for c in cands if _runnable(module, model, c)]
    if split is not None:
        cands = [c for c in cands if (c.dp, c.tp, c.pp) == split]
    if not cands:
        cm._cache[key] = ([], [], [])
        return cm._cache[key]
    res = evaluate(module, s.name, cands, cost_model=cm, backend="numpy")
    mem = (res["weights_bytes"] + res["state_bytes"] + res["transient_bytes"]).tolist()
    total = res["total"].tolist()
    order = sorted(range(len(cands)), key=lambda i: total[i])
    cm._cache[key] = (cands, mem, order)
    return cm._cache[key]
