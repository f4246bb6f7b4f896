"""The IR verifier: runs after lowering and after every pass.

Each message says what is wrong and how to fix it. Checks:
- cluster: known device kind, positive sizes;
- models: known architecture and head, consistent shapes, ``init`` names a model
  with the same architecture, no copy cycles;
- graph: unique SSA names, each value defined before use (so the graph is
  acyclic), ops known, operand count and types, attribute names/types/ranges,
  result types, model heads, ``train`` only on trainable models with a loss of
  the matching head, one train stage per model;
- parameter versions: exactly the edges the stage order implies;
- plus any checks registered by passes (:func:`register_check`), e.g. placement.
"""

from __future__ import annotations

from typing import Callable

from .arch import ARCH_FIELDS, ARCHS, HEADS
from .core import Module, Stage, Symbol, derive_versions
from .devices import DEVICE_MEMORY
from .diagnostics import CompileError, Diagnostic, DiagnosticSink, did_you_mean
from .ops import LOSS_FOR_HEAD, OpSpec, all_ops, get_op

_EXTRA_CHECKS: list[Callable[[Module, DiagnosticSink], None]] = []


def register_check(fn: Callable[[Module, DiagnosticSink], None]) -> Callable:
    """Add a check run by :func:`verify` (for annotations that passes introduce)."""
    if fn not in _EXTRA_CHECKS:
        _EXTRA_CHECKS.append(fn)
    return fn


class VerificationError(CompileError):
    """The IR is not valid; ``diagnostics`` say where and how to fix it."""


def verify(module: Module) -> None:
    """Raise :class:`VerificationError` if the module is invalid."""
    sink = DiagnosticSink()
    _check_cluster(module, sink)
    _check_models(module, sink)
    _check_data(module, sink)
    _check_graph(module, sink)
    for check in _EXTRA_CHECKS:
        check(module, sink)
    if sink.errors:
        raise VerificationError(sink.errors)


def check_attr_value(spec_attr, value) -> str | None:
    """Why ``value`` is not valid for attribute ``spec_attr``, or None."""
    kind = spec_attr.kind
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        return f"expects {'a' if kind != 'int' else 'an'} {kind}, got {_describe(value)}"
    if spec_attr.choices and value not in spec_attr.choices:
        return f"must be one of {', '.join(map(str, spec_attr.choices))}, got {value!r}"
    if spec_attr.min is not None and value < spec_attr.min:
        return f"must be >= {spec_attr.min}, got {value}"
    if spec_attr.max is not None and value > spec_attr.max:
        return f"must be <= {spec_attr.max}, got {value}"
    return None


def _describe(value) -> str:
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if isinstance(value, str):
        return f"string {value!r}"
    return f"{type(value).__name__} {value!r}"


def _check_cluster(module: Module, sink: DiagnosticSink) -> None:
    c = module.cluster
    if c.device not in DEVICE_MEMORY:
        sink.error(f"unknown device kind '{c.device}' in cluster @{c.name}", c.loc,
                   did_you_mean(c.device, DEVICE_MEMORY) or f"known kinds: {', '.join(DEVICE_MEMORY)}")
    if c.nodes < 1 or c.per_node < 1:
        sink.error(f"cluster @{c.name} needs at least one node and one device per node", c.loc)


def _check_models(module: Module, sink: DiagnosticSink) -> None:
    for m in module.models.values():
        where = f"model @{m.name}"
        if m.arch not in ARCHS:
            sink.error(f"{where}: unknown architecture '{m.arch}'", m.loc, f"architectures: {', '.join(ARCHS)}")
            continue
        if m.head not in HEADS:
            sink.error(f"{where}: unknown head '{m.head}'", m.loc, f"heads: {', '.join(HEADS)}")
        bad = [f for f in ARCH_FIELDS if not isinstance(getattr(m, f), int) or getattr(m, f) < 1]
        if bad:
            sink.error(f"{where}: '{bad[0]}' must be a positive integer", m.loc)
            continue
        if m.hidden % m.heads:
            sink.error(f"{where}: hidden ({m.hidden}) is not divisible by heads ({m.heads})", m.loc,
                       "choose heads so that hidden / heads is a whole head size")
        if m.heads % m.kv_heads:
            sink.error(f"{where}: heads ({m.heads}) is not divisible by kv_heads ({m.kv_heads})", m.loc,
                       "grouped-query attention needs heads to be a multiple of kv_heads")
        if isinstance(m.init, Symbol):
            src = module.models.get(m.init.name)
            if src is None:
                sink.error(f"{where} copies unknown model @{m.init.name}", m.loc)
            elif src.config() != m.config():
                sink.error(f"{where} copies @{src.name} but their architectures differ", m.loc,
                           "a copy must have the same layers/hidden/heads/ffn/vocab")
        elif m.init not in ("random", "pretrained"):
            sink.error(f"{where}: init must be \"random\", \"pretrained\" or @model, got {m.init!r}", m.loc)
        if m.init == "pretrained" and not m.source:
            sink.error(f"{where}: init \"pretrained\" needs a source folder", m.loc)
    # copy cycles
    for m in module.models.values():
        seen = {m.name}
        cur = m
        while isinstance(cur.init, Symbol) and cur.init.name in module.models:
            cur = module.models[cur.init.name]
            if cur.name in seen:
                sink.error(f"model @{m.name}: copy cycle through @{cur.name}", m.loc,
                           "one model in the chain must start from random or pretrained weights")
                break
            seen.add(cur.name)


def _check_data(module: Module, sink: DiagnosticSink) -> None:
    for d in module.data.values():
        if d.kind not in ("synthetic", "jsonl"):
            sink.error(f"data @{d.name}: unknown kind '{d.kind}'", d.loc, "kinds: synthetic, jsonl")


