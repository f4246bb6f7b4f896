"""The placement search: a seeded walk over plans, each priced exactly as ``compile`` will emit it.

One pricing path. A candidate plan is a mesh per model stage (``{stage: (first, count)}``). To price it,
:class:`PlanPricer` does what the compile does with it: a copy of the module before placement is placed
(:func:`rlhfc.passes.placement.place`: each stage's fastest layout that fits, memory budgets tightened until the
devices' totals fit), then the passes that follow ``placement`` in the running pipeline (``recompute``, ``realloc``
at -O2) are run on it, and the result is simulated as ``rlhfc explain`` simulates a compiled job
(:func:`rlhfc.cost.simulate`, 3 unrolled steps, the pass's cost configuration: catalog rates and its
``response_lengths``). So a plan whose weight syncs or recomputation are expensive is ranked by the price it has,
and the searched plan's price is ``explain``'s price of the compiled job (a test checks it on the examples). It is
fast because everything that does not change between candidates is computed once: stage prices and layout tables
(:func:`rlhfc.cost.shared_prices`), weight-sync times, traced blocks.

The walk (ReaL's Metropolis search): it starts from the best of the strategies' plans (flatten, interleave,
separate), then, when the space of per-model meshes is small, prices every assignment; else it proposes a new mesh
for one model (or for one model's generation alone), accepts it if faster, or with probability ``exp(-Δ/T)`` (``T``
= 5 % of the best price), restarts from the best plan at twice the temperature after ``PATIENCE`` proposals without
improvement, and stops after ``candidates`` distinct plans priced (or 20 times as many proposals, when the walk
keeps revisiting plans it priced). Plans that overflow memory cost 3× (as ReaL), and the result is the fastest plan
that fits — never slower than any strategy's plan, since those are candidates too. A plan whose weights and
optimizer state alone overflow a device cannot be emitted by any pipeline (the passes after placement do not change
them); the walk scores it by its placed price without running those passes. Seeded: the same program and seed give
the same plan on any machine and load (the budget is counted in plans, not seconds).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
import warnings
from dataclasses import dataclass, field

from rlhfc.ir import CompileError, Module

#: proposals without improvement after which the walk restarts from the best plan at twice the temperature
PATIENCE = 150
#: the walk's starting temperature, as a fraction of the best strategy's price (ReaL: a few percent)
TEMPERATURE = 0.05
#: a space of per-model mesh assignments at most this large is enumerated instead of walked
EXHAUSTIVE = 256
#: an overflowing plan's price is its time times this (ReaL), so the walk can cross it
OVERFLOW_PENALTY = 3.0


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

    def __init__(self, module: Module, downstream: list, config, steps: int = 3):
        self.base = module
        self.downstream = list(downstream)
        self.config = config
        self.steps = steps
        self.prices: dict[tuple, tuple[float, bool]] = {}

    def compile(self, assign: dict) -> Module:
        """The module the pipeline emits for ``assign``: placed, then the downstream passes."""
        return self._downstream(self._placed(assign))

    def _placed(self, assign: dict) -> Module:
        from .placement import place

        # the models, data sources and cluster are shared with the base module: no pass after placement
        # changes them (placement, recompute and realloc annotate and add stages), and copying 70B programs'
        # declarations for every candidate is most of a candidate's price otherwise
        base = self.base
        trial = copy.deepcopy(base, {id(base.models): base.models, id(base.data): base.data,
                                     id(base.cluster): base.cluster})
        place(trial, assign, "search")
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
            from rlhfc.cost import CostModel, fits, simulate

            trial = self._placed(assign)
            cm = CostModel(trial, self.config)
            if not _resident_fits(trial, cm):
                # weights and optimizer state alone overflow a device: no pass after placement changes them
                # (they only add syncs and trade activations for time), so no pipeline can emit this plan;
                # the walk scores it by its placed price (penalised) without running those passes
                self.prices[key] = (simulate(trial, steps=self.steps, cost_model=cm).step_time_s, False)
                return self.prices[key]
            try:
                trial = self._downstream(trial)
            except CompileError:   # a downstream pass rejects this plan: it cannot be emitted
                self.prices[key] = (math.inf, False)
                return self.prices[key]
            cm = CostModel(trial, self.config)
            sim = simulate(trial, steps=self.steps, cost_model=cm)
            self.prices[key] = (sim.step_time_s, fits(trial, sim=sim, cost_model=cm))
        return self.prices[key]

    def score(self, assign: dict) -> float:
        """The walk's objective: the price, times :data:`OVERFLOW_PENALTY` when the plan does not fit."""
        t, ok = self.price(assign)
        return t if ok else t * OVERFLOW_PENALTY


