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


def optimise(module: Module, level: str | None, passes: str | None, *, verify_each: bool = True,
             print_after: set[str] | None = None):
    """Run ``--passes`` if given, else the pipeline of ``level`` (default: the program's run.optimize)."""
    from rlhfc.passes import PassManager, parse_pipeline, pipeline_for

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
):
    """Compile a program: optimise it and write canonical IR or a runnable job."""
    if emit not in ("ir", "job"):
        raise CompileError([Diagnostic("error", f"unknown --emit '{emit}'", None, "use --emit ir or --emit job")])
    module, text = _load(file, plugin)
    module, _ = optimise(module, opt, passes, verify_each=not no_verify,
                         print_after={"*"} if print_after_all else set(print_after))
    if emit == "ir":
        ir = print_module(module)
        if out:
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(ir)
        else:
            typer.echo(ir, nl=False)
        return
    from rlhfc.codegen import emit_job

    if not out:
        raise CompileError([Diagnostic("error", "--emit job needs an output folder", None, "add -o job/")])
    emit_job(module, out, source_path=file)
    typer.echo(f"wrote {out}/main.py, {out}/plan.json", err=True)


@app.command(name="passes")
def passes_cmd(plugin: List[str] = typer.Option([], "--plugin", help="also list passes from this plugin")):
    """List every registered pass with its description and options."""
    from rlhfc.passes import PIPELINES, load_plugin, registered_passes

    for p in plugin:
        load_plugin(p)
    for name, cls in registered_passes().items():
        levels = [lvl for lvl, names in PIPELINES.items() if name in names]
        tag = "exact" if cls.exact else "changes training"
        typer.echo(f"{name:<20} {cls.description}  [{tag}; {', '.join(levels) or 'by name only'}]")
        for f in cls.options():
            default = f.default if f.default is not f.default_factory else "?"
            typer.echo(f"    {f.name}: {getattr(f.type, '__name__', f.type)} = {default}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping compile errors to exit 2."""
    try:
        app(args=argv, standalone_mode=False)
    except CompileError as exc:
        _emit_diagnostics(exc.diagnostics, exc.source_text)
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
