"""Parse ``.rlhf`` text into the typed AST (lark LALR, positions on every node)."""

from __future__ import annotations

import functools
import math
from importlib import resources

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from rlhfc.ir.diagnostics import CompileError, Diagnostic, Loc, error
from rlhfc.ir.larkdiag import syntax_diagnostic

from . import ast

_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r", "0": "\0"}
_SIZE_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = resources.files("rlhfc.frontend").joinpath("grammar.lark").read_text()
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def parse_program(text: str, file: str = "<input>") -> ast.Program:
    """Parse a program; raise CompileError (with location and hint) on a syntax error."""
    parser = _parser()
    _check_nesting(text, file)
    try:
        tree = parser.parse(text)
    except UnexpectedInput as exc:
        raise CompileError([_syntax_error(exc, parser, file, text)], text) from None
    try:
        decls = _ToAst(file).transform(tree)
    except VisitError as exc:
        if isinstance(exc.orig_exc, CompileError):
            exc.orig_exc.source_text = text
            raise exc.orig_exc from None
        raise
    prog = ast.Program(file=file, text=text)
    for d in decls:
        {ast.ClusterDecl: prog.clusters, ast.ModelDecl: prog.models, ast.DataDecl: prog.data, ast.ToolDecl: prog.tools,
         ast.PipelineDecl: prog.pipelines, ast.RunDecl: prog.runs}[type(d)].append(d)
    return prog


#: deepest bracket nesting accepted (real programs nest calls two or three deep; the parser and the
#: lowering recurse over nesting, so a limit keeps a pathological input from overflowing the stack)
MAX_NESTING = 64


def _check_nesting(text: str, file: str) -> None:
    depth = 0
    for _, ch, line, col in _scan(text, len(text)):
        if ch in "({":
            depth += 1
            if depth > MAX_NESTING:
                raise error(f"brackets nested more than {MAX_NESTING} deep", Loc(file, line, col),
                            "bind inner calls to names first, e.g. loss = ppo_clip(...), then actor.train(loss)")
        elif ch in ")}":
            depth = max(depth - 1, 0)


#: words the grammar reserves; a program cannot use them as names
_KEYWORDS = ("cluster", "model", "data", "tool", "env", "pipeline", "run", "true", "false", "trainable", "frozen")
_DECL_KEYWORDS = ("cluster", "model", "data", "tool", "env", "pipeline", "run")
_CLOSERS = {"(": ")", "{": "}"}


def _syntax_error(exc: UnexpectedInput, parser: Lark, file: str, text: str) -> Diagnostic:
    """lark's error made specific: where the file really ends, unclosed brackets, keywords used as names."""
    base = syntax_diagnostic(exc, parser, file, text)
    at_end = isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END")
    if at_end:
        line, col, pos = end_of_code(text)
        unclosed = _unclosed(text, pos)
        if unclosed:
            ch, oline, ocol = unclosed[-1]
            return Diagnostic("error", f"unexpected end of file: '{ch}' opened at line {oline} is never closed",
                              Loc(file, line, col), f"add '{_CLOSERS[ch]}'; {base.hint}" if base.hint else
                              f"add '{_CLOSERS[ch]}'")
        return Diagnostic("error", base.message, Loc(file, line, col), base.hint)
    if isinstance(exc, UnexpectedCharacters):
        ch = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        if ch == '"':
            return Diagnostic("error", "unterminated string", base.loc,
                              'close it with " on the same line (strings cannot span lines; write \\" for a quote)')
        hint = f"remove it; {base.hint}" if base.hint else "remove it"
        if ch in ")}":
            hint = f"there is no matching '{'(' if ch == ')' else '{'}' for it; {hint}"
        elif ch in "+*/%":
            hint = "the language has no arithmetic; write the value itself (e.g. 2e-3)"
        return Diagnostic("error", base.message, base.loc, _with_unclosed(hint, text, exc.pos_in_stream, exc.line))
    if isinstance(exc, UnexpectedToken):
        tok = exc.token
        expected = set(exc.accepts or exc.expected or ())
        hint = base.hint or ""
        pos = tok.start_pos if tok.start_pos is not None else len(text)
        after = text[pos + len(str(tok)):].lstrip(" \t")[:1]
        if str(tok) in _KEYWORDS and "NAME" in expected and (after in "=,.()" or str(tok) not in _DECL_KEYWORDS):
            return Diagnostic("error", f"'{tok}' is a keyword and cannot be used as a name", base.loc,
                              f"rename it, e.g. {tok}_1 (keywords: {', '.join(_KEYWORDS)})")
        if str(tok) == "=" and text[:pos].rstrip(" \t")[-1:] == "=":
            return Diagnostic("error", "unexpected '=='", base.loc, "settings are written with one '=': name = value")
        unclosed = _unclosed(text, pos)
        if str(tok) in _DECL_KEYWORDS and unclosed and unclosed[-1][1] < tok.line:
            ch, oline, ocol = unclosed[-1]
            return Diagnostic("error", f"missing '{_CLOSERS[ch]}' before '{tok}'", base.loc,
                              f"the '{ch}' at line {oline}, column {ocol} is not closed; add '{_CLOSERS[ch]}' "
                              f"where it ends")
        if str(tok) in (")", "}") and not any(_CLOSERS[c] == str(tok) for c, _, _ in unclosed):
            hint = f"there is no '{'(' if str(tok) == ')' else '{'}' before it to close; remove it, or add the " \
                   f"missing opening bracket; {hint}"
        elif "COMMA" in expected and tok.type in ("NAME", "INT", "FLOAT", "SIZE", "STRING", "MINUS") \
                and tok.line == _prev_code_line(text, tok.start_pos):
            hint = f"a ',' may be missing before '{tok}'; {hint}"
        return Diagnostic("error", base.message, base.loc, _with_unclosed(hint, text, pos, tok.line))
    return base


