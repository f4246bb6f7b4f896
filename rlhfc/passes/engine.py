"""``engine``: under ``run { rollout = auto }``, pick the rollout engine of each generating model from the
cost model.

For every model with generate stages the pass prices those stages on rlhfc's torch decode loop and on the
vLLM engine (:func:`rlhfc.cost.model.engine_prices`: vLLM's measured speed from the profile — the pass's
``profile`` option (``--profile``), else this machine's default profile that ``rlhfc profile`` saved —, continuous
batching, its refit when the model is trained; or the documented catalog assumption) and marks the
model's generate stages ``engine = "vllm"`` when vLLM is cheaper; torch is the unmarked default. Under
vLLM the trainer's log-prob forward stays (``reuse_logprobs`` does not apply to the engine's log-probs), so
when ``reuse_logprobs`` runs later in the pipeline the torch side is credited with the forwards it would
remove.

A model vLLM cannot run stays on torch, with a note, not an error
(:func:`rlhfc.ir.plan.engine_problem`: its head size, a generate's ``top_p``, vLLM not installed where
it compiles, or a profile that recorded the engine failing on that shape). A model of several ranks may run
on vLLM: an engine per rank, priced on its share of the rows.

Not in the -O pipelines: ``compile``/``run``/``explain`` run it first at every level, -O0 included, whenever
the program says ``rollout = auto`` (:func:`rlhfc.cli.optimise.optimise`), so every level runs the same
engine and an -O2 build still trains as the -O0 one. So it runs before ``reuse_logprobs`` (whose decision
depends on the engine) and before placement: the prices are taken on the stages' layouts at that point (the
whole cluster when nothing is placed yet). Not exact in itself: the engines sample with different generators,
so the tokens differ from torch's (the program opted in with ``auto``). Under ``torch``/``vllm`` the pass
changes nothing; it is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.contract.engines import DEFAULT_ROLLOUT, rollout_traits
from rlhfc.ir import Module
from rlhfc.ir import plan

from rlhfc.ir.diagnostics import error

from .base import Pass, register_pass


@dataclass
class EngineChoice:
    """One generating model's choice: ``engine``, its ``prices`` (seconds per step of its generate stages on
    each engine; empty when vLLM cannot run it), ``saved`` (the log-prob forwards torch avoids) and ``why``."""

    model: str
    engine: str
    prices: dict
    saved: float
    why: str


def choose_engines(module: Module, downstream_names=(), config=None) -> list[EngineChoice]:
    """The choice for every generating model of ``module`` under ``rollout = auto`` (module docstring)."""
    from rlhfc.cost import CostConfig, CostModel
    from rlhfc.cost.engine import reusable_forwards, unsupported
    from rlhfc.cost.model import engine_prices

    g = module.graph
    config = config or CostConfig()
    out = []
    models = list(dict.fromkeys(s.target for s in g.stages if s.op == "generate" and s.target in module.models))
    other = plan.auto_engine()
    title = rollout_traits(other).title
    for name in models:
        gens = [s for s in g.stages if s.op == "generate" and s.target == name]
        problem = plan.engine_problem(module, name, other) or unsupported(config.profile, module.models[name])
        if problem is not None:
            out.append(EngineChoice(name, DEFAULT_ROLLOUT, {}, 0.0, f"{title} cannot run @{name} here: {problem}"))
            continue
        prices = engine_prices(module, gens, config)
        saved = 0.0
        if "reuse_logprobs" in downstream_names:   # torch's own sampling log-probs replace the trainer's forward
            cm = CostModel(module, config)
            saved = sum(cm.stage_cost(s).time_s for s in reusable_forwards(module, gens))
        default_s, other_s = prices[DEFAULT_ROLLOUT] - saved, prices[other]
        engine = other if other_s < default_s else DEFAULT_ROLLOUT
        credit = f" minus the {saved * 1e3:.1f} ms log-prob forward its sampling log-probs replace" if saved else ""
        why = (f"{other} {other_s * 1e3:.1f} ms (refit included) vs {DEFAULT_ROLLOUT} "
               f"{prices[DEFAULT_ROLLOUT] * 1e3:.1f} ms{credit}, per step")
        if engine != DEFAULT_ROLLOUT and not _engine_fits(module, gens, config, engine):
            engine, why = DEFAULT_ROLLOUT, why + (f"; but the {title} engine's weights copy and KV cache do not fit "
                                                  f"where {DEFAULT_ROLLOUT}'s do")
        out.append(EngineChoice(name, engine, prices, saved, why))
    return out


def _engine_fits(module: Module, gens: list, config, engine: str) -> bool:
    """Whether the plan still fits in memory with ``gens`` on vLLM, or did not fit on torch either (then the
    placement's memory check speaks, not this choice): :func:`rlhfc.cost.engine.engine_bytes`."""
    from dataclasses import replace

    from rlhfc.cost import CostModel
    from rlhfc.cost.memory import fits

    names = {s.name for s in gens}
    trial = module.clone()
    for s in trial.graph.stages:
        if s.name in names:
            s.annotations[plan.ENGINE_KEY] = engine
    if fits(trial, cost_model=CostModel(trial, replace(config, engine=None))):
        return True
    return not fits(module, cost_model=CostModel(module, replace(config, engine=DEFAULT_ROLLOUT)))


@register_pass
@dataclass(frozen=True)
class Engine(Pass):
    name = "engine"
    description = ("rollout = auto: pick torch or vllm per generating model from the cost model (run first, at "
                   "every level, whenever a program says rollout = auto)")
    exact = False
    profile: str = field(default="", metadata={
        "doc": "measured profile the engines are priced with (a path, as explain's --profile; empty: this "
               "machine's default profile, the one `rlhfc profile` saves, else the catalog assumption)"})

    def run(self, module: Module) -> Module:
        return self.run_in_pipeline(module, [])

    def run_in_pipeline(self, module: Module, downstream: list) -> Module:
        if module.run.rollout != "auto":
            return module
        for s in module.graph.stages:   # idempotent: chosen again from the prices
            s.annotations.pop(plan.ENGINE_KEY, None)
        from rlhfc.cost import CostConfig, ProfileError, find_default_profile, load_profile

        try:   # the measured speeds of this machine are what auto is for: its default profile unless one is given
            prof = load_profile(self.profile) if self.profile else find_default_profile(module.cluster.device)
        except ProfileError as exc:
            raise error(f"engine: {exc}", None, "give a file `rlhfc profile` wrote, or no profile") from None
        choices = choose_engines(module, [p.name for p in downstream], CostConfig(profile=prof))
        for c in choices:
            if c.engine != DEFAULT_ROLLOUT:
                for s in module.graph.stages:
                    if s.op == "generate" and s.target == c.model:
                        s.annotations[plan.ENGINE_KEY] = c.engine
        module.engine_choices = choices   # not IR: what explain reports about the choice
        return module


def set_gpu_memory(module: Module, config=None) -> Module:
    """Mark each generate stage that runs on vLLM on a GPU cluster with ``gpu_memory = f``, the
    ``gpu_memory_utilization`` its engine is started with (:meth:`rlhfc.cost.model.CostModel.gpu_fraction`: what the
    engine needs for its weights, its rows' KV cache and vLLM's overhead, not vLLM's default 90 % of the
    device, which a co-located trained model's weights and optimizer state leave no room for). The memory
    check then prices the engine at that share, and the runtime asks vLLM for it. Not a pass: ``compile``,
    ``run`` and ``explain`` call it after the passes at every level (:func:`rlhfc.cli.optimise.optimise`); on a
    CPU cluster, or with no stage on vLLM, it changes nothing. Idempotent."""
    from rlhfc.cost import CostConfig, CostModel

    for s in module.graph.stages:
        plan.set_gpu_memory(s, None)
    if module.cluster.device == "cpu":
        return module
    gens = [s for s in module.graph.stages
            if s.op == "generate" and rollout_traits(plan.stage_engine(module, s)).own_weights]
    if not gens:
        return module
    cm = CostModel(module, config or CostConfig())
    share = {name: cm.gpu_fraction(module.models[name]) for name in dict.fromkeys(s.target for s in gens)}
    for s in gens:
        plan.set_gpu_memory(s, share[s.target])
    return module

