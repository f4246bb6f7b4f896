"""Placement on a multi-node Ray cluster (two raylets on this machine, via --ray-address):
stages land on the nodes the plan names, and the placed job trains like the unplaced one."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.passes import PassManager, parse_pipeline
from rlhfc.runtime.job import Job

pytestmark = pytest.mark.e2e
HERE = os.path.dirname(__file__)
TIMING = {"step_time_s", "samples_per_s", "wait_s"}


def _compile(tmp_path, passes: str, name: str) -> str:
    module, _, _ = load_file(os.path.join(HERE, "two_nodes.rlhf"))
    module = PassManager(parse_pipeline(passes)).run(module)
    job = str(tmp_path / name)
    emit_job(module, job, source_path="two_nodes.rlhf", opt_level="custom", passes=passes.split(","))
    return job


def _run(job_dir, out, address=None):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"m_{os.path.basename(job_dir)}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    job = Job(job_dir, out=out, ray_address=address, progress=False)
    try:
        rows = job.run(mod.step)
        info = dict(job.worker_info)
    finally:
        job.shutdown()
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows], info


def test_interleaved_plan_lands_on_the_named_nodes_and_trains_like_flatten(tmp_path):
    from ray.cluster_utils import Cluster

    placed = _compile(tmp_path, "placement{strategy=interleave}", "placed")
    plan = json.load(open(os.path.join(placed, "plan.json")))["placement"]
    assert plan["strategy"] == "STRICT_SPREAD" and len(plan["bundles"]) == 2
    assert plan["workers"]["actor"]["bundle"] == 0
    assert {plan["workers"][m]["bundle"] for m in ("critic", "ref", "reward")} == {1}

    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        rows_placed, info = _run(placed, str(tmp_path / "run_placed"), address=cluster.address)
    finally:
        cluster.shutdown()
    nodes = {name: w["node"] for name, w in info.items()}
    assert nodes["actor"] != nodes["critic"]
    assert nodes["critic"] == nodes["ref"] == nodes["reward"]

    flat = _compile(tmp_path, "placement{strategy=flatten}", "flat")
    rows_flat, _ = _run(flat, str(tmp_path / "run_flat"))
    assert rows_placed == rows_flat
