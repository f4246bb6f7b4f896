"""The import contract: layers import one way (the runtime's sub-packages too), no cycle, plans read through ``rlhfc/ir/plan.py``, no file
over 500 lines without a reason at its top.

| package       | may import (besides itself and ``contract``)                  |
| ------------- | ------------------------------------------------------------- |
| ``contract``  | nothing of rlhfc (what compiler and runtime agree on)         |
| ``ir``        | nothing else of rlhfc                                         |
| ``frontend``  | ``ir``                                                        |
| ``cost``      | ``ir``                                                        |
| ``passes``    | ``ir``, ``cost``                                              |
| ``codegen``   | ``ir``                                                        |
| ``explain``   | ``ir``, ``cost``                                              |
| ``runtime``   | nothing else of rlhfc (a job runs without the compiler)       |
| ``calibrate`` | ``ir``, ``cost``, ``runtime`` (it measures the real models)   |
| ``cli``       | everything                                                    |

Imports inside functions count too: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
import pathlib
import re

import networkx as nx

PKG = pathlib.Path(__file__).resolve().parents[1] / "rlhfc"

ALLOWED = {
    "contract": set(),
    "ir": {"contract"},
    "frontend": {"ir", "contract"},
    "cost": {"ir", "contract"},
    "passes": {"ir", "cost", "contract"},
    "codegen": {"ir", "contract"},
    "explain": {"ir", "cost", "contract"},
    "runtime": {"contract"},
    "calibrate": {"ir", "cost", "runtime", "contract"},
    "cli": {"ir", "frontend", "cost", "passes", "codegen", "explain", "runtime", "calibrate", "contract"},
}
#: plan annotation keys: only rlhfc/ir/plan.py reads or writes them on a stage or module
PLAN_KEYS = ("mesh", "parallel", "microbatches", "recompute", "overlap", "stream", "stream_from", "overcommit",
             "unpad", "logprobs", "strategy", "threads", "refit_mb", "gpu_memory", "changes_training", "engine",
             "tail", "fused")
MAX_LINES = 500


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield ".".join(parts), path, is_pkg


def _imports(name: str, path: pathlib.Path, is_pkg: bool, *, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)   # `from . import plan` imports a module
            elif node.module:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m == "rlhfc" or m.startswith("rlhfc.")}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_layers_import_one_way():
    bad = []
    for name, path, is_pkg in _modules():
        mine = _package(name)
        if mine not in ALLOWED:
            continue
        for dep in _imports(name, path, is_pkg):
            theirs = _package(dep)
            if theirs and theirs != mine and theirs in ALLOWED and theirs not in ALLOWED[mine]:
                bad.append(f"{path.relative_to(PKG.parent)} imports {dep} ({mine} may import "
                           f"{', '.join(sorted(ALLOWED[mine])) or 'nothing of rlhfc'})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_every_package_is_in_the_table():
    packages = {_package(n) for n, _, _ in _modules()} - {""}
    assert packages <= set(ALLOWED), f"add {sorted(packages - set(ALLOWED))} to ALLOWED"


def test_no_import_cycle():
    """Imports — module-level and deferred into functions alike — form no cycle between modules, and packages
    form none between packages (a deferred import is for an optional heavy dependency, never to untangle our
    own modules)."""
    mods = {name: (path, is_pkg) for name, path, is_pkg in _modules()}
    g, pkgs = nx.DiGraph(), nx.DiGraph()
    for name, (path, is_pkg) in mods.items():
        for dep in _imports(name, path, is_pkg):
            if dep in mods and dep != name and not name.startswith(dep + "."):  # a package's own children
                g.add_edge(name, dep)
        for dep in _imports(name, path, is_pkg):
            a, b = _package(name), _package(dep)
            if a and b and a != b:
                pkgs.add_edge(a, b)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"module import cycles: {cycles[:5]}"
    assert nx.is_directed_acyclic_graph(pkgs), f"package cycles: {list(nx.simple_cycles(pkgs))[:5]}"


def test_plans_are_read_and_written_through_ir_plan():
    pattern = re.compile(r"annotations\s*(?:\.get\(|\.pop\(|\.setdefault\(|\[)\s*[\"'](%s)[\"']" % "|".join(PLAN_KEYS))
    bad = []
    for name, path, _ in _modules():
        if name == "rlhfc.ir.plan" or name.startswith("rlhfc.ir.plan."):
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{path.relative_to(PKG.parent)}:{i}: {line.strip()}")
    assert not bad, "plan annotations touched outside rlhfc/ir/plan.py:\n" + "\n".join(bad)


def test_no_file_over_500_lines_without_a_reason():
    long = []
    for _, path, _ in _modules():
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES and not any("Why this file is long:" in line for line in lines[:40]):
            long.append(f"{path.relative_to(PKG.parent)}: {len(lines)} lines")
    assert not long, "split these, or say at the top why not ('Why this file is long: ...'):\n" + "\n".join(long)


def test_the_contract_imports_no_third_party_package():
    """``rlhfc.contract`` is read by the job and by the compiler alike: the standard library only."""
    import sys

    bad = []
    for name, path, _ in _modules():
        if not name.startswith("rlhfc.contract"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            bad += [f"{name} imports {m}" for m in mods
                    if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "__future__"]
    assert not bad, bad


#: the runtime's sub-packages, lowest first: each imports only those before it (and the top-level
#: ``rlhfc.runtime.errors``); the top-level modules (``job``, ``compute``, ``rewards``) may import any
RUNTIME_ORDER = ("models", "rollout", "data", "rl", "train", "worker", "driver")


def test_the_runtime_sub_packages_import_one_way():
    bad = []
    for name, path, is_pkg in _modules():
        parts = name.split(".")
        if parts[:2] != ["rlhfc", "runtime"] or len(parts) < 3 or parts[2] not in RUNTIME_ORDER:
            continue
        mine = RUNTIME_ORDER.index(parts[2])
        for dep in _imports(name, path, is_pkg):
            theirs = dep.split(".")
            if theirs[:2] != ["rlhfc", "runtime"] or len(theirs) < 3:
                continue
            if theirs[2] in RUNTIME_ORDER and RUNTIME_ORDER.index(theirs[2]) > mine:
                bad.append(f"{path.relative_to(PKG.parent)} imports {dep} ({theirs[2]} is above {parts[2]})")
            elif theirs[2] not in RUNTIME_ORDER and theirs[2] != "errors":
                bad.append(f"{path.relative_to(PKG.parent)} imports {dep} (a top-level module of the runtime)")
    assert not bad, "upward imports in rlhfc/runtime:\n" + "\n".join(bad)


def test_the_runtime_map_lists_every_sub_package():
    import rlhfc.runtime as rt

    subs = {p.name for p in (PKG / "runtime").iterdir() if (p / "__init__.py").is_file()}
    assert subs == set(RUNTIME_ORDER), subs
    assert all(f"``{s}``" in rt.__doc__ for s in subs)


#: the registries and the engines' own modules, where an engine may be named; elsewhere the code asks the
#: registered traits (rlhfc.contract.engines)
ENGINE_MODULES = ("rlhfc/contract/engines.py", "rlhfc/runtime/rollout/vllm.py", "rlhfc/runtime/train/fsdp.py",
                  "rlhfc/runtime/train/megatron.py", "rlhfc/runtime/models/megatron.py",
                  "rlhfc/runtime/models/megatron_convert.py", "rlhfc/calibrate/vllm_engine.py", "rlhfc/cost/engine.py")
#: the most comparisons against an engine's name allowed outside them (issue #35's target)
MAX_ENGINE_NAME_COMPARISONS = 10


def engine_name_comparisons() -> list[str]:
    """``x == "vllm"``, ``t in ("torch", "megatron")`` and the like, outside :data:`ENGINE_MODULES`."""
    from rlhfc.contract.engines import rollout_engines, train_backends

    names = set(rollout_engines()) | set(train_backends())
    hits = []
    for _, path, _ in _modules():
        rel = str(path.relative_to(PKG.parent))
        if rel in ENGINE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = [x.value for x in sides if isinstance(x, ast.Constant)]
            consts += [e.value for x in sides if isinstance(x, (ast.Tuple, ast.List, ast.Set)) for e in x.elts
                       if isinstance(e, ast.Constant)]
            if any(c in names for c in consts if isinstance(c, str)):
                hits.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_engines_are_asked_by_traits_not_by_name():
    hits = engine_name_comparisons()
    assert len(hits) <= MAX_ENGINE_NAME_COMPARISONS, "compare traits, not engine names:\n" + "\n".join(hits)
