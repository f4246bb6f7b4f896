"""The placement search: a seeded walk over plans, each priced exactly as ``compile`` will emit it.

One pricing path. A candidate plan is a mesh per model stage (``{stage: (first, count)}``), or a whole layout
for a pinned stage, and :data:`~rlhfc.passes.layouts.STREAMS` when it runs without streaming. To price it,
:class:`PlanPricer` does what the compile does with it: a copy of the module before placement is placed
(:func:`rlhfc.passes.layouts.place`: each stage's fastest layout that fits, memory budgets tightened until the
devices' totals fit), then the passes that follow ``placement`` in the running pipeline (``recompute``, ``realloc``
at -O2) are run on it, and the result is simulated as ``rlhfc explain`` simulates a compiled job
(:func:`rlhfc.cost.simulate`, 3 unrolled steps, the pass's cost configuration: catalog rates and its
``response_lengths``). So a plan whose weight syncs or recomputation are expensive is ranked by the price it has,
and the searched plan's price is ``explain``'s price of the compiled job (a test checks it on the examples). It is
fast because everything that does not change between candidates is computed once: stage prices and layout tables
(:func:`rlhfc.cost.shared_prices`), weight-sync times, traced blocks.

The walk (ReaL's Metropolis search): it starts from the best of the seeds — the strategies' plans (flatten,
interleave, separate: :mod:`rlhfc.passes.strategies`) and each baseline system's plan twice (its whole plan: meshes
and layouts pinned, without streaming, as it runs; and its meshes with rlhfc's layouts), all priced under rlhfc's
runtime terms — then, when the space of per-model meshes is small, prices every assignment; else it proposes a new
mesh for one model (or for one model's generation alone), accepts it if faster, or with probability ``exp(-Δ/T)``
(``T`` = 5 % of the best price), restarts from the best plan at twice the temperature after ``PATIENCE`` proposals
without improvement. On GPU clusters the last fifth of the budget goes to a layout search beyond each stage's
greedy choice (:func:`_polish_layouts`: one stage pinned to another layout of its mesh, the others re-chosen around
it; the plan with and without streaming); if it settles early the walk goes on. The search stops after
``candidates`` distinct plans priced (or 20 times as many proposals, when the walk keeps revisiting plans it
priced). Plans that overflow memory cost 3× (as ReaL), and the result is the fastest plan that fits — never slower
than any seed, since those are candidates too, hence never slower than any strategy's plan or any baseline system's
plan as that system runs it (its own slowness terms only add cost; a test checks it over the examples and a table
of clusters). A plan whose weights and optimizer state alone overflow a device cannot be emitted by any pipeline
(the passes after placement do not change them); the walk scores it by its placed price without running those
passes. Seeded: the same program and seed give the same plan on any machine and load (the budget is counted in
plans, not seconds).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import pickle
import random
import time
import warnings
from dataclasses import dataclass, field

from rlhfc.cost import CostModel, shared_prices
from rlhfc.cost.quick import search_price   # simulate's step time and memory check, no more
from rlhfc.cost.simulator import resident_bytes
from rlhfc.ir import CompileError, Module, plan
from rlhfc.ir.plan import BASELINES

from .baselines import build
from .layouts import OLD_LOGPROBS, STREAMS, layout_table, mesh_of, model_stages, place, runnable
from .reuse_logprobs import reuses
from .strategies import fixed_sizes, flatten, interleave, respect_fixed, separate

#: whether search may put a model's generation on other devices than its training (needs realloc)
SPLIT_GENERATION = True
#: proposals without improvement after which the walk restarts from the best plan at twice the temperature
PATIENCE = 150
#: the walk's starting temperature, as a fraction of the best strategy's price (ReaL: a few percent)
TEMPERATURE = 0.05
#: a space of per-model mesh assignments at most this large is enumerated instead of walked
EXHAUSTIVE = 256
#: an overflowing plan's price is its time times this (ReaL), so the walk can cross it
OVERFLOW_PENALTY = 3.0
#: the share of the budget kept for the layout search after the walk (GPU clusters; 1/5)
POLISH_SHARE = 5
#: alternative layouts per stage the layout search tries in a sweep (the fastest of distinct splits)
POLISH_ALTERNATIVES = 4


@dataclass
class SearchReport:
    """What the search did: ``strategy`` (``exhaustive`` or ``mcmc``), ``candidates`` (distinct plans priced),
    ``proposals`` (plans proposed, repeats included), ``restarts`` (reheats of a stuck walk), ``seconds`` (wall
    time, reported only: it decides nothing), ``trajectory`` (``[candidate, best price so far]`` at each
    improvement), ``seeds`` (the strategies' plans' prices), ``best_s`` (the price of the plan chosen) and
    ``fits``."""

    strategy: str
    candidates: int = 0
    proposals: int = 0
    seconds: float = 0.0
    trajectory: list = field(default_factory=list)
    seeds: dict = field(default_factory=dict)
    best_s: float = math.inf
    fits: bool = True
    restarts: int = 0

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "candidates": self.candidates, "proposals": self.proposals,
                "seconds": self.seconds, "trajectory": [list(t) for t in self.trajectory],
                "seeds": dict(self.seeds), "best_s": self.best_s, "fits": self.fits,
                "restarts": self.restarts}


class PlanPricer:
    """Prices candidate plans of ``module`` (the IR before placement) as the pipeline will emit them: placed,
    then ``downstream`` run, then simulated over ``steps`` steps with ``config``."""

    def __init__(self, module: Module, downstream: list, config, steps: int = 3, regroup=None):
        self.base = module
        self.regroup = regroup
        self.downstream = list(downstream)
        self.config = config
        self.steps = steps
        self.prices: dict[tuple, tuple[float, bool]] = {}
        # shared by every candidate's copy: the declarations (see _placed) and the frozen source locations and
        # value types of the stages (copying them is most of a copy's time otherwise)
        shared = [module.models, module.data, module.cluster]
        for s in module.graph.stages:
            shared += [s.loc, s.ir_loc, *s.field_locs.values(), *(v.type for v in s.inputs + s.outputs)]
        self._shared = {id(x): x for x in shared if x is not None}
        self._snapshot = _Snapshot(module, self._shared)

    def compile(self, assign: dict) -> Module:
        """The module the pipeline emits for ``assign``: placed, then the downstream passes."""
        return self._downstream(self._placed(assign))

    def _placed(self, assign: dict) -> Module:
        # the models, data sources and cluster are shared with the base module: no pass after placement
        # changes them (placement, recompute and realloc annotate and add stages), and copying 70B programs'
        # declarations for every candidate is most of a candidate's price otherwise
        trial = self._snapshot.copy()
        place(trial, assign, "search", self.regroup)
        return trial

    def _downstream(self, trial: Module) -> Module:
        with warnings.catch_warnings():   # the real run of these passes says what they have to say, once
            warnings.simplefilter("ignore")
            for p in self.downstream:
                trial = p.run(trial) or trial
        return trial

    def price(self, assign: dict) -> tuple[float, bool]:
        """(seconds per step, whether it fits in memory) of ``assign`` as compiled; cached per plan."""
        key = tuple(sorted(assign.items()))
        if key not in self.prices:
            trial = self._placed(assign)
            cm = CostModel(trial, self.config)
            if not _resident_fits(trial, cm) and not (any(p.name == "offload" for p in self.downstream)
                                                      and _resident_fits_offloaded(trial, self.config)):
                # weights and optimizer state alone overflow a device: no pass after placement changes them
                # (they only add syncs and trade activations for time), so no pipeline can emit this plan;
                # the walk scores it by its placed price (penalised) without running those passes
                self.prices[key] = (search_price(trial, cm, self.steps)[0], False)
                return self.prices[key]
            try:
                trial = self._downstream(trial)
            except CompileError:   # a downstream pass rejects this plan: it cannot be emitted
                self.prices[key] = (math.inf, False)
                return self.prices[key]
            self.prices[key] = search_price(trial, CostModel(trial, self.config), self.steps)
        return self.prices[key]

    def score(self, assign: dict) -> float:
        """The walk's objective: the price, times :data:`OVERFLOW_PENALTY` when the plan does not fit."""
        t, ok = self.price(assign)
        return t if ok else t * OVERFLOW_PENALTY


