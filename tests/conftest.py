"""Options of the test suite.

``--fuzz-n N``: how many mutated programs the fuzz tests (``tests/test_fuzz.py``) check; the data-file and
command-line fuzzers scale with it. CI runs the default (2000 programs, about half a minute); a long local
run is ``pytest tests/test_fuzz.py --fuzz-n 10000``.
"""

from __future__ import annotations

#: programs the fuzz tests mutate by default (the CI tier)
DEFAULT_FUZZ_N = 2000


def pytest_addoption(parser):
    parser.addoption("--fuzz-n", type=int, default=DEFAULT_FUZZ_N, metavar="N",
                     help=f"mutated programs the fuzz tests check (default {DEFAULT_FUZZ_N}; e.g. 10000 locally)")


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
