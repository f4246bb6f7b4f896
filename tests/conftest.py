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