def _with_unclosed(hint: str, text: str, pos: int, line: int | None) -> str:
    """Prefix the hint with the innermost '(' left open on an earlier line, if any (an open '{' is normal
    inside a block; a declaration keyword inside one is handled by the caller)."""
    unclosed = _unclosed(text, pos)
    if unclosed and line is not None and unclosed[-1][1] < line and unclosed[-1][0] == "(":
        ch, oline, ocol = unclosed[-1]
        return f"the '{ch}' at line {oline}, column {ocol} is not closed (add '{_CLOSERS[ch]}'); {hint}"
    return hint


def _scan(text: str, end: int):
    """Yield (index, char, line, col) of code characters before ``end``: comments and the inside of strings
    are skipped (a string's quotes are yielded)."""
    line, col, i = 1, 1, 0
    in_str = in_comment = False
    while i < min(end, len(text)):
        ch = text[i]
        if in_comment:
            in_comment = ch != "\n"
        elif in_str:
            if ch == "\\" and i + 1 < len(text) and text[i + 1] != "\n":
                i, col = i + 1, col + 1
            elif ch == '"':
                in_str = False
                yield i, ch, line, col
            elif ch == "\n":
                in_str = False
        elif ch == "#":
            in_comment = True
        elif ch == '"':
            in_str = True
            yield i, ch, line, col
        else:
            yield i, ch, line, col
        if ch == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1


def _unclosed(text: str, end: int) -> list[tuple[str, int, int]]:
    """Brackets opened before ``end`` and not closed: [(char, line, col)], innermost last."""
    stack: list[tuple[str, int, int]] = []
    for _, ch, line, col in _scan(text, end):
        if ch in _CLOSERS:
            stack.append((ch, line, col))
        elif ch in ")}" and stack and _CLOSERS[stack[-1][0]] == ch:
            stack.pop()
    return stack


def end_of_code(text: str) -> tuple[int, int, int]:
    """(line, col, index) just after the last character of code (not whitespace or a comment)."""
    last = None
    for i, ch, line, col in _scan(text, len(text)):
        if not ch.isspace():
            last = (line, col + 1, i + 1)
    return last if last is not None else (1, 1, 0)