def _resident_fits(module: Module, cm) -> bool:
    """Whether what stays on every device for the whole run (weights, gradients and optimizer state) fits."""
    from rlhfc.cost.simulator import resident_bytes

    n = module.cluster.nodes * module.cluster.per_node
    held = resident_bytes(module, {s.name: cm.stage_cost(s) for s in module.graph.stages}, n)
    return all(sum(h.values()) <= cm.spec.memory for h in held)


def search(module: Module, candidates: int, seed: int, downstream: list, config) -> tuple[dict, SearchReport]:
    """The fastest plan that fits (else the best penalised one), and what the search did."""
    from rlhfc.cost import shared_prices

    from . import placement as P

    start = time.perf_counter()
    # built outside shared_prices(): a baseline-marked module is priced with that system's costs, which
    # must not enter the shared stage prices
    baselines = _baseline_meshes(module, P._model_stages(module))
    with shared_prices():
        pricer = PlanPricer(module, downstream, config)
        by_model = P._model_stages(module)
        seeds = {"flatten": P.flatten(module), "interleave": P.interleave(module)}
        if P.SPLIT_GENERATION and module.cluster.num_devices > 1:
            seeds["separate"] = P.separate(module)
        seeds.update(baselines)
        seeds = {name: P.respect_fixed(module, a) for name, a in seeds.items()}
        n = module.cluster.num_devices
        fixed = P._fixed_sizes(module)
        free = P._meshes(n, module.cluster.per_node)
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
        if space <= EXHAUSTIVE:
            for combo in itertools.product(*(meshes_of[m] for m in models)):
                if len(pricer.prices) >= candidates:
                    break
                walk.offer({s.name: combo[i] for i, m in enumerate(models) for s in by_model[m]})
        else:
            keys = [(m, False) for m in models]
            if P.SPLIT_GENERATION:
                keys += [(m, True) for m in models
                         if m not in fixed and any(s.op == "generate" for s in by_model[m])]
            _metropolis(walk, by_model, keys, meshes_of, candidates, seed)
        best = walk.result()
    report.candidates = len(pricer.prices)
    report.seconds = time.perf_counter() - start
    report.best_s, report.fits = pricer.price(best)
    return best, report


def _baseline_meshes(module: Module, by_model: dict) -> dict[str, dict]:
    """The meshes each baseline system's plan gives the stages (``baseline:NAME`` seeds of the search; GPU
    clusters): priced as rlhfc compiles them, so the plan found is never slower than another system's
    placement run by rlhfc's pipeline."""
    from rlhfc.ir import plan
    from rlhfc.ir.plan import BASELINES

    from .baselines import build

    if module.cluster.device == "cpu":
        return {}
    out = {}
    for name in BASELINES:
        trial = build(module.clone(), name)
        out[f"baseline:{name}"] = {s.name: plan.stage_mesh(trial, trial.graph.stage(s.name)).pair()
                                   for stages in by_model.values() for s in stages}
    return out


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
        for s in by_model[model]:
            if (s.op == "generate") == gen_only or not gen_only:
                prop[s.name] = mesh
        before = walk.best_fit_t
        score = walk.offer(prop)
        idle = 0 if walk.best_fit_t < before else idle + 1
        if score < cur_score or rng.random() < math.exp(-(score - cur_score) / temp):
            cur, cur_score = prop, score
