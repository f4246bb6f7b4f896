"""The IR verifier: runs after lowering, after parsing ``.rlir`` and after every pass.

Every message says what is wrong *and* carries a hint saying how to fix it. A
diagnostic points at the entity's position in the ``.rlir`` text when the
module was parsed from one, else at its ``.rlhf`` source location. Checks:

- cluster: known device kind, positive integer sizes;
- models: known architecture and head, positive integer shapes that divide
  (hidden by heads, heads by kv_heads), boolean ``trainable``, ``init`` naming
  ``random``/``pretrained``/a model of the same architecture, no copy cycles;
- data sources: known kind, known options of the right type;
- run settings: types and ranges, a known -O level;
- graph: unique SSA names; every operand is the very Value its producer
  defines, defined above its use (so the graph is acyclic); ops known; target
  model/data; operand count, types and batch sizes; attribute names, types
  (``float`` attributes hold Python floats, so the text form is unique) and
  ranges; result count and types; model heads; ``train`` only on trainable
  models with a loss of the matching head; one train stage per model;
- parameter versions: exactly the edges the stage order implies (none missing,
  none stale, no duplicates);
- the plan annotations passes write (docs/ir.md, "Annotations"): a stage's
  ``mesh`` lies on the cluster, its ``parallel`` layout multiplies to the mesh
  size (and tp divides the heads, pp the layers), ``microbatches``,
  ``recompute``, ``overlap``, ``stream`` and ``overcommit`` have their forms,
  the module's ``strategy`` is known;
- plus checks registered by passes (:func:`register_check`), e.g. for the
  annotations they add.
"""

from __future__ import annotations

import math

from typing import Callable

from .arch import ARCH_FIELDS, ARCHS, HEADS
from .core import DATA_OPTIONS, Module, Stage, Symbol, Value, derive_versions
from .devices import DEVICE_MEMORY
from .diagnostics import CompileError, Diagnostic, DiagnosticSink, Loc, did_you_mean
from .ops import LOSS_FOR_HEAD, OpSpec, all_ops, get_op
from .plan import OPT_LEVELS, PLACEMENTS, verify_plan
from .plan import describe as _describe
from .types import ValueType

_EXTRA_CHECKS: list[Callable[[Module, DiagnosticSink], None]] = []

#: which stage produces each value type (for hints)
PRODUCERS = {
    "Prompts": "load @data", "Rollout": "generate", "TokenFloat": "forward.logprobs / forward.values / compute.*",
    "SeqFloat": "forward.score or compute.rule", "PolicyLoss": "compute.ppo_clip",
    "ValueLoss": "compute.value_loss", "Metrics": "train",
}


def register_check(fn: Callable[[Module, DiagnosticSink], None]) -> Callable:
    """Add a check run by :func:`verify` (for annotations that passes introduce).

    ``fn(module, sink)`` reports problems with ``sink.error(message, loc, hint)``;
    use :func:`where` for the location of an entity.
    """
    if fn not in _EXTRA_CHECKS:
        _EXTRA_CHECKS.append(fn)
    return fn


class VerificationError(CompileError):
    """The IR is not valid; ``diagnostics`` say where and how to fix it."""


def verify(module: Module) -> None:
    """Raise :class:`VerificationError` listing every problem if the module is invalid."""
    sink = DiagnosticSink()
    _check_cluster(module, sink)
    _check_models(module, sink)
    _check_data(module, sink)
    _check_run(module, sink)
    _check_graph(module, sink)
    verify_plan(module, sink)
    for check in _EXTRA_CHECKS:
        check(module, sink)
    if sink.errors:
        raise VerificationError(sink.errors)


def where(entity) -> Loc | None:
    """Where to point a diagnostic about ``entity``: its ``.rlir`` position if parsed from one, else its source."""
    return getattr(entity, "ir_loc", None) or getattr(entity, "loc", None)


