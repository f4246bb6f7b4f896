"""Lower the AST to the IR: resolve names, type the pipeline, order it, fill defaults.

Why this file is long: it is one pass over the pipeline (its calls, their operands and settings, the
warnings about what the program leaves unused); the declarations are lowered in :mod:`.lower_decls`.

:func:`lower` builds the module: the declarations (:mod:`.lower_decls`), then
the pipeline into the graph (here). Lowering only builds: every rule about
values (shapes, ranges, choices, kinds) is the verifier's
(:mod:`rlhfc.ir.verify_fields`), which lowering runs on each entity it builds,
with the position where the program wrote each field, before building on it.
What lowering reports itself is what only building can find: unknown names,
misused syntax, duplicate bindings, cycles, and the typing of the pipeline in the
language's terms (argument positions and bound names, method calls on models of
the wrong head or frozen) — which building needs to derive each result's type.

Every user mistake becomes a diagnostic with a location and, where one helps, a
hint; lowering keeps going after an error so one run reports every independent
problem, then raises a single CompileError. Warnings (unused values, models,
data) are returned, not raised.
"""

from __future__ import annotations

import json
import os

import networkx as nx

from rlhfc.ir.core import Cluster, Graph, Module, Stage, Value
from rlhfc.ir.diagnostics import DiagnosticSink, Loc, did_you_mean
from rlhfc.ir.ops import BUILTIN_OPS, LOSS_FOR_HEAD, METHOD_OPS, MIXED_BATCH_OPS, get_op
from rlhfc.ir.verifier import check_remax, rollout_readers
from rlhfc.ir.verifier import where as stage_where
from rlhfc.ir.verify_fields import (attr_hint, check_attr_values, check_params, check_prompt_lengths, is_positive_int,
                                    reward_module_problem)

from . import ast
from .literals import KIND_NAMES, coerce, show, value_of
from .lower_decls import Declarations, Scope
from .files import chat_template_problem, tool_template_problem
from .rules import extract_problem, rollout_fields, rule_problem

_PIPELINE_PARAMS = {"batch": 8}


class _Failed(Exception):
    """A statement could not be lowered; its error is already in the sink."""


def lower(program: ast.Program, sink: DiagnosticSink) -> Module:
    """Lower a parsed program; errors go to ``sink`` (caller raises), the module is returned best-effort."""
    module = Module(name=_module_name(program.file), cluster=Cluster("local"))
    scope = Scope(program, sink, module)
    decls = Declarations(scope)
    module.cluster = decls.cluster()
    for d in program.models + program.data:
        scope.declare(d.name, d.name_loc)
    decls.models()
    decls.data()
    module.run = decls.run_block()
    allowed = module.run.reward_modules
    decls.tools([m for m in allowed if isinstance(m, str) and reward_module_problem(m) is None]
                if isinstance(allowed, list) else [])
    pipeline = _Pipeline(scope)
    module.graph = pipeline.lower()
    module.refresh_versions()
    if not sink.errors:   # the longest prompt of each data source (JSONL: read by decls.data())
        check_prompt_lengths(module, sink, {**scope.prompt_lengths, **{
            d.name: (d.options["max_len"], f"max_len = {d.options['max_len']} of data '{d.name}'")
            for d in module.data.values() if d.kind == "synthetic"}})
    pipeline.warn_unused()
    return module


def _module_name(file: str) -> str:
    name = os.path.splitext(os.path.basename(file))[0] if not file.startswith("<") else "main"
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "main"
    return "m_" + name if name[0].isdigit() else name