def _prev_code_line(text: str, pos: int | None) -> int | None:
    """The line of the last code character before ``pos``."""
    if pos is None:
        return None
    found = None
    for _, ch, line, _col in _scan(text, pos):
        if not ch.isspace():
            found = line
    return found


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
    def _number(self, meta, text: str, convert, kind: str, sign: int = 1) -> ast.Literal:
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            value = math.inf
        if isinstance(value, float) and not math.isfinite(value):
            raise error(f"number {text} is too large", self._loc(meta),
                        "write a number within the range of a 64-bit float (about 1e308)") from None
        return ast.Literal(sign * value, kind, self._loc(meta))

    def int(self, meta, items):
        return self._number(meta, str(items[0]), int, "int")

    def neg_int(self, meta, items):
        return self._number(meta, str(items[0]), int, "int", -1)

    def float(self, meta, items):
        return self._number(meta, str(items[0]), float, "float")

    def neg_float(self, meta, items):
        return self._number(meta, str(items[0]), float, "float", -1)

    def size(self, meta, items):
        text = str(items[0])
        lit = self._number(meta, text, lambda t: float(t[:-1]) * _SIZE_SUFFIX[t[-1]], "size")
        if lit.value >= 1:
            return ast.Literal(int(round(lit.value)), "size", lit.loc)
        return ast.Literal(lit.value, "float", lit.loc)

    def string(self, meta, items):
        raw = str(items[0])[1:-1]
        out, i = [], 0
        while i < len(raw):
            ch = raw[i]
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            esc = raw[i + 1]   # the grammar guarantees a character after a backslash
            if esc in _ESCAPES:
                out.append(_ESCAPES[esc])
                i += 2
                continue
            width = {"x": 2, "u": 4, "U": 8}.get(esc)
            digits = raw[i + 2:i + 2 + width] if width else ""
            if width and len(digits) == width and all(c in "0123456789abcdefABCDEF" for c in digits) \
                    and int(digits, 16) <= 0x10FFFF and not 0xD800 <= int(digits, 16) <= 0xDFFF:
                out.append(chr(int(digits, 16)))
                i += 2 + width
                continue
            loc = Loc(self.file, meta.line, meta.column + 1 + i)
            raise error(f"invalid escape '\\{esc}' in string", loc,
                        'escapes: \\\\ \\" \\n \\t \\r \\xHH \\uHHHH; write \\\\ for a backslash')
        return ast.Literal("".join(out), "str", self._loc(meta))

    def true(self, meta, _):
        return ast.Literal(True, "bool", self._loc(meta))

    def false(self, meta, _):
        return ast.Literal(False, "bool", self._loc(meta))

    def ident(self, meta, items):
        return ast.Literal(str(items[0]), "ident", self._loc(meta))

    def device_count(self, meta, items):
        return ast.Literal((str(items[0]), int(items[1])), "device", self._loc(meta))

    def items(self, meta, items):
        return items

    def list(self, meta, items):
        return ast.Literal(items[0] or [], "list", self._loc(meta))

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
                first_kw = next(k for k in args if isinstance(k, ast.KwArg))
                raise error("positional argument after keyword argument", getattr(a, "loc", self._loc(meta)),
                            f"move positional arguments before the first keyword argument ('{first_kw.name} = ...')")
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

    def model_clause(self, meta, items):
        name, args = items
        return self._call(meta, name, None, args)

    def flag(self, meta, items):
        return str(items[0])

    def cluster_decl(self, meta, items):
        return ast.ClusterDecl(str(items[0]), items[1], self._loc(meta))

    def run_decl(self, meta, items):
        return ast.RunDecl(items[0], self._loc(meta))

    def model_decl(self, meta, items):
        name, ctor, *rest = items
        flag = next((r for r in rest if isinstance(r, str)), None)
        opts = [r for r in rest if isinstance(r, ast.Setting)]
        clauses = [r for r in rest if isinstance(r, ast.Call)]
        return ast.ModelDecl(str(name), ctor, opts, flag, self._loc(meta), self._tok(name), clauses)

    def data_decl(self, meta, items):
        return ast.DataDecl(str(items[0]), items[1], self._loc(meta), self._tok(items[0]))

    def tool_decl(self, meta, items):
        return ast.ToolDecl(str(items[0]), items[1], self._loc(meta), self._tok(items[0]))

    def env_decl(self, meta, items):
        return ast.ToolDecl(str(items[0]), items[1], self._loc(meta), self._tok(items[0]), kind="env")

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
