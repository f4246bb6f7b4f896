"""The .rlhf frontend: lark grammar → typed AST → IR, with located diagnostics."""

from __future__ import annotations

import os

from rlhfc.ir import CompileError, Diagnostic, DiagnosticSink, Module, error, verify
from rlhfc.ir.diagnostics import Loc

from .lower import lower
from .parser import parse_program


def compile_source(text: str, file: str = "<input>") -> tuple[Module, list[Diagnostic]]:
    """Parse, lower and verify one program. Returns (module, warnings); raises CompileError."""
    program = parse_program(text, file)
    sink = DiagnosticSink(text)
    module = lower(program, sink)
    sink.raise_if_errors()
    try:
        verify(module)
    except CompileError as exc:
        exc.source_text = text   # so the diagnostics show the source line even for text not on disk
        raise
    return module, sink.warnings


def load_file(path: str) -> tuple[Module, list[Diagnostic], str]:
    """Read a ``.rlhf`` or ``.rlir`` file into a verified Module. Returns (module, warnings, text)."""
    from rlhfc.ir import parse_ir

    if not os.path.isfile(path):
        raise error(f"no such file: {path}", None, "check the path (it is relative to the current folder)")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}", None, "check the file's permissions") from None
    try:
        text = data.decode("utf-8-sig")   # a leading byte-order mark is not part of the program
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, data, exc) from None
    if path.endswith(".rlir"):
        module = parse_ir(text, path)
        verify(module)
        return module, [], text
    module, warnings = compile_source(text, path)
    return module, warnings, text


def _not_utf8(path: str, data: bytes, exc: UnicodeDecodeError) -> CompileError:
    """A located error for a byte that is not UTF-8 (the caret shows it as the replacement character)."""
    start = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
    before = data[:start]
    line = before.count(b"\n") + 1
    col = len(before[before.rfind(b"\n") + 1:].decode("utf-8", "replace")) + 1
    text = data.decode("utf-8", "replace")
    err = error(f"byte 0x{data[start]:02x} is not valid UTF-8", Loc(path, line, col),
                "save the program as UTF-8 text")
    err.source_text = text
    return err


__all__ = ["compile_source", "load_file", "parse_program", "lower"]