def check_attr_value(spec_attr, value) -> str | None:
    """Why ``value`` is not valid for attribute ``spec_attr``, or None."""
    kind = spec_attr.kind
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, float) and math.isfinite(value),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok:
        return f"expects {'an' if kind == 'int' else 'a'} {kind}, got {_describe(value)}"
    if spec_attr.choices and value not in spec_attr.choices:
        return f"must be one of {', '.join(map(str, spec_attr.choices))}, got {value!r}"
    if spec_attr.min is not None and value < spec_attr.min:
        return f"must be >= {spec_attr.min}, got {value}"
    if spec_attr.max is not None and value > spec_attr.max:
        return f"must be <= {spec_attr.max}, got {value}"
    return None


def _attr_hint(spec_attr, value) -> str:
    if spec_attr.kind == "float" and isinstance(value, int) and not isinstance(value, bool):
        return f"write it as a float: {spec_attr.name} = {float(value)!r}"
    if spec_attr.choices:
        return f"{spec_attr.name} is one of {', '.join(map(str, spec_attr.choices))}"
    parts = [f"{spec_attr.name}: {spec_attr.kind}"]
    if spec_attr.min is not None:
        parts.append(f">= {spec_attr.min}")
    if spec_attr.max is not None:
        parts.append(f"<= {spec_attr.max}")
    if spec_attr.doc:
        parts.append(f"({spec_attr.doc})")
    return " ".join(parts)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_cluster(module: Module, sink: DiagnosticSink) -> None:
    c = module.cluster
    if c.device not in DEVICE_MEMORY:
        close = did_you_mean(str(c.device), DEVICE_MEMORY)
        sink.error(f"unknown device kind '{c.device}' in cluster @{c.name}", where(c),
                   (close + " " if close else "") + f"known kinds: {', '.join(DEVICE_MEMORY)}")
    for key in ("nodes", "per_node"):
        value = getattr(c, key)
        if not _is_int(value) or value < 1:
            sink.error(f"cluster @{c.name}: {key} must be a positive integer, got {_describe(value)}", where(c),
                       f"set {key} = 1 or more")


def _check_models(module: Module, sink: DiagnosticSink) -> None:
    for m in module.models.values():
        at = where(m)
        name = f"model @{m.name}"
        if m.arch not in ARCHS:
            sink.error(f"{name}: unknown architecture '{m.arch}'", at,
                       (did_you_mean(str(m.arch), ARCHS) or "") + f" architectures: {', '.join(ARCHS)}")
            continue
        if m.head not in HEADS:
            sink.error(f"{name}: unknown head '{m.head}'", at,
                       "heads: lm (policy), value (critic), score (reward model)")
        if not isinstance(m.trainable, bool):
            sink.error(f"{name}: trainable must be true or false, got {_describe(m.trainable)}", at,
                       "write trainable = true or trainable = false")
        if not isinstance(m.source, str):
            sink.error(f"{name}: source must be a string, got {_describe(m.source)}", at,
                       'write source = "" for config-built models')
        bad = [f for f in ARCH_FIELDS if not _is_int(getattr(m, f)) or getattr(m, f) < 1]
        if bad:
            sink.error(f"{name}: '{bad[0]}' must be a positive integer, got {_describe(getattr(m, bad[0]))}", at,
                       f"give {bad[0]} as a whole number >= 1")
            continue
        if m.hidden % m.heads:
            sink.error(f"{name}: hidden ({m.hidden}) is not divisible by heads ({m.heads})", at,
                       "choose heads so that hidden / heads is a whole head size")
        if m.arch == "gpt2" and m.kv_heads != m.heads:
            sink.error(f"{where}: gpt2 has no grouped-query attention (kv_heads {m.kv_heads} != heads {m.heads})",
                       m.loc, "drop kv_heads for gpt2 models, or use llama")
        if m.heads % m.kv_heads:
            sink.error(f"{name}: heads ({m.heads}) is not divisible by kv_heads ({m.kv_heads})", at,
                       "grouped-query attention needs heads to be a multiple of kv_heads")
        if isinstance(m.init, Symbol):
            src = module.models.get(m.init.name)
            if src is None:
                sink.error(f"{name} copies unknown model @{m.init.name}", at,
                           did_you_mean(m.init.name, module.models) or
                           f"models: {', '.join('@' + n for n in module.models)}")
            elif src.config() != m.config():
                diff = [k for k, v in m.config().items() if src.config()[k] != v]
                sink.error(f"{name} copies @{src.name} but their architectures differ ({', '.join(diff)})", at,
                           f"a copy must have the same {', '.join(('arch',) + ARCH_FIELDS)}; use init = \"random\" "
                           "for a model of another shape")
        elif m.init not in ("random", "pretrained"):
            sink.error(f"{name}: init must be \"random\", \"pretrained\" or @model, got {_describe(m.init)}", at,
                       'write init = "random", init = "pretrained" (with a source folder) or init = @actor')
        if m.init == "pretrained" and not m.source:
            sink.error(f"{name}: init \"pretrained\" needs a source folder", at,
                       'set source = "path/to/hf_folder", or use init = "random"')
    # copy cycles: report each cycle once, at its first model in declaration order
    reported: set[str] = set()
    for m in module.models.values():
        chain = [m.name]
        cur = m
        while isinstance(cur.init, Symbol) and cur.init.name in module.models:
            cur = module.models[cur.init.name]
            if cur.name in chain:
                cycle = chain[chain.index(cur.name):]
                if not reported.intersection(cycle):
                    sink.error(f"model @{m.name}: copy cycle " + " -> ".join("@" + n for n in cycle + [cur.name]),
                               where(m), "one model in the chain must start from init = \"random\" or \"pretrained\"")
                reported.update(cycle)
                break
            chain.append(cur.name)


