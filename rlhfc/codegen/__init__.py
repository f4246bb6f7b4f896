"""Code generation: an optimised module → a runnable job folder.

``emit_job(module, out)`` writes ``main.py`` (readable driver), ``plan.json``
(what the compiler decided), ``ir.rlir`` (the optimised IR) and a copy of the
source program.
"""

from __future__ import annotations

import json
import os
import shutil

from rlhfc.ir import Module, print_module

from .emitter import PythonEmitter, py_name
from .plan import build_plan


def emit_job(module: Module, out: str, *, source_path: str | None = None, opt_level: str | None = None,
             passes: list[str] | None = None, emitter: type[PythonEmitter] = PythonEmitter,
             plugins: list[str] | tuple[str, ...] = ()) -> str:
    """Write the job folder ``out``; returns the path of its ``main.py``. ``plugins``: what the compiler
    imported with ``--plugin`` (the job imports them too)."""
    passes = passes or []
    os.makedirs(out, exist_ok=True)
    plan = build_plan(module, source=source_path, opt_level=opt_level, passes=passes, plugins=plugins)
    code = emitter(module, source=source_path, opt_level=opt_level, passes=passes).emit()
    main_py = os.path.join(out, "main.py")
    with open(main_py, "w", encoding="utf-8") as fh:
        fh.write(code)
    with open(os.path.join(out, "plan.json"), "w", encoding="utf-8") as fh:
        json.dump(plan.to_json(), fh, indent=1)
        fh.write("\n")
    with open(os.path.join(out, "ir.rlir"), "w", encoding="utf-8") as fh:
        fh.write(print_module(module))
    if source_path and os.path.isfile(source_path):
        shutil.copyfile(source_path, os.path.join(out, "source" + os.path.splitext(source_path)[1]))
    return main_py


__all__ = ["emit_job", "PythonEmitter", "py_name", "build_plan"]
