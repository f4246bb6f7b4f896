"""The .rlhf frontend: lark grammar → typed AST → IR, with located diagnostics."""

from __future__ import annotations

import os

from rlhfc.ir import CompileError, Diagnostic, DiagnosticSink, Module, error, verify

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
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}", None) from None
    if path.endswith(".rlir"):
        module = parse_ir(text, path)
        verify(module)
        return module, [], text
    module, warnings = compile_source(text, path)
    return module, warnings, text


__all__ = ["compile_source", "load_file", "parse_program", "lower"]
