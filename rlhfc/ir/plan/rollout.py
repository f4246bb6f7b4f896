"""Which rollout engine each generate stage runs on (:func:`stage_engine`), and what an engine needs of the
program, checked at check time (the verifier calls :func:`verify_rollout`). Every rule here asks the engine's
registered traits (:mod:`rlhfc.contract.engines`), never its name.

Under ``rollout = <engine>`` every generate stage runs on that engine. Under ``rollout = auto`` the ``engine``
pass (:mod:`rlhfc.passes.engine`) picks one per generating model and marks the model's generate stages
``engine = "<engine>"`` when it picks another than the default; an unmarked stage runs on the default engine
(so at -O0, where no pass runs, ``auto`` is the default). The pass asks :func:`engine_problem` first, so what
keeps a model off an engine is one rule.

A generating model that runs as several ranks (``trainer = fsdp`` or ``megatron``) is fine: on an engine with
weights of its own every rank owns an engine of the whole model in the group's ``torch.distributed`` world
and generates its share of the rows (docs/runtime.md, The vLLM rollout engine).

A program whose stages run on an engine (or an IR whose stages are marked ``engine = ...``) is refused before
any job starts when:

* a generating model is one the engine cannot run: an architecture other than llama/gpt2 is impossible here
  (the language has only those), so the rule is the attention head size (``hidden / heads``), which the
  engine's kernels may support only for some sizes (its ``head_sizes``; vLLM's CPU backend's list);
* a generate stage asks for sampling the engine does not do (``top_p = 0`` where ``top_p_zero`` is false);
* the engine's package is not installed (reported only when nothing else is wrong, so a program's own
  mistakes read the same with or without it installed); the message gives the install command. Not for
  stages the ``engine`` pass marked: it marks only when the engine is installed where it compiles.
"""

from __future__ import annotations

import importlib.util

from rlhfc.contract.engines import DEFAULT_ROLLOUT, RolloutTraits, rollout_engines, rollout_traits

from ..core import Module
from ..diagnostics import DiagnosticSink, where
from .attrs import AUTO

def installed(package: str | None) -> bool:
    """Whether ``package`` (a dotted import name; None: nothing needed) can be imported."""
    if package is None:
        return True
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:   # its parent package is missing
        return False


def head_problem(traits: RolloutTraits, hidden: int, heads: int) -> tuple[str, str] | None:
    """Why the engine cannot run attention of ``hidden`` width over ``heads`` heads (what, hint), or None."""
    sizes = traits.head_sizes
    if sizes is None or not heads or hidden % heads:
        return None   # any size; or the model's own check reports it
    size = hidden // heads
    if size in sizes:
        return None
    fits = [h for h in range(1, heads) if hidden % h == 0 and hidden // h in sizes]
    change = f"hidden = {heads * 64} ({heads} heads of 64)" + (f" or heads = {fits[-1]}" if fits else "")
    return (f"head size {size} (hidden {hidden} / heads {heads})",
            f"{traits.title} runs head sizes {', '.join(map(str, sizes))}: e.g. {change}, or run "
            f"{{ rollout = {DEFAULT_ROLLOUT} }}")


#: the stage annotation that records ``rollout = auto``'s choice (another engine than the default; absent =
#: the default engine)
ENGINE_KEY = "engine"


def stage_engine(module: Module, stage) -> str:
    """The registered engine that runs generate stage ``stage``: the run's ``rollout``, or under ``auto`` the
    stage's ``engine`` annotation (the default engine when absent)."""
    rollout = module.run.rollout
    if rollout != AUTO:
        return rollout if rollout in rollout_engines() else DEFAULT_ROLLOUT
    marked = stage.annotations.get(ENGINE_KEY)
    return marked if marked in rollout_engines() else DEFAULT_ROLLOUT


def model_engine(module: Module, model: str) -> str:
    """The engine of ``model``'s generate stages (one engine per worker): the first that is not the default,
    else the default."""
    engines = [stage_engine(module, s) for s in module.graph.stages if s.op == "generate" and s.target == model]
    return next((e for e in engines if e != DEFAULT_ROLLOUT), DEFAULT_ROLLOUT)


def auto_engine() -> str:
    """The engine ``rollout = auto`` weighs against the default one: the registered engine with ``auto`` traits
    (vLLM; the cost model prices an engine with weights of its own from its fitted rates)."""
    return next(e for e in rollout_engines() if rollout_traits(e).auto)


def engine_problem(module: Module, model: str, engine: str) -> str | None:
    """Why ``rollout = auto`` must keep generating model ``model`` off ``engine`` (None when it can run it): the
    checks of ``rollout = <engine>``: head size, a generate's ``top_p``, the engine installed (a model of
    several ranks runs an engine on each)."""
    m = module.models.get(model)
    if m is None:
        return None
    traits = rollout_traits(engine)
    if isinstance(m.hidden, int) and isinstance(m.heads, int):
        problem = head_problem(traits, m.hidden, m.heads)
        if problem is not None:
            return f"{traits.title} cannot run its {problem[0]}"
    for s in module.graph.stages:
        top_p = s.attrs.get("top_p", 1.0) if s.op == "generate" and s.target == model else 1.0
        if not traits.top_p_zero and isinstance(top_p, (int, float)) and top_p <= 0:
            return f"%{s.name} samples with top_p = {top_p}, which {traits.title} does not support"
    if not installed(traits.package):
        return f"{traits.title} is not installed ({traits.install})"
    return None


def verify_rollout(module: Module, sink: DiagnosticSink) -> None:
    """Report what keeps the program's generate stages off their engines: every stage under ``rollout =
    <engine>``, the stages the ``engine`` pass marked under ``auto``; nothing for the default engine."""
    before = len(sink.errors)
    at_run = where(module.run, "rollout")
    seen: set[str] = set()
    for s in module.graph.stages:
        engine = stage_engine(module, s) if s.op == "generate" else DEFAULT_ROLLOUT
        if engine == DEFAULT_ROLLOUT:
            continue
        traits = rollout_traits(engine)
        top_p = s.attrs.get("top_p", 1.0)
        if not traits.top_p_zero and isinstance(top_p, (int, float)) and top_p <= 0:
            sink.error(f"stage %{s.name}: top_p = {top_p} is not a sampling setting {traits.title} supports",
                       where(s, "top_p"), f"{traits.title} needs 0 < top_p <= 1: use top_p = 1.0 (no nucleus cut), "
                       f"or run {{ rollout = {DEFAULT_ROLLOUT} }}")
        m = module.models.get(s.target or "")
        if m is None or m.name in seen:
            continue
        seen.add(m.name)
        problem = head_problem(traits, m.hidden, m.heads) if isinstance(m.hidden, int) and isinstance(m.heads, int) \
            else None
        if problem is not None:
            what, hint = problem
            sink.error(f"model @{m.name} generates under rollout = {engine}, but {traits.title} cannot run its {what}",
                       where(m, "heads"), hint)
    asked = module.run.rollout
    if asked not in (AUTO, DEFAULT_ROLLOUT) and asked in rollout_engines() and len(sink.errors) == before:
        traits = rollout_traits(asked)
        if not installed(traits.package):
            sink.error(f"rollout = {asked}, but {traits.title} is not installed", at_run,
                       f"install the extra: {traits.install}")
