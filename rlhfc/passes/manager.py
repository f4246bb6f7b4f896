"""PassManager: run passes in order, verify after each, report which pass broke what."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

from rlhfc.ir import CompileError, Module, print_module, verify
from rlhfc.ir.diagnostics import Diagnostic

from .base import Pass, get_pass


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
    """A pass raised, or left IR the verifier rejects.

    The first diagnostic reads ``pass X failed after [A, B]: ...``; the verifier's
    diagnostics (or the pass's own CompileError diagnostics) follow.
    """


def _upstream(p, before: list) -> dict:
    """``{"upstream": before}`` if ``p.run_in_pipeline`` takes the passes that ran before it, else ``{}``."""
    import inspect

    return {"upstream": list(before)} if "upstream" in inspect.signature(p.run_in_pipeline).parameters else {}


def _print_to_stderr(spec: str, text: str) -> None:
    sys.stderr.write(f"// ----- IR after {spec} -----\n{text}")


@dataclass
class PassManager:
    """Runs ``passes`` in order on a module.

    ``verify_each``: verify the input and the IR after every pass (default; turn
    off only to debug a pass). ``print_after``: pass names after which the IR
    text goes to ``printer(spec, text)`` (``"*"``: after every pass; unknown
    names are an error). ``printer`` defaults to writing to stderr.
    ``records``: one :class:`PassRecord` per pass that ran. A pass with a ``run_in_pipeline(module,
    downstream)`` method is called that way instead, with the passes that follow it (the placement search
    prices each candidate plan as those passes will leave it), and with ``upstream=`` the passes before it
    when the method takes that argument.
    """

    passes: list[Pass]
    verify_each: bool = True
    print_after: set[str] = field(default_factory=set)
    printer: Callable[[str, str], None] | None = None
    records: list[PassRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in self.print_after:
            if name != "*":
                get_pass(name)  # raises "unknown pass" with a hint

    def run(self, module: Module) -> Module:
        done: list[str] = []
        if self.verify_each:
            try:
                verify(module)
            except CompileError as exc:
                raise PassFailure([Diagnostic("error", "the IR is invalid before the first pass", None,
                                              "fix the input program; the diagnostics below say where")]
                                  + exc.diagnostics, exc.source_text) from None
        text = print_module(module)
        printer = self.printer or _print_to_stderr
        for i, p in enumerate(self.passes):
            try:
                if hasattr(p, "run_in_pipeline"):   # a pass that plans for the passes after it (placement)
                    result = p.run_in_pipeline(module, self.passes[i + 1:], **_upstream(p, self.passes[:i]))
                else:
                    result = p.run(module)
                module = result if result is not None else module
            except CompileError as exc:
                head = Diagnostic("error", f"pass {p.spec()} failed after [{', '.join(done)}]", None, None)
                raise PassFailure([head] + exc.diagnostics, exc.source_text) from None
            except Exception as exc:  # a bug in the pass: say which one, keep the cause
                raise PassFailure([Diagnostic("error", f"pass {p.spec()} failed after [{', '.join(done)}]: "
                                              f"{type(exc).__name__}: {exc}", None,
                                              f"this is a bug in pass {p.name}; run it alone with "
                                              f"--passes {p.spec()} and RLHFC_DEBUG=1 for the traceback")]) from exc
            if self.verify_each:
                try:
                    verify(module)
                except CompileError as exc:
                    head = Diagnostic("error", f"pass {p.spec()} failed after [{', '.join(done)}]: "
                                      "it left invalid IR", None,
                                      f"the pass must leave valid IR; --print-after {p.name} --no-verify-each "
                                      "shows what it produced")
                    raise PassFailure([head] + exc.diagnostics) from None
                except Exception as exc:  # IR so malformed that the verifier itself trips over it
                    raise PassFailure([Diagnostic("error", f"pass {p.spec()} failed after [{', '.join(done)}]: "
                                                  f"it left malformed IR ({type(exc).__name__}: {exc})", None,
                                                  f"this is a bug in pass {p.name}: build stages from "
                                                  "Value/ValueType/Stage as documented in docs/ir.md")]) from exc
            after = print_module(module)
            self.records.append(PassRecord(p.spec(), text, after))
            if p.name in self.print_after or "*" in self.print_after:
                printer(p.spec(), after)
            text = after
            done.append(p.spec())
        return module
