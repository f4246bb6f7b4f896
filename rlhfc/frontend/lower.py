"""Lower the AST to the IR: resolve names, check types, order the pipeline, fill defaults.

Every user mistake becomes a diagnostic with a location and, where one helps, a
hint; lowering keeps going after an error so one run reports every independent
problem, then raises a single CompileError. Warnings (unused values, models,
data) are returned, not raised.
"""

from __future__ import annotations

import json
import os

import networkx as nx

from rlhfc.ir import arch as archs
from rlhfc.ir.core import RUN_KEYS, Cluster, DataSource, Graph, Model, Module, RunConfig, Stage, Symbol, Value
from rlhfc.ir.devices import GPU_KINDS
from rlhfc.ir.diagnostics import DiagnosticSink, Loc, did_you_mean
from rlhfc.ir.ops import BUILTIN_OPS, LOSS_FOR_HEAD, METHOD_OPS, get_op
from rlhfc.ir.verifier import check_attr_value

from . import ast
from .parser import end_of_code

_OPT_LEVELS = ("O0", "O1", "O2", "O3")
_PLACEMENTS = ("auto", "flatten", "interleave", "separate", "search")
_MODEL_CTORS = ("llama", "gpt2", "hf", "copy", "like")
_DATA_CTORS = ("synthetic", "jsonl")
_PIPELINE_PARAMS = {"batch": 8}
_DEFAULT_MAX_SEQ = {"llama": 2048, "gpt2": 1024}
_EXAMPLE_INT = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "vocab": 96, "max_seq": 64,
                "nodes": 2, "gpus_per_node": 8, "batch": 8, "count": 1024, "min_len": 4, "max_len": 16, "seed": 0,
                "steps": 100, "checkpoint_every": 10}
_LITERAL_KIND_NAMES = {"int": "an integer", "float": "a number", "size": "a size", "str": "a string",
                       "bool": "a bool", "ident": "a name", "device": "a device count"}


class _Failed(Exception):
    """A statement could not be lowered; its error is already in the sink."""


def lower(program: ast.Program, sink: DiagnosticSink) -> Module:
    """Lower a parsed program; errors go to ``sink`` (caller raises), the module is returned best-effort."""
    return _Lowerer(program, sink).run()