class _Snapshot:
    """Copies of a module as it was when taken, sharing the objects ``shared`` ({id: object}) with it: the
    module pickled once, each copy unpickled (in C: a fifth of ``copy.deepcopy``'s time with the same sharing)."""

    def __init__(self, module: Module, shared: dict):
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda obj: id(obj) if id(obj) in shared else None
        pickler.dump(module)
        self._bytes, self._shared = buf.getvalue(), shared

    def copy(self) -> Module:
        unpickler = pickle.Unpickler(io.BytesIO(self._bytes))
        unpickler.persistent_load = self._shared.__getitem__
        return unpickler.load()


def _resident_fits(module: Module, cm) -> bool:
    """Whether what stays on every device for the whole run (weights, gradients and optimizer state) fits."""
    n = module.cluster.nodes * module.cluster.per_node
    held = resident_bytes(module, {s.name: cm.stage_cost(s) for s in module.graph.stages}, n, cm)
    return all(sum(h.values()) <= cm.spec.memory for h in held)


def _resident_fits_offloaded(module: Module, config) -> bool:
    """Whether the resident bytes fit once every train stage keeps its optimizer state on the host (GPU
    clusters): then the offload pass downstream may make the plan fit."""
    if module.cluster.device == "cpu":
        return False
    trial = module.clone()
    for s in trial.graph.stages:
        if s.op == "train":
            plan.set_offload(s, True)
    return _resident_fits(trial, CostModel(trial, config))


