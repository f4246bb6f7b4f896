"""Placement on a multi-node Ray cluster (two raylets on this machine, via --ray-address):
stages land on the nodes the plan names, and the placed job trains like the unplaced one."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.passes import PassManager, parse_pipeline
from rlhfc.runtime.job import Job

from .conftest import HERE, compile_job, untimed

pytestmark = pytest.mark.e2e


def _compile(tmp_path, passes: str, name: str) -> str:
    return compile_job(os.path.join(HERE, "two_nodes.rlhf"), str(tmp_path / name), level=None,
                       passes=passes.split(","), source="two_nodes.rlhf")


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
    return untimed(rows), info


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


@pytest.mark.slow
def test_group_ranks_land_on_the_node_the_plan_names(tmp_path):
    """Multi-rank groups (the actor and the critic fixed at dp = 2, trainer = auto: FSDP2 ranks) start every
    rank on the node of their mesh."""
    import ray
    from ray.cluster_utils import Cluster

    from rlhfc.frontend import compile_source

    text = open(os.path.join(HERE, "two_nodes.rlhf")).read()
    text = text.replace("devices = cpu:1; nodes = 2", "devices = cpu:2; nodes = 2").replace(
        "steps = 3; seed = 3; checkpoint_every = 0; placement = interleave",
        "steps = 1; seed = 3; checkpoint_every = 0; placement = interleave; trainer = auto").replace(
        "max_seq = 32) trainable", "max_seq = 32) layout(dp = 2) trainable").replace(
        "head = value trainable", "head = value layout(dp = 2) trainable")
    module, _ = compile_source(text, os.path.join(HERE, "two_nodes_fsdp.rlhf"))
    module = PassManager(parse_pipeline("placement{strategy=interleave}")).run(module)
    job_dir = str(tmp_path / "job")
    emit_job(module, job_dir, source_path="two_nodes_fsdp.rlhf", opt_level="custom", passes=["placement"])
    placement = json.load(open(os.path.join(job_dir, "plan.json")))["placement"]
    ranks = {name: w["ranks"] for name, w in placement["workers"].items()}
    assert ranks["actor"] == ranks["critic"] == 2, placement["workers"]

    import importlib.util

    spec = importlib.util.spec_from_file_location("m_fsdp_nodes", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seen: dict[str, list[str]] = {}

    def step(job, w):
        for name, group in job.workers.items():
            seen[name] = [ray.get(r.ready.remote())["node"] for r in group.ranks]
        return mod.step(job, w)

    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        job = Job(job_dir, out=str(tmp_path / "run"), ray_address=cluster.address, progress=False)
        try:
            job.run(step)
        finally:
            job.shutdown()
    finally:
        cluster.shutdown()
    by_bundle: dict[int, set[str]] = {}
    for name, nodes in seen.items():
        assert len(nodes) == ranks[name]
        assert len(set(nodes)) == 1, f"{name}'s ranks are on several nodes: {nodes}"
        by_bundle.setdefault(placement["workers"][name]["bundle"], set()).update(nodes)
    assert len(by_bundle) == 2 and all(len(n) == 1 for n in by_bundle.values())
    assert by_bundle[0] != by_bundle[1]   # the two bundles are the two nodes
