"""Options of the test suite.

``--fuzz-n N``: how many mutated programs the fuzz tests (``tests/test_fuzz.py``) check; the data-file and
command-line fuzzers scale with it. CI runs the default (2000 programs, about half a minute); a long local
run is ``pytest tests/test_fuzz.py --fuzz-n 10000``.

``--slow``: also run the long end-to-end tests (marked ``slow``: fault injection, multi-rank layouts, the
resume and claims runs, prediction through Ray; about 12 more minutes on 2 cores). The default run (the
README's test command, CI's) skips them, saying so, to stay well inside CI's 30 minutes; the README's
first command and its claims, and the vLLM job, run by default.
"""

from __future__ import annotations

#: programs the fuzz tests mutate by default (the CI tier)
DEFAULT_FUZZ_N = 2000


def pytest_addoption(parser):
    parser.addoption("--fuzz-n", type=int, default=DEFAULT_FUZZ_N, metavar="N",
                     help=f"mutated programs the fuzz tests check (default {DEFAULT_FUZZ_N}; e.g. 10000 locally)")
    parser.addoption("--slow", action="store_true", help="also run the long end-to-end tests (marked slow)")


def pytest_collection_modifyitems(config, items):
    """Without ``--slow``, tests marked ``slow`` are skipped (with the reason, so the summary counts them)."""
    if config.getoption("--slow"):
        return
    import pytest

    skip = pytest.mark.skip(reason="long end-to-end run: pytest --slow runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


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
