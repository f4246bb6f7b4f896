"""The IR verifier: runs after lowering, after parsing ``.rlir`` and after every pass.

Every message says what is wrong *and* carries a hint saying how to fix it. Checks:

- cluster: known device kind, positive integer sizes;
- models: known architecture and head, positive integer shapes that divide
  (hidden by heads, heads by kv_heads; gpt2 has no grouped-query attention),
  boolean ``trainable``, ``init`` naming ``random``/``pretrained``/a model of
  the same architecture, no copy cycles;
- data sources: known kind, known options of the right type and range
  (``min_len <= max_len``);
- run settings: types and ranges, a known -O level and placement;
- graph: a positive ``batch``; unique SSA names; every operand is the very
  Value its producer defines, defined above its use (so the graph is acyclic);
  ops known; target model/data; operand count, types and batch sizes;
  attribute names, types (``float`` attributes hold Python floats, so the text
  form is unique) and ranges; result count and types; model heads; ``train``
  only on trainable models with a loss of the matching head; one train stage
  per model;
- parameter versions: exactly the edges the stage order implies (none missing,
  none stale, no duplicates);
- what would train nothing or garbage (:func:`_check_training`): ``minibatches``
  no larger than the batch a train stage sees; no ``temperature = 0`` on a
  generate whose groups feed ``group_advantages`` (identical samples, zero
  advantages); models that read a rollout's token ids share the generating
  model's tokenizer (that prompts plus ``max_new_tokens`` fit ``max_seq`` is
  checked by the frontend, which knows the prompts:
  :func:`~rlhfc.ir.verify_fields.check_prompt_lengths`);
- the plan annotations passes write (:func:`rlhfc.ir.plan.verify_plan`);
- plus checks registered by passes (:func:`register_check`), e.g. for the
  annotations they add.

A diagnostic points at the field it is about when it can — its key in the
``.rlir`` text the module was parsed from, else where the ``.rlhf`` program
wrote it (:func:`where`, the entities' ``field_locs``) — else at the entity.
The rules about values (the declarations' fields, the stages' attributes) are
in :mod:`rlhfc.ir.verify_fields`, which lowering also runs on each entity it
builds, so that they live in one place; the structural rules are here.
"""

from __future__ import annotations

from typing import Callable

