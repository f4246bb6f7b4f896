"""The README's install command gives PyTorch's CPU build wherever it runs (issue #19): ``constraints.txt``
adds PyTorch's CPU-only index, whose ``2.13.0+cpu`` pip prefers to PyPI's CUDA ``2.13.0``. Checked offline:
pip resolves the repository's own constraints file against two local indexes standing in for PyPI and
PyTorch's CPU index (fake wheels of a few bytes), as it would on a machine whose default index serves the
CUDA build."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as fh:
        return fh.read()


def test_constraints_pin_torch_and_add_the_cpu_index_and_ci_installs_as_the_readme():
    lines = [x.strip() for x in _read("constraints.txt").splitlines() if x.strip() and not x.startswith("#")]
    assert lines == [f"--extra-index-url {CPU_INDEX}", "torch==2.13.0", "transformers==5.19.0"]
    assert _torch_range().contains("2.13.0")                            # inside the package's range
    # the traced blocks that ship were made under the pinned versions (python -m rlhfc.passes.recompute_trace)
    import glob
    import json

    made = {tuple(json.load(open(f, encoding="utf-8"))["versions"])
            for f in glob.glob(os.path.join(ROOT, "rlhfc", "passes", "traces", "*.json"))}
    assert made == {("2.13.0+cpu", "5.19.0")}, made
    first = next(x for x in _read("README.md").splitlines() if "pip install" in x)
    readme = re.search(r"pip install (-c constraints\.txt -e '\.\[[a-z,]+\]')", first)
    assert readme, first
    ci = re.search(r"pip install -q (-c constraints\.txt -e '\.\[[a-z,]+\]')", _read(".ci", "run"))
    assert ci and ci.group(1).split("[")[0] == readme.group(1).split("[")[0]


def test_a_local_cpu_label_satisfies_the_pin_and_sorts_above_the_plain_release():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    assert Version("2.13.0+cpu") in SpecifierSet("==2.13.0") and Version("2.13.0+cu130") in SpecifierSet("==2.13.0")
    assert Version("2.13.0+cpu") > Version("2.13.0") and Version("2.14.0") not in SpecifierSet("==2.13.0")


def _wheel(folder, version: str) -> None:
    """A wheel of package ``torch`` at ``version`` holding only its metadata, in a PEP 503 index folder."""
    os.makedirs(folder / "torch", exist_ok=True)
    name = f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / "torch" / name, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    (folder / "torch" / "index.html").write_text(f'<html><body><a href="{name}">{name}</a></body></html>')


def _resolve(tmp_path, constraints: str) -> str:
    (tmp_path / "c.txt").write_text(constraints)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--no-deps",
                           "--ignore-installed", "--disable-pip-version-check",
                           "--index-url", (tmp_path / "pypi").as_uri(), "-c", str(tmp_path / "c.txt"), "torch"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PIP_RETRIES": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return re.search(r"Would install (\S+)", proc.stdout).group(1)


def test_pip_takes_the_cpu_build_through_the_repositorys_constraints_file(tmp_path):
    pytest.importorskip("pip")
    _wheel(tmp_path / "pypi", "2.13.0")          # PyPI: the plain version (the CUDA build on Linux)
    _wheel(tmp_path / "cpu", "2.13.0+cpu")       # PyTorch's CPU index
    ours = _read("constraints.txt").replace(CPU_INDEX, (tmp_path / "cpu").as_uri())
    assert _resolve(tmp_path, ours) == "torch-2.13.0+cpu"
    assert _resolve(tmp_path, "torch==2.13.0\n") == "torch-2.13.0"   # without the index line: PyPI's build


def _torch_range():
    """The torch requirement's specifier in pyproject.toml's ``dependencies``."""
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads(_read("pyproject.toml"))["project"]["dependencies"]
    return next(Requirement(d) for d in deps if Requirement(d).name == "torch").specifier


def test_the_package_states_a_torch_range_whose_lowest_release_is_the_one_ci_tests():
    """The package's requirement is a range (a user's own CUDA build stays); constraints.txt keeps the exact pin
    CI and the README's CPU install use, and it is the range's lowest release: the oldest one tested."""
    from packaging.version import Version

    import torch

    spec = _torch_range()
    pin = next(x.split("==")[1] for x in _read("constraints.txt").splitlines() if x.startswith("torch=="))
    lowest = [Version(s.version) for s in spec if s.operator == ">="]
    assert lowest == [Version(pin)], spec
    for build in (pin, f"{pin}+cpu", f"{pin}+cu130", "2.14.0+cu128"):   # CUDA builds, a later release
        assert spec.contains(build), build
    assert not spec.contains("2.12.1")
    assert spec.contains(torch.__version__)   # the installed torch (this venv's)


def test_installing_rlhfc_keeps_a_torch_release_inside_the_range(tmp_path):
    """``pip install -e .`` where a CUDA torch of another release is installed keeps it: pip resolves offline
    (``--no-index``: it can only keep what is installed), seeing a torch 2.14.0+cu130 (the metadata of one, on
    the path ahead of this venv's) — with the old exact pin it could not resolve at all."""
    pytest.importorskip("pip")
    info = tmp_path / "site" / "torch-2.14.0+cu130.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.0+cu130\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("pip\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "PIP_RETRIES": "0"}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--disable-pip-version-check", "-e", ROOT], capture_output=True, text=True, timeout=300,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch==2.14.0+cu130" in proc.stdout or "torch>=2.13 in" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^Would install rlhfc-[\d.]+$", proc.stdout, re.M), proc.stdout[-2000:]
