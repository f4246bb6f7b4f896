"""Turn lark's parse errors into diagnostics with a location and a readable expectation."""

from __future__ import annotations

from lark import Lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from .diagnostics import Diagnostic, Loc

#: how terminals read in a message
_PRETTY = {
    "NAME": "a name", "INT": "an integer", "FLOAT": "a number", "SIZE": "a size (e.g. 7B)",
    "STRING": "a string", "ESCAPED_STRING": "a string", "SYMBOL": "@name", "VALUE": "%name",
    "OPNAME": "an op name", "TYPE": "a type", "KEY": "a key", "DISTANCE": "+N",
    "$END": "end of file",
}


def _terminal_text(parser: Lark, name: str) -> str:
    if name in _PRETTY:
        return _PRETTY[name]
    for t in parser.terminals:
        if t.name == name and t.pattern.type == "str":
            return f"'{t.pattern.value}'"
    return name.lower()


def _expected(parser: Lark, names) -> str:
    texts = sorted({_terminal_text(parser, n) for n in names})
    if len(texts) > 6:
        texts = texts[:6] + ["…"]
    return ", ".join(texts)


def syntax_diagnostic(exc: UnexpectedInput, parser: Lark, file: str, text: str) -> Diagnostic:
    """A diagnostic for a lark syntax error (line/col from the exception)."""
    line = getattr(exc, "line", None) or 1
    col = getattr(exc, "column", None) or 1
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        lines = text.splitlines() or [""]
        line, col = len(lines), len(lines[-1]) + 1
        expected = getattr(exc, "accepts", None) or getattr(exc, "expected", None) or []
        return Diagnostic("error", "unexpected end of file", Loc(file, line, col),
                          f"expected {_expected(parser, expected)}" if expected else "the program ends early")
    if isinstance(exc, UnexpectedCharacters):
        ch = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else "?"
        allowed = exc.allowed or set()
        hint = f"expected {_expected(parser, allowed)}" if allowed else None
        return Diagnostic("error", f"unexpected character {ch!r}", Loc(file, line, col), hint)
    if isinstance(exc, UnexpectedToken):
        tok = exc.token
        shown = str(tok).replace("\n", "\\n")
        expected = exc.accepts or exc.expected
        return Diagnostic("error", f"unexpected {shown!r}", Loc(file, line, col),
                          f"expected {_expected(parser, expected)}")
    return Diagnostic("error", "syntax error", Loc(file, line, col), None)