def _check_data(module: Module, sink: DiagnosticSink) -> None:
    for d in module.data.values():
        known = DATA_OPTIONS.get(d.kind)
        if known is None:
            sink.error(f"data @{d.name}: unknown kind '{d.kind}'", where(d), f"kinds: {', '.join(DATA_OPTIONS)}")
            continue
        for key, value in d.options.items():
            if key not in known:
                sink.error(f"data @{d.name}: unknown {d.kind} option '{key}'", where(d),
                           did_you_mean(key, known) or f"{d.kind} options: {', '.join(known)}")
            elif not isinstance(value, known[key]) or isinstance(value, bool):
                sink.error(f"data @{d.name}: option '{key}' expects {known[key].__name__}, got {_describe(value)}",
                           where(d), f"write {key} as {'a whole number' if known[key] is int else 'a string'}")


def _check_run(module: Module, sink: DiagnosticSink) -> None:
    r = module.run
    for key, lo in (("steps", 1), ("seed", 0), ("checkpoint_every", 0)):
        value = getattr(r, key)
        if not _is_int(value) or value < lo:
            sink.error(f"run setting {key} must be an integer >= {lo}, got {_describe(value)}", where(r),
                       f"write {key} = {max(lo, 1) if key == 'steps' else lo} or more")
    if r.placement not in PLACEMENTS:
        sink.error(f"run setting placement must be {', '.join(PLACEMENTS[:-1])} or {PLACEMENTS[-1]}, got "
                   f"{_describe(r.placement)}", where(r), 'e.g. placement = "interleave"')
    if r.optimize not in OPT_LEVELS:
        sink.error(f"run setting optimize must name an -O level, got {_describe(r.optimize)}", where(r),
                   f"levels: {', '.join(OPT_LEVELS)}")


