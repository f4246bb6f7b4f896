"""The suite's own order (tests/conftest.py): shuffled by default, a module's tests kept together and a
parametrized module fixture's tests kept in one block, repeatable from the seed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite_conftest():
    """tests/conftest.py by its path (``conftest`` by name may be another folder's)."""
    spec = importlib.util.spec_from_file_location("_rlhfc_suite_conftest", os.path.join(ROOT, "tests", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shuffled = _suite_conftest().shuffled


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def _items():
    return [_Item(f"tests/m{m}.py::test_{t}") for m in range(6) for t in range(8)] + \
           [_Item(f"tests/k.py::TestA::test_{t}") for t in range(4)] + \
           [_Item(f"tests/k.py::TestB::test_{t}") for t in range(4)]


def test_the_same_seed_gives_the_same_order_and_another_seed_another():
    items = _items()
    first = [i.nodeid for i in shuffled(items, 7)]
    assert first == [i.nodeid for i in shuffled(items, 7)]
    assert sorted(first) == sorted(i.nodeid for i in items)
    assert first != [i.nodeid for i in shuffled(items, 8)]
    assert first != [i.nodeid for i in items]


def test_a_modules_tests_and_a_classs_tests_stay_together():
    order = [i.nodeid for i in shuffled(_items(), 3)]

    def runs(key):
        keys = [key(n) for n in order]
        return sum(1 for a, b in zip([None] + keys, keys) if a != b)

    assert runs(lambda n: n.split("::")[0]) == 7             # 7 modules, each one run
    assert runs(lambda n: "::".join(n.split("::")[:-1])) == 8  # + TestA and TestB each one run


@pytest.mark.parametrize("seed", [1, 2])
def test_a_parametrized_module_fixture_is_set_up_once_per_value(tmp_path, seed):
    """Run through pytest itself: the module fixture's setups are counted in a file."""
    (tmp_path / "conftest.py").write_text((open(f"{ROOT}/tests/conftest.py").read()))
    (tmp_path / "test_mod.py").write_text(textwrap.dedent(f"""
        import pytest

        @pytest.fixture(scope="module", params=["a", "b", "c"])
        def job(request):
            with open({str(tmp_path / "setups")!r}, "a") as fh:
                fh.write(request.param + "\\n")
            return request.param

        @pytest.mark.parametrize("k", range(4))
        def test_reads(job, k):
            assert job in "abc"

        def test_other(job):
            assert job

        def test_plain():
            pass
        """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          "--order-seed", str(seed), str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "16 passed" in out.stdout
    assert sorted((tmp_path / "setups").read_text().split()) == ["a", "b", "c"]
