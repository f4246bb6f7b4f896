"""Running the pass pipeline a command asked for: ``--passes``, ``-O``, or the program's own level.

Every -O level is named through :func:`rlhfc.ir.plan.opt_level` (``"O1"``, ``"o1"`` and ``"1"`` are the
same level everywhere) and every ``--placement`` is checked against :data:`rlhfc.ir.plan.PLACEMENTS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from rlhfc.ir import CompileError, Diagnostic, Module
from rlhfc.ir.plan import PLACEMENTS, opt_level, placement_problem, rollouts

if TYPE_CHECKING:
    from rlhfc.passes import PassManager


#: ``--placement``'s help: the strategies, then auto
PLACEMENT_HELP = "|".join(PLACEMENTS[1:] + PLACEMENTS[:1])
#: ``--rollout``'s help: the engines of the generate stages
ROLLOUT_HELP = "|".join(rollouts()) + " (overrides run { rollout = ... }; auto: the cost model picks per model)"


@dataclass
class Optimised:
    """The module after the passes, the pass manager that ran them (its ``records``), the canonical -O
    level (None when ``--passes`` chose the passes) and the passes that ran, as written in a job's plan."""

    module: Module
    manager: PassManager
    level: str | None
    passes: list[str]

    @property
    def records(self) -> list:
        return self.manager.records


def check_placement(placement: str) -> str:
    problem = placement_problem(placement)
    if problem is not None:
        message = f"unknown --placement '{placement}'" if not placement.startswith("baseline:") else \
            f"--placement {placement}: {problem[0]}"
        raise CompileError([Diagnostic("error", message, None,
                                       problem[1] if placement.startswith("baseline:")
                                       else f"strategies: {', '.join(PLACEMENTS)}")])
    return placement


def check_rollout(rollout: str) -> str:
    if rollout not in rollouts():
        raise CompileError([Diagnostic("error", f"unknown --rollout '{rollout}'", None,
                                       f"engines: {', '.join(rollouts())}")])
    return rollout


def override_rollout(module: Module, rollout: str | None) -> None:
    """``--rollout``: replace the program's ``run { rollout = ... }`` and check what the new engine needs
    (vLLM installed, models and sampling it runs: :func:`rlhfc.ir.plan.verify_rollout`)."""
    if rollout is None:
        return
    from rlhfc.ir import DiagnosticSink
    from rlhfc.ir.plan import verify_rollout

    module.run.rollout = check_rollout(rollout)
    sink = DiagnosticSink()
    verify_rollout(module, sink)
    sink.raise_if_errors()


def optimise(module: Module, level: str | None, passes: str | None, *, verify_each: bool = True,
             print_after: set[str] | None = None, placement: str | None = None,
             memory_check: bool | str = True, response_lengths: str | None = None,
             profile: str | None = None, rollout: str | None = None) -> Optimised:
    """Run ``passes`` (``--passes a,b{opt=1}``) if given, else the pipeline of ``level`` (default: the
    program's ``run { optimize = ... }``). ``placement`` overrides the program's ``run { placement = ... }``
    strategy, ``rollout`` its ``run { rollout = ... }`` engine. A bad level, placement or rollout is a :class:`~rlhfc.ir.CompileError`, before any pass runs.
    Under ``rollout = auto`` the ``engine`` pass runs first (unless the pipeline names it), at every level.

    ``response_lengths`` (``--response-lengths``): the response-length law the placement search prices
    (given to every ``placement`` pass that does not set its own ``response_lengths``); ``profile``
    (``--profile PATH``): the measured profile it prices with, likewise (default: catalog rates).

    ``memory_check``: after the passes, at every level (-O0 included), a stage that does not fit its
    devices' memory under the resulting plan is a compile error naming the stage, the device, bytes needed
    vs available and what would make it fit (:func:`rlhfc.cost.check_memory`) — a job never starts only to
    run out of memory where the cost model could tell. ``explain`` reports instead of failing; an explicit
    ``--passes`` pipeline (pass development) that only prints IR passes ``memory_check="warn"``."""
    from rlhfc.passes import PIPELINES, PassManager, parse_pipeline, pipeline_for

    if level is not None:
        level = opt_level(level)
    if placement is not None:
        module.run.placement = check_placement(placement)
    override_rollout(module, rollout)
    if passes is not None:
        level, chosen = None, parse_pipeline(passes)
    else:
        level = level or opt_level(module.run.optimize)
        chosen = pipeline_for(level)
        if str(module.run.placement).startswith("baseline:"):   # a baseline's plan: the system's own passes
            from rlhfc.passes.baselines import PIPELINE

            chosen, passes = parse_pipeline(",".join(PIPELINE)), ",".join(PIPELINE)

    if module.run.rollout == "auto" and all(p.name != "engine" for p in chosen):
        # rollout = auto is resolved first at every level, -O0 included, so every level runs the same engine
        chosen = parse_pipeline("engine") + chosen
    if response_lengths is not None and response_lengths != "auto":
        from rlhfc.cost import response_dist

        try:
            response_dist(response_lengths, 8, vocab=100, pretrained=False)
        except (ValueError, IndexError) as exc:
            raise CompileError([Diagnostic("error", f"bad --response-lengths: {exc}", None,
                                           "e.g. --response-lengths max or lognormal:0.25:1.0")]) from None
        chosen = [dataclasses.replace(p, response_lengths=response_lengths)
                  if p.name == "placement" and getattr(p, "response_lengths", None) == "auto" else p
                  for p in chosen]
    if profile:
        chosen = [dataclasses.replace(p, profile=profile) if p.name in ("placement", "engine", "recompute", "threads")
                  and getattr(p, "profile", None) == "" else p for p in chosen]

    def show(spec: str, text: str) -> None:
        typer.echo(f"// ----- IR after {spec} -----", err=True)
        typer.echo(text, err=True, nl=False)

    pm = PassManager(chosen, verify_each=verify_each, print_after=print_after or set(), printer=show)
    module = pm.run(module)
    from rlhfc.passes.engine import set_gpu_memory

    set_gpu_memory(module)   # a CUDA vLLM engine's gpu_memory_utilization, before the memory check prices it
    if memory_check:
        from rlhfc.cost import check_memory
        from rlhfc.ir import DiagnosticSink

        sink = DiagnosticSink()
        warn = memory_check == "warn" and level is None
        check_memory(module, sink, severity="warning" if warn else "error")
        for d in sink.warnings:
            typer.echo(f"warning: {d.message} (a job of this IR would run out of memory)", err=True)
        sink.raise_if_errors()
    names = [p.name for p in chosen if p.name == "engine"] + list(PIPELINES[level]) \
        if level is not None and passes is None else [r.spec for r in pm.records]
    return Optimised(module, pm, level, names)
