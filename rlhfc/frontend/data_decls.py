"""Lowering of the data declarations: ``synthetic(...)``, ``jsonl(...)``, ``parquet(...)`` and ``arrow(...)`` to
IR data sources.

A file source's options: ``field`` (written ``prompt = "question"`` or ``field = "question"``: the JSON key of
the prompt), ``fields = [answer, tests]`` (other keys each line carries, which travel with the prompt's
samples to the rules that name them) and ``truncate = error | left | right`` (what the job does with a
prompt too long for a model: stop, or drop its first or last tokens).
"""

from __future__ import annotations

import os

from rlhfc.ir.core import DataSource
from rlhfc.ir.diagnostics import DiagnosticSink, did_you_mean
from rlhfc.ir.verify_fields import RESERVED_FIELDS, check_data

from . import ast
from .files import read_prompts
from .literals import value_of

#: the IR options jsonl() takes (``prompt = "..."`` is ``field``)
_JSONL_SETTINGS = ("field", "fields", "truncate")


def lower_synthetic(d: ast.DataDecl, sink: DiagnosticSink) -> DataSource | None:
    """``synthetic(count = ..., ...)``: the source with its defaults and the program's settings."""
    c = d.ctor
    src = DataSource(d.name, "synthetic", {"count": 1024, "min_len": 4, "max_len": 16, "seed": 0}, d.loc,
                     field_locs={"kind": c.name_loc})
    if c.args:
        sink.error("synthetic() takes keyword arguments", getattr(c.args[0], "loc", c.loc),
                   "e.g. synthetic(count = 4096, min_len = 4, max_len = 16)")
        return None
    for kw in c.kwargs:
        if kw.name not in src.options:
            sink.error(f"unknown synthetic setting '{kw.name}'", kw.loc,
                       did_you_mean(kw.name, src.options) or f"settings: {', '.join(src.options)}")
            return None
        if kw.name in src.field_locs:
            sink.error(f"'{kw.name}' given twice", kw.loc, "remove one")
            continue
        src.options[kw.name] = value_of(kw.value)
        src.field_locs[kw.name] = kw.value.loc
    return src


def lower_jsonl(d: ast.DataDecl, base_dir: str, prompt_lengths: dict, sink: DiagnosticSink) -> DataSource | None:
    """``jsonl("file", prompt = "key", fields = [...], truncate = ...)`` (and ``parquet(...)``, ``arrow(...)``,
    whose tables the job reads); a JSONL file is read now when small (a
    line without the prompt or a declared field is reported at the path); the longest prompt goes to
    ``prompt_lengths`` unless prompts are truncated to fit."""
    c = d.ctor
    kind = c.name   # jsonl, parquet or arrow: the same settings
    if len(c.args) != 1 or not isinstance(c.args[0], ast.Literal) or c.args[0].kind != "str":
        sink.error(f"{kind}() takes a file path", c.loc, f'e.g. {kind}("prompts.{kind}", field = "prompt")')
        return None
    lit = c.args[0]
    path = os.path.normpath(os.path.join(base_dir, lit.value))
    src = DataSource(d.name, kind, {"path": path, "field": "prompt"}, d.loc,
                     field_locs={"kind": c.name_loc, "path": lit.loc})
    for kw in c.kwargs:
        key = "field" if kw.name == "prompt" else kw.name   # prompt = "question": the prompt's JSON key
        if key not in _JSONL_SETTINGS:
            sink.error(f"unknown {kind} setting '{kw.name}'", kw.loc,
                       did_you_mean(kw.name, ("prompt", *_JSONL_SETTINGS)) or
                       "settings: prompt (or field), fields, truncate")
            return None
        if key in src.field_locs:
            sink.error(f"'{kw.name}' given twice", kw.loc, "remove one (prompt and field are one setting)")
            continue
        src.options[key] = value_of(kw.value)
        src.field_locs[key] = kw.value.loc
    if not os.path.isfile(path):
        sink.error(f"data file '{lit.value}' not found", lit.loc,
                   f"looked for {path}; paths are relative to the program's folder")
        check_data(src, sink)   # so that a bad field is reported too
        return None
    fields = src.options.get("fields", [])
    if kind != "jsonl":   # a table is read when the job starts (with the datasets library)
        return src
    if isinstance(src.options["field"], str) and isinstance(fields, list) and all(
            isinstance(x, str) and x.isidentifier() and x not in RESERVED_FIELDS for x in fields):
        # (else the verifier reports the field or the names)
        longest, problem = read_prompts(path, lit.value, src.options["field"], fields)
        if problem is not None:
            sink.error(problem[0], lit.loc, problem[1])
            return None
        if longest is not None and src.options.get("truncate", "error") == "error":
            prompt_lengths[d.name] = longest
    return src


__all__ = ["lower_synthetic", "lower_jsonl"]
