"""Parse IR text (``.rlir``) back into a :class:`Module`.

``print_module(parse_ir(text)) == text`` for any text the printer produced;
hand-written text (other whitespace, ``//`` comments, version edges or keys in
another order) parses to the same module and prints canonically.

Errors (syntax, unknown or missing keys, undefined values, duplicates) are
:class:`CompileError`s located at the offending token of the ``.rlir`` file.
Semantic checks are the verifier's job; so that its messages can point into
the ``.rlir`` file too, every parsed entity records its position in ``ir_loc``
and the position of each of its keys in ``field_locs`` (never printed).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from lark import Lark, Token, Transformer, Tree
from lark.exceptions import UnexpectedInput, VisitError

from .core import (DATA_OPTIONS, ENV_DEFAULTS, RUN_KEYS, TOOL_DEFAULTS, Cluster, DataSource, Graph, Model, Module, RunConfig,
                   Stage, Symbol, Tool, Value, VersionEdge)
from .diagnostics import CompileError, Diagnostic, Loc, did_you_mean
from .larkdiag import syntax_diagnostic
from .types import ValueType

_CLUSTER_KEYS = ("device", "nodes", "per_node")
_MODEL_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq",
               "head", "trainable", "init", "source")


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("rlhfc.ir").joinpath("rlir.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


class _KeyedDict(dict):
    """A parsed ``{k = v, ...}``: a dict that remembers the token of each key (for error locations)."""

    key_tokens: dict


class _Attrs(Transformer):
    """Attribute values -> Python values."""

    def int(self, items):
        return int(items[0])

    def float(self, items):
        return float(items[0])

    def string(self, items):
        return json.loads(items[0])

    def true(self, _):
        return True

    def false(self, _):
        return False

    def symbol(self, items):
        return Symbol(str(items[0])[1:])

    def list(self, items):
        return [i for i in items if i is not None]

    def entry(self, items):
        return (str(items[0]), items[1], items[0])

    def dict(self, items):
        out = _KeyedDict()
        out.key_tokens = {}
        for item in items:
            if item is None:
                continue
            key, value, tok = item
            if key in out:
                raise _Fail(f"duplicate key '{key}'", tok, "give each key once")
            out[key] = value
            out.key_tokens[key] = tok
        return out


class _Fail(Exception):
    """A located parse error: ``where`` is a Token or a Tree (its first position is used)."""

    def __init__(self, message: str, where=None, hint: str | None = None):
        super().__init__(message)
        self.message, self.where, self.hint = message, where, hint


def parse_ir(text: str, file: str = "<ir>") -> Module:
    """Parse ``.rlir`` text into a Module (raises CompileError). The module is not verified."""
    parser = _parser()
    try:
        tree = parser.parse(text)
    except UnexpectedInput as exc:
        raise CompileError([syntax_diagnostic(exc, parser, file, text)], text) from None
    try:
        tree = _Attrs().transform(tree)
        return _Builder(file).build(tree.children[0])
    except VisitError as exc:
        inner = exc.orig_exc
        if isinstance(inner, _Fail):
            raise _to_error(inner, file, text) from None
        raise
    except _Fail as exc:
        raise _to_error(exc, file, text) from None


def _position(where) -> tuple[int, int] | None:
    if isinstance(where, Token) and getattr(where, "line", None):
        return where.line, where.column
    if isinstance(where, Tree) and not where.meta.empty:
        return where.meta.line, where.meta.column
    return None


def _to_error(exc: _Fail, file: str, text: str) -> CompileError:
    pos = _position(exc.where)
    loc = Loc(file, *pos) if pos else None
    return CompileError([Diagnostic("error", exc.message, loc, exc.hint)], text)


def _plain(d) -> dict:
    """A parsed dict as a plain dict (nested ones too), without key tokens."""
    if isinstance(d, dict):
        return {k: _plain(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_plain(v) for v in d]
    return d


class _Builder:
    def __init__(self, file: str):
        self.file = file

    def build(self, tree: Tree) -> Module:
        sym, annot, *items = tree.children
        module = Module(name=str(sym)[1:], cluster=None, annotations=self.annot(annot))  # type: ignore[arg-type]
        cluster_seen = run_seen = graph_seen = False
        for item in items:
            kind = item.data
            if kind == "cluster":
                if cluster_seen:
                    raise _Fail("a module has one cluster", item.children[0], "merge the two cluster lines")
                module.cluster = self.cluster(item)
                cluster_seen = True
            elif kind == "model":
                m = self.model(item)
                if m.name in module.models:
                    raise _Fail(f"duplicate model @{m.name}", item.children[0], "rename one of them")
                module.models[m.name] = m
            elif kind == "data":
                d = self.data(item)
                if d.name in module.data:
                    raise _Fail(f"duplicate data source @{d.name}", item.children[0], "rename one of them")
                module.data[d.name] = d
            elif kind in ("tool", "env"):
                t = self.tool(item, kind)
                if t.name in module.tools:
                    raise _Fail(f"duplicate tool @{t.name}", item.children[0], "rename one of them")
                module.tools[t.name] = t
            elif kind == "run":
                if run_seen:
                    raise _Fail("a module has one run block", item, "merge the two run lines")
                module.run = self.run(item)
                run_seen = True
            elif kind == "graph":
                if graph_seen:
                    raise _Fail("a module has one graph", item.children[0], "merge the two graphs")
                module.graph = self.graph(item)
                graph_seen = True
        if not cluster_seen:
            raise _Fail("module has no cluster", sym, 'add `cluster @local {device = "cpu", nodes = 1, per_node = 1}`')
        if not graph_seen:
            raise _Fail("module has no graph", sym, "add `graph @main {batch = 8} { ... }`")
        return module

    # -- helpers ---------------------------------------------------------------------------
    def here(self, where) -> Loc | None:
        pos = _position(where)
        return Loc(self.file, *pos) if pos else None

    def loc(self, tree) -> Loc | None:
        if tree is None:
            return None
        f, line, col = tree.children
        return Loc(json.loads(f), int(line), int(col))

    def annot(self, tree) -> dict:
        return {} if tree is None else _plain(tree.children[0])

    def key_locs(self, attrs: _KeyedDict) -> dict[str, Loc]:
        """Where each key of a parsed ``{k = v, ...}`` stands (the verifier points at the field)."""
        return {k: loc for k, tok in attrs.key_tokens.items() if (loc := self.here(tok)) is not None}

    def take(self, attrs: _KeyedDict, keys, where: Token, kind: str) -> dict:
        """Check that ``attrs`` has exactly ``keys``; point at the first unknown key, else at ``where``."""
        for k in attrs:
            if k not in keys:
                raise _Fail(f"unknown key '{k}' in {kind}", attrs.key_tokens[k],
                            did_you_mean(k, keys) or f"{kind} keys: {', '.join(keys)}")
        for k in keys:
            if k not in attrs:
                raise _Fail(f"{kind} {where} is missing '{k}'", where, f"add `{k} = ...`; {kind} keys: {', '.join(keys)}")
        return {k: _plain(attrs[k]) for k in keys}

    # -- entities --------------------------------------------------------------------------
    def cluster(self, tree) -> Cluster:
        sym, attrs, annot, loc = tree.children
        memory = _plain(attrs["memory"]) if "memory" in attrs else None   # optional: bytes per device
        required = _KeyedDict({k: v for k, v in attrs.items() if k != "memory"})
        required.key_tokens = {k: t for k, t in attrs.key_tokens.items() if k != "memory"}
        a = self.take(required, _CLUSTER_KEYS, sym, "cluster")
        return Cluster(str(sym)[1:], a["device"], a["nodes"], a["per_node"], self.loc(loc), self.annot(annot),
                       ir_loc=self.here(sym), field_locs=self.key_locs(attrs), memory=memory)

    def model(self, tree) -> Model:
        sym, attrs, annot, loc = tree.children
        layout = _plain(attrs["layout"]) if "layout" in attrs else None   # optional: the fixed layout
        lora = _plain(attrs["lora"]) if "lora" in attrs else None         # optional: LoRA adapters
        dropout = _plain(attrs["dropout"]) if "dropout" in attrs else False   # optional: keep the folder's dropout
        required = _KeyedDict({k: v for k, v in attrs.items() if k not in ("layout", "lora", "dropout")})
        required.key_tokens = attrs.key_tokens
        a = self.take(required, _MODEL_KEYS, sym, "model")
        return Model(name=str(sym)[1:], loc=self.loc(loc), annotations=self.annot(annot), ir_loc=self.here(sym),
                     field_locs=self.key_locs(attrs), layout=layout, lora=lora, dropout=dropout, **a)

    def data(self, tree) -> DataSource:
        sym, attrs, annot, loc = tree.children
        if "kind" not in attrs:
            raise _Fail(f"data source {sym} is missing 'kind'", sym,
                        f"add `kind = \"synthetic\"` (kinds: {', '.join(DATA_OPTIONS)})")
        opts = _plain(attrs)
        kind = opts.pop("kind")
        return DataSource(str(sym)[1:], kind, opts, self.loc(loc), self.annot(annot), ir_loc=self.here(sym),
                          field_locs=self.key_locs(attrs))

    def tool(self, tree, kind: str) -> Tool:
        sym, attrs, loc = tree.children
        keys = ("fn", *ENV_DEFAULTS) if kind == "env" else ("fn", *TOOL_DEFAULTS)
        for k in attrs:
            if k not in keys:
                raise _Fail(f"unknown {kind} setting '{k}'", attrs.key_tokens[k],
                            did_you_mean(k, keys) or f"{kind} settings: {', '.join(keys)}")
        if "fn" not in attrs:
            raise _Fail(f"{kind} {sym} is missing 'fn'", sym,
                        'add `fn = "envs:Game"`' if kind == "env" else 'add `fn = "tools:calculator"`')
        return Tool(str(sym)[1:], **_plain(attrs), kind=kind, loc=self.loc(loc), ir_loc=self.here(sym),
                    field_locs=self.key_locs(attrs))

    def run(self, tree) -> RunConfig:
        attrs, loc = tree.children
        for k in attrs:
            if k not in RUN_KEYS:
                raise _Fail(f"unknown run setting '{k}'", attrs.key_tokens[k],
                            did_you_mean(k, RUN_KEYS) or f"run settings: {', '.join(RUN_KEYS)}")
        return RunConfig(**_plain(attrs), loc=self.loc(loc), ir_loc=self.here(tree), field_locs=self.key_locs(attrs))

    def graph(self, tree) -> Graph:
        sym, params, annot, loc, *body = tree.children
        g = Graph(str(sym)[1:], _plain(params), loc=self.loc(loc), annotations=self.annot(annot),
                  ir_loc=self.here(sym), field_locs=self.key_locs(params))
        defined: dict[str, Value] = {}
        stage_names: set[str] = set()
        for item in body:
            if item.data == "stage":
                stage = self.stage(item, defined)
                g.stages.append(stage)
                stage_names.add(stage.name)
            else:
                model, writer, reader, dist, upto = item.children
                for tok in (writer, reader):
                    name = str(tok)[1:]
                    if name not in stage_names:
                        hint = (f"{tok} is not the first result of its stage; stages are named after their first result"
                                if name in defined else "version edges name stages defined above them")
                        raise _Fail(f"version edge names unknown stage {tok}", tok, hint)
                d = int(str(dist)[1:])
                stale = int(str(upto)[1:]) - d if upto is not None else 0
                if stale < 0:
                    raise _Fail(f"version edge range [{dist}..{upto}] ends before it starts", upto,
                                "write [+D..+E] with E >= D: the reader reads weights D to E steps old")
                g.versions.append(VersionEdge(str(model)[1:], str(writer)[1:], str(reader)[1:], d, stale))
        return g

    def stage(self, tree, defined: dict[str, Value]) -> Stage:
        results, opname, target, *rest = tree.children
        attrs, annot, types, loc = rest[-4:]
        args = [a for a in rest[:-4] if a is not None]
        result_toks = results.children
        type_toks = types.children
        if len(result_toks) != len(type_toks):
            raise _Fail(f"{len(result_toks)} results but {len(type_toks)} types", type_toks[0],
                        "write one type per result, in the same order")
        inputs = []
        for tok in args:
            name = str(tok)[1:]
            if name not in defined:
                close = did_you_mean(name, defined)
                raise _Fail(f"use of undefined value {tok}", tok,
                            f"{close} (values must be defined above their uses)" if close
                            else "values must be defined by a stage above their uses")
            inputs.append(defined[name])
        outputs = []
        for tok, ttok in zip(result_toks, type_toks):
            name = str(tok)[1:]
            if name in defined:
                raise _Fail(f"value {tok} is defined twice", tok, "SSA values are defined once; rename one of them")
            try:
                vt = ValueType.parse(str(ttok))
            except ValueError as exc:
                raise _Fail(str(exc), ttok, "types: Prompts[B], Rollout[B], TokenFloat[B], SeqFloat[B], "
                            "PolicyLoss[B], ValueLoss[B], Metrics") from None
            v = Value(name, vt)
            defined[name] = v
            outputs.append(v)
        return Stage(str(opname), str(target)[1:] if target is not None else None, inputs, outputs,
                     _plain(attrs), self.annot(annot), self.loc(loc), ir_loc=self.here(results),
                     field_locs=self.key_locs(attrs))
