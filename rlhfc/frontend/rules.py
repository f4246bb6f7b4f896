"""Where ``rule("module:function", ...)`` finds its function, checked without running any of its code.

A program runs no code but the reward functions its author named. A rule's module is looked up in, in order:

1. rlhfc's built-in rewards, ``rlhfc.runtime.rewards`` (only the rules it lists in ``BUILTIN_RULES``);
2. an installed module listed in the run block's ``reward_modules = ["pkg.mod"]``;
3. a ``.py`` file (or package folder) in the program's own folder: ``"my_rewards:f"`` is ``my_rewards.py``
   beside the program, ``"rules.text:f"`` is ``rules/text.py``.

Anything else — ``os``, ``builtins``, ``subprocess``, any other installed module — is refused. The module's
source is read and parsed, never imported (a check runs no code): the function must be defined there by a
plain ``def`` that can be called as ``f(prompt, response, ...)``, and each further parameter without a
default must be a field the rollout's data declares (``jsonl(..., fields = [answer])``): the job passes it
by name. A function whose first two parameters are ``prompts, responses`` is batched (called once with
lists). The runtime
(:func:`rlhfc.runtime.rewards.resolve_rule`) looks the function up the same way and checks it again.
"""

from __future__ import annotations

import ast
import importlib.machinery
import json
import os
import sys

from rlhfc.ir.diagnostics import did_you_mean
from rlhfc.ir.verify_fields import BUILTIN_REWARDS

_BUILTIN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime", "rewards.py")
_EXAMPLE = f'"{BUILTIN_REWARDS}:vowel_count"'


def rule_problem(ref: str, base_dir: str, allowed: list[str], fields: tuple[str, list[str]] | None = None) \
        -> tuple[str, str] | None:
    """(message, hint) when rule ``ref`` ("module:function") cannot be used by a program in ``base_dir`` that
    allows the installed ``allowed`` modules, else None. ``fields``: (data source, the fields it declares) of
    the rollout the rule scores: every parameter after ``(prompt, response)`` without a default must be one."""
    mod, _, fn = ref.partition(":")
    if mod == BUILTIN_REWARDS:
        source, what = _BUILTIN_FILE, "rlhfc's built-in rewards"
    elif mod in allowed:
        source = _installed_source(mod)
        what = f"installed module '{mod}'"
        if source is None:
            return (f"reward module '{mod}' (listed in reward_modules) is not installed",
                    f"install it where the job runs ({sys.executable}), or remove it from reward_modules")
        if not source.endswith(".py"):
            return (f"reward module '{mod}' has no Python source to check ({os.path.basename(source)})",
                    "a reward module must be a .py file; write the rule in Python beside the program")
    else:
        source = local_source(base_dir, mod)
        what = f"{os.path.relpath(source)}" if source else ""
        if source is None:
            return _not_found(mod, base_dir)
    tree = _parse(source, f"rule module '{mod}'", what)
    if isinstance(tree, tuple):
        return tree
    if mod == BUILTIN_REWARDS:
        names = _builtin_rules(tree)
        if fn not in names:
            return (f"'{fn}' is not one of rlhfc's built-in rules",
                    " ".join(filter(None, [did_you_mean(fn, names), f"built-in rules: {', '.join(names)}"])))
    return _function_problem(tree, mod, fn, what, fields)


def rollout_fields(module, graph, rollout) -> tuple[str, list[str]] | None:
    """(data source, its declared fields) of the prompts ``rollout`` was generated from, or None when that is
    not a generate of a known data source."""
    try:
        gen = graph.producer(rollout)
        load = graph.producer(gen.inputs[0]) if gen.op == "generate" and gen.inputs else None
    except KeyError:
        return None
    data = module.data.get(load.target) if load is not None and load.op == "load" else None
    if data is None:
        return None
    fields = data.options.get("fields", [])
    return data.name, [f for f in fields if isinstance(f, str)] if isinstance(fields, list) else []


#: the extractors rule(..., extract = ...) takes by name (rlhfc.runtime.data.answers.EXTRACTORS; a test keeps the
#: two lists equal — the compiler imports no runtime code)
EXTRACTORS = ("strip", "first_line", "last_line", "first_number", "last_number", "boxed")


def extract_problem(spec: str) -> tuple[str, str] | None:
    """(message, hint) when ``spec`` names no answer extractor, else None."""
    import re

    hint = f"extractors: {', '.join(EXTRACTORS)}, after:MARK (e.g. after:####), re:PATTERN (first group)"
    if spec in ("", *EXTRACTORS) or (spec.startswith("after:") and len(spec) > len("after:")):
        return None
    if spec.startswith("re:") and len(spec) > 3:
        try:
            re.compile(spec[3:])
            return None
        except re.error as e:
            return f"extract = {json.dumps(spec)} is not a regular expression ({e})", hint
    return f"unknown answer extractor {json.dumps(spec)}", " ".join(filter(None, [did_you_mean(spec, EXTRACTORS),
                                                                                  hint]))