def _check_graph(module: Module, sink: DiagnosticSink) -> None:
    g = module.graph
    defined: set[int] = set()
    names: set[str] = set()
    trained: dict[str, Stage] = {}
    for stage in g.stages:
        where = f"stage %{stage.name if stage.outputs else '?'} ({stage.op})"
        if not stage.outputs:
            sink.error(f"{where} has no results", stage.loc, "every stage produces at least one value")
            continue
        for v in stage.inputs:
            if id(v) not in defined:
                sink.error(f"{where} uses %{v.name} before it is defined", stage.loc,
                           "stages must be listed in dependency order (the graph must be acyclic)")
        for v in stage.outputs:
            if v.name in names:
                sink.error(f"value %{v.name} is defined twice", stage.loc, "rename one of them")
            names.add(v.name)
            defined.add(id(v))
        spec = get_op(stage.op)
        if spec is None:
            sink.error(f"{where}: unknown op '{stage.op}'", stage.loc,
                       did_you_mean(stage.op, all_ops()) or "register custom ops with rlhfc.ir.register_op")
            continue
        _check_stage(module, stage, spec, where, sink)
        if spec.trains and stage.target:
            if stage.target in trained:
                sink.error(f"model @{stage.target} is trained by two stages (%{trained[stage.target].name}, "
                           f"%{stage.name})", stage.loc, "train each model once per step; use epochs/minibatches")
            trained[stage.target] = stage
    expected = derive_versions(g, module.trainable_models())
    have = set(g.versions)
    for e in expected:
        if e not in have:
            sink.error(f"missing parameter-version edge: %{e.reader} reads @{e.model} written by %{e.writer} "
                       f"{'one step earlier' if e.distance else 'this step'}", g.loc,
                       f"add `version @{e.model} %{e.writer} -> %{e.reader} [+{e.distance}]` "
                       "(or call Module.refresh_versions() in the pass)")
    for e in g.versions:
        if e not in expected:
            sink.error(f"stale parameter-version edge @{e.model} %{e.writer} -> %{e.reader} [+{e.distance}]",
                       g.loc, "remove it (or call Module.refresh_versions() in the pass)")


def _check_stage(module: Module, stage: Stage, spec: OpSpec, where: str, sink: DiagnosticSink) -> None:
    # target
    if spec.model == "model":
        model = module.models.get(stage.target or "")
        if model is None:
            sink.error(f"{where}: unknown model @{stage.target}", stage.loc)
            return
        if spec.head and model.head != spec.head:
            sink.error(f"{where}: model @{model.name} has a '{model.head}' head but {spec.op} needs '{spec.head}'",
                       stage.loc)
        if spec.trains:
            if not model.trainable:
                sink.error(f"{where}: model @{model.name} is frozen", stage.loc, "mark the model trainable")
            want = LOSS_FOR_HEAD.get(model.head)
            if stage.inputs and want and stage.inputs[0].type.kind != want:
                sink.error(f"{where}: a {stage.inputs[0].type.kind} cannot train @{model.name} "
                           f"(a '{model.head}' head needs a {want})", stage.loc)
            if want is None:
                sink.error(f"{where}: models with a '{model.head}' head cannot be trained here", stage.loc)
    elif spec.model == "data":
        if stage.target not in module.data:
            sink.error(f"{where}: unknown data source @{stage.target}", stage.loc)
    elif stage.target is not None:
        sink.error(f"{where}: {spec.op} takes no model", stage.loc)
    # operands
    n = len(stage.inputs)
    if not spec.min_operands() <= n <= len(spec.operands):
        sink.error(f"{where}: expects {_count(spec)} operands, got {n}", stage.loc)
        return
    for operand, v in zip(spec.operands, stage.inputs):
        if v.type.kind not in operand.kinds:
            sink.error(f"{where}: operand '{operand.name}' must be {' or '.join(operand.kinds)}, "
                       f"got %{v.name} : {v.type}", stage.loc)
    batches = {v.type.batch for v in stage.inputs if v.type.batch is not None}
    if len(batches) > 1 and spec.op != "train":
        sink.error(f"{where}: operands have different batch sizes {sorted(batches)}", stage.loc,
                   "all per-sample inputs must come from the same rollout")
    # attributes
    for key in stage.attrs:
        if spec.attr(key) is None:
            sink.error(f"{where}: unknown attribute '{key}'", stage.loc,
                       did_you_mean(key, [a.name for a in spec.attrs]) or
                       f"attributes: {', '.join(a.name for a in spec.attrs) or 'none'}")
    for a in spec.attrs:
        if a.name not in stage.attrs:
            sink.error(f"{where}: missing attribute '{a.name}'", stage.loc)
            continue
        why = check_attr_value(a, stage.attrs[a.name])
        if why:
            sink.error(f"{where}: attribute '{a.name}' {why}", stage.loc)
    # results
    if len(stage.outputs) != len(spec.results):
        sink.error(f"{where}: {spec.op} has {len(spec.results)} results, got {len(stage.outputs)}", stage.loc)
        return
    try:
        want_types = spec.result_types([v.type for v in stage.inputs], stage.attrs)
    except (KeyError, TypeError, ValueError):
        return
    for v, t in zip(stage.outputs, want_types):
        if v.type != t:
            sink.error(f"{where}: result %{v.name} has type {v.type}, expected {t}", stage.loc)


def _count(spec: OpSpec) -> str:
    lo, hi = spec.min_operands(), len(spec.operands)
    return str(lo) if lo == hi else f"{lo} to {hi}"


__all__ = ["verify", "register_check", "VerificationError", "check_attr_value", "Diagnostic"]
