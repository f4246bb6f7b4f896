"""PassManager: run passes in order, verify after each, report which pass broke what."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rlhfc.ir import CompileError, Module, print_module, verify
from rlhfc.ir.diagnostics import Diagnostic

from .base import Pass


@dataclass
class PassRecord:
    """What one pass did: its spec, and the IR text before and after (for explain / print-after)."""

    spec: str
    before: str
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after


class PassFailure(CompileError):
    """A pass raised or left invalid IR."""


@dataclass
class PassManager:
    """Runs ``passes`` in order on a module.

    ``verify_each``: run the verifier after every pass (default; turn off only to debug a pass).
    ``print_after``: pass names after which to hand the IR text to ``printer`` (``"*"`` for all).
    """

    passes: list[Pass]
    verify_each: bool = True
    print_after: set[str] = field(default_factory=set)
    printer: Callable[[str, str], None] | None = None
    records: list[PassRecord] = field(default_factory=list)

    def run(self, module: Module) -> Module:
        done: list[str] = []
        text = print_module(module)
        for p in self.passes:
            try:
                result = p.run(module)
                module = result if result is not None else module
            except CompileError as exc:
                raise PassFailure(exc.diagnostics + [self._where(p, done)], exc.source_text) from None
            except Exception as exc:  # a bug in the pass: say which one, keep the cause
                raise PassFailure([Diagnostic("error", f"pass {p.name} failed after [{', '.join(done)}]: "
                                              f"{type(exc).__name__}: {exc}", None,
                                              "this is a bug in the pass; rerun with --passes to isolate it")]) from exc
            if self.verify_each:
                try:
                    verify(module)
                except CompileError as exc:
                    raise PassFailure(exc.diagnostics + [self._where(p, done, invalid=True)]) from None
            after = print_module(module)
            self.records.append(PassRecord(p.spec(), text, after))
            if self.printer and (p.name in self.print_after or "*" in self.print_after):
                self.printer(p.spec(), after)
            text = after
            done.append(p.spec())
        return module

    @staticmethod
    def _where(p: Pass, done: list[str], invalid: bool = False) -> Diagnostic:
        what = "left invalid IR" if invalid else "failed"
        return Diagnostic("note", f"pass {p.name} {what} after [{', '.join(done)}]", None,
                          "run with --print-after-all to see the IR after each pass" if invalid else None)