def _check_graph(module: Module, sink: DiagnosticSink) -> None:
    g = module.graph
    defined: set[int] = set()
    names: dict[str, object] = {}
    trained: dict[str, Stage] = {}
    for stage in g.stages:
        at = where(stage)
        if not stage.outputs:
            sink.error(f"a {stage.op} stage has no results", at,
                       "every stage produces at least one value (train stages produce Metrics)")
            continue
        bad = [v for v in stage.inputs + stage.outputs if not isinstance(v, Value) or not isinstance(v.type, ValueType)]
        if bad:
            sink.error(f"a {stage.op} stage has an operand or result that is not a typed Value: {bad[0]!r}", at,
                       "operands are the producers' Value objects; results are new Value(name, ValueType(...))")
            continue
        label = f"stage %{stage.name} ({stage.op})"
        for v in stage.inputs:
            if id(v) in defined:
                continue
            if v.name in names:
                sink.error(f"{label} uses a Value object %{v.name} that is not the one its producer defines", at,
                           "pass the producer's output object (graph.values()[name]), not a new Value with the same "
                           "name; Graph.replace_all_uses() rewires uses")
            else:
                sink.error(f"{label} uses %{v.name} before it is defined", at,
                           "list stages in dependency order: move the stage that defines "
                           f"%{v.name} above this one (the graph must be acyclic)")
        for v in stage.outputs:
            if v.name in names:
                sink.error(f"value %{v.name} is defined twice", at,
                           f"SSA values are defined once; rename one (Graph.fresh_name('{v.name}') gives a free name)")
            names[v.name] = v
            defined.add(id(v))
        spec = get_op(stage.op)
        if spec is None:
            close = did_you_mean(stage.op, all_ops())
            sink.error(f"{label}: unknown op '{stage.op}'", at,
                       (close + " " if close else "") +
                       "ops: " + ", ".join(sorted(all_ops())) + "; register new ops with rlhfc.ir.register_op")
            continue
        _check_stage(module, stage, spec, label, sink)
        if spec.trains and stage.target:
            if stage.target in trained:
                sink.error(f"model @{stage.target} is trained by two stages (%{trained[stage.target].name}, "
                           f"%{stage.name})", at, "train each model once per step; use epochs/minibatches for more "
                           "updates")
            trained[stage.target] = stage
    _check_versions(module, sink)


def _check_versions(module: Module, sink: DiagnosticSink) -> None:
    g = module.graph
    expected = derive_versions(g, module.trainable_models())
    have = set(g.versions)
    at = where(g)
    for e in expected:
        if e not in have:
            when = "the previous step" if e.distance else "this step"
            sink.error(f"missing parameter-version edge: %{e.reader} reads the @{e.model} weights %{e.writer} "
                       f"wrote {when}", at,
                       f"add `version @{e.model} %{e.writer} -> %{e.reader} [+{e.distance}]` "
                       "(a pass that moves, adds or removes stages calls Module.refresh_versions())")
    for e in g.versions:
        if e not in expected:
            sink.error(f"stale parameter-version edge @{e.model} %{e.writer} -> %{e.reader} [+{e.distance}]: "
                       f"{_why_stale(module, e)}", at,
                       "remove it (a pass that moves, adds or removes stages calls Module.refresh_versions())")
    seen: set = set()
    for e in g.versions:
        if e in seen:
            sink.error(f"parameter-version edge @{e.model} %{e.writer} -> %{e.reader} [+{e.distance}] is listed twice",
                       at, "remove the duplicate")
        seen.add(e)


def _why_stale(module: Module, e) -> str:
    g = module.graph
    stages = {s.name: s for s in g.stages if s.outputs}
    if e.writer not in stages:
        return f"no stage %{e.writer}"
    if e.reader not in stages:
        return f"no stage %{e.reader}"
    writer, reader = stages[e.writer], stages[e.reader]
    if writer.op != "train" or writer.target != e.model:
        return f"%{e.writer} does not train @{e.model}"
    if e.model not in module.trainable_models():
        return f"@{e.model} is not trainable"
    if reader.target != e.model:
        return f"%{e.reader} does not read @{e.model}"
    right = 1 if g.stages.index(reader) < g.stages.index(writer) else 0
    if right != e.distance:
        return f"%{e.reader} runs {'before' if right else 'after'} %{e.writer}, so the distance is +{right}"
    return "the stage order does not imply it"