def local_source(base_dir: str, mod: str) -> str | None:
    """The file of module ``mod`` in the program's folder (``a.b`` is ``a/b.py`` or ``a/b/__init__.py``)."""
    base = os.path.join(base_dir or ".", *mod.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _installed_source(mod: str) -> str | None:
    """The file an installed module would be imported from, found without importing anything."""
    parts = mod.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), list(spec.submodule_search_locations))
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen", "namespace"):
        return None
    return spec.origin


def _not_found(mod: str, base_dir: str) -> tuple[str, str]:
    top = mod.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "rlhfc":
        return (f"rule() may not call into '{mod}': a rule names a reward function of the program's folder or "
                "of rlhfc's built-in rewards",
                f"define def f(prompt, response) -> float in a .py file beside the program, or use a built-in "
                f"rule such as {_EXAMPLE}")
    shown = os.path.join(base_dir or ".", *mod.split(".")) + ".py"
    return (f"rule module '{mod}' not found: no {mod.replace('.', '/')}.py in the program's folder",
            f"looked for {shown}; put the module beside the program, use a built-in rule such as {_EXAMPLE}, or "
            f"allow an installed module with reward_modules = [{json.dumps(mod)}] in the run block")


def _builtin_rules(tree: ast.Module) -> list[str]:
    """The names in ``BUILTIN_RULES = (...)`` of the built-in rewards module."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "BUILTIN_RULES"
                                                for t in node.targets):
            try:
                return [str(x) for x in ast.literal_eval(node.value)]
            except ValueError:
                return []
    return []


def _function_problem(tree: ast.Module, mod: str, fn: str, what: str,
                      fields: tuple[str, list[str]] | None = None) -> tuple[str, str] | None:
    """Why ``fn`` of the parsed module is not a plain function callable as ``fn(prompt, response, **fields)``
    (or, batched, ``fn(prompts, responses, **fields)``) with the data's declared ``fields``."""
    binding = None   # the last top-level statement that binds the name wins, as when Python runs the module
    defs = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append(node.name)
        if _binds(node, fn):
            binding = node
    example = f"def {fn}(prompt, response):\n    return float(...)"
    if binding is None:
        listed = f"functions there: {', '.join(defs[:8])}{' …' if len(defs) > 8 else ''}" if defs else \
            f"define it there: {example.splitlines()[0]}"
        return f"module '{mod}' ({what}) has no function '{fn}'", " ".join(filter(None, [did_you_mean(fn, defs), listed]))
    if not isinstance(binding, ast.FunctionDef):
        kind = {ast.AsyncFunctionDef: "an async function", ast.ClassDef: "a class", ast.Import: "an import",
                ast.ImportFrom: "an import"}.get(type(binding), "not a function definition")
        return (f"'{fn}' in module '{mod}' is {kind}, not a plain function defined there",
                f"a rule is a function written in the module with def: {example.splitlines()[0]}")
    a = binding.args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults)
    shown = ", ".join(x.arg for x in positional) + (f", *{a.vararg.arg}" if a.vararg else "")
    missing_kw = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    if len(positional) < 2 and a.vararg is None:
        return (f"rule function '{mod}:{fn}' must take (prompt, response), but it is {fn}({shown})",
                f"define it as def {fn}(prompt, response) -> float")
    # every parameter past the first two that has no default is a data field the sample must carry
    needed = [x.arg for x in positional[2:required]] + missing_kw
    if fields is None:   # not known here (not a rollout of a data source): fields are checked at run time
        return None
    data, declared = fields
    for name in needed:
        if name not in declared:
            have = f"data @{data} declares fields = [{', '.join(declared)}]" if declared else \
                f"data @{data} declares no fields"
            return (f"rule function '{mod}:{fn}' takes parameter '{name}', which is not a field of its data "
                    f"({have})",
                    f"declare it on the data source, e.g. jsonl(\"...\", fields = [{', '.join([*declared, name])}]), "
                    f"or give the parameter a default")
    return None


