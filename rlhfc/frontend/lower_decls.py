"""Lowering of the declarations: the cluster, models, data sources and the run block.

Why this file is long: every kind of declaration is lowered the same way, here side by side (the model
constructors llama/gpt2/hf/copy/like, their clauses, the cluster, the run block); data sources have their own
module.

Each declaration is built into its IR entity — names resolved, literals turned
into values, defaults filled, and where each field was written recorded in the
entity's ``field_locs`` — and then handed to the verifier's check for that kind
of entity (:mod:`rlhfc.ir.verify_fields`), which owns every rule about values
(positive sizes, shapes that divide, known device kinds, heads, -O levels and
placements, option ranges) and reports at the recorded positions. An entity the
verifier rejects is left out of the module, like one that could not be built,
so that its uses do not repeat the error.

Reported here are only the mistakes the IR cannot hold: unknown constructors,
settings and model names, settings given twice, a second cluster or run block,
misused syntax (``devices`` other than ``cpu:N``, positional arguments where
keywords go), copy()/like() loops, missing files and unreadable configs, and
what the files say (:mod:`.files`): a JSONL prompt file that the job could not
read (not UTF-8, a line that is not JSON or lacks the field; its longest prompt
is kept for the length check), a model folder without a tokenizer or with one
larger than the model's vocabulary.
"""

from __future__ import annotations

import json
import os

from rlhfc.ir import arch as archs
from rlhfc.ir.core import RUN_KEYS, Cluster, DataSource, Model, Module, RunConfig, Symbol, Tool
from rlhfc.ir.devices import GPU_KINDS
from rlhfc.ir.diagnostics import DiagnosticSink, Loc, did_you_mean
from rlhfc.ir.lora import DEFAULT_TARGETS, LORA_KEYS
from rlhfc.ir.plan import AUTO, LAYOUT_FACTORS, Parallel, fixed_layout
from rlhfc.ir.verify_fields import EXAMPLES, check_cluster, check_data, check_model, check_run, is_positive_int

from . import ast
from .data_decls import lower_jsonl, lower_synthetic
from .files import tokenizer_problem
from .literals import memory_bytes, size_text, value_of
from .parser import end_of_code
from .rules import tool_problem

_MODEL_CTORS = ("llama", "gpt2", "hf", "copy", "like")
_DATA_CTORS = ("synthetic", "jsonl", "parquet", "arrow")
_DEFAULT_MAX_SEQ = {"llama": 2048, "gpt2": 1024}
#: the most devices (cores or GPUs) one node may have
MAX_DEVICES_PER_NODE = 1024


class Scope:
    """What the parts of lowering share: the program, the sink, the module being built, and every
    module-level and pipeline name defined so far."""

    def __init__(self, program: ast.Program, sink: DiagnosticSink, module: Module):
        self.p = program
        self.sink = sink
        self.module = module
        self.names: dict[str, Loc] = {}   # name -> where defined
        self.failed_decls: set[str] = set()  # models/data whose declaration had an error (already reported)
        file = program.file
        self.base_dir = os.path.dirname(file) if file and not file.startswith("<") else "."
        #: per JSONL data source read at check time: (characters of its longest prompt, where it is)
        self.prompt_lengths: dict[str, tuple[int, str]] = {}

    def declare(self, name: str, loc: Loc) -> bool:
        if name in self.names:
            first = self.names[name]
            self.sink.error(f"duplicate name '{name}'", loc,
                            f"'{name}' is already defined at line {first.line}; rename one of them")
            return False
        self.names[name] = loc
        return True

    def end_loc(self) -> Loc:
        """Just after the last code of the file (where a missing declaration would go)."""
        line, col, _ = end_of_code(self.p.text)
        return Loc(self.p.file, line, col)


def _derived(source, make=None):
    """A default derived from ``source`` (``make(source)``, else ``source`` itself); when ``source`` is a value
    the verifier will reject, a placeholder instead, so that only the value written is reported."""
    if not is_positive_int(source):
        return 1
    return source if make is None else make(source)