def _check_stage(module: Module, stage: Stage, spec: OpSpec, label: str, sink: DiagnosticSink) -> None:
    at = where(stage)
    # target
    if spec.model == "model":
        model = module.models.get(stage.target or "")
        if model is None:
            close = did_you_mean(stage.target or "", module.models)
            sink.error(f"{label}: unknown model @{stage.target}" if stage.target else f"{label}: needs a model", at,
                       (close + " " if close else "") + f"models: {', '.join('@' + n for n in module.models)}")
            return
        if spec.head and model.head != spec.head:
            sink.error(f"{label}: model @{model.name} has a '{model.head}' head but {spec.op} needs '{spec.head}'",
                       at, f"call {spec.op} on a model with head = \"{spec.head}\"")
        if spec.trains:
            if not model.trainable:
                sink.error(f"{label}: model @{model.name} is frozen and cannot be trained", at,
                           f"mark it trainable (model @{model.name} {{..., trainable = true}}) or remove the train "
                           "stage")
            want = LOSS_FOR_HEAD.get(model.head)
            if want is None:
                sink.error(f"{label}: models with a '{model.head}' head cannot be trained", at,
                           "train the policy (lm head, on compute.ppo_clip) or a critic (value head, on "
                           "compute.value_loss)")
            elif stage.inputs and stage.inputs[0].type.kind in LOSS_FOR_HEAD.values() \
                    and stage.inputs[0].type.kind != want:
                sink.error(f"{label}: a {stage.inputs[0].type.kind} cannot train @{model.name} "
                           f"(a '{model.head}' head needs a {want})", at,
                           f"train @{model.name} on the result of {PRODUCERS[want]}")
    elif spec.model == "data":
        if stage.target not in module.data:
            sink.error(f"{label}: unknown data source @{stage.target}", at,
                       f"data sources: {', '.join('@' + n for n in module.data) or 'none (declare one)'}")
    elif stage.target is not None:
        sink.error(f"{label}: {spec.op} takes no model, got @{stage.target}", at,
                   f"write it without a target: {spec.op}(...)")
    # operands
    n = len(stage.inputs)
    if not spec.min_operands() <= n <= len(spec.operands):
        sink.error(f"{label}: expects {_count(spec)} operands, got {n}", at,
                   f"operands: ({_signature(spec)})")
        return
    for operand, v in zip(spec.operands, stage.inputs):
        if v.type.kind not in operand.kinds:
            sink.error(f"{label}: operand '{operand.name}' must be {' or '.join(operand.kinds)}, "
                       f"got %{v.name} : {v.type}", at,
                       "; ".join(f"a {k} comes from {PRODUCERS.get(k, '?')}" for k in operand.kinds))
    batches = {v.type.batch for v in stage.inputs if v.type.batch is not None}
    if len(batches) > 1 and spec.op != "train":
        sink.error(f"{label}: operands have different batch sizes {sorted(batches)}", at,
                   "all per-sample inputs must come from the same rollout")
    # attributes
    for key in stage.attrs:
        if spec.attr(key) is None:
            close = did_you_mean(key, [a.name for a in spec.attrs])
            sink.error(f"{label}: unknown attribute '{key}'", at,
                       (close + " " if close else "") +
                       f"{spec.op} attributes: {', '.join(a.name for a in spec.attrs) or 'none'}; "
                       "put pass decisions in annotations (annot {...})")
    for a in spec.attrs:
        if a.name not in stage.attrs:
            example = a.default if a.default is not None else "..."
            sink.error(f"{label}: missing attribute '{a.name}'", at,
                       f"add `{a.name} = {example!r}`" if a.default is not None else f"add `{a.name} = {example}`")
            continue
        why = check_attr_value(a, stage.attrs[a.name])
        if why:
            sink.error(f"{label}: attribute '{a.name}' {why}", at, _attr_hint(a, stage.attrs[a.name]))
    # results
    if len(stage.outputs) != len(spec.results):
        sink.error(f"{label}: {spec.op} has {len(spec.results)} results, got {len(stage.outputs)}", at,
                   f"results: {', '.join(spec.results)}")
        return
    try:
        want_types = spec.result_types([v.type for v in stage.inputs], stage.attrs)
    except (KeyError, TypeError, ValueError):
        return
    for v, t in zip(stage.outputs, want_types):
        if v.type != t:
            sink.error(f"{label}: result %{v.name} has type {v.type}, expected {t}", at,
                       f"change the type to {t} (result batch follows {spec.batch_from})")


def _count(spec: OpSpec) -> str:
    lo, hi = spec.min_operands(), len(spec.operands)
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _signature(spec: OpSpec) -> str:
    return ", ".join(f"{o.name}{'?' if o.optional else ''}: {'|'.join(o.kinds)}" for o in spec.operands) or "none"


__all__ = ["verify", "register_check", "where", "VerificationError", "check_attr_value", "Diagnostic", "OPT_LEVELS"]
