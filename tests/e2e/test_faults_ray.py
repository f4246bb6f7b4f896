"""Ray hygiene (runtime/hygiene.py): workers that would import another rlhfc than the driver stop the job
before any worker starts, naming both; a Ray the job started leaves no temporary folder behind, also
after Ctrl-C. (tests/e2e/test_faults.py checks the folder after every run it makes, failed ones too.)"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import rlhfc
from rlhfc.cli import main as cli
from rlhfc.runtime.driver import cluster as cluster_mod
from rlhfc.runtime.driver.hygiene import code_identity, remove_ray_temp
from rlhfc.runtime.job import Interrupted, JobError, run_job

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hygiene")
    assert cli(["compile", str(HERE / "tiny_ppo.rlhf"), "-O0", "--emit", "job", "-o", str(tmp / "job")]) == 0
    return tmp / "job"


@pytest.fixture()
def temp_folders(monkeypatch) -> list[str]:
    """The Ray temporary folders the jobs of a test removed (each checked to exist before)."""
    removed: list[str] = []
    original = cluster_mod.remove_ray_temp

    def remove(path, *args, **kwargs):
        assert os.path.isdir(path)
        removed.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(cluster_mod, "remove_ray_temp", remove)
    return removed


def test_remove_ray_temp_removes_a_tree(tmp_path):
    (tmp_path / "t" / "session_x" / "logs").mkdir(parents=True)
    (tmp_path / "t" / "session_x" / "logs" / "raylet.out").write_text("x")
    os.symlink(tmp_path / "t" / "session_x", tmp_path / "t" / "session_latest")
    assert remove_ray_temp(str(tmp_path / "t")) and not (tmp_path / "t").exists()
    assert code_identity() == {"version": rlhfc.__version__, "path": os.path.realpath(os.path.dirname(rlhfc.__file__))}


@pytest.mark.e2e
def test_workers_importing_another_rlhfc_stop_the_job(job, tmp_path, monkeypatch, temp_folders):
    import ray

    stale = tmp_path / "checkout"
    (stale / "rlhfc").mkdir(parents=True)
    (stale / "rlhfc" / "__init__.py").write_text('__version__ = "0.0.0-stale"\n')
    monkeypatch.chdir(stale)   # Ray's workers import from the driver's current folder first
    with pytest.raises(JobError) as exc:
        run_job(str(job), out=str(tmp_path / "run"), progress=False)
    here = os.path.realpath(os.path.dirname(rlhfc.__file__))
    assert (f"import rlhfc 0.0.0-stale from {os.path.realpath(stale / 'rlhfc')}, but the driver runs "
            f"rlhfc {rlhfc.__version__} from {here}") in exc.value.message, exc.value.message
    assert "a folder named rlhfc in the current folder" in exc.value.hint
    assert not ray.is_initialized()
    assert len(temp_folders) == 1 and not os.path.exists(temp_folders[0])


@pytest.mark.e2e
def test_ctrl_c_removes_ray_temp_folder_in_the_run_folder(job, temp_folders):
    import ray

    spec = importlib.util.spec_from_file_location("hygiene_main", job / "main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def interrupted(job_, w):
        if job_.step == 1:
            raise KeyboardInterrupt
        return mod.step(job_, w)

    base = tempfile.mkdtemp(prefix="rlhfc-t-", dir="/tmp")   # short: Ray's folder goes inside the run folder
    try:
        out = os.path.join(base, "run")
        with pytest.raises(Interrupted):
            run_job(str(job), step_fn=interrupted, out=out, progress=False)
        assert temp_folders == [os.path.join(out, "ray")]
        assert "ray" not in os.listdir(out) and "metrics.jsonl" in os.listdir(out)
        assert not ray.is_initialized()
    finally:
        shutil.rmtree(base, ignore_errors=True)