def tool_problem(ref: str, base_dir: str, allowed: list[str], kind: str = "tool") -> tuple[str, str] | None:
    """(message, hint) when tool ``ref`` ("module:function") cannot be used by a program in ``base_dir`` that
    allows the installed ``allowed`` modules, else None. Its module is found as a rule's is (the program's
    folder, or an installed module the run block lists in ``reward_modules``), read and parsed, never imported;
    the function must be a plain ``def`` callable with one argument, the call's text. ``kind = "env"``: an
    environment, a class defining ``reset(self, record)`` and ``step(self, action)``."""
    mod, _, fn = ref.partition(":")
    if not mod or not fn or not all(p.isidentifier() for p in mod.split(".")) or not fn.isidentifier():
        return (f'a tool is written "module:function", got {json.dumps(ref)}',
                'e.g. tool calc = python("tools:calculator"), with def calculator(text) in tools.py beside the program')
    if mod in allowed:
        source = _installed_source(mod)
        if source is None or not source.endswith(".py"):
            return (f"tool module '{mod}' (listed in reward_modules) is not installed as Python source",
                    f"install it where the job runs ({sys.executable}), or put the tool beside the program")
    else:
        source = local_source(base_dir, mod)
        top = mod.split(".")[0]
        if source is None and (top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "rlhfc"):
            return (f"a tool may not call into '{mod}': a tool names a function of the program's folder",
                    "define def f(text) -> str in a .py file beside the program")
        if source is None:
            shown = os.path.join(base_dir or ".", *mod.split(".")) + ".py"
            return (f"tool module '{mod}' not found: no {mod.replace('.', '/')}.py in the program's folder",
                    f"looked for {shown}; put the module beside the program, or allow an installed module with "
                    f"reward_modules = [{json.dumps(mod)}] in the run block")
    tree = _parse(source, f"tool module '{mod}'", os.path.relpath(source))
    if isinstance(tree, tuple):
        return tree
    binding, defs = None, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs.append(node.name)
        if _binds(node, fn):
            binding = node
    if kind == "env":
        return _env_problem(binding, mod, fn, defs)
    if binding is None:
        return (f"tool module '{mod}' has no function '{fn}'",
                " ".join(filter(None, [did_you_mean(fn, defs), f"define it there: def {fn}(text) -> str"])))
    if not isinstance(binding, ast.FunctionDef):
        return (f"tool '{mod}:{fn}' is not a plain function defined in its module (it is "
                f"{'a class' if isinstance(binding, ast.ClassDef) else 'not a def'})",
                f"a tool is a function written with def: def {fn}(text) -> str")
    a = binding.args
    positional = a.posonlyargs + a.args
    required = len(positional) - len(a.defaults)
    if (not positional and a.vararg is None) or required > 1 or any(d is None for d in a.kw_defaults):
        shown = ", ".join(x.arg for x in positional)
        return (f"tool function '{mod}:{fn}' must take one argument, the call's text, but it is {fn}({shown})",
                f"define it as def {fn}(text) -> str")
    return None


def _env_problem(binding, mod: str, cls: str, defs: list[str]) -> tuple[str, str] | None:
    """Why ``cls`` of module ``mod`` is not an environment class (reset(record), step(action))."""
    example = f"class {cls}:\n    def reset(self, record): ...\n    def step(self, action): ..."
    if binding is None:
        return (f"environment module '{mod}' has no class '{cls}'",
                " ".join(filter(None, [did_you_mean(cls, defs), f"define it there: {example.splitlines()[0]}"])))
    if not isinstance(binding, ast.ClassDef):
        return (f"environment '{mod}:{cls}' is not a class defined in its module",
                "an environment is a class with reset(self, record) and step(self, action)")
    methods = {n.name: n for n in binding.body if isinstance(n, ast.FunctionDef)}
    for name, params in (("reset", "record"), ("step", "action")):
        m = methods.get(name)
        if m is None:
            return (f"environment class '{mod}:{cls}' has no method '{name}'",
                    f"define def {name}(self, {params}) in it (reset returns the first observation, step returns "
                    "(observation, reward, done))")
        positional = m.args.posonlyargs + m.args.args
        required = len(positional) - len(m.args.defaults)
        if (len(positional) < 2 and m.args.vararg is None) or required > 2:
            shown = ", ".join(x.arg for x in positional)
            return (f"method '{name}' of environment '{mod}:{cls}' must take ({params}), but it is {name}({shown})",
                    f"define it as def {name}(self, {params})")
    return None


def _parse(source: str, what: str, shown: str) -> ast.Module | tuple[str, str]:
    """The parsed module at ``source``, or the (message, hint) saying why it cannot be read."""
    try:
        with open(source, "rb") as fh:
            return ast.parse(fh.read(), filename=source)
    except (OSError, SyntaxError, ValueError) as exc:
        line = f", line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
        return (f"cannot read {what} ({shown}{line}): {type(exc).__name__}",
                "fix the module so that Python can parse it")


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name.split(".")[0]) == name for a in node.names)
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t))
    return False


__all__ = ["rule_problem", "tool_problem", "rollout_fields", "extract_problem", "local_source", "EXTRACTORS"]