from .core import TOOL_DEFAULTS, Module, Stage, Value, derive_versions
from .diagnostics import CompileError, Diagnostic, DiagnosticSink, did_you_mean, field_loc, where
from .ops import LOSS_FOR_HEAD, MIXED_BATCH_OPS, OpSpec, all_ops, get_op
from . import plan
from .plan import OPT_LEVELS, verify_plan
from .types import ValueType
from .verify_fields import (EXAMPLES, attr_hint, check_attr_value, check_attr_values, check_cluster, check_data,
                            check_model, check_models, check_params, check_run, is_positive_int, rollout_readers, show,
                            tokenizer_key, tokenizer_text)

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
    use :func:`where` for the location of an entity or of one of its fields.
    """
    if fn not in _EXTRA_CHECKS:
        _EXTRA_CHECKS.append(fn)
    return fn


class VerificationError(CompileError):
    """The IR is not valid; ``diagnostics`` say where and how to fix it."""


def verify(module: Module) -> None:
    """Raise :class:`VerificationError` listing every problem if the module is invalid."""
    sink = DiagnosticSink()
    check_cluster(module.cluster, sink)
    check_models(module, sink)
    for d in module.data.values():
        check_data(d, sink)
    check_run(module.run, sink)
    _check_graph(module, sink)
    _check_tools(module, sink)
    if not sink.errors:   # the rules below follow values to their producers: only on a well-formed graph
        _check_training(module, sink)
        _check_env_rewards(module, sink)
    verify_plan(module, sink)
    for check in _EXTRA_CHECKS:
        check(module, sink)
    if sink.errors:
        raise VerificationError(sink.errors)


# -- the graph ---------------------------------------------------------------------------------------------
def _check_graph(module: Module, sink: DiagnosticSink) -> None:
    g = module.graph
    check_params(g, sink)
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
    expected = derive_versions(g, module.trainable_models(), module.staleness_of)
    have = set(g.versions)
    at = where(g)
    for e in expected:
        if e not in have:
            when = "the previous step" if e.distance else "this step"
            sink.error(f"missing parameter-version edge: %{e.reader} reads the @{e.model} weights %{e.writer} "
                       f"wrote {when}", at,
                       f"add `version @{e.model} %{e.writer} -> %{e.reader} [{e.span}]` "
                       "(a pass that moves, adds or removes stages calls Module.refresh_versions())")
    for e in g.versions:
        if e not in expected:
            sink.error(f"stale parameter-version edge @{e.model} %{e.writer} -> %{e.reader} [{e.span}]: "
                       f"{_why_stale(module, e)}", at,
                       "remove it (a pass that moves, adds or removes stages calls Module.refresh_versions())")
    seen: set = set()
    for e in g.versions:
        if e in seen:
            sink.error(f"parameter-version edge @{e.model} %{e.writer} -> %{e.reader} [{e.span}] is listed twice",
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
    k = module.staleness_of(reader)
    if k != e.staleness:
        return (f"%{e.reader}'s staleness bound is {k} (run {{ staleness }} or its async_rollout annotation), so the "
                f"edge reads [+{right}" + (f"..+{right + k}]" if k else "]"))
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
    if len(batches) > 1 and spec.op not in MIXED_BATCH_OPS:
        sink.error(f"{label}: operands have different batch sizes {sorted(batches)}", at,
                   "all per-sample inputs must come from the same rollout")
    # attributes
    for key in stage.attrs:
        if spec.attr(key) is None:
            close = did_you_mean(key, [a.name for a in spec.attrs])
            sink.error(f"{label}: unknown attribute '{key}'", where(stage, key),
                       (close + " " if close else "") +
                       f"{spec.op} attributes: {', '.join(a.name for a in spec.attrs) or 'none'}; "
                       "put pass decisions in annotations (annot {...})")
    for a in spec.attrs:
        if a.name not in stage.attrs and not a.omit_default:
            example = a.default if a.default is not None else "..."
            sink.error(f"{label}: missing attribute '{a.name}'", at,
                       f"add `{a.name} = {example!r}`" if a.default is not None else f"add `{a.name} = {example}`")
    check_attr_values(stage, spec, sink)
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


# -- what would train nothing or garbage -------------------------------------------------------------------
def _check_training(module: Module, sink: DiagnosticSink) -> None:
    g = module.graph
    for s in g.stages:
        if s.op == "train" and s.inputs:
            mb, seen = s.attrs.get("minibatches"), s.inputs[0].type.batch
            if is_positive_int(mb) and is_positive_int(seen) and mb > seen:
                sink.error(f"minibatches ({mb}) is more than the {seen} samples this train stage sees",
                           where(s, "minibatches"), f"each minibatch needs at least one sample: use minibatches = "
                           f"{seen} or fewer, or raise the pipeline's batch")
        elif s.op == "compute.group_advantages" and s.inputs:
            gen = g.producer(s.inputs[0])
            n = gen.attrs.get("n", 1)
            if gen.op == "generate" and gen.attrs.get("temperature") == 0 and is_positive_int(n) and n > 1:
                sink.error(f"temperature = 0 samples greedily: the {n} samples of each prompt are identical, so "
                           "group_advantages() gives every sample a zero advantage and nothing trains",
                           where(gen, "temperature"), "sample with temperature > 0 (e.g. temperature = 1.0), or "
                           "generate n = 1 and estimate advantages with a critic (gae)")
    _check_algorithms(module, sink)
    _check_tokenizers(module, sink)
    _check_staleness(module, sink)


def _check_tools(module: Module, sink: DiagnosticSink) -> None:
    """The tools (their settings) and the multi-turn generates that call them: each named tool declared, a
    turn no longer than the trajectory, more than one turn where tools are called."""
    for t in module.tools.values():
        fn = t.fn if isinstance(t.fn, str) else ""
        mod, _, name = fn.partition(":")
        if not mod or not name:
            sink.error(f'tool @{t.name}: fn must be "module:function", got {t.fn!r}', where(t, "fn"),
                       'fn = "tools:calculator"')
        for key, low in (("timeout", 0.01), ("memory_mb", 16), ("max_output", 1)):
            v = getattr(t, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < low:
                sink.error(f"tool @{t.name}: {key} must be a number of at least {low}, got {v!r}", where(t, key),
                           f"e.g. {key} = {TOOL_DEFAULTS[key]}")
    for s in module.graph.stages:
        if s.op != "generate":
            continue
        names = [n for n in str(s.attrs.get("tools", "")).split(",") if n]
        for n in names:
            if n not in module.tools or module.tools[n].kind != "tool":
                sink.error(f"%{s.name} calls tool '{n}', which the module does not declare", where(s, "tools"),
                           did_you_mean(n, list(module.tools)) or f'declare it: tool @{n} {{fn = "tools:{n}"}}')
        env = s.attrs.get("env", "")
        if env and (env not in module.tools or module.tools[env].kind != "env"):
            sink.error(f"%{s.name} acts in environment '{env}', which the module does not declare", where(s, "env"),
                       did_you_mean(env, list(module.tools)) or f'declare it: env @{env} {{fn = "envs:Game"}}')
        turn, width = s.attrs.get("turn_tokens", 0), s.attrs.get("max_new_tokens", 32)
        if is_positive_int(turn) and is_positive_int(width) and turn > width:
            sink.error(f"%{s.name}: turn_tokens = {turn} is longer than the whole trajectory (max_new_tokens = "
                       f"{width})", where(s, "turn_tokens"),
                       f"a trajectory's turns and tool results share max_new_tokens: turn_tokens <= {width}")
        if names and s.attrs.get("max_turns", 1) == 1 and not env:
            sink.error(f"%{s.name} may call tools but has max_turns = 1: the policy would never see a result",
                       where(s, "tools"), "give it room for the answer after a call: max_turns = 2 or more")


def _check_env_rewards(module: Module, sink: DiagnosticSink) -> None:
    """``env_reward(roll)`` and ``env_turn_rewards(roll)`` read the rewards of an environment: their rollout comes
    from a generate with one."""
    g = module.graph
    for s in g.stages:
        if s.op not in ("compute.env_reward", "compute.env_turn_rewards") or not s.inputs:
            continue
        gen = g.producer(s.inputs[0])
        if gen.op != "generate" or not gen.attrs.get("env"):
            sink.error(f"%{s.name}: {s.op.split('.', 1)[1]} reads an environment's rewards, but %{gen.name} acts in no "
                       "environment", where(s), "generate with one: actor.generate(prompts, env = game, max_turns = 4)")


def _check_staleness(module: Module, sink: DiagnosticSink) -> None:
    """``run { staleness = K > 0 }`` needs a trained model that generates: the weight edge it loosens."""
    k = module.run.staleness
    if not is_positive_int(k):
        return
    g = module.graph
    if not any(s.op == "generate" and s.target in module.trainable_models() for s in g.stages):
        gens = sorted({s.target for s in g.stages if s.op == "generate"})
        why = (f"the pipeline's generate stages use frozen models ({', '.join('@' + m for m in gens)}), whose "
               "weights never change" if gens else "the pipeline generates nothing")
        sink.error(f"staleness = {k} needs a trained model that generates: {why}", where(module.run, "staleness"),
                   "asynchronous rollout lets a trained policy's generation run ahead of its training; drop "
                   "staleness, or generate with the model the pipeline trains")
        return
    stuck = [s for s in g.stages if s.op == "generate" and s.target in module.trainable_models()
             and not plan.can_run_ahead(module, s)]
    if stuck:
        why = ("the pipeline refills its sampling round (max_refill), which re-runs the generate within the step"
               if plan.refills(g) else "their prompts are read by another stage too (the driver draws an asynchronous "
               "generate's prompts per generation it launches)")
        sink.error(f"staleness = {k}: {', '.join('%' + s.name for s in stuck)} cannot run ahead of training: {why}",
                   where(module.run, "staleness"), "drop staleness (synchronous), or give the generate prompts "
                   "of its own and no max_refill")


def _check_algorithms(module: Module, sink: DiagnosticSink) -> None:
    """Options of the algorithm family that only make sense together (REINFORCE++, ReMax, DAPO)."""
    g = module.graph
    for s in g.stages:
        if s.op == "compute.group_advantages" and s.attrs.get("filter_groups") and s.attrs.get("group", 1) < 2:
            sink.error("filter_groups drops the groups whose samples all score the same; with 1 sample per prompt "
                       "that is every group", where(s, "filter_groups"),
                       "generate several samples per prompt (actor.generate(prompts, n = 4)), or drop filter_groups")
        if s.op == "compute.group_advantages" and s.attrs.get("max_refill") and not s.attrs.get("filter_groups"):
            sink.error("max_refill samples more prompts until enough groups survive filter_groups, which this "
                       "stage does not set", where(s, "max_refill"),
                       "add filter_groups = true, or drop max_refill")
        if s.op == "compute.group_advantages" and len(s.inputs) > 2:
            if len(s.inputs) == 3:
                sink.error("group_advantages() takes logp and ref_logp together (the KL in the reward)", where(s),
                           "write group_advantages(roll, scores, logp, ref_logp, method = reinforce_pp)")
            elif not str(s.attrs.get("method", "")).startswith("reinforce_pp"):
                sink.error(f"logp and ref_logp put a token-level KL into the reward, which only method = "
                           f"reinforce_pp uses, not {s.attrs.get('method')}", where(s, "method"),
                           "use method = reinforce_pp (or reinforce_pp_baseline), or put the KL in the loss: "
                           "ppo_clip(roll, logp, adv, ref_logp, kl_coef = 0.02)")
        elif s.op == "compute.remax" and len(s.inputs) == 3:
            check_remax(g, s, sink)
        elif s.op == "compute.overlong":
            top, buf = s.attrs.get("max_len"), s.attrs.get("buffer")
            if is_positive_int(top) and isinstance(buf, int) and buf > top:
                sink.error(f"buffer ({buf}) is longer than max_len ({top})", where(s, "buffer"),
                           f"the penalty grows over the last buffer tokens before max_len; e.g. buffer = {top // 4}")


def check_remax(g, s: Stage, sink: DiagnosticSink) -> None:
    """ReMax's baseline: the scores of one greedy response to each prompt of the rollout it scores (lowering
    runs this too, for the warning: the verifier keeps only errors)."""
    roll, base = s.inputs[0], s.inputs[2]
    try:
        gen, greedy = g.producer(roll), g.producer(g.producer(base).inputs[0])
    except (KeyError, IndexError):
        gen = greedy = None
    if gen is None or gen.op != "generate" or greedy.op != "generate":
        if roll.type.batch and base.type.batch and roll.type.batch % base.type.batch:
            sink.error(f"remax() has {base.type.batch} baseline scores for {roll.type.batch} samples", where(s),
                       "the baseline scores one greedy response per prompt: generate it from the same prompts")
        return
    if greedy.inputs[0] is not gen.inputs[0]:
        sink.error("remax()'s baseline answers other prompts than the rollout it scores", where(s),
                   "generate both from the same prompts value: greedy = actor.generate(prompts, temperature = 0)")
    elif greedy.attrs.get("n", 1) != 1:
        sink.error(f"remax()'s baseline rollout has n = {greedy.attrs.get('n')} responses per prompt; ReMax's "
                   "baseline is one greedy response per prompt", where(greedy, "n"),
                   "drop n from the greedy generate (n = 1); the sampled rollout may have any n")
    elif greedy.attrs.get("temperature") != 0:
        sink.warning(f"remax()'s baseline rollout samples at temperature {greedy.attrs.get('temperature')}; ReMax's "
                     "baseline is the greedy response", where(greedy, "temperature"), "set temperature = 0")


def _check_tokenizers(module: Module, sink: DiagnosticSink) -> None:
    """A model that reads a rollout's token ids (logprobs, values, train) must share the generating model's
    tokenizer (a score model may have its own: it scores the decoded text)."""
    g = module.graph
    reported: set[tuple[str, str]] = set()
    for s in g.stages:
        if s.op != "generate" or not s.outputs:
            continue
        gen = module.models.get(s.target or "")
        for r in rollout_readers(g, s.outputs[0]):
            m = module.models.get(r.target or "")
            if gen is None or m is None or r.op == "forward.score" or (m.name, gen.name) in reported:
                continue
            if tokenizer_key(m) != tokenizer_key(gen):
                reported.add((m.name, gen.name))
                fix = (f"give '{m.name}' vocab = {gen.vocab}" if not m.source and not gen.source else
                       f"load '{m.name}' from the folder of '{gen.name}'")
                sink.error(f"'{m.name}' reads the token ids '{gen.name}' generates, but uses another tokenizer "
                           f"({tokenizer_text(m)}, not {tokenizer_text(gen)})", where(r),
                           f"models that exchange per-token values share a tokenizer: {fix}, or declare it "
                           f"like({gen.name}) or copy({gen.name})")


def _count(spec: OpSpec) -> str:
    lo, hi = spec.min_operands(), len(spec.operands)
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _signature(spec: OpSpec) -> str:
    return ", ".join(f"{o.name}{'?' if o.optional else ''}: {'|'.join(o.kinds)}" for o in spec.operands) or "none"


__all__ = ["check_remax", "verify", "register_check", "where", "field_loc", "VerificationError", "check_attr_value", "attr_hint",
           "check_attr_values", "check_cluster", "check_model", "check_data", "check_run", "check_params",
           "is_positive_int", "show", "EXAMPLES", "Diagnostic", "OPT_LEVELS"]
