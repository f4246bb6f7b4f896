"""The ``rlhfc`` command line.

Every command turns a :class:`~rlhfc.ir.CompileError` into diagnostics on stderr
and exit status 2; no user mistake prints a Python traceback. Set
``RLHFC_DEBUG=1`` to see tracebacks of internal errors.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from rlhfc.ir import CompileError, Diagnostic, Module, print_module

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlhfc — a compiler for RLHF training jobs.")


def _emit_diagnostics(diags: list[Diagnostic], text: str | None = None) -> None:
    for d in diags:
        typer.echo(d.render(text), err=True)


def _load(path: str, plugins: list[str] | None = None) -> tuple[Module, str]:
    from rlhfc.frontend import load_file
    from rlhfc.passes import load_plugin

    for p in plugins or []:
        load_plugin(p)
    module, warnings, text = load_file(path)
    _emit_diagnostics(warnings, text)
    return module, text


PLACEMENTS = ("auto", "flatten", "interleave", "separate", "search")


def optimise(module: Module, level: str | None, passes: str | None, *, verify_each: bool = True,
             print_after: set[str] | None = None, placement: str | None = None):
    """Run ``--passes`` if given, else the pipeline of ``level`` (default: the program's run.optimize).
    ``placement`` overrides the program's ``run { placement = ... }`` strategy."""
    from rlhfc.passes import PassManager, parse_pipeline, pipeline_for

    if placement is not None:
        if placement not in PLACEMENTS:
            raise CompileError([Diagnostic("error", f"unknown --placement '{placement}'", None,
                                           f"strategies: {', '.join(PLACEMENTS)}")])
        module.run.placement = placement

    chosen = parse_pipeline(passes) if passes is not None else pipeline_for(level or module.run.optimize)

    def show(spec: str, text: str) -> None:
        typer.echo(f"// ----- IR after {spec} -----", err=True)
        typer.echo(text, err=True, nl=False)

    pm = PassManager(chosen, verify_each=verify_each, print_after=print_after or set(), printer=show)
    return pm.run(module), pm


@app.command()
def check(file: str = typer.Argument(..., help=".rlhf or .rlir file"),
          plugin: List[str] = typer.Option([], "--plugin", help="import a module that registers passes/ops")):
    """Parse and verify a program; exit 0, or print diagnostics and exit 2."""
    module, _ = _load(file, plugin)
    typer.echo(f"{file}: ok ({len(module.models)} models, {len(module.graph.stages)} stages)", err=True)


@app.command(name="compile")
def compile_cmd(
    file: str = typer.Argument(..., help=".rlhf or .rlir file"),
    opt: Optional[str] = typer.Option(None, "-O", "--opt-level", help="optimisation level 0-3 (-O2)"),
    passes: Optional[str] = typer.Option(None, "--passes", help="run exactly these passes: a,b{opt=1},..."),
    emit: str = typer.Option("ir", "--emit", help="ir | job"),
    out: Optional[str] = typer.Option(None, "-o", "--output", help="output file (ir) or folder (job)"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers passes"),
    print_after_all: bool = typer.Option(False, "--print-after-all", help="print the IR after every pass"),
    print_after: List[str] = typer.Option([], "--print-after", help="print the IR after this pass"),
    no_verify: bool = typer.Option(False, "--no-verify-each", help="skip the verifier between passes (debugging)"),
    placement: Optional[str] = typer.Option(None, "--placement", help="flatten|interleave|separate|search|auto"),
):
    """Compile a program: optimise it and write canonical IR or a runnable job."""
    if emit not in ("ir", "job"):
        raise CompileError([Diagnostic("error", f"unknown --emit '{emit}'", None, "use --emit ir or --emit job")])
    module, text = _load(file, plugin)
    module, _ = optimise(module, opt, passes, verify_each=not no_verify,
                         print_after={"*"} if print_after_all else set(print_after), placement=placement)
    if emit == "ir":
        ir = print_module(module)
        if out:
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(ir)
        else:
            typer.echo(ir, nl=False)
        return

    if not out:
        raise CompileError([Diagnostic("error", "--emit job needs an output folder", None, "add -o job/")])
    _emit(module, out, file, opt, passes)
    typer.echo(f"wrote {out}/main.py, {out}/plan.json", err=True)


def _emit(module: Module, out: str, file: str, opt: str | None, passes: str | None) -> None:
    from rlhfc.codegen import emit_job
    from rlhfc.passes import PIPELINES

    level = None if passes is not None else (opt if opt and opt.startswith("O") else f"O{opt}" if opt else
                                            module.run.optimize)
    names = [p.strip() for p in passes.split(",")] if passes is not None else PIPELINES[level]
    emit_job(module, out, source_path=file, opt_level=level or "custom", passes=names)


def _default_run_dir(name: str, resume: bool) -> str:
    """runs/NAME for the first run, then runs/NAME-1, -2 …; --resume picks the newest existing one."""
    candidates = [os.path.join("runs", name)] + [os.path.join("runs", f"{name}-{i}") for i in range(1, 1000)]
    existing = [c for c in candidates if os.path.isdir(c) and os.listdir(c)]
    if resume:
        return existing[-1] if existing else candidates[0]
    return next(c for c in candidates if not (os.path.isdir(c) and os.listdir(c)))


@app.command()
def run(
    target: str = typer.Argument(..., help=".rlhf/.rlir program, or a job folder from `compile --emit job`"),
    opt: Optional[str] = typer.Option(None, "-O", "--opt-level", help="optimisation level 0-3"),
    passes: Optional[str] = typer.Option(None, "--passes", help="run exactly these passes"),
    steps: Optional[int] = typer.Option(None, "--steps", help="train this many steps in total"),
    out: Optional[str] = typer.Option(None, "--out", help="run folder (default runs/<program>)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run folder's latest checkpoint"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="use an existing Ray cluster"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers passes"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    placement: Optional[str] = typer.Option(None, "--placement", help="flatten|interleave|separate|search|auto"),
):
    """Compile (if needed) and train: locally on Ray by default, or on a cluster with --ray-address."""
    from rlhfc.runtime.job import JobError, run_job

    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "plan.json")):
            raise CompileError([Diagnostic("error", f"{target} is not a job folder (no plan.json)", None,
                                           "compile one with `rlhfc compile FILE --emit job -o DIR`")])
        job_dir = target
        name = os.path.basename(os.path.normpath(target))
    else:
        module, _ = _load(target, plugin)
        module, _ = optimise(module, opt, passes, placement=placement)
        name = module.name
        out = out or _default_run_dir(name, resume)
        job_dir = os.path.join(out, "job")
        if resume and os.path.isfile(os.path.join(job_dir, "plan.json")):
            with open(os.path.join(job_dir, "ir.rlir"), encoding="utf-8") as fh:
                if fh.read() != print_module(module):
                    typer.echo("rlhfc: note: the program changed since the checkpointed run; "
                               "resuming with the new compiled job", err=True)
        _emit(module, job_dir, target, opt, passes)
    try:
        run_job(job_dir, steps=steps, out=out or _default_run_dir(name, resume), resume=resume,
                ray_address=ray_address, progress=not no_progress)
    except JobError as exc:
        typer.echo(f"rlhfc: error: {exc.message}", err=True)
        if exc.hint:
            typer.echo(f"  hint: {exc.hint}", err=True)
        raise SystemExit(1)


@app.command(name="passes")
def passes_cmd(plugin: List[str] = typer.Option([], "--plugin", help="also list passes from this plugin")):
    """List every registered pass with its description and options."""
    from rlhfc.passes import PIPELINES, load_plugin, registered_passes

    for p in plugin:
        load_plugin(p)
    for name, cls in registered_passes().items():
        levels = [lvl for lvl, names in PIPELINES.items() if name in names]
        tag = ("exact up to rounding" if cls.rounding else "exact") if cls.exact else "changes training"
        typer.echo(f"{name:<20} {cls.description}  [{tag}; {', '.join(levels) or 'by name only'}]")
        for opt, kind, default, doc in cls.option_help():
            typer.echo(f"    {opt}: {kind} = {default}" + (f"  — {doc}" if doc else ""))


from rlhfc import cli_cost  # noqa: E402,F401  (registers explain/profile)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping compile errors to exit 2."""
    try:
        app(args=argv, standalone_mode=False)
    except CompileError as exc:
        _emit_diagnostics(exc.diagnostics, exc.source_text)
        if os.environ.get("RLHFC_DEBUG") and exc.__cause__ is not None:  # e.g. the traceback of a failing pass
            import traceback

            traceback.print_exception(exc.__cause__)
        return 2
    except SystemExit as exc:
        return int(exc.code or 0)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    except Exception as exc:  # click usage errors and internal bugs
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            return 2
        if os.environ.get("RLHFC_DEBUG"):
            raise
        typer.echo(f"rlhfc: internal error: {type(exc).__name__}: {exc}\n"
                   "  hint: rerun with RLHFC_DEBUG=1 for a traceback, and report it", err=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
