"""The canonical text form of the IR (``.rlir``).

One module prints one way: stage attributes in their op's declared order,
model/cluster/run/data fields in a fixed order, annotation keys and graph
parameters sorted, version edges sorted by (model, reader position), floats
with Python's shortest round-tripping repr (``1.0``, ``1e-05``), strings
JSON-quoted. ``parse(print(m))`` rebuilds an equal module and
``print(parse(text)) == text`` for every printed text (the tests check both for
every example at every -O level and every golden file).

Comments (``// ...``) and whitespace are not part of the canonical form: the
parser skips them, and the printer writes one comment of its own, the derived
parameter count after each model.

Shape::

    module @name {
      cluster @local {device = "cpu", nodes = 1, per_node = 2}
      model @actor {arch = "llama", ..., head = "lm", trainable = true, init = "random", source = ""}  // 119K params
      data @prompts {kind = "synthetic", ...}
      run {steps = 50, seed = 0, checkpoint_every = 10, optimize = "O2"}
      graph @ppo {batch = 32} annot {...} {
        %roll = generate @actor(%prompts) {max_new_tokens = 48, ...} annot {...} : Rollout[32] loc("f.rlhf":14:3)
        version @actor %actor_train -> %roll [+1]
      }
    }
"""

from __future__ import annotations

import json
import math
import re

from .arch import human_count
from .core import Module, Stage, Symbol
from .diagnostics import Loc
from .ops import get_op

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def format_attr(value) -> str:
    """Print one attribute value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"attribute value {value} cannot be printed (not finite)")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Symbol):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    if isinstance(value, dict):
        return format_dict(value)
    raise TypeError(f"attribute value of type {type(value).__name__} cannot be printed: {value!r}")


def format_dict(d: dict, order: list[str] | None = None) -> str:
    keys = list(d)
    if order is not None:
        keys = [k for k in order if k in d] + sorted(k for k in d if k not in order)
    else:
        keys = sorted(keys)
    parts = []
    for k in keys:
        if not _KEY.match(k):
            raise ValueError(f"attribute key {k!r} is not an identifier")
        parts.append(f"{k} = {format_attr(d[k])}")
    return "{" + ", ".join(parts) + "}"


def format_loc(loc: Loc | None) -> str:
    return "" if loc is None else f" loc({json.dumps(loc.file)}:{loc.line}:{loc.col})"


def _annot(annotations: dict) -> str:
    return f" annot {format_dict(annotations)}" if annotations else ""


def format_stage(stage: Stage) -> str:
    spec = get_op(stage.op)
    order = [a.name for a in spec.attrs] if spec else None
    results = ", ".join(f"%{v.name}" for v in stage.outputs)
    target = f" @{stage.target}" if stage.target else ""
    args = ", ".join(f"%{v.name}" for v in stage.inputs)
    types = ", ".join(str(v.type) for v in stage.outputs)
    return (f"{results} = {stage.op}{target}({args}) {format_dict(stage.attrs, order)}"
            f"{_annot(stage.annotations)} : {types}{format_loc(stage.loc)}")


def _params_comment(m) -> str:
    """``  // 6.74B params``, or nothing when the architecture is invalid (the verifier says why)."""
    try:
        return f"  // {human_count(m.params)} params"
    except (TypeError, ValueError, ZeroDivisionError):
        return ""


def _version_order(module: Module):
    index = {s.name: i for i, s in enumerate(module.graph.stages) if s.outputs}

    def key(e):
        return (e.model, index.get(e.reader, len(index)), e.reader, e.writer, e.distance)

    return key


def print_module(module: Module) -> str:
    """The canonical text of a module (ends with a newline)."""
    out = [f"module @{module.name}{_annot(module.annotations)} {{"]
    c = module.cluster
    out.append(f"  cluster @{c.name} {format_dict(c.attrs(), list(c.attrs()))}{_annot(c.annotations)}{format_loc(c.loc)}")
    for m in module.models.values():
        attrs = m.attrs()
        out.append(f"  model @{m.name} {format_dict(attrs, list(attrs))}{_annot(m.annotations)}{format_loc(m.loc)}"
                   f"{_params_comment(m)}")
    for d in module.data.values():
        attrs = d.attrs()
        out.append(f"  data @{d.name} {format_dict(attrs, list(attrs))}{_annot(d.annotations)}{format_loc(d.loc)}")
    for t in module.tools.values():
        out.append(f"  {t.kind} @{t.name} {format_dict(t.attrs(), list(t.attrs()))}{format_loc(t.loc)}")
    r = module.run
    out.append(f"  run {format_dict(r.attrs(), list(r.attrs()))}{format_loc(r.loc)}")
    g = module.graph
    out.append(f"  graph @{g.name} {format_dict(g.params)}{_annot(g.annotations)}{format_loc(g.loc)} {{")
    for s in g.stages:
        out.append(f"    {format_stage(s)}")
    for e in sorted(g.versions, key=_version_order(module)):
        out.append(f"    version @{e.model} %{e.writer} -> %{e.reader} [{e.span}]")
    out.append("  }")
    out.append("}")
    return "\n".join(out) + "\n"