class _Pipeline:
    """Builds the pipeline into the module's graph: one stage per call, in dependency order."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.p = scope.p
        self.sink = scope.sink
        self.module = scope.module
        self.names = scope.names
        self.failed_decls = scope.failed_decls
        self.graph: Graph | None = None

    def lower(self) -> Graph:
        if not self.p.pipelines:
            self.sink.error("the program has no pipeline", self.scope.end_loc(),
                            "add `pipeline ppo(batch = 8) { roll = actor.generate(prompts) ... }`")
            return Graph("main")
        for extra in self.p.pipelines[1:]:
            self.sink.error("a program has one pipeline", extra.loc,
                            f"the first is '{self.p.pipelines[0].name}' at line {self.p.pipelines[0].loc.line}")
        decl = self.p.pipelines[0]
        self.graph = Graph(decl.name, dict(_PIPELINE_PARAMS), loc=decl.loc)
        for kw in decl.params:
            if kw.name not in _PIPELINE_PARAMS:
                self.sink.error(f"unknown pipeline parameter '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, _PIPELINE_PARAMS) or "parameters: batch")
                continue
            if kw.name in self.graph.field_locs:
                self.sink.error(f"pipeline parameter '{kw.name}' given twice", kw.loc, "remove one")
                continue
            self.graph.params[kw.name] = value_of(kw.value)
            self.graph.field_locs[kw.name] = kw.value.loc
        if not check_params(self.graph, self.sink):
            self.graph.params = dict(_PIPELINE_PARAMS)   # reported; type the stages with the default
        if not decl.stmts:
            self.sink.error(f"pipeline '{decl.name}' is empty", decl.name_loc,
                            "add the per-step dataflow, e.g. roll = actor.generate(prompts), "
                            "logp = actor.logprobs(roll), ...")
        self.values: dict[str, Value] = {}
        self.failed: set[str] = set()
        self.bound_at: dict[str, Loc] = {}
        self.loads: dict[str, Value] = {}
        self.trained: dict[str, Loc] = {}
        order = self.order_statements(decl.stmts)
        for stmt in order:
            try:
                self.statement(stmt)
            except _Failed:
                for t in stmt.targets:
                    self.failed.add(t.name)
        return self.graph

    def order_statements(self, stmts: list[ast.Stmt]) -> list[ast.Stmt]:
        """Topological order of statements by the names they use (source order breaks ties)."""
        producer: dict[str, ast.Stmt] = {}
        for s in stmts:
            seen_here = set()
            duplicate = False
            for t in s.targets:
                if t.name in seen_here:
                    self.sink.error(f"'{t.name}' is bound twice in one statement", t.loc,
                                    "give each result its own name, e.g. adv, ret = gae(...)")
                    continue
                seen_here.add(t.name)
                if duplicate and t.name in self.names:
                    continue   # one duplicate-name error per statement (a repeated line repeats them all)
                if not self.scope.declare(t.name, t.loc):
                    duplicate = True
                    continue
                producer[t.name] = s
                self.bound_at[t.name] = t.loc
        g = nx.DiGraph()
        for s in stmts:
            g.add_node(s.index)
        for s in stmts:
            for ref in _refs(s.call):
                if ref.name in producer:
                    g.add_edge(producer[ref.name].index, s.index)
        by_index = {s.index: s for s in stmts}
        if not nx.is_directed_acyclic_graph(g):
            cycle = nx.find_cycle(g)
            nodes = [by_index[a] for a, _ in cycle]
            first = min(nodes, key=lambda s: s.index)
            names = [next((t.name for t in n.targets), n.call.name) for n in nodes]
            start = names.index(next((t.name for t in first.targets), first.call.name))
            names = names[start:] + names[:start]
            self.sink.error("cycle in pipeline: " + " -> ".join(names + [names[0]]), first.loc,
                            "a value cannot depend on itself within a step; across steps, models carry state "
                            "through their weights")
            for s in nodes:
                g.remove_edges_from(list(g.in_edges(s.index)))
                for t in s.targets:
                    self.failed.add(t.name)
        order = list(nx.lexicographical_topological_sort(g, key=lambda i: i))
        return [by_index[i] for i in order if not any(t.name in self.failed for t in by_index[i].targets)]

    def statement(self, stmt: ast.Stmt) -> None:
        names = [t.name for t in stmt.targets]
        stage = self.call(stmt.call, names, stmt)
        if names and len(names) != len(stage.outputs):
            n = len(stage.outputs)
            wanted = (names + _result_names(get_op(stage.op))[len(names):])[:n]
            where = stmt.targets[n].loc if len(names) > n else stmt.targets[0].loc
            self.sink.error(f"{_callee_text(stmt.call)} returns {n} value{'s' if n != 1 else ''} but "
                            f"{len(names)} name{'s are' if len(names) != 1 else ' is'} bound", where,
                            f"write {', '.join(wanted)} = {_callee_text(stmt.call)[:-1]}...)")
            raise _Failed

    def call(self, call: ast.Call, names: list[str], stmt: ast.Stmt) -> Stage:
        spec, target = self.resolve_callee(call)
        positional = list(call.args)
        preset: dict = {}
        preset_locs: dict[str, Loc] = {}
        if spec.op == "compute.rule":
            if not positional or not isinstance(positional[0], ast.Literal) or positional[0].kind != "str":
                self.sink.error('rule() takes the rule function first, as "module:function"', call.loc,
                                'e.g. scores = rule("my_rewards:exact_match", roll)')
                raise _Failed
            fn = positional.pop(0)
            mod, _, func = fn.value.partition(":")
            if not mod or not func or not all(p.isidentifier() for p in mod.split(".")) or not func.isidentifier():
                self.sink.error(f'rule function must be written "module:function", got {json.dumps(fn.value)}',
                                fn.loc, 'name an importable Python module and a function in it, e.g. '
                                '"rlhfc.runtime.rewards:vowel_fraction"')
                raise _Failed
            allowed = self.module.run.reward_modules   # those the verifier refuses (reported) allow nothing
            allowed = [m for m in allowed if isinstance(m, str) and reward_module_problem(m) is None] \
                if isinstance(allowed, list) else []
            rule_ref = (fn, allowed)   # checked with the fields of the rollout's data below
            preset["fn"], preset_locs["fn"] = fn.value, fn.loc
        lo, hi = spec.min_operands(), len(spec.operands)
        shown = _callee_text(call)
        if not lo <= len(positional) <= hi:
            shift = 1 if spec.op == "compute.rule" else 0   # the rule function was popped above
            want = str(lo + shift) if lo == hi else f"{lo + shift} to {hi + shift}"
            names_text = ", ".join(o.name + ("?" if o.optional else "") for o in spec.operands)
            if spec.op == "compute.rule":
                names_text = '"module:function", ' + names_text
            extra = positional[hi] if len(positional) > hi else None
            self.sink.error(f"{shown} takes {want} positional argument{'s' if hi + shift != 1 else ''}, "
                            f"got {len(positional) + shift}",
                            extra.loc if extra is not None else call.loc,
                            f"write {shown[:-1]}{names_text})" +
                            (" (? marks an optional argument)" if lo != hi else ""))
            raise _Failed
        inputs: list[Value] = []
        for i, (arg, operand) in enumerate(zip(positional, spec.operands)):
            v = self.operand(arg, stmt)
            if v.type.kind not in operand.kinds:
                want = " or ".join(operand.kinds)
                self.sink.error(f"argument {i + 1} of {shown} ('{operand.name}') must be {want}, "
                                f"got '{_arg_name(arg)}' of type {v.type.kind}",
                                arg.loc, _type_hint(operand.kinds, v.type.kind))
                raise _Failed
            inputs.append(v)
        batches = sorted({v.type.batch for v in inputs if v.type.batch is not None})
        if len(batches) > 1 and spec.op not in MIXED_BATCH_OPS:
            self.sink.error(f"arguments of {shown} have different batch sizes {batches}", call.loc,
                            "per-sample values must come from the same rollout")
            raise _Failed
        attrs, locs, ok = self.attrs(call, spec, preset, preset_locs)
        stage = Stage(spec.op, target, inputs, [], attrs, {}, call.loc, field_locs=locs)   # results below
        if not check_attr_values(stage, spec, self.sink) or not ok:   # the values' types, ranges, choices
            raise _Failed
        if spec.op == "compute.rule":
            fn, allowed = rule_ref
            problem = rule_problem(fn.value, self.scope.base_dir, allowed, rollout_fields(self.module, self.graph,
                                                                                         inputs[0]))
            loc = fn.loc
            if problem is None and attrs.get("extract"):
                problem, loc = extract_problem(attrs["extract"]), locs["extract"]
            if problem is not None:
                self.sink.error(problem[0], loc, problem[1])
                raise _Failed
        if spec.op == "compute.group_advantages":
            gen = self.graph.producer(inputs[0])
            attrs["group"] = int(gen.attrs.get("n", 1)) if gen.op == "generate" else 1
            if attrs["group"] < 2 and not str(attrs.get("method")).startswith("reinforce_pp"):   # no groups needed
                self.sink.warning("group_advantages over groups of 1 sample gives zero advantages", call.loc,
                                  "generate several samples per prompt: actor.generate(prompts, n = 4)")
        if spec.op == "train" and (attrs.get("lr_schedule", "constant") != "constant" or attrs.get("warmup_steps")) \
                and is_positive_int(self.module.run.steps):
            attrs["total_steps"] = self.module.run.steps   # the schedule spans the run
        if spec.op == "compute.remax":
            check_remax(self.graph, stage, self.sink)
        self.check_model(call, spec, target, inputs)
        if spec.op == "generate" and attrs.get("chat"):
            problem = chat_template_problem(self.module.models[target].source, target)
            if problem is None and attrs.get("tools"):
                problem = tool_template_problem(self.module.models[target].source, target)
            if problem is not None:
                self.sink.error(problem[0], locs.get("chat", call.loc), problem[1])
                raise _Failed
        result_types = spec.result_types([v.type for v in inputs], attrs)
        if names and len(names) == len(result_types):
            out_names = names
        else:
            base = f"{target}_{call.name}" if target and spec.model == "model" else call.name
            out_names = [self.graph.fresh_name(base if i == 0 else f"{base}_{i}") for i in range(len(result_types))]
            out_names = [n if n not in self.names or n in self.values else self.graph.fresh_name(n + "_v")
                         for n in out_names]
        outputs = [Value(n, t) for n, t in zip(out_names, result_types)]
        stage.outputs = outputs
        self.graph.stages.append(stage)
        for v in outputs:
            self.values[v.name] = v
        return stage

    def resolve_callee(self, call: ast.Call):
        if call.receiver is None:
            op = BUILTIN_OPS.get(call.name)
            if op is None:
                if call.name in METHOD_OPS:
                    hint = f"{call.name} is a model method: write MODEL.{call.name}(...)"
                else:
                    hint = did_you_mean(call.name, BUILTIN_OPS) or f"builtins: {', '.join(BUILTIN_OPS)}"
                self.sink.error(f"unknown function '{call.name}'", call.name_loc, hint)
                raise _Failed
            return get_op(op), None
        recv = call.receiver.name
        if recv not in self.module.models:
            if recv in self.failed_decls and any(d.name == recv for d in self.p.models):
                raise _Failed   # its declaration already has an error
            if recv in self.values or recv in self.bound_at:
                self.sink.error(f"'{recv}' is a value, not a model", call.receiver.loc,
                                f"methods ({', '.join(METHOD_OPS)}) are called on models")
            elif recv in self.module.data:
                self.sink.error(f"'{recv}' is a data source, not a model", call.receiver.loc,
                                f"pass it to a model: actor.generate({recv})")
            else:
                self.sink.error(f"unknown model '{recv}'", call.receiver.loc,
                                did_you_mean(recv, self.module.models) or "declare it with `model NAME = ...`")
            raise _Failed
        op = METHOD_OPS.get(call.name)
        if op is None:
            self.sink.error(f"model '{recv}' has no method '{call.name}'", call.name_loc,
                            did_you_mean(call.name, METHOD_OPS) or f"methods: {', '.join(METHOD_OPS)}")
            raise _Failed
        return get_op(op), recv

    def operand(self, arg, stmt: ast.Stmt) -> Value:
        if isinstance(arg, ast.Call):
            stage = self.call(arg, [], stmt)
            if len(stage.outputs) != 1:
                self.sink.error(f"{_callee_text(arg)} returns {len(stage.outputs)} values; bind them to names first",
                                arg.loc, f"e.g. {', '.join(_result_names(get_op(stage.op)))} = "
                                f"{_callee_text(arg)[:-1]}...), then pass one of them")
                raise _Failed
            return stage.outputs[0]
        if isinstance(arg, ast.Literal):
            self.sink.error(f"expected a value, got {KIND_NAMES.get(arg.kind, arg.kind)} {show(arg)}",
                            arg.loc, "constants are passed by keyword, e.g. temperature = 0.7")
            raise _Failed
        name = arg.name
        if name in self.values:
            return self.values[name]
        if name in self.failed:
            raise _Failed
        if name in self.module.data:
            return self.load(name, arg.loc)
        if name in self.module.models:
            self.sink.error(f"'{name}' is a model, not a value", arg.loc,
                            f"call a method on it, e.g. {name}.generate(prompts) or {name}.logprobs(roll)")
            raise _Failed
        if any(name == d.name for d in self.p.models + self.p.data):
            raise _Failed  # its declaration already failed
        choices = list(self.bound_at) + list(self.module.data)
        self.sink.error(f"unknown value '{name}'", arg.loc, did_you_mean(name, choices) or
                        "bind it in the pipeline (name = model.method(...)) or declare it as data")
        self.failed.add(name)   # report each unknown name once, not at every use
        raise _Failed

    def load(self, data: str, loc: Loc) -> Value:
        if data not in self.loads:
            batch = self.graph.params["batch"]
            name = data if data not in self.bound_at else self.graph.fresh_name(data + "_batch")
            v = Value(name, get_op("load").result_types([], {"batch": batch})[0])
            self.graph.stages.append(Stage("load", data, [], [v], {"batch": batch}, {}, loc))
            self.loads[data] = v
        return self.loads[data]

    def attrs(self, call: ast.Call, spec, preset: dict, preset_locs: dict) -> tuple[dict, dict, bool]:
        """The stage's attributes from the call's keywords, defaults for the rest, and where each keyword was
        written; False if one was unknown, given twice, of the wrong kind of literal or missing (reported)."""
        attrs = dict(preset)
        locs = dict(preset_locs)
        user_attrs = [a for a in spec.attrs if a.name not in spec.internal_attrs and a.name not in preset]
        ok = True
        for kw in call.kwargs:
            a = next((x for x in user_attrs if x.name == kw.name), None)
            if a is None:
                self.sink.error(f"{_callee_text(call)} has no setting '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, [x.name for x in user_attrs]) or
                                (f"settings: {', '.join(x.name for x in user_attrs)}" if user_attrs else
                                 "it takes no settings"))
                ok = False
                continue
            if kw.name in attrs:
                self.sink.error(f"setting '{kw.name}' given twice", kw.loc, "remove one")
                ok = False
                continue
            if spec.op == "generate" and kw.name in ("tools", "env"):   # declared tools' / environment's names
                value = self.tool_names(kw.value, kw.name)
                if value is None:
                    ok = False
                    continue
                attrs[kw.name], locs[kw.name] = value, kw.value.loc
                continue
            value = coerce(kw.value, a.kind)   # the literal's kind, which the IR does not keep
            if value is None:
                self.sink.error(f"'{kw.name}' expects {KIND_NAMES.get(a.kind, a.kind)}, "
                                f"got {KIND_NAMES.get(kw.value.kind, kw.value.kind)} {show(kw.value)}",
                                kw.value.loc, attr_hint(a))
                ok = False
                continue
            attrs[kw.name] = value
            locs[kw.name] = kw.value.loc
        for a in spec.attrs:
            if a.name in attrs:
                continue
            if a.required:
                self.sink.error(f"{_callee_text(call)} needs '{a.name}'", call.loc, attr_hint(a))
                ok = False
                continue
            attrs[a.name] = a.default
        return {a.name: attrs[a.name] for a in spec.attrs
                if a.name in attrs and not (a.omit_default and attrs[a.name] == a.default)}, locs, ok

    def tool_names(self, lit: ast.Literal, key: str = "tools") -> str | None:
        """``tools = [calc, search]`` (or one name) as the attribute's comma-separated names, each a declared
        tool; ``env = game``: one declared environment. None when one is not (reported)."""
        kind = "env" if key == "env" else "tool"
        if kind == "env" and lit.kind == "list":
            self.sink.error("env = names one environment", lit.loc, "env = game")
            return None
        items = lit.value if lit.kind == "list" else [lit]
        names = []
        for item in items:
            if not isinstance(item, ast.Literal) or item.kind not in ("ident", "str"):
                self.sink.error(f"{key} = ... names declared {'environments' if kind == 'env' else 'tools'}",
                                item.loc if isinstance(item, ast.Literal) else lit.loc,
                                'declare one first: env game = python("envs:Game")' if kind == "env" else
                                'declare one first: tool calc = python("tools:calculator")')
                return None
            name = str(item.value)
            declared = [t.name for t in self.module.tools.values() if t.kind == kind]
            if name not in declared:
                if any(t.name == name and t.kind == kind for t in self.p.tools):
                    return None   # its declaration failed (reported there)
                other = self.module.tools.get(name)
                self.sink.error(f"'{name}' is {'a tool' if other.kind == 'tool' else 'an environment'}, not "
                                f"{'an environment' if kind == 'env' else 'a tool'}" if other is not None else
                                f"unknown {'environment' if kind == 'env' else 'tool'} '{name}'", item.loc,
                                did_you_mean(name, declared) or (
                                    f'declare it: env {name} = python("envs:Game")' if kind == "env" else
                                    f'declare it: tool {name} = python("tools:{name}")'))
                return None
            names.append(name)
        if not names:
            self.sink.error("tools = [] names no tool", lit.loc, "list the declared tools the policy may call")
            return None
        return ",".join(names)

    def check_model(self, call: ast.Call, spec, target: str | None, inputs: list[Value]) -> None:
        if target is None:
            return
        m = self.module.models[target]
        if spec.head and m.head != spec.head:
            self.sink.error(f"{target}.{call.name}() needs a model with {_a(spec.head)} '{spec.head}' head, but "
                            f"'{target}' has {_a(m.head)} '{m.head}' head", call.name_loc,
                            self.head_hint(spec.head, call.name))
            raise _Failed
        if spec.trains:
            if not m.trainable:
                self.sink.error(f"cannot train frozen model '{target}'", call.loc,
                                f"declare it trainable: model {target} = ... trainable")
                raise _Failed
            want = LOSS_FOR_HEAD.get(m.head)
            got = inputs[0].type.kind
            if want is None:
                self.sink.error(f"models with a '{m.head}' head cannot be trained", call.loc,
                                "train the actor (lm head) or a critic (value head)")
                raise _Failed
            if got != want:
                fix = "ppo_clip(...)" if want == "PolicyLoss" else "value_loss(...)"
                self.sink.error(f"{target}.train() needs a {want} ('{target}' has {_a(m.head)} '{m.head}' head), "
                                f"got a {got}", call.args[0].loc, f"train it with {fix}")
                raise _Failed
            if target in self.trained:
                self.sink.error(f"model '{target}' is trained twice in one step", call.loc,
                                f"it is already trained at line {self.trained[target].line}; train each model once "
                                "per step, and raise epochs or minibatches for more updates")
                raise _Failed
            self.trained[target] = call.loc

    def head_hint(self, head: str, method: str) -> str:
        have = [m.name for m in self.module.models.values() if m.head == head]
        if have:
            return f"call it on a model with {_a(head)} '{head}' head: " + " or ".join(f"{n}.{method}(...)" for n in have)
        return {"lm": "declare a policy model (head = lm, the default), e.g. model actor = llama(size = 7B) trainable",
                "value": "declare a critic, e.g. model critic = like(actor) head = value trainable",
                "score": "declare a reward model, e.g. model reward = llama(size = 7B) head = score frozen, "
                         "or score with rule(\"module:function\", roll)"}.get(head, f"declare a model with head = {head}")

    # -- warnings ----------------------------------------------------------------------------
    def warn_unused(self) -> None:
        g = self.graph
        if g is None:   # no pipeline (reported)
            return
        used = {id(v) for s in g.stages for v in s.inputs}
        for s in g.stages:
            for v in s.outputs:
                if id(v) in used or v.type.kind == "Metrics" or v.name not in self.bound_at:
                    continue
                self.sink.warning(f"value '{v.name}' is never used", self.bound_at[v.name],
                                  "remove it, or pass it to a stage that needs it")
        for s in g.stages:
            if s.op != "generate" or not s.outputs or s.attrs.get("temperature", 1.0) != 0:
                continue
            trained = [r for r in rollout_readers(g, s.outputs[0]) if r.op == "train" and r.target == s.target]
            if trained:
                self.sink.warning(f"@{s.target} trains on a greedy rollout (temperature = 0): its responses never "
                                  "explore, and they are not samples of the policy whose log-probs the loss uses",
                                  stage_where(s, "temperature"), "sample with temperature > 0 (1.0 is usual); a greedy "
                                  "rollout serves as an evaluation or as remax()'s baseline, not as training data")
        called = {s.target for s in g.stages}
        for m in self.module.models.values():
            if m.name not in called:
                self.sink.warning(f"model '{m.name}' is never used", m.loc, "remove it or call it in the pipeline")
            elif m.trainable and not any(s.op == "train" and s.target == m.name for s in g.stages):
                self.sink.warning(f"model '{m.name}' is trainable but never trained", m.loc,
                                  f"add {m.name}.train(...) or declare it frozen")
        for d in self.module.data.values():
            if d.name not in called:
                self.sink.warning(f"data '{d.name}' is never used", d.loc, "pass it to actor.generate(...)")


# -- helpers ---------------------------------------------------------------------------------
def _refs(call: ast.Call):
    for a in call.args:
        if isinstance(a, ast.Ref):
            yield a
        elif isinstance(a, ast.Call):
            yield from _refs(a)


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" or word == "lm" else "a"


def _callee_text(call: ast.Call) -> str:
    return f"{call.receiver.name}.{call.name}()" if call.receiver else f"{call.name}()"


def _arg_name(arg) -> str:
    if isinstance(arg, ast.Ref):
        return arg.name
    if isinstance(arg, ast.Call):
        return _callee_text(arg)
    return str(getattr(arg, "value", "?"))


def _result_names(spec) -> list[str]:
    if spec.op == "compute.gae":
        return ["adv", "ret"]
    return [f"out{i}" for i in range(len(spec.results))] if len(spec.results) > 1 else ["out"]


_PRODUCERS = {
    "Rollout": "MODEL.generate(prompts)", "TokenFloat": "MODEL.logprobs(roll) or MODEL.values(roll)",
    "SeqFloat": "MODEL.score(roll) or rule(\"module:function\", roll)", "Prompts": "a data source",
    "PolicyLoss": "ppo_clip(...)", "ValueLoss": "value_loss(...)", "Metrics": "MODEL.train(...)",
}


def _type_hint(wanted: tuple[str, ...], got: str) -> str:
    return "; ".join(f"{_a(w)} {w} comes from {_PRODUCERS.get(w, 'another stage')}" for w in wanted)