class _Lowerer:
    def __init__(self, program: ast.Program, sink: DiagnosticSink):
        self.p = program
        self.sink = sink
        self.base_dir = os.path.dirname(program.file) if program.file and not program.file.startswith("<") else "."
        self.names: dict[str, Loc] = {}   # every module-level and pipeline name -> where defined
        self.failed_decls: set[str] = set()  # models/data whose declaration had an error (already reported)

    # -- entry -------------------------------------------------------------------------------
    def run(self) -> Module:
        name = os.path.splitext(os.path.basename(self.p.file))[0] if not self.p.file.startswith("<") else "main"
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "main"
        if name[0].isdigit():
            name = "m_" + name
        cluster = self.cluster()
        module = Module(name=name, cluster=cluster)
        self.module = module
        for d in self.p.models:
            self.declare(d.name, d.name_loc)
        for d in self.p.data:
            self.declare(d.name, d.name_loc)
        self.models()
        self.data()
        module.run = self.run_block()
        module.graph = self.pipeline()
        module.refresh_versions()
        self.warn_unused()
        return module

    def end_loc(self) -> Loc:
        """Just after the last code of the file (where a missing declaration would go)."""
        line, col, _ = end_of_code(self.p.text)
        return Loc(self.p.file, line, col)

    def declare(self, name: str, loc: Loc) -> bool:
        if name in self.names:
            first = self.names[name]
            self.sink.error(f"duplicate name '{name}'", loc,
                            f"'{name}' is already defined at line {first.line}; rename one of them")
            return False
        self.names[name] = loc
        return True

    # -- cluster -----------------------------------------------------------------------------
    def cluster(self) -> Cluster:
        if not self.p.clusters:
            return Cluster("local", "cpu", 1, 1)
        for extra in self.p.clusters[1:]:
            self.sink.error("a program has one cluster", extra.loc,
                            f"merge it into 'cluster {self.p.clusters[0].name}' (line {self.p.clusters[0].loc.line})")
        decl = self.p.clusters[0]
        keys = ("devices", "nodes", "gpus_per_node", "gpu")
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
        if "devices" in got:
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
            if count < 1:
                self.sink.error("a cluster needs at least one device", s.value.loc, "e.g. devices = cpu:2")
            c.per_node = max(count, 1)
            if "nodes" in got:
                c.nodes = self.positive_int(got["nodes"].value, "nodes") or 1
            return c
        if "gpu" not in got:
            if got:
                self.sink.error("a GPU cluster needs gpu = \"KIND\"", decl.loc,
                                f"known kinds: {', '.join(GPU_KINDS)}; or write devices = cpu:N")
            return c
        g = got["gpu"].value
        kind = str(g.value)
        if g.kind not in ("str", "ident"):
            self.sink.error("gpu must be a device kind name", g.loc, f"known kinds: {', '.join(GPU_KINDS)}")
        elif kind not in GPU_KINDS:
            self.sink.error(f"unknown device kind '{kind}'", g.loc,
                            " ".join(filter(None, [did_you_mean(kind, GPU_KINDS),
                                                   f"known kinds: {', '.join(GPU_KINDS)}"])))
        else:
            c.device = kind
        c.nodes = self.positive_int(got["nodes"].value, "nodes") if "nodes" in got else 1
        c.per_node = self.positive_int(got["gpus_per_node"].value, "gpus_per_node") if "gpus_per_node" in got else 1
        c.nodes, c.per_node = c.nodes or 1, c.per_node or 1
        return c

    def positive_int(self, lit: ast.Literal, what: str) -> int | None:
        if lit.kind not in ("int", "size") or lit.value < 1:
            self.sink.error(f"{what} must be a positive integer, got {_show(lit)}", lit.loc,
                            f"e.g. {what} = {_EXAMPLE_INT.get(what, 1)}")
            return None
        return int(lit.value)

    # -- models ------------------------------------------------------------------------------
    def models(self) -> None:
        decls = {d.name: d for d in self.p.models}
        pending = []
        for d in self.p.models:
            ctor = d.ctor
            if ctor.receiver is not None or ctor.name not in _MODEL_CTORS:
                shown = f"{ctor.receiver.name}.{ctor.name}" if ctor.receiver else ctor.name
                self.sink.error(f"unknown model constructor '{shown}'", ctor.name_loc,
                                did_you_mean(ctor.name, _MODEL_CTORS) or f"constructors: {', '.join(_MODEL_CTORS)}")
                self.failed_decls.add(d.name)
                continue
            if ctor.name in ("copy", "like"):
                pending.append(d)
                continue
            model = self.direct_model(d)
            if model is not None:
                self.finish_model(d, model)
            else:
                self.failed_decls.add(d.name)
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
                    self.failed_decls.add(d.name)
                    pending.remove(d)
                    progress = True
                    continue
                src_name = args[0].name
                if src_name in self.failed_decls:
                    self.failed_decls.add(d.name)   # its source already has an error
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
                    m = Model(d.name, **src.config(), head=src.head, loc=d.loc, init=init, source=src.source)
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
                    self.failed_decls.add(d.name)
                    pending.remove(d)
                    progress = True
        # what is left copies a model that is itself still pending: a cycle, or a chain hanging off one
        src_of = {d.name: d.ctor.args[0] for d in pending}
        reported: set[str] = set()
        for d in pending:
            self.failed_decls.add(d.name)
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
        given: dict[str, int] = {}
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
                text = _size_text(kw.value)
                if text not in sizes:
                    self.sink.error(f"no published {arch} config of size {text}", kw.value.loc,
                                    f"sizes: {', '.join(sizes)}; or give layers/hidden/heads/vocab")
                    ok = False
                else:
                    preset = dict(sizes[text])
            else:
                v = self.positive_int(kw.value, kw.name)
                if v is None:
                    ok = False
                else:
                    given[kw.name] = v
        if not ok:
            return None
        cfg = {**preset, **given}
        missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in cfg]
        if missing:
            self.sink.error(f"{arch}() needs {', '.join(missing)}", ctor.loc,
                            f"add {', '.join(f'{f} = {_EXAMPLE_INT[f]}' for f in missing)}, or use a published size: "
                            f"{arch}(size = {next(iter(archs.PRESETS[arch]))})")
            return None
        cfg.setdefault("kv_heads", cfg["heads"])
        cfg.setdefault("ffn", archs.default_ffn(arch, cfg["hidden"]))
        cfg.setdefault("max_seq", _DEFAULT_MAX_SEQ[arch])
        given_at = {kw.name: kw.value.loc for kw in ctor.kwargs}
        if not self.check_shape({**cfg, "arch": arch}, lambda f: given_at.get(f, ctor.loc)):
            return None
        return Model(d.name, arch, loc=d.loc, **{k: cfg[k] for k in archs.ARCH_FIELDS})

    def check_shape(self, cfg: dict, where) -> bool:
        """Attention shapes must divide evenly (checked here so the error points at the setting)."""
        ok = True
        if cfg["hidden"] % cfg["heads"]:
            divisors = [h for h in range(1, min(cfg["hidden"], 128) + 1) if cfg["hidden"] % h == 0]
            near = sorted(divisors, key=lambda h: (abs(h - cfg["heads"]), h))[:3]
            self.sink.error(f"hidden ({cfg['hidden']}) is not divisible by heads ({cfg['heads']})", where("heads"),
                            f"each head gets hidden / heads dimensions; try heads = "
                            f"{' or '.join(map(str, sorted(near)))}")
            ok = False
        if cfg.get("arch") == "gpt2" and cfg["kv_heads"] != cfg["heads"]:
            self.sink.error(f"gpt2 has no grouped-query attention: kv_heads ({cfg['kv_heads']}) must equal heads "
                            f"({cfg['heads']})", where("kv_heads"), "drop kv_heads for gpt2 models, or use llama")
            return False
        if cfg["heads"] % cfg["kv_heads"]:
            self.sink.error(f"heads ({cfg['heads']}) is not divisible by kv_heads ({cfg['kv_heads']})",
                            where("kv_heads"),
                            "grouped-query attention shares each key/value head among heads / kv_heads query "
                            "heads; choose kv_heads that divides heads")
            ok = False
        return ok

    def hf_model(self, d: ast.ModelDecl) -> Model | None:
        ctor = d.ctor
        if len(ctor.args) != 1 or not isinstance(ctor.args[0], ast.Literal) or ctor.args[0].kind != "str" \
                or ctor.kwargs:
            self.sink.error("hf() takes the path of a local Hugging Face model folder", ctor.loc,
                            'e.g. model actor = hf("checkpoints/tiny-llama") trainable')
            return None
        lit = ctor.args[0]
        path = os.path.normpath(os.path.join(self.base_dir, lit.value))
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
                fields = dict(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                              heads=cfg["num_attention_heads"],
                              kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                              ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                              max_seq=cfg.get("max_position_embeddings", 2048))
            elif mt == "gpt2":
                fields = dict(layers=cfg["n_layer"], hidden=cfg["n_embd"], heads=cfg["n_head"],
                              kv_heads=cfg["n_head"], ffn=cfg.get("n_inner") or 4 * cfg["n_embd"],
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
        bad = [k for k, v in fields.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            self.sink.error(f"{cfg_path}: '{bad[0]}' is {fields[bad[0]]!r}, not a positive integer", lit.loc,
                            "fix the model's config.json")
            return None
        if not self.check_shape(fields, lambda f: lit.loc):
            return None
        return Model(d.name, mt, loc=d.loc, init="pretrained", source=path, **fields)

    def finish_model(self, d: ast.ModelDecl, m: Model) -> None:
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
            head = opt.value.value
            if opt.value.kind not in ("ident", "str") or head not in archs.HEADS:
                self.sink.error(f"unknown head '{_show(opt.value)}'", opt.value.loc,
                                did_you_mean(str(head), archs.HEADS) or
                                "heads: lm (a policy), value (a critic), score (a reward model)")
                ok = False
                continue
            m.head = head
        if not ok:   # leave it undeclared so later uses do not repeat the error
            self.failed_decls.add(d.name)
            return
        m.trainable = d.flag == "trainable"
        self.module.models[m.name] = m

    # -- data --------------------------------------------------------------------------------
    def data(self) -> None:
        for d in self.p.data:
            c = d.ctor
            if c.receiver is not None or c.name not in _DATA_CTORS:
                self.sink.error(f"unknown data source '{c.name}'", c.name_loc,
                                did_you_mean(c.name, _DATA_CTORS) or f"sources: {', '.join(_DATA_CTORS)}")
                self.failed_decls.add(d.name)
                continue
            if c.name == "synthetic":
                src = self.synthetic(d)
            else:
                src = self.jsonl(d)
            if src is not None:
                self.module.data[d.name] = src
            else:
                self.failed_decls.add(d.name)

    def synthetic(self, d: ast.DataDecl) -> DataSource | None:
        c = d.ctor
        opts = {"count": 1024, "min_len": 4, "max_len": 16, "seed": 0}
        if c.args:
            self.sink.error("synthetic() takes keyword arguments", getattr(c.args[0], "loc", c.loc),
                            "e.g. synthetic(count = 4096, min_len = 4, max_len = 16)")
            return None
        for kw in c.kwargs:
            if kw.name not in opts:
                self.sink.error(f"unknown synthetic setting '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, opts) or f"settings: {', '.join(opts)}")
                return None
            lo = 0 if kw.name == "seed" else 1
            if kw.value.kind not in ("int", "size") or kw.value.value < lo:
                self.sink.error(f"'{kw.name}' must be {'a positive' if lo else 'a non-negative'} integer, "
                                f"got {_show(kw.value)}", kw.value.loc, f"e.g. {kw.name} = {_EXAMPLE_INT[kw.name]}")
                return None
            opts[kw.name] = int(kw.value.value)
        if opts["min_len"] > opts["max_len"]:
            at = {kw.name: kw.value.loc for kw in c.kwargs}
            self.sink.error(f"min_len ({opts['min_len']}) is larger than max_len ({opts['max_len']})",
                            at.get("min_len", at.get("max_len", c.loc)),
                            "prompt lengths are drawn from min_len to max_len; make min_len <= max_len")
            return None
        return DataSource(d.name, "synthetic", opts, d.loc)

    def jsonl(self, d: ast.DataDecl) -> DataSource | None:
        c = d.ctor
        if len(c.args) != 1 or not isinstance(c.args[0], ast.Literal) or c.args[0].kind != "str":
            self.sink.error("jsonl() takes a file path", c.loc, 'e.g. jsonl("prompts.jsonl", field = "prompt")')
            return None
        field = "prompt"
        for kw in c.kwargs:
            if kw.name != "field":
                self.sink.error(f"unknown jsonl setting '{kw.name}'", kw.loc, "settings: field")
                return None
            if kw.value.kind not in ("str", "ident"):
                self.sink.error("field must be a string", kw.value.loc, 'the JSON key holding the prompt, e.g. field = "prompt"')
                return None
            field = str(kw.value.value)
        lit = c.args[0]
        path = os.path.normpath(os.path.join(self.base_dir, lit.value))
        if not os.path.isfile(path):
            self.sink.error(f"data file '{lit.value}' not found", lit.loc,
                            f"looked for {path}; paths are relative to the program's folder")
            return None
        return DataSource(d.name, "jsonl", {"path": path, "field": field}, d.loc)

    # -- run ---------------------------------------------------------------------------------
    def run_block(self) -> RunConfig:
        rc = RunConfig()
        if not self.p.runs:
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
            v = s.value
            if s.name == "optimize":
                if v.kind not in ("ident", "str") or v.value not in _OPT_LEVELS:
                    self.sink.error(f"optimize must be one of {', '.join(_OPT_LEVELS)}, got {_show(v)}", v.loc,
                                    "O0 runs no passes, O1 is the default; e.g. optimize = O2")
                else:
                    rc.optimize = v.value
                continue
            if s.name == "placement":
                if v.kind not in ("ident", "str") or v.value not in _PLACEMENTS:
                    self.sink.error(f"placement must be one of {', '.join(_PLACEMENTS)}, got {_show(v)}", v.loc,
                                    "auto searches on multi-device clusters; e.g. placement = interleave")
                else:
                    rc.placement = v.value
                continue
            lo = 1 if s.name == "steps" else 0
            if v.kind not in ("int", "size") or v.value < lo:
                self.sink.error(f"{s.name} must be an integer >= {lo}, got {_show(v)}", v.loc,
                                f"e.g. {s.name} = {_EXAMPLE_INT.get(s.name, lo)}")
                continue
            setattr(rc, s.name, int(v.value))
        return rc

    # -- pipeline ----------------------------------------------------------------------------
    def pipeline(self) -> Graph:
        if not self.p.pipelines:
            self.sink.error("the program has no pipeline", self.end_loc(),
                            "add `pipeline ppo(batch = 8) { roll = actor.generate(prompts) ... }`")
            return Graph("main")
        for extra in self.p.pipelines[1:]:
            self.sink.error("a program has one pipeline", extra.loc,
                            f"the first is '{self.p.pipelines[0].name}' at line {self.p.pipelines[0].loc.line}")
        decl = self.p.pipelines[0]
        params = dict(_PIPELINE_PARAMS)
        for kw in decl.params:
            if kw.name not in _PIPELINE_PARAMS:
                self.sink.error(f"unknown pipeline parameter '{kw.name}'", kw.loc,
                                did_you_mean(kw.name, _PIPELINE_PARAMS) or "parameters: batch")
                continue
            if kw.value.kind not in ("int", "size") or kw.value.value < 1:
                self.sink.error(f"batch must be a positive integer, got {_show(kw.value)}", kw.value.loc,
                                "the number of prompts per step, e.g. pipeline ppo(batch = 32)")
                continue
            params[kw.name] = int(kw.value.value)
        self.graph = Graph(decl.name, params, loc=decl.loc)
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
                if not self.declare(t.name, t.loc):
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
        attrs_from_args: dict = {}
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
            attrs_from_args["fn"] = fn.value
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
                            _arg_loc(extra) if extra is not None else call.loc,
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
                                _arg_loc(arg), _type_hint(operand.kinds, v.type.kind))
                raise _Failed
            inputs.append(v)
        batches = sorted({v.type.batch for v in inputs if v.type.batch is not None})
        if len(batches) > 1 and spec.op != "train":
            self.sink.error(f"arguments of {shown} have different batch sizes {batches}", call.loc,
                            "per-sample values must come from the same rollout")
            raise _Failed
        attrs = self.attrs(call, spec, attrs_from_args)
        if spec.op == "compute.group_advantages":
            gen = self.graph.producer(inputs[0])
            attrs["group"] = int(gen.attrs.get("n", 1)) if gen.op == "generate" else 1
            if attrs["group"] < 2:
                self.sink.warning("group_advantages over groups of 1 sample gives zero advantages", call.loc,
                                  "generate several samples per prompt: actor.generate(prompts, n = 4)")
        self.check_model(call, spec, target, inputs)
        result_types = spec.result_types([v.type for v in inputs], attrs)
        if names and len(names) == len(result_types):
            out_names = names
        else:
            base = f"{target}_{call.name}" if target and spec.model == "model" else call.name
            out_names = [self.graph.fresh_name(base if i == 0 else f"{base}_{i}") for i in range(len(result_types))]
            out_names = [n if n not in self.names or n in self.values else self.graph.fresh_name(n + "_v")
                         for n in out_names]
        outputs = [Value(n, t) for n, t in zip(out_names, result_types)]
        stage = Stage(spec.op, target, inputs, outputs, attrs, {}, call.loc)
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
            self.sink.error(f"expected a value, got {_LITERAL_KIND_NAMES.get(arg.kind, arg.kind)} {_show(arg)}",
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

    def attrs(self, call: ast.Call, spec, preset: dict) -> dict:
        attrs = dict(preset)
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
            value = _coerce(kw.value, a.kind)
            if value is None:
                self.sink.error(f"'{kw.name}' expects {_LITERAL_KIND_NAMES.get(a.kind, a.kind)}, "
                                f"got {_LITERAL_KIND_NAMES.get(kw.value.kind, kw.value.kind)} {_show(kw.value)}",
                                kw.value.loc, _attr_hint(kw.name, a))
                ok = False
                continue
            why = check_attr_value(a, value)
            if why:
                self.sink.error(f"'{kw.name}' {why}", kw.value.loc, _attr_hint(kw.name, a))
                ok = False
                continue
            attrs[kw.name] = value
        for a in spec.attrs:
            if a.name in attrs:
                continue
            if a.required:
                self.sink.error(f"{_callee_text(call)} needs '{a.name}'", call.loc, _attr_hint(a.name, a))
                ok = False
                continue
            attrs[a.name] = a.default
        if not ok:
            raise _Failed
        return {a.name: attrs[a.name] for a in spec.attrs}

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
                                f"got a {got}", _arg_loc(call.args[0]), f"train it with {fix}")
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
        g = self.graph if hasattr(self, "graph") else None
        if g is None:
            return
        used = {id(v) for s in g.stages for v in s.inputs}
        for s in g.stages:
            for v in s.outputs:
                if id(v) in used or v.type.kind == "Metrics" or v.name not in self.bound_at:
                    continue
                self.sink.warning(f"value '{v.name}' is never used", self.bound_at[v.name],
                                  "remove it, or pass it to a stage that needs it")
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


def _coerce(lit: ast.Literal, kind: str):
    if kind == "int":
        return int(lit.value) if lit.kind in ("int", "size") else None
    if kind == "float":
        return float(lit.value) if lit.kind in ("int", "float", "size") else None
    if kind == "str":
        return str(lit.value) if lit.kind in ("str", "ident") else None
    if kind == "bool":
        return lit.value if lit.kind == "bool" else None
    return None


def _show(lit: ast.Literal) -> str:
    if lit.kind == "str":
        return json.dumps(lit.value)
    if lit.kind == "bool":
        return "true" if lit.value else "false"
    if lit.kind == "device":
        return f"{lit.value[0]}:{lit.value[1]}"
    return str(lit.value)


def _size_text(lit: ast.Literal) -> str:
    if lit.kind == "size":
        n = lit.value
        for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
            if n >= scale:
                text = f"{n / scale:.3g}"
                return f"{text}{unit}"
        return str(n)
    return str(lit.value)


def _attr_hint(name: str, a) -> str:
    """What a setting means and a valid way to write it."""
    if a.choices:
        allowed, example = f"one of {', '.join(map(str, a.choices))}", a.choices[0]
    elif a.kind == "bool":
        allowed, example = "true or false", "true"
    else:
        bounds = [f">= {a.min}" if a.min is not None else "", f"<= {a.max}" if a.max is not None else ""]
        allowed = {"float": "a number", "int": "an integer", "str": "a string"}.get(a.kind, a.kind)
        allowed += " " + " and ".join(filter(None, bounds)) if any(bounds) else ""
        example = a.default if a.default is not None else (a.min if a.min is not None else 1)
        if a.kind == "str":
            example = json.dumps(str(example))
    return f"{a.doc + ' ' if a.doc else ''}({allowed}); e.g. {name} = {example}"


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


def _arg_loc(arg) -> Loc:
    return arg.loc


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