#: the young generation's collection threshold during a search (Python's default: 700 allocations)
GC_GEN0 = 50_000


@contextlib.contextmanager
def _fewer_collections():
    """Collect the young generation every :data:`GC_GEN0` allocations instead of every 700 while searching: each
    candidate allocates tens of thousands of short-lived objects (a copy of the module, its simulated tasks), and
    collecting them as often was a sixth of a search's time, more after torch and transformers are imported (the
    first trace). Garbage is still collected (the peak memory of a 1000-plan search did not change); the
    thresholds are restored after."""
    import gc

    before = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def candidate_meshes(n: int, per_node: int) -> list[tuple[int, int]]:
    """The meshes the walk moves a model to: aligned power-of-two ranges (within a node, or whole nodes), and the
    whole cluster."""
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


def search(module: Module, candidates: int, seed: int, downstream: list, config,
           upstream: list = ()) -> tuple[dict, SearchReport]:
    """The fastest plan that fits (else the best penalised one), and what the search did. ``upstream``: the
    passes that ran before placement (their ``parallelize`` regroups a plan that takes ``reuse_logprobs``'
    decision back; a ``stream`` given its ``chunk`` keeps its streaming)."""
    start = time.perf_counter()
    # built outside shared_prices(): a baseline-marked module is priced with that system's costs, which
    # must not enter the shared stage prices
    takeback = takeback_keys(module, upstream)
    baselines = _baseline_meshes(module, model_stages(module), takeback)
    with shared_prices(), _fewer_collections():
        pricer = PlanPricer(module, downstream, config,
                            regroup=next((p for p in upstream if p.name == "parallelize"), None))
        by_model = model_stages(module)
        seeds = {"flatten": flatten(module), "interleave": interleave(module)}
        if SPLIT_GENERATION and module.cluster.num_devices > 1:
            seeds["separate"] = separate(module)
        seeds.update(baselines)
        seeds = {name: respect_fixed(module, a) for name, a in seeds.items()}
        n = module.cluster.num_devices
        fixed = fixed_sizes(module)
        free = candidate_meshes(n, module.cluster.per_node)
        # a fixed-layout model moves only between meshes of its size (aligned to it)
        meshes_of = {m: [(f, fixed[m]) for f in range(0, n - fixed[m] + 1, fixed[m])] if m in fixed else free
                     for m in by_model}
        models = sorted(by_model)
        space = math.prod(len(meshes_of[m]) for m in models)
        report = SearchReport("exhaustive" if space <= EXHAUSTIVE else "mcmc")
        walk = _Walk(pricer, report)
        for name, a in seeds.items():
            walk.offer(a)
            report.seeds[name] = pricer.price(a)[0]
        polish = candidates // POLISH_SHARE
        keys = [(m, False) for m in models]
        if SPLIT_GENERATION:
            keys += [(m, True) for m in models if m not in fixed and any(s.op == "generate" for s in by_model[m])]
        if space <= EXHAUSTIVE:
            for combo in itertools.product(*(meshes_of[m] for m in models)):
                if len(pricer.prices) >= candidates - polish:
                    break
                walk.offer({s.name: combo[i] for i, m in enumerate(models) for s in by_model[m]})
        else:
            _metropolis(walk, by_model, keys, meshes_of, candidates - polish, seed)
        if polish:
            _polish_layouts(walk, module, by_model, candidates, takeback)
            if space > EXHAUSTIVE and len(pricer.prices) < candidates:   # the layout search settled early
                _metropolis(walk, by_model, keys, meshes_of, candidates, seed + 1)
        best = walk.result()
    report.candidates = len(pricer.prices)
    report.seconds = time.perf_counter() - start
    report.best_s, report.fits = pricer.price(best)
    return best, report


