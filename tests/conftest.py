"""Options of the test suite.

``--fuzz-n N``: how many mutated programs the fuzz tests (``tests/test_fuzz.py``) check; the data-file and
command-line fuzzers scale with it. CI runs the default (2000 programs, about half a minute); a long local
run is ``pytest tests/test_fuzz.py --fuzz-n 10000``.

Every test runs by default, the long end-to-end ones (marked ``slow``: fault injection, multi-rank layouts,
the resume and claims runs, prediction through Ray) included: the README's test command is CI's.
``pytest -m "not slow"`` is the quick local loop (it skips what docs/claims.md needs, and says so).

**A claim's test must run.** When the whole suite runs (no paths, ``-k``, ``-m`` or ``--deselect``), every test
that docs/claims.md names must have been collected and passed, each parametrization included: one skipped
(a missing optional extra), deselected or missing fails the run, naming it (:func:`pytest_sessionfinish`).

**Order.** The default, ``--order shuffle``, runs the modules in a shuffled order and the tests of each module
shuffled (pytest's grouping of a module's parametrized fixtures is kept, and a module's tests stay together, so
no module fixture — a trained job several tests read — is set up twice). The seed is the checked-out commit's
(``git rev-parse HEAD``), so CI's run of a commit is repeatable and each commit tries another order; the header
prints it, and ``--order-seed N`` repeats an order. ``--order file`` and ``--order reverse`` give those orders. A
test that leans on an earlier test's state (an engine another test stopped, a job another test trained) fails in
some order, as it would for a user running a claim's test by its id alone or the claims' ids sorted. A
whole-suite run reversed once failed from tests/e2e/test_cluster.py on: a runtime test's bare ``ray.init()`` had
turned Ray's token authentication on for the process (see :func:`pytest_configure`).
"""

from __future__ import annotations

#: programs the fuzz tests mutate by default (the CI tier)
DEFAULT_FUZZ_N = 2000


def pytest_configure(config):
    """One compile cache for every vLLM engine the suite starts (``RLHFC_VLLM_CACHE``: the kernels and
    precompiled headers an engine's start builds, about half a minute each on 2 cores, built once), removed
    at the end. Ray workers and spawned processes inherit it from the environment.

    ``RAY_AUTH_MODE=disabled`` for the whole session, as a job's driver sets it (rlhfc.runtime.driver.cluster
    .import_ray): a test's own ``ray.init()`` with the mode unset turns token authentication on *for the rest
    of the process* (Ray caches its config), and every later job whose Ray cluster runs without tokens —
    the two-raylet cluster of tests/e2e/test_cluster.py — then fails to start its workers ("cancelled before
    it started"). That was the suite's failure in reverse order."""
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if "RLHFC_VLLM_CACHE" not in os.environ and not hasattr(config, "workerinput"):
        config._vllm_cache = tempfile.mkdtemp(prefix="rlhfc-vllm-cache-")
        os.environ["RLHFC_VLLM_CACHE"] = config._vllm_cache


def pytest_unconfigure(config):
    import shutil

    folder = getattr(config, "_vllm_cache", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--fuzz-n", type=int, default=DEFAULT_FUZZ_N, metavar="N",
                     help=f"mutated programs the fuzz tests check (default {DEFAULT_FUZZ_N}; e.g. 10000 locally)")
    parser.addoption("--order", choices=("shuffle", "file", "reverse"), default="shuffle",
                     help="test order: modules and their tests shuffled (default; seed: the commit's), file "
                          "order, or last to first")
    parser.addoption("--order-seed", type=int, default=None, metavar="N",
                     help="the shuffle's seed (default: from the checked-out commit, printed in the header)")
    parser.addoption("--slow", action="store_true",
                     help="accepted for old command lines: the long end-to-end tests run by default now")


def order_seed(config) -> int:
    """The shuffle's seed: ``--order-seed``, else the checked-out commit's hash, else a random one."""
    import random
    import subprocess

    if config.getoption("order_seed", default=None) is not None:
        return config.getoption("order_seed")
    if getattr(config, "_order_seed", None) is None:
        try:
            head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=str(config.rootpath), capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
            config._order_seed = int(head[:8], 16)
        except (OSError, ValueError, subprocess.SubprocessError):
            config._order_seed = random.randrange(2 ** 32)
    return config._order_seed


def _block(item) -> tuple:
    """The tests that must stay together inside a module: one class, one value of each parametrized fixture
    wider than a test (their fixture would otherwise be set up again for each switch)."""
    parts = item.nodeid.split("::")[1:-1]
    callspec = getattr(item, "callspec", None)
    wide = []
    if callspec is not None:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        for name in sorted(callspec.params):
            fixturedefs = defs.get(name) or ()
            scope = getattr(fixturedefs[-1], "scope", "function") if fixturedefs else "function"
            if scope in ("class", "module", "package"):
                wide.append((name, callspec.indices.get(name)))
    return tuple(parts), tuple(wide)


