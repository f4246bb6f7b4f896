"""Parse the canonical IR text (``.rlir``) back into a :class:`Module`.

``print_module(parse_ir(text)) == text`` for any text the printer produced.
Errors (syntax, unknown keys, undefined values) are :class:`CompileError`s located
in the ``.rlir`` file. Semantic checks are the verifier's job.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedInput, VisitError

from .core import RUN_KEYS, Cluster, DataSource, Graph, Model, Module, RunConfig, Stage, Symbol, Value, VersionEdge
from .diagnostics import CompileError, Diagnostic, Loc, error
from .larkdiag import syntax_diagnostic
from .types import ValueType

_MODEL_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq",
               "head", "trainable", "init", "source")


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("rlhfc.ir").joinpath("rlir.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


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
        out: dict = {}
        for item in items:
            if item is None:
                continue
            key, value, tok = item
            if key in out:
                raise _Fail(f"duplicate key '{key}'", tok)
            out[key] = value
        return out


class _Fail(Exception):
    def __init__(self, message: str, tok=None, hint: str | None = None):
        super().__init__(message)
        self.message, self.tok, self.hint = message, tok, hint


def parse_ir(text: str, file: str = "<ir>") -> Module:
    """Parse ``.rlir`` text into a Module (raises CompileError)."""
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


def _to_error(exc: _Fail, file: str, text: str) -> CompileError:
    loc = None
    if exc.tok is not None and getattr(exc.tok, "line", None):
        loc = Loc(file, exc.tok.line, exc.tok.column)
    return CompileError([Diagnostic("error", exc.message, loc, exc.hint)], text)


class _Builder:
    def __init__(self, file: str):
        self.file = file

    def build(self, tree: Tree) -> Module:
        sym, annot, *items = tree.children
        module = Module(name=str(sym)[1:], cluster=None, annotations=annot or {})  # type: ignore[arg-type]
        cluster_seen = run_seen = graph_seen = False
        for item in items:
            kind = item.data
            if kind == "cluster":
                if cluster_seen:
                    raise _Fail("a module has one cluster", item.children[0])
                module.cluster = self.cluster(item)
                cluster_seen = True
            elif kind == "model":
                m = self.model(item)
                if m.name in module.models:
                    raise _Fail(f"duplicate model @{m.name}", item.children[0])
                module.models[m.name] = m
            elif kind == "data":
                d = self.data(item)
                if d.name in module.data:
                    raise _Fail(f"duplicate data source @{d.name}", item.children[0])
                module.data[d.name] = d
            elif kind == "run":
                if run_seen:
                    raise _Fail("a module has one run block")
                module.run = self.run(item)
                run_seen = True
            elif kind == "graph":
                if graph_seen:
                    raise _Fail("a module has one graph", item.children[0])
                module.graph = self.graph(item)
                graph_seen = True
        if not cluster_seen:
            raise _Fail("module has no cluster", sym, "add `cluster @local {device = \"cpu\", nodes = 1, per_node = 1}`")
        if not graph_seen:
            raise _Fail("module has no graph", sym)
        return module

    # -- helpers ---------------------------------------------------------------------------
    def loc(self, tree) -> Loc | None:
        if tree is None:
            return None
        f, line, col = tree.children
        return Loc(json.loads(f), int(line), int(col))

    def annot(self, tree) -> dict:
        return {} if tree is None else tree.children[0]

    def take(self, attrs: dict, keys, where: Token, kind: str) -> dict:
        unknown = [k for k in attrs if k not in keys]
        missing = [k for k in keys if k not in attrs]
        if unknown:
            raise _Fail(f"unknown key '{unknown[0]}' in {kind}", where, f"{kind} keys: {', '.join(keys)}")
        if missing:
            raise _Fail(f"{kind} is missing '{missing[0]}'", where)
        return attrs

    # -- entities --------------------------------------------------------------------------
    def cluster(self, tree) -> Cluster:
        sym, attrs, annot, loc = tree.children
        a = self.take(attrs, ("device", "nodes", "per_node"), sym, "cluster")
        return Cluster(str(sym)[1:], a["device"], a["nodes"], a["per_node"], self.loc(loc), self.annot(annot))

    def model(self, tree) -> Model:
        sym, attrs, annot, loc = tree.children
        a = self.take(attrs, _MODEL_KEYS, sym, "model")
        return Model(name=str(sym)[1:], loc=self.loc(loc), annotations=self.annot(annot), **a)

    def data(self, tree) -> DataSource:
        sym, attrs, annot, loc = tree.children
        if "kind" not in attrs:
            raise _Fail("data source is missing 'kind'", sym)
        opts = dict(attrs)
        kind = opts.pop("kind")
        return DataSource(str(sym)[1:], kind, opts, self.loc(loc), self.annot(annot))

    def run(self, tree) -> RunConfig:
        attrs, loc = tree.children
        unknown = [k for k in attrs if k not in RUN_KEYS]
        if unknown:
            raise _Fail(f"unknown run setting '{unknown[0]}'", None, f"run settings: {', '.join(RUN_KEYS)}")
        return RunConfig(**attrs, loc=self.loc(loc))

    def graph(self, tree) -> Graph:
        sym, params, loc, *body = tree.children
        g = Graph(str(sym)[1:], params, loc=self.loc(loc))
        defined: dict[str, Value] = {}
        for item in body:
            if item.data == "stage":
                g.stages.append(self.stage(item, defined))
            else:
                model, writer, reader, dist = item.children
                for tok in (writer, reader):
                    if str(tok)[1:] not in defined:
                        raise _Fail(f"version edge names undefined stage {tok}", tok)
                g.versions.append(VersionEdge(str(model)[1:], str(writer)[1:], str(reader)[1:], int(str(dist)[1:])))
        return g

    def stage(self, tree, defined: dict[str, Value]) -> Stage:
        results, opname, target, *rest = tree.children
        attrs, annot, types, loc = rest[-4:]
        args = [a for a in rest[:-4] if a is not None]
        result_toks = results.children
        type_toks = types.children
        if len(result_toks) != len(type_toks):
            raise _Fail(f"{len(result_toks)} results but {len(type_toks)} types", opname)
        inputs = []
        for tok in args:
            name = str(tok)[1:]
            if name not in defined:
                raise _Fail(f"use of undefined value {tok}", tok, "values must be defined above their uses")
            inputs.append(defined[name])
        outputs = []
        for tok, ttok in zip(result_toks, type_toks):
            name = str(tok)[1:]
            if name in defined:
                raise _Fail(f"value {tok} is defined twice", tok)
            try:
                vt = ValueType.parse(str(ttok))
            except ValueError as exc:
                raise _Fail(str(exc), ttok) from None
            v = Value(name, vt)
            defined[name] = v
            outputs.append(v)
        return Stage(str(opname), str(target)[1:] if target is not None else None, inputs, outputs,
                     attrs, self.annot(annot), self.loc(loc))