def _baseline_meshes(module: Module, by_model: dict, keys: list) -> dict[str, dict]:
    """Two seeds per baseline system (GPU clusters), both priced under rlhfc's runtime terms (the module stays
    rlhfc's: none of the system's own slowness terms, which only add cost) and compiled by the rest of the
    pipeline: ``baseline:NAME``, the system's whole plan (each model stage pinned to the mesh *and* layout the
    system gives it: split, micro-batches or generation waves, recompute), and ``baseline:NAME:meshes``, its
    meshes with the layouts rlhfc picks on them. So the plan found is never slower than another system's plan
    run by rlhfc, nor than its placement compiled by rlhfc. A baseline layout the run's trainer cannot run
    (:func:`rlhfc.passes.layouts.runnable`) leaves that stage to rlhfc's choice on the same mesh."""
    out = {}
    undone = {k: False for k in keys}
    stages = [s for group in by_model.values() for s in group]
    for name in BASELINES:
        trial = build(module.clone(), name)
        meshes = {s.name: plan.stage_mesh(trial, trial.graph.stage(s.name)).pair() for s in stages}
        whole = dict(meshes)
        for s in stages:
            lay = plan.stage_layout(trial, trial.graph.stage(s.name))
            if s.op.split(".")[0] in ("generate", "forward", "train") and \
                    runnable(module, module.models[s.target], lay):
                whole[s.name] = lay
        streams = {STREAMS: False} if STREAMS in keys else {}
        if undone.get(OLD_LOGPROBS) is False:   # also with rlhfc's sampled log-probs (the system's plan else)
            out[f"baseline:{name}:sampled"] = {**whole, **streams}
        out[f"baseline:{name}"] = {**whole, **undone}
        out[f"baseline:{name}:meshes"] = meshes
    return out


def takeback_keys(module: Module, upstream: list = ()) -> list[str]:
    """The earlier passes' decisions a plan may take back: ``stream``'s chunking
    (:data:`~rlhfc.passes.layouts.STREAMS`; not when the pipeline's ``stream`` was given its ``chunk``, the
    user's choice) and ``reuse_logprobs``' sampled log-probs (:data:`~rlhfc.passes.layouts.OLD_LOGPROBS`)."""
    chosen = any(p.name == "stream" and getattr(p, "chunk", 0) for p in upstream)
    return ([STREAMS] if _streams(module) and not chosen else []) + ([OLD_LOGPROBS] if reuses(module) else [])


def _decisions(cur: dict, keys: list) -> list[dict]:
    """``cur`` with the decisions ``keys`` (:func:`takeback_keys`) taken back or restored, in every other
    combination."""
    out = []
    for values in itertools.product((True, False), repeat=len(keys)):
        prop = {k: v for k, v in cur.items() if k not in keys}
        prop.update({k: False for k, v in zip(keys, values) if not v})
        if prop != cur:
            out.append(prop)
    return out


def _streams(module: Module) -> bool:
    """Whether the ``stream`` pass chunked a generation of ``module`` (so a plan may also run without it)."""
    return any("stream" in s.annotations for s in module.graph.stages)


class _Walk:
    """The best plan seen (fitting plans first) and the trajectory of improvements."""

    def __init__(self, pricer: PlanPricer, report: SearchReport):
        self.pricer, self.report = pricer, report
        self.best: dict | None = None
        self.best_score = math.inf
        self.best_fit: dict | None = None
        self.best_fit_t = math.inf

    def offer(self, assign: dict) -> float:
        """Price ``assign`` (counting the proposal) and keep it if it is the best so far; its score."""
        self.report.proposals += 1
        score = self.pricer.score(assign)
        t, ok = self.pricer.price(assign)
        if score < self.best_score:
            self.best, self.best_score = dict(assign), score
        if ok and t < self.best_fit_t:
            self.best_fit, self.best_fit_t = dict(assign), t
            self.report.trajectory.append((len(self.pricer.prices), t))
        return score

    def result(self) -> dict:
        return self.best_fit if self.best_fit is not None else self.best


