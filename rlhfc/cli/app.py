"""The typer application every command registers on, and the process entry point.

Every command turns a :class:`~rlhfc.ir.CompileError` into diagnostics on stderr
and exit status 2; no user mistake prints a Python traceback. Set
``RLHFC_DEBUG=1`` to see tracebacks of internal errors (exit status 3).

This module is the bottom of the ``rlhfc.cli`` layers (app ← load ← optimise ←
compile, explain): it imports no other command-line module.
"""

from __future__ import annotations

import os
import sys

import typer

from rlhfc.ir import CompileError, Diagnostic

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlhfc — a compiler for RLHF training jobs.")


def print_diagnostics(diags: list[Diagnostic], text: str | None = None) -> None:
    """Render diagnostics on stderr (with source lines when ``text`` is the file they point into)."""
    for d in diags:
        typer.echo(d.render(text), err=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit status: 0, 2 for compile and usage errors, 3 for internal errors,
    130 when interrupted (a command's own ``SystemExit`` status passes through)."""
    try:
        app(args=argv, standalone_mode=False)
    except CompileError as exc:
        print_diagnostics(exc.diagnostics, exc.source_text)
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


def _entry() -> None:
    """Console-script entry point (``rlhfc = "rlhfc.cli:_entry"``)."""
    sys.exit(main())