def _set(entity, field: str, lit: ast.Literal) -> None:
    """Set ``entity.field`` from a literal and remember where it was written."""
    setattr(entity, field, value_of(lit))
    entity.field_locs[field] = lit.loc


class Declarations:
    """Builds the cluster, models, data sources and run settings of a program into ``scope.module``."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.p = scope.p
        self.sink = scope.sink
        self.module = scope.module

    # -- cluster -----------------------------------------------------------------------------
    def cluster(self) -> Cluster:
        if not self.p.clusters:
            return Cluster("local", "cpu", 1, 1)
        for extra in self.p.clusters[1:]:
            self.sink.error("a program has one cluster", extra.loc,
                            f"merge it into 'cluster {self.p.clusters[0].name}' (line {self.p.clusters[0].loc.line})")
        decl = self.p.clusters[0]
        keys = ("devices", "nodes", "gpus_per_node", "gpu", "memory")
        got: dict[str, ast.Setting] = {}
        for s in decl.settings:
            if s.name not in keys:
                self.sink.error(f"unknown cluster setting '{s.name}'", s.loc,
                                did_you_mean(s.name, keys) or f"settings: {', '.join(keys)}")
            elif s.name in got:
                self.sink.error(f"cluster setting '{s.name}' given twice", s.loc,
                                f"it is first set at line {got[s.name].loc.line}; remove one")
            else:
                got[s.name] = s
        c = Cluster(decl.name, "cpu", 1, 1, decl.loc)
        if "memory" in got:   # bytes per device, e.g. memory = "2GB" (a bad one: -1, which check_cluster reports)
            c.memory, c.field_locs["memory"] = memory_bytes(got["memory"].value) or -1, got["memory"].value.loc
        if "devices" in got:   # a local machine: devices = cpu:N
            s = got["devices"]
            if "gpu" in got or "gpus_per_node" in got:
                self.sink.error("give either 'devices = cpu:N' or 'gpu'/'gpus_per_node', not both", s.loc,
                                "devices = cpu:N describes a local CPU machine; gpu, nodes and gpus_per_node "
                                "describe a GPU cluster")
            if s.value.kind != "device":
                self.sink.error("devices must be written kind:count", s.value.loc, "e.g. devices = cpu:2")
                return c
            kind, count = s.value.value
            if kind != "cpu":
                self.sink.error(f"unknown device kind '{kind}'", s.value.loc,
                                "local devices are cpu:N; for GPUs write gpu = \"H100-80GB\" and gpus_per_node = 8")
            c.per_node = count
            c.field_locs["per_node"] = s.value.loc
        elif "gpu" in got:     # a GPU cluster: gpu = KIND, nodes, gpus_per_node
            g = got["gpu"].value
            if g.value == "cpu":   # the gpu setting names a GPU; a local CPU machine is devices = cpu:N
                self.sink.error("unknown device kind 'cpu'", g.loc, f"known kinds: {', '.join(GPU_KINDS)}")
            else:
                _set(c, "device", g)
            if "gpus_per_node" in got:
                _set(c, "per_node", got["gpus_per_node"].value)
        else:
            if set(got) - {"memory"}:
                self.sink.error("a GPU cluster needs gpu = \"KIND\"", decl.loc,
                                f"known kinds: {', '.join(GPU_KINDS)}; or write devices = cpu:N")
            return c
        if "nodes" in got:
            _set(c, "nodes", got["nodes"].value)
        if check_cluster(c, self.sink) and c.per_node > MAX_DEVICES_PER_NODE:
            # the plan lists every device: billions of them would exhaust memory in the placement pass
            self.sink.error(f"{c.per_node} devices per node is more than rlhfc plans for ({MAX_DEVICES_PER_NODE})",
                            c.field_locs.get("per_node") or decl.loc,
                            "give the devices of one machine, e.g. devices = cpu:8 or gpus_per_node = 8")
        return c

    # -- models ------------------------------------------------------------------------------
    def models(self) -> None:
        decls = {d.name: d for d in self.p.models}
        failed = self.scope.failed_decls
        pending = []
        for d in self.p.models:
            ctor = d.ctor
            if ctor.receiver is not None or ctor.name not in _MODEL_CTORS:
                shown = f"{ctor.receiver.name}.{ctor.name}" if ctor.receiver else ctor.name
                self.sink.error(f"unknown model constructor '{shown}'", ctor.name_loc,
                                did_you_mean(ctor.name, _MODEL_CTORS) or f"constructors: {', '.join(_MODEL_CTORS)}")
                failed.add(d.name)
                continue
            if ctor.name in ("copy", "like"):
                pending.append(d)
                continue
            model = self.direct_model(d)
            if model is not None:
                self.finish_model(d, model)
            else:
                failed.add(d.name)
        # copy()/like() in dependency order
        progress = True
        while pending and progress:
            progress = False
            for d in list(pending):
                args = d.ctor.args
                if len(args) != 1 or not isinstance(args[0], ast.Ref) or d.ctor.kwargs:
                    if len(args) == 1 and isinstance(args[0], ast.Ref):    # a setting after the name
                        where, hint = d.ctor.kwargs[0].loc, "options go after the call: " \
                            f"model {d.name} = {d.ctor.name}({args[0].name}) {d.ctor.kwargs[0].name} = ..."
                    else:
                        where = args[min(1, len(args) - 1)].loc if args else d.ctor.loc
                        hint = f"e.g. model {d.name} = {d.ctor.name}(actor)"
                    self.sink.error(f"{d.ctor.name}() takes one model name", where, hint)
                    failed.add(d.name)
                    pending.remove(d)
                    progress = True
                    continue
                src_name = args[0].name
                if src_name in failed:
                    failed.add(d.name)   # its source already has an error
                    pending.remove(d)
                    progress = True
                elif src_name in self.module.models:
                    src = self.module.models[src_name]
                    # copy(x): x's initial weights. like(x): x's architecture and tokenizer; for a
                    # pretrained x that means its trunk weights too (the usual critic initialisation)
                    if d.ctor.name == "copy":
                        init = Symbol(src_name)
                    else:
                        init = "pretrained" if src.source else "random"
                    m = Model(d.name, **src.config(), head=src.head, loc=d.loc, init=init, source=src.source,
                              field_locs={f: args[0].loc for f in ("arch", "head", "init") + archs.ARCH_FIELDS})
                    self.finish_model(d, m)
                    pending.remove(d)
                    progress = True
                elif src_name not in decls:
                    if any(x.name == src_name for x in self.p.data):
                        msg, hint = f"'{src_name}' is a data source, not a model", "copy a model declared with `model`"
                    else:
                        msg = f"unknown model '{src_name}'"
                        hint = did_you_mean(src_name, decls) or "declare it with `model NAME = llama(...)`"
                    self.sink.error(msg, args[0].loc, hint)
                    failed.add(d.name)
                    pending.remove(d)
                    progress = True
        # what is left copies a model that is itself still pending: a cycle, or a chain hanging off one
        src_of = {d.name: d.ctor.args[0] for d in pending}
        reported: set[str] = set()
        for d in pending:
            failed.add(d.name)
            chain, cur = [d.name], src_of[d.name].name
            while cur in src_of and cur not in chain:
                chain.append(cur)
                cur = src_of[cur].name
            if cur == d.name and d.name not in reported:   # d is the first of a loop: report the loop once
                reported.update(chain)
                self.sink.error(f"model '{d.name}' is defined in terms of itself: "
                                + " -> ".join(chain + [d.name]), src_of[d.name].loc,
                                "copy()/like() cannot form a loop; start one model of the chain from "
                                "llama(...), gpt2(...) or hf(...)")
        order = [d.name for d in self.p.models]
        self.module.models = {n: self.module.models[n] for n in order if n in self.module.models}

    def direct_model(self, d: ast.ModelDecl) -> Model | None:
        ctor = d.ctor
        if ctor.name == "hf":
            return self.hf_model(d)
        arch = ctor.name
        if ctor.args:
            self.sink.error(f"{arch}() takes keyword arguments", getattr(ctor.args[0], "loc", ctor.loc),
                            f"e.g. {arch}(layers = 2, hidden = 64, heads = 4, vocab = 96) or {arch}(size = 7B)")
            return None
        fields = ("size",) + archs.ARCH_FIELDS
        given: dict = {}
        preset: dict[str, int] = {}
        ok = True
        for kw in ctor.kwargs:
            if kw.name not in fields:
                self.sink.error(f"unknown {arch} setting '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, fields) or f"settings: {', '.join(fields)}")
                ok = False
            elif kw.name in given or (kw.name == "size" and preset):
                self.sink.error(f"'{kw.name}' given twice", kw.loc, "remove one")
                ok = False
            elif kw.name == "size":
                sizes = archs.PRESETS[arch]
                text = size_text(kw.value)
                if text not in sizes:
                    self.sink.error(f"no published {arch} config of size {text}", kw.value.loc,
                                    f"sizes: {', '.join(sizes)}; or give layers/hidden/heads/vocab")
                    ok = False
                else:
                    preset = dict(sizes[text])
            else:
                given[kw.name] = value_of(kw.value)
        if not ok:
            return None
        cfg = {**preset, **given}
        missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in cfg]
        if missing:
            self.sink.error(f"{arch}() needs {', '.join(missing)}", ctor.loc,
                            f"add {', '.join(f'{f} = {EXAMPLES[f]}' for f in missing)}, or use a published size: "
                            f"{arch}(size = {next(iter(archs.PRESETS[arch]))})")
            return None
        cfg.setdefault("kv_heads", _derived(cfg["heads"]))
        cfg.setdefault("ffn", _derived(cfg["hidden"], lambda h: archs.default_ffn(arch, h)))
        cfg.setdefault("max_seq", _DEFAULT_MAX_SEQ[arch])
        given_at = {kw.name: kw.value.loc for kw in ctor.kwargs}
        locs = {f: given_at.get(f, ctor.loc) for f in archs.ARCH_FIELDS}   # preset and defaults: the call
        locs["arch"] = ctor.name_loc
        return Model(d.name, arch, loc=d.loc, field_locs=locs, **{k: cfg[k] for k in archs.ARCH_FIELDS})

    def hf_model(self, d: ast.ModelDecl) -> Model | None:
        ctor = d.ctor
        if len(ctor.args) != 1 or not isinstance(ctor.args[0], ast.Literal) or ctor.args[0].kind != "str":
            self.sink.error("hf() takes the path of a local Hugging Face model folder", ctor.loc,
                            'e.g. model actor = hf("checkpoints/tiny-llama") trainable')
            return None
        dropout, dropout_at = False, None
        for kw in ctor.kwargs:
            value = value_of(kw.value)
            if kw.name != "dropout":
                self.sink.error(f"unknown hf setting '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, ("dropout",)) or "settings: dropout = true (keep the folder's "
                                "dropout in training; it is off by default)")
                return None
            if not isinstance(value, bool):
                self.sink.error(f"dropout must be true or false, got {value!r}", kw.value.loc,
                                "dropout = true keeps the folder's dropout; leave it out to train without")
                return None
            dropout, dropout_at = value, kw.value.loc
        lit = ctor.args[0]
        path = os.path.normpath(os.path.join(self.scope.base_dir, lit.value))
        if not os.path.isdir(path):
            self.sink.error(f"local model folder '{lit.value}' not found", lit.loc,
                            f"looked for {path}; paths are relative to the program's folder, and nothing is "
                            "downloaded from a model hub")
            return None
        cfg_path = os.path.join(path, "config.json")
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                cfg = json.load(fh)
        except (OSError, ValueError) as exc:
            self.sink.error(f"cannot read {cfg_path}: {exc.__class__.__name__}", lit.loc,
                            "a Hugging Face model folder has a config.json")
            return None
        if not isinstance(cfg, dict):
            self.sink.error(f"{cfg_path} is not a model config", lit.loc,
                            "the folder must hold a Hugging Face config.json (a JSON object)")
            return None
        mt = cfg.get("model_type")
        try:
            if mt == "llama":
                heads = cfg["num_attention_heads"]
                fields = dict(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=heads,
                              kv_heads=cfg.get("num_key_value_heads") or _derived(heads),
                              ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                              max_seq=cfg.get("max_position_embeddings", 2048))
            elif mt == "gpt2":
                hidden, heads = cfg["n_embd"], cfg["n_head"]
                fields = dict(layers=cfg["n_layer"], hidden=hidden, heads=heads, kv_heads=_derived(heads),
                              ffn=cfg.get("n_inner") or _derived(hidden, lambda h: 4 * h),
                              vocab=cfg["vocab_size"], max_seq=cfg.get("n_positions", 1024))
            else:
                self.sink.error(f"unsupported model_type {mt!r} in {cfg_path}", lit.loc,
                                f"supported: {', '.join(archs.ARCHS)}")
                return None
        except (KeyError, TypeError) as exc:
            self.sink.error(f"{cfg_path} lacks {exc.args[0]!r}" if isinstance(exc, KeyError) else
                            f"{cfg_path} is not a model config", lit.loc,
                            "the folder must hold a Hugging Face config.json for a llama or gpt2 model")
            return None
        # every field comes from the folder named here
        locs = {f: lit.loc for f in ("arch", "init", "source") + archs.ARCH_FIELDS}
        if dropout_at is not None:
            locs["dropout"] = dropout_at
        return Model(d.name, mt, loc=d.loc, init="pretrained", source=path, field_locs=locs, dropout=dropout,
                     **fields)

    def finish_model(self, d: ast.ModelDecl, m: Model) -> None:
        """Apply the options (``head = ...``) and the trainable/frozen flag, then have the verifier check it."""
        ok = True
        seen: set[str] = set()
        for opt in d.options:
            if opt.name != "head":
                self.sink.error(f"unknown model option '{opt.name}'", opt.loc,
                                did_you_mean(opt.name, ["head"]) or "options: head = lm|value|score")
                ok = False
                continue
            if opt.name in seen:
                self.sink.error(f"'{opt.name}' given twice", opt.loc, "a model has one head; remove one")
                ok = False
                continue
            seen.add(opt.name)
            _set(m, "head", opt.value)
        ok = self.clauses(d, m) and ok
        m.trainable = d.flag == "trainable"
        ok = check_model(m, self.module.models, self.sink) and ok
        if ok and d.ctor.name == "hf":   # a well-formed model: does its folder's tokenizer fit it?
            lit = d.ctor.args[0]
            problem = tokenizer_problem(m.source, lit.value, m.vocab)
            if problem is not None:
                self.sink.error(problem[0], lit.loc, problem[1])
                ok = False
        if not ok:   # leave it undeclared so later uses do not repeat the error
            self.scope.failed_decls.add(d.name)
            return
        self.module.models[m.name] = m

    def clauses(self, d: ast.ModelDecl, m: Model) -> bool:
        """Apply the call-shaped options: ``layout(dp = D, tp = T, pp = P)`` fixes the model's layout (a
        factor left out is 1); the verifier checks the values, the plan what the trainer can run."""
        ok = True
        for clause in d.clauses:
            if clause.name == "lora":
                ok = self.lora(clause, m) and ok
                continue
            problem = None if clause.name == "layout" else (
                f"unknown model clause '{clause.name}(...)'", clause.name_loc,
                did_you_mean(clause.name, ["layout", "lora"]) or
                "clauses: layout(dp = D, tp = T, pp = P), lora(rank = R, alpha = A, targets = [...])")
            if problem is None and m.layout is not None:
                problem = ("'layout' given twice", clause.name_loc, "a model has one layout; remove one")
            if problem is None and clause.args:
                problem = ("layout() takes keyword settings", getattr(clause.args[0], "loc", clause.loc),
                           "e.g. layout(dp = 2, tp = 2, pp = 1); a factor left out is 1")
            if problem is not None:
                self.sink.error(*problem)
                ok = False
                continue
            layout = {k: 1 for k in LAYOUT_FACTORS}
            m.field_locs["layout"] = clause.name_loc
            for kw in clause.kwargs:
                if kw.name not in LAYOUT_FACTORS:
                    self.sink.error(f"unknown layout factor '{kw.name}'", kw.loc,
                                    did_you_mean(kw.name, LAYOUT_FACTORS) or
                                    "factors: dp (data), tp (tensor), pp (pipeline parallel)")
                    ok = False
                elif f"layout.{kw.name}" in m.field_locs:
                    self.sink.error(f"'{kw.name}' given twice", kw.loc, "remove one")
                    ok = False
                else:
                    layout[kw.name] = value_of(kw.value)
                    m.field_locs[f"layout.{kw.name}"] = kw.value.loc
            m.layout = layout
        return ok

    def lora(self, clause, m: Model) -> bool:
        """``lora(rank = 8, alpha = 16, targets = [q_proj, v_proj])``: LoRA adapters on the policy (defaults:
        rank 8, alpha 16, the attention's query and value projections); the verifier checks the values."""
        problem = ("'lora' given twice", clause.name_loc, "a model has one set of adapters; remove one") \
            if m.lora is not None else ("lora() takes keyword settings", getattr(clause.args[0], "loc", clause.loc),
                                        "e.g. lora(rank = 8, alpha = 16, targets = [q_proj, v_proj])") \
            if clause.args else None
        if problem is not None:
            self.sink.error(*problem)
            return False
        lora, ok = {"alpha": 16, "rank": 8, "targets": list(DEFAULT_TARGETS.get(m.arch, ["q_proj"]))}, True
        m.field_locs["lora"] = clause.name_loc
        for kw in clause.kwargs:
            if kw.name not in LORA_KEYS or f"lora.{kw.name}" in m.field_locs:
                self.sink.error(f"'{kw.name}' given twice" if kw.name in LORA_KEYS else
                                f"unknown LoRA setting '{kw.name}'", kw.loc, "remove one" if kw.name in LORA_KEYS
                                else did_you_mean(kw.name, LORA_KEYS) or "settings: rank, alpha, targets")
                ok = False
                continue
            value = value_of(kw.value)
            lora[kw.name] = [value] if kw.name == "targets" and isinstance(value, str) else value
            m.field_locs[f"lora.{kw.name}"] = kw.value.loc
        m.lora = lora
        return ok

    # -- data --------------------------------------------------------------------------------
    def data(self) -> None:
        for d in self.p.data:
            c = d.ctor
            if c.receiver is not None or c.name not in _DATA_CTORS:
                self.sink.error(f"unknown data source '{c.name}'", c.name_loc,
                                did_you_mean(c.name, _DATA_CTORS) or f"sources: {', '.join(_DATA_CTORS)}")
                self.scope.failed_decls.add(d.name)
                continue
            src = self.synthetic(d) if c.name == "synthetic" else self.jsonl(d)   # jsonl, parquet, arrow
            if src is not None and check_data(src, self.sink):
                self.module.data[d.name] = src
            else:
                self.scope.failed_decls.add(d.name)

    def synthetic(self, d: ast.DataDecl) -> DataSource | None:
        return lower_synthetic(d, self.sink)

    def jsonl(self, d: ast.DataDecl) -> DataSource | None:
        return lower_jsonl(d, self.scope.base_dir, self.scope.prompt_lengths, self.sink)

    # -- tools -------------------------------------------------------------------------------
    def tools(self, allowed: list[str]) -> None:
        """``tool NAME = python("module:function", timeout = 2, memory = 256M, max_output = 1024)`` and
        ``env NAME = python("module:Class")``: the function or class is checked where it lives
        (:func:`rlhfc.frontend.rules.tool_problem`), never imported."""
        for d in self.p.tools:
            c = d.ctor
            env = d.kind == "env"
            if c.receiver is not None or c.name != "python":
                self.sink.error(f"unknown {d.kind} kind '{c.name}'", c.name_loc,
                                'environments: python("module:Class")' if env else
                                'tools: python("module:function", timeout = 2, memory = 256M)')
                continue
            if len(c.args) != 1 or not isinstance(c.args[0], ast.Literal) or c.args[0].kind != "str":
                self.sink.error(f'python() takes the {"environment class" if env else "tool function"} first, as '
                                f'"module:{"Class" if env else "function"}"', c.loc,
                                'e.g. env game = python("envs:Game")' if env else
                                'e.g. tool calc = python("tools:calculator", timeout = 2)')
                continue
            tool = Tool(d.name, str(c.args[0].value), kind=d.kind, loc=d.loc)
            tool.field_locs["fn"] = c.args[0].loc
            ok = True
            for kw in c.kwargs:
                key = {"memory": "memory_mb"}.get(kw.name, kw.name)
                if env and key not in ("timeout", "memory_mb"):
                    self.sink.error(f"python() of environment '{d.name}' has no setting '{kw.name}'", kw.loc,
                                    did_you_mean(kw.name, ("timeout", "memory")) or
                                    "settings: timeout (seconds per reset or step), memory (e.g. 512M)")
                    ok = False
                    continue
                if key not in ("timeout", "memory_mb", "max_output"):
                    self.sink.error(f"python() of tool '{d.name}' has no setting '{kw.name}'", kw.loc,
                                    did_you_mean(kw.name, ("timeout", "memory", "max_output")) or
                                    "settings: timeout (seconds), memory (e.g. 256M), max_output (characters)")
                    ok = False
                    continue
                lit = kw.value
                if key == "timeout":
                    value = float(lit.value) if lit.kind in ("int", "float") else None
                elif key == "memory_mb":   # a size (256M: bytes) or an integer of megabytes
                    value = int(round(lit.value / 10**6)) if lit.kind == "size" else \
                        int(lit.value) if lit.kind == "int" else None
                else:
                    value = int(lit.value) if lit.kind == "int" else None
                low = {"timeout": 0.01, "memory_mb": 16, "max_output": 1}[key]
                if value is None or value < low:
                    self.sink.error(f"{'environment' if env else 'tool'} setting '{kw.name}' must be {'a number of seconds' if key == 'timeout' else 'a size such as 256M' if key == 'memory_mb' else 'an integer'} "
                                    f"of at least {low if key != 'memory_mb' else '16M'}, got {lit.value!r}", lit.loc,
                                    {"timeout": "timeout = 2", "memory_mb": "memory = 256M",
                                     "max_output": "max_output = 1024"}[key])
                    ok = False
                    continue
                setattr(tool, key, value)
                tool.field_locs[key] = lit.loc
            problem = tool_problem(tool.fn, self.scope.base_dir, allowed, d.kind)
            if problem is not None:
                self.sink.error(problem[0], c.args[0].loc, problem[1])
                ok = False
            if ok:
                self.module.tools[d.name] = tool

    # -- run ---------------------------------------------------------------------------------
    def run_block(self) -> RunConfig:
        rc = RunConfig()
        if not self.p.runs:
            self._default_trainer(rc)
            return rc
        for extra in self.p.runs[1:]:
            self.sink.error("a program has one run block", extra.loc,
                            f"merge its settings into the run block at line {self.p.runs[0].loc.line}")
        decl = self.p.runs[0]
        rc.loc = decl.loc
        seen = set()
        for s in decl.settings:
            if s.name not in RUN_KEYS:
                self.sink.error(f"unknown run setting '{s.name}'", s.loc,
                                did_you_mean(s.name, RUN_KEYS) or f"settings: {', '.join(RUN_KEYS)}")
                continue
            if s.name in seen:
                self.sink.error(f"run setting '{s.name}' given twice", s.loc, "remove one")
                continue
            seen.add(s.name)
            _set(rc, s.name, s.value)
        if "trainer" not in seen:
            self._default_trainer(rc)
        check_run(rc, self.sink)
        return rc

    def _default_trainer(self, rc: RunConfig) -> None:
        """Without ``trainer = ...``: ``auto`` where a model's ``layout(...)`` needs several processes (each model
        then runs on a backend that runs its layout; printed in the IR), else the one-process default."""
        if any((fixed_layout(m) or Parallel(1, 1, 1)).size > 1 for m in self.scope.module.models.values()):
            rc.trainer = AUTO


__all__ = ["Scope", "Declarations"]
