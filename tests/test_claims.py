"""docs/claims.md: every claim row names tests, and every test it names exists.

A row of a claims table (under a heading other than "Measurements") must name at least one test as
``tests/PATH.py::test_name``; the file must exist and define ``test_name`` (a ``def`` at any indentation,
so test classes count). Also checked here: the README quotes the learning-curve figures that
``tests/e2e/test_claims_readme.py`` asserts, and ``explain`` says that -O3 changes training.
"""

from __future__ import annotations

import ast
import os
import re

from rlhfc.cli import main as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLAIMS = os.path.join(ROOT, "docs", "claims.md")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _claim_rows() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(section, claim, [(file, test)]) for every row of every claims table."""
    rows, section = [], ""
    with open(CLAIMS, encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("## "):
                section = line[3:].strip()
            if not line.startswith("|") or section.startswith(("Measurements", "What the optimisation")):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in ("claim", "") or set(cells[0]) <= {"-", " ", ":"}:
                continue
            rows.append((section, cells[0], TEST_REF.findall(cells[-1])))
    return rows


def _test_names(path: str) -> set[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_claims_page_lists_claims_of_the_readme_and_the_docs():
    sections = {s for s, _, _ in _claim_rows()}
    assert {"README.md", "docs/runtime.md"} <= sections
    assert len(_claim_rows()) >= 40


def test_every_claim_names_a_test_that_exists():
    missing, unnamed = [], []
    for section, claim, refs in _claim_rows():
        if not refs:
            unnamed.append(f"{section}: {claim}")
        for path, name in refs:
            if not os.path.isfile(os.path.join(ROOT, path)) or name not in _test_names(path):
                missing.append(f"{section}: {claim} -> {path}::{name}")
    assert not unnamed, "claims without a test:\n" + "\n".join(unnamed)
    assert not missing, "claims naming a test that does not exist:\n" + "\n".join(missing)


def test_readme_points_at_the_claims_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        assert "docs/claims.md" in fh.read()


def test_readme_quotes_the_figures_the_curve_tests_check():
    """The README's learning-curve figures are the ones tests/e2e/test_claims_readme.py asserts."""
    import importlib
    import sys

    if os.path.join(ROOT, "tests") not in sys.path:   # the e2e tests are a package (tests/e2e/conftest.py)
        sys.path.insert(0, os.path.join(ROOT, "tests"))
    mod = importlib.import_module("e2e.test_claims_readme")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = " ".join(fh.read().split())
    first, last = mod.README_CURVES["ppo_tiny"]
    assert f"first 5 steps +{first:.2f} -> last 5 steps +{last:.2f}" in text
    first, last = mod.README_CURVES["grpo_tiny"]
    assert f"from ≈{first:.2f} to ≈{last:.2f} in 40 steps" in text
    mod = importlib.import_module("e2e.test_arith_learns")
    first, last = mod.README_ARITH
    assert f"mean reward: first 5 steps +{first:.4f} -> last 5 steps +{last:.4f}" in text
    assert "rlhfc run examples/arith_tiny.rlhf" in text.split("```")[1]   # the first command trains it


def test_explain_says_O3_changes_what_the_job_trains_on(capsys):
    program = os.path.join(ROOT, "examples", "ppo_tiny.rlhf")
    assert cli(["explain", program, "-O3", "--no-profile"]) == 0
    assert "note: async_rollout changes what the job trains on" in capsys.readouterr().out
    assert cli(["explain", program, "-O2", "--no-profile"]) == 0
    assert "changes what the job trains on" not in capsys.readouterr().out



def test_a_claims_test_that_was_skipped_or_not_run_fails_the_whole_suite():
    """The whole-suite check of tests/conftest.py: every test docs/claims.md names must have run and passed,
    each parametrization and test-class method included."""
    import importlib.util

    # tests/conftest.py itself (a bare `import conftest` may find another folder's conftest)
    spec = importlib.util.spec_from_file_location("rlhfc_tests_root_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    claim_key, claim_problems = root.claim_key, root.claim_problems

    assert claim_key("tests/e2e/test_x.py::TestA::test_b[llama-2]") == "tests/e2e/test_x.py::test_b"
    refs = sorted({f"{p}::{n}" for _, _, rs in _claim_rows() for p, n in rs})
    passed = {r: ["passed"] for r in refs}
    assert claim_problems(passed) == []
    one = refs[0]
    assert claim_problems({**passed, one: ["passed", "skipped"]}) == [f"{one}: passed, skipped"]
    gone = {r: o for r, o in passed.items() if r != one}
    assert claim_problems(gone) == [f"{one}: not run (deselected, or no longer collected)"]
