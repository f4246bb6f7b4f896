"""Parse ``.rlhf`` text into the typed AST (lark LALR, positions on every node)."""

from __future__ import annotations

import functools
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedInput, VisitError

from rlhfc.ir.diagnostics import CompileError, Loc, error
from rlhfc.ir.larkdiag import syntax_diagnostic

from . import ast

_SIZE_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("rlhfc.frontend").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def parse_program(text: str, file: str = "<input>") -> ast.Program:
    """Parse a program; raise CompileError (with location and hint) on a syntax error."""
    parser = _parser()
    try:
        tree = parser.parse(text)
    except UnexpectedInput as exc:
        raise CompileError([syntax_diagnostic(exc, parser, file, text)], text) from None
    try:
        decls = _ToAst(file).transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, CompileError):
            exc.orig_exc.source_text = text
            raise exc.orig_exc from None
        raise
    prog = ast.Program(file=file, text=text)
    for d in decls:
        {ast.ClusterDecl: prog.clusters, ast.ModelDecl: prog.models, ast.DataDecl: prog.data,
         ast.PipelineDecl: prog.pipelines, ast.RunDecl: prog.runs}[type(d)].append(d)
    return prog


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _loc(self, meta) -> Loc:
        return Loc(self.file, getattr(meta, "line", 1), getattr(meta, "column", 1))

    def _tok(self, tok: Token) -> Loc:
        return Loc(self.file, tok.line, tok.column)

    # -- literals --------------------------------------------------------------------------
    def int(self, meta, items):
        return ast.Literal(int(items[0]), "int", self._loc(meta))

    def neg_int(self, meta, items):
        return ast.Literal(-int(items[0]), "int", self._loc(meta))

    def float(self, meta, items):
        return ast.Literal(float(items[0]), "float", self._loc(meta))

    def neg_float(self, meta, items):
        return ast.Literal(-float(items[0]), "float", self._loc(meta))

    def size(self, meta, items):
        text = str(items[0])
        number = float(text[:-1]) * _SIZE_SUFFIX[text[-1]]
        return ast.Literal(int(round(number)), "size", self._loc(meta)) if number >= 1 else \
            ast.Literal(number, "float", self._loc(meta))

    def string(self, meta, items):
        raw = str(items[0])[1:-1]
        try:
            value = raw.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError:
            raise error("invalid escape in string", self._loc(meta), "use \\\\ for a backslash") from None
        return ast.Literal(value, "str", self._loc(meta))

    def true(self, meta, _):
        return ast.Literal(True, "bool", self._loc(meta))

    def false(self, meta, _):
        return ast.Literal(False, "bool", self._loc(meta))

    def ident(self, meta, items):
        return ast.Literal(str(items[0]), "ident", self._loc(meta))

    def device_count(self, meta, items):
        return ast.Literal((str(items[0]), int(items[1])), "device", self._loc(meta))

    # -- calls -----------------------------------------------------------------------------
    def ref(self, meta, items):
        return ast.Ref(str(items[0]), self._tok(items[0]))

    def kwarg(self, meta, items):
        return ast.KwArg(str(items[0]), items[1], self._tok(items[0]))

    def args(self, meta, items):
        return items

    def _call(self, meta, name_tok, receiver, args):
        args = args or []
        positional = [a for a in args if not isinstance(a, ast.KwArg)]
        kwargs = [a for a in args if isinstance(a, ast.KwArg)]
        seen_kw = False
        for a in args:
            if isinstance(a, ast.KwArg):
                seen_kw = True
            elif seen_kw:
                raise error("positional argument after keyword argument", getattr(a, "loc", self._loc(meta)),
                            "put positional arguments first")
        return ast.Call(str(name_tok), receiver, positional, kwargs, self._loc(meta), self._tok(name_tok))

    def method_call(self, meta, items):
        recv, name, args = items
        return self._call(meta, name, ast.Ref(str(recv), self._tok(recv)), args)

    def func_call(self, meta, items):
        name, args = items
        return self._call(meta, name, None, args)

    # -- declarations ----------------------------------------------------------------------
    def setting(self, meta, items):
        return ast.Setting(str(items[0]), items[1], self._tok(items[0]))

    def settings(self, meta, items):
        return items

    def model_opt(self, meta, items):
        return ast.Setting(str(items[0]), items[1], self._tok(items[0]))

    def flag(self, meta, items):
        return str(items[0])

    def cluster_decl(self, meta, items):
        return ast.ClusterDecl(str(items[0]), items[1], self._loc(meta))

    def run_decl(self, meta, items):
        return ast.RunDecl(items[0], self._loc(meta))

    def model_decl(self, meta, items):
        name, ctor, *rest = items
        flag = rest[-1] if rest and isinstance(rest[-1], str) else None
        opts = [r for r in rest if isinstance(r, ast.Setting)]
        return ast.ModelDecl(str(name), ctor, opts, flag, self._loc(meta), self._tok(name))

    def data_decl(self, meta, items):
        return ast.DataDecl(str(items[0]), items[1], self._loc(meta), self._tok(items[0]))

    def targets(self, meta, items):
        return [ast.Ref(str(t), self._tok(t)) for t in items]

    def bind(self, meta, items):
        return ast.Stmt(items[0], items[1], self._loc(meta))

    def effect(self, meta, items):
        return ast.Stmt([], items[0], self._loc(meta))

    def pipeline_decl(self, meta, items):
        name, params, *stmts = items
        params = params or []
        for p in params:
            if not isinstance(p, ast.KwArg):
                raise error("pipeline parameters are written name = value", getattr(p, "loc", self._loc(meta)),
                            "e.g. pipeline ppo(batch = 32) { ... }")
        for i, s in enumerate(stmts):
            s.index = i
        return ast.PipelineDecl(str(name), params, stmts, self._loc(meta), self._tok(name))

    def start(self, meta, items):
        return items
