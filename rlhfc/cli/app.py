"""The typer application every command registers on, and the process entry point.

Every command turns a :class:`~rlhfc.ir.CompileError` into diagnostics on stderr
and exit status 2; no user mistake prints a Python traceback. Command-line usage
mistakes (an unknown option, a missing argument, a value of the wrong type) are
click's usual usage errors, also exit status 2. Set ``RLHFC_DEBUG=1`` to see
tracebacks of internal errors (exit status 3).

This module is the bottom of the ``rlhfc.cli`` layers (app ← load ← optimise ←
compile, explain): it imports no other command-line module.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

import typer

from rlhfc import __version__
from rlhfc.ir import CompileError, Diagnostic

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlhfc — a compiler for RLHF training jobs.")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"rlhfc {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: Optional[bool] = typer.Option(None, "--version", callback=_show_version, is_eager=True,
                                                    help="print the rlhfc version and exit")) -> None:
    """rlhfc — a compiler for RLHF training jobs."""


def print_diagnostics(diags: list[Diagnostic], text: str | None = None) -> None:
    """Render diagnostics on stderr (with source lines when ``text`` is the file they point into)."""
    for d in diags:
        typer.echo(d.render(text), err=True)


def _usage_error_types() -> tuple[type, ...]:
    """The exception classes of click usage errors: typer ships its own click (``typer._click``, whose
    exceptions derive from ``typer.TyperException``); older typers use the ``click`` package."""
    types: list[type] = []
    if hasattr(typer, "TyperException"):
        types.append(typer.TyperException)
    try:
        import click

        types.append(click.ClickException)
    except ImportError:  # pragma: no cover - typer without click
        pass
    return tuple(types)


def _abort_types() -> tuple[type, ...]:
    types: list[type] = [typer.Abort]
    try:
        import click

        types.append(click.exceptions.Abort)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


def _usage_hint(argv: list[str]) -> str | None:
    """A hint for common slips the usage error alone does not explain."""
    for arg in argv:
        if re.fullmatch(r"-0[0-9]*", arg):   # -02: a zero where the letter O was meant
            return f"the optimisation level is -O{arg[2:] or 'N'} (the letter O), not {arg} (zero)"
    return None


#: the cases that exit 1: (the commands that may, None: any; the message's first lines, a regex on stderr)
#: — docs/language.md, "Exit status"
EXIT_1 = {
    "run failed": (("run",), r"^rlhfc: [a-z ]+: .+"),                          # a JobError of a run
    "file refused": (None, r"^rlhfc: error: .+: .+\n  hint: check the path"),  # an OSError naming a path
    "aborted": (None, r"^rlhfc: aborted$"),                                    # end of input at a prompt
}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit status: 0; 1 for one of :data:`EXIT_1` (a run that failed, a named file
    the system cannot read or write, input that ended at a prompt), each with its own message; 2 for compile
    and usage errors; 3 for internal errors; 130 when interrupted (a command's own ``SystemExit`` status passes
    through)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        # non-standalone: typer returns a command's typer.Exit code (130 for a Ctrl-C it caught)
        code = app(args=args, prog_name="rlhfc", standalone_mode=False)
    except CompileError as exc:
        print_diagnostics(exc.diagnostics, exc.source_text)
        if os.environ.get("RLHFC_DEBUG") and exc.__cause__ is not None:  # e.g. the traceback of a failing pass
            import traceback

            traceback.print_exception(exc.__cause__)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        typer.echo("rlhfc: interrupted", err=True)
        return 130
    except _abort_types():   # end of input at a prompt
        typer.echo("rlhfc: aborted", err=True)
        return 1
    except _usage_error_types() as exc:   # click usage errors: the usual "Usage: … Error: …", exit 2
        exc.show()
        hint = _usage_hint(args)
        if hint:
            typer.echo(f"  hint: {hint}", err=True)
        return int(getattr(exc, "exit_code", 2) or 2)
    except OSError as exc:
        if os.environ.get("RLHFC_DEBUG") or not exc.filename:   # no path named: not the user's file; a bug
            return _internal_error(exc)
        # the file system refused a path the command line named: an output path that is a folder, a full disk
        typer.echo(f"rlhfc: error: {exc.strerror or exc}: {exc.filename}\n"
                   "  hint: check the path (an output file's folder must exist), its permissions and free space",
                   err=True)
        return 1
    except Exception as exc:  # internal bugs
        return _internal_error(exc)
    if code == 130:   # typer turned a KeyboardInterrupt into Exit(130)
        typer.echo("rlhfc: interrupted", err=True)
    return code if isinstance(code, int) else 0


def _internal_error(exc: BaseException) -> int:
    """A bug: exit 3 with the error and how to get its traceback (``RLHFC_DEBUG=1`` raises it)."""
    if os.environ.get("RLHFC_DEBUG"):
        raise exc
    typer.echo(f"rlhfc: internal error: {type(exc).__name__}: {exc}\n"
               "  hint: rerun with RLHFC_DEBUG=1 for a traceback, and report it", err=True)
    return 3


def _entry() -> None:
    """Console-script entry point (``rlhfc = "rlhfc.cli:_entry"``)."""
    sys.exit(main())