def _polish_layouts(walk: _Walk, module: Module, by_model: dict, limit: int, keys: list) -> None:
    """The layout search (beyond each stage's greedy choice): from the best plan, pin one model stage to
    another layout on its mesh (the fastest of each distinct split and micro-batch count it may take, up to
    :data:`POLISH_ALTERNATIVES`) and let the stages not pinned be chosen around it (so a stage that gives up
    memory lets the stages beside it take faster layouts); also the plan with the earlier passes' decisions
    ``keys`` taken back (without streaming; then with the old log-probs recomputed). First improvement is kept; sweeps repeat until one improves nothing or ``limit`` plans are
    priced. Only improvements are kept, so the result is never slower than the walk's."""
    pricer = walk.pricer
    if walk.best_fit is None:
        return
    stages = [s for group in by_model.values() for s in group if s.op.split(".")[0] in ("generate", "forward", "train")
              and plan.fixed_layout(module.models[s.target]) is None]
    stages.sort(key=lambda s: (s.op != "train", s.op != "generate", s.name))
    same_split = module.run.trainer == plan.AUTO or bool(plan.backend_traits(module.run.trainer).dims)
    improved = True
    while improved and len(pricer.prices) < limit:
        improved = False
        cur, cur_t = dict(walk.best_fit), walk.best_fit_t
        placed = pricer._placed(cur)
        cm = CostModel(placed, pricer.config)
        moves = _decisions(cur, keys)
        later = [m for m in moves if m.get(OLD_LOGPROBS) != cur.get(OLD_LOGPROBS)]
        moves = [m for m in moves if m not in later]
        for s in stages:
            first, count = mesh_of(cur[s.name])
            now = plan.stage_layout(placed, placed.graph.stage(s.name))
            c, r = layout_table(placed, cm, placed.graph.stage(s.name), first, count)
            if r is None:
                continue
            seen, alts = {(now.dp, now.tp, now.pp, now.microbatches)}, []
            for i in sorted(range(len(c)), key=lambda i: (float(r["total"][i]), i)):
                split = (c[i].dp, c[i].tp, c[i].pp, c[i].microbatches)
                if split not in seen:
                    seen.add(split)
                    alts.append(c[i])
                if len(alts) >= POLISH_ALTERNATIVES:
                    break
            for lay in alts:
                prop = dict(cur)
                prop[s.name] = lay
                if same_split:   # the model's other stages on this mesh are re-chosen in the new split
                    for o in by_model[s.target]:
                        if o.name != s.name and isinstance(prop[o.name], plan.Layout) and \
                                mesh_of(prop[o.name]) == (first, count):
                            prop[o.name] = (first, count)
                moves.append(prop)
        for prop in moves + later:   # the log-probs' alternatives last: rarely faster, off the walk's budget
            if len(pricer.prices) >= limit:
                return
            walk.offer(prop)
            if walk.best_fit_t < cur_t:
                improved = True
                break


def _metropolis(walk: _Walk, by_model: dict, keys: list, meshes_of: dict, candidates: int, seed: int) -> None:
    """ReaL's walk: move one model (or its generation) to another mesh; accept by the Metropolis rule."""
    rng = random.Random(seed)
    cur = dict(walk.best)
    cur_score = walk.best_score
    base = max(walk.best_score if math.isfinite(walk.best_score) else 1.0, 1e-9)
    temp, idle, limit = base * TEMPERATURE, 0, candidates * 20   # repeats of priced plans are free but bounded
    while len(walk.pricer.prices) < candidates and walk.report.proposals < limit:
        if idle >= PATIENCE:   # stuck: restart from the best plan, hotter, so the walk leaves its basin
            cur, cur_score, temp, idle = dict(walk.best), walk.best_score, temp * 2, 0
            walk.report.restarts += 1
        model, gen_only = rng.choice(keys)
        mesh = rng.choice(meshes_of[model])
        prop = dict(cur)
        for s in by_model[model]:   # moved stages lose any pinned layout (a layout belongs to its mesh)
            if (s.op == "generate") == gen_only or not gen_only:
                prop[s.name] = mesh
        before = walk.best_fit_t
        score = walk.offer(prop)
        idle = 0 if walk.best_fit_t < before else idle + 1
        if score < cur_score or rng.random() < math.exp(-(score - cur_score) / temp):
            cur, cur_score = prop, score