def shuffled(items: list, seed: int) -> list:
    """``items`` with the modules in a shuffled order and each module's tests shuffled within their blocks
    (:func:`_block`); the same seed gives the same order."""
    import random

    rng = random.Random(seed)
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    names = list(modules)
    rng.shuffle(names)
    out = []
    for name in names:
        blocks: dict[tuple, list] = {}
        for item in modules[name]:
            blocks.setdefault(_block(item), []).append(item)
        keys = list(blocks)
        rng.shuffle(keys)
        for key in keys:
            rng.shuffle(blocks[key])
            out.extend(blocks[key])
    return out


def pytest_report_header(config):
    order = config.getoption("order", default="file")
    if order == "shuffle":
        seed = order_seed(config)
        return f"test order: shuffled, seed {seed} (repeat with --order-seed {seed}; --order file for file order)"
    return f"test order: {order}"


def pytest_collection_modifyitems(session, config, items):
    """Shuffle the tests (the default) or run them last to first (``--order reverse``)."""
    order = config.getoption("order", default="file")
    if order == "reverse":
        items.reverse()
    elif order == "shuffle":
        items[:] = shuffled(items, order_seed(config))


_OUTCOMES: dict[str, list[str]] = {}   # "tests/FILE.py::test_name" (no class, no parameters) -> outcomes


def claim_key(nodeid: str) -> str:
    """``tests/FILE.py::test_name`` of a node id (a test class's name and the parameters dropped), as
    docs/claims.md names tests."""
    path, _, rest = nodeid.partition("::")
    return f"{path}::{rest.split('[', 1)[0].split('::')[-1]}"


def pytest_runtest_logreport(report):
    """Record each test's outcome (a failure or skip in any phase counts) for the claims check."""
    if report.when == "call" or report.outcome != "passed":
        _OUTCOMES.setdefault(claim_key(report.nodeid), []).append(
            "passed" if report.outcome == "passed" and report.when == "call" else report.outcome)


def _whole_suite(config) -> bool:
    """Whether this run is the whole suite (``pytest`` as CI and the README run it)."""
    import os

    args = [os.path.normpath(os.path.join(str(config.invocation_params.dir), a)) for a in config.args]
    root = os.path.normpath(os.path.join(str(config.rootpath), "tests"))
    # options that run fewer tests
    narrowed = ("keyword", "markexpr", "deselect", "ignore", "ignore_glob", "lf", "exitfirst", "collectonly")
    return args == [root] and not any(config.getoption(o, default=None) for o in narrowed)


def claim_problems(outcomes: dict[str, list[str]]) -> list[str]:
    """The tests docs/claims.md names that did not run and pass in ``outcomes`` (test id -> outcomes)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "claims.md"), encoding="utf-8") as fh:
        refs = sorted(set(re.findall(r"(tests/[\w/]+\.py::\w+)", fh.read())))
    # a name whose file does not exist (the page's own example) is test_claims.py's to report
    refs = [r for r in refs if os.path.isfile(os.path.join(root, r.split("::")[0]))]
    out = []
    for ref in refs:
        got = outcomes.get(ref)
        if not got:
            out.append(f"{ref}: not run (deselected, or no longer collected)")
        elif any(o != "passed" for o in got):
            out.append(f"{ref}: {', '.join(sorted(set(got)))}")
    return out


def pytest_sessionfinish(session, exitstatus):
    """Fail a whole-suite run in which a test docs/claims.md names did not run and pass."""
    if not _whole_suite(session.config) or exitstatus not in (0, 1):
        return
    problems = claim_problems(_OUTCOMES)
    if problems:
        session.config._claim_problems = problems
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    problems = getattr(config, "_claim_problems", None)
    if problems:
        terminalreporter.section("claims not proven", sep="=", red=True)
        terminalreporter.line(f"{len(problems)} test(s) named in docs/claims.md did not run and pass "
                              "(a claim's test must run: install the extras with .ci/run's command):")
        for line in problems:
            terminalreporter.line(f"  {line}")


def _pretend_megatron_installed(monkeypatch) -> None:
    """Make ``check`` see megatron-core as installed (only its name; other modules are looked up as usual):
    tests of layouts and of what megatron can run hold whether or not the optional extra is installed
    (``tests/test_layouts.py`` tests the missing-install diagnostic itself)."""
    import importlib.util

    from rlhfc.ir.plan import check

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.startswith("megatron"):
            return object()
        return real(name, *args, **kwargs)

    monkeypatch.setattr(check.importlib.util, "find_spec", find_spec)


import pytest  # noqa: E402


@pytest.fixture
def megatron_installed(monkeypatch):
    _pretend_megatron_installed(monkeypatch)


@pytest.fixture(autouse=True, scope="module")
def _temp_folder_restored():
    """Every module starts and ends with the session's temp folder and environment. A vLLM engine started in the
    test process points ``TMPDIR`` and Python's temp folder into its own folder, which its test's tmp_path may
    remove; a vLLM rank's engine sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` for torch.distributed, which every
    Ray worker a later job starts would inherit."""
    import os
    import tempfile

    saved, saved_env = tempfile.tempdir, dict(os.environ)
    yield
    tempfile.tempdir = saved
    os.environ.clear()
    os.environ.update(saved_env)
