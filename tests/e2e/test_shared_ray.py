"""A job on a Ray it found running (``--ray-address``, or one the calling process started) leaves Ray running
and gives back what it took: its workers are killed and its placement group removed, so the next job in the
same process finds the devices free (the e2e modules share one Ray this way: ``shared_ray``)."""

from __future__ import annotations

import time

import pytest

from rlhfc.runtime.job import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("shared_ray")]


def _free_cpus(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_a_job_on_a_running_ray_gives_back_its_workers_and_placement_group(tiny_ppo_job, tmp_path):
    import ray

    total = ray.cluster_resources()["CPU"]
    for k in range(2):   # the second job reserves the same devices again
        rows = run_job(tiny_ppo_job, out=str(tmp_path / f"run{k}"), steps=1, progress=False)
        assert len(rows) == 1 and ray.is_initialized()
        deadline = time.monotonic() + 30
        while _free_cpus(ray) < total and time.monotonic() < deadline:   # the release is asynchronous
            time.sleep(0.2)
        assert _free_cpus(ray) == total, ray.available_resources()
