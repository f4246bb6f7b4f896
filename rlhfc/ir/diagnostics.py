"""Source locations and diagnostics shared by every stage of the compiler.

A diagnostic prints as ``file:line:col: error: message``, then the source line
with a caret under the column, then ``hint: ...``. Columns and lines are
1-based. The CLI turns a :class:`CompileError` into that text and exit code 2;
nothing a user writes should ever surface as a Python traceback.

:func:`where` says where to point a diagnostic about an IR entity or one of
its fields (the entities' ``loc``, ``ir_loc`` and ``field_locs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Loc:
    """A position in a source file (``.rlhf`` or ``.rlir``); 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    """One message for the user. ``severity`` is ``error``, ``warning`` or ``note``."""

    severity: str
    message: str
    loc: Loc | None = None
    hint: str | None = None

    def render(self, source_text: str | None = None) -> str:
        """Format as ``file:line:col: severity: message`` + source line + caret + hint."""
        where = f"{self.loc}: " if self.loc else "rlhfc: "
        lines = [f"{where}{self.severity}: {self.message}"]
        text = source_text if source_text is not None else _read_source(self.loc)
        if self.loc is not None and text is not None:
            src_lines = text.splitlines()
            if 1 <= self.loc.line <= len(src_lines):
                src = src_lines[self.loc.line - 1].expandtabs(1)
                lines.append(f"  {src}")
                lines.append("  " + " " * max(self.loc.col - 1, 0) + "^")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def _read_source(loc: Loc | None) -> str | None:
    if loc is None or not os.path.isfile(loc.file):
        return None
    try:
        with open(loc.file, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError):
        return None


@dataclass
class CompileError(Exception):
    """Raised with one or more error diagnostics; the CLI prints them and exits 2."""

    diagnostics: list[Diagnostic] = field(default_factory=list)
    source_text: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render(self.source_text) for d in self.diagnostics)

    def __str__(self) -> str:
        return self.render()


def error(message: str, loc: Loc | None = None, hint: str | None = None) -> CompileError:
    """Shorthand: a CompileError holding one error diagnostic."""
    return CompileError([Diagnostic("error", message, loc, hint)])


class DiagnosticSink:
    """Collects diagnostics while a stage of the compiler runs; raises once at the end.

    Collecting (rather than failing at the first problem) lets a user fix several
    mistakes per edit, like any compiler.
    """

    def __init__(self, source_text: str | None = None) -> None:
        self.diagnostics: list[Diagnostic] = []
        self.source_text = source_text

    def error(self, message: str, loc: Loc | None = None, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic("error", message, loc, hint))

    def warning(self, message: str, loc: Loc | None = None, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic("warning", message, loc, hint))

    @property
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    @property
    def warnings(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "warning"]

    def raise_if_errors(self) -> None:
        if self.errors:
            raise CompileError(sorted(self.errors, key=_loc_key), self.source_text)


def _loc_key(d: Diagnostic) -> tuple:
    if d.loc is None:
        return ("", 0, 0)
    return (d.loc.file, d.loc.line, d.loc.col)


def field_loc(entity, *fields: str) -> Loc | None:
    """The position of the first of ``fields`` of ``entity`` that has one, or None.

    Positions in the ``.rlir`` text win: an entity parsed from one only uses field positions in that file."""
    locs = getattr(entity, "field_locs", None) or {}
    ir = getattr(entity, "ir_loc", None)
    for name in fields:
        loc = locs.get(name)
        if loc is not None and (ir is None or loc.file == ir.file):
            return loc
    return None


def where(entity, *fields: str) -> Loc | None:
    """Where to point a diagnostic about ``entity`` (or about one of its ``fields``): the field's position if
    known (:func:`field_loc`), else the entity's ``.rlir`` position if parsed from one, else its source."""
    return field_loc(entity, *fields) or getattr(entity, "ir_loc", None) or getattr(entity, "loc", None)



def did_you_mean(word: str, choices) -> str | None:
    """A 'did you mean X?' hint for a misspelt name, or None."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
