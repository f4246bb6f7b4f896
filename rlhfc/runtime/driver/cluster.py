"""Cluster start-up: start or connect to Ray, reserve the plan's devices, create the worker groups.

The plan's ``placement`` holds one bundle per node and one entry per worker (a model on a mesh):
its bundle, CPU / GPU share, threads and cores, and the train backend and rollout engine that run it.
:meth:`Cluster.start` turns each entry into a :class:`~rlhfc.runtime.driver.group.WorkerGroup` of ``ranks`` Ray
actors, each a :class:`~rlhfc.runtime.worker.base.ModelWorker` holding the train backend and rollout engine the
plan names (their classes registered in :mod:`rlhfc.contract.engines`), and waits until every worker has built
its model.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import tempfile
from typing import Any

from rlhfc.contract.engines import rollout_traits, train_traits
from rlhfc.contract.plan import Plan, WorkerPlan
from rlhfc.runtime.errors import JobError

from rlhfc.runtime.train.backend import open_store
from rlhfc.runtime.worker.base import ModelWorker
from rlhfc.runtime.worker.host import MAX_CALLS, HostedRank, ModelHost

from .group import WorkerGroup
from .hygiene import check_worker_code, remove_ray_temp


def import_ray():
    """Import Ray with the environment a job needs (set before Ray starts)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # idle OpenMP threads must sleep, not spin: workers share cores (10-100x slower otherwise on 2 cores)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import ray

    return ray


def check_local_gpus(plan: Plan, ray_address: str | None) -> None:
    """A run on a local Ray (none given, none running in this process) of a plan that needs more GPUs than this
    machine has fails at once, before its data is built and Ray started (the error :meth:`Cluster.check_resources`
    gives on a cluster)."""
    need = sum(b.get("GPU", 0) for b in plan.placement.bundles)
    if need <= 0 or ray_address:
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    import torch

    have = torch.cuda.device_count()
    if have + 1e-9 < need:
        raise JobError(f"the plan needs {need:g} GPU ({plan.cluster.device}) but this machine has {have}",
                       "run it on a matching cluster with --ray-address, or compile a program whose cluster is "
                       "`devices = cpu:N` to run locally")


class Cluster:
    """The Ray side of one job: the connection, its placement group and its worker groups."""

    def __init__(self, plan: Plan, out: str, seed: int, ray_address: str | None = None):
        self.plan, self.out, self.seed, self.ray_address = plan, out, seed, ray_address
        self.started_ray = False
        self.pg = None
        #: worker name -> its group (the generated code's ``w.<name>``)
        self.workers: dict[str, WorkerGroup] = {}
        #: worker name -> what its ``ready()`` returned (pid, node, threads, cores, ...)
        self.worker_info: dict[str, dict] = {}

    def start(self) -> dict[str, WorkerGroup]:
        """Start (or connect to) Ray, check resources, reserve the placement group, create the workers."""
        ray = import_ray()
        os.makedirs(self.out, exist_ok=True)
        self._connect(ray)
        self.check_resources(ray)
        self.pg = self._reserve(ray)
        refs = self._create_workers(ray)
        for name, ref in refs.items():
            try:
                self.worker_info[name] = ray.get(ref)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                raise JobError(f"worker for model '{name}' failed to start: {type(cause).__name__}: {cause}",
                               "check the model's config (and for hf(...) models, the local folder)") from None
        return self.workers

    def _connect(self, ray) -> None:
        """Connect to ``ray_address``, or start a local Ray in a temporary folder of its own (removed at
        :meth:`shutdown`); then check that Ray's workers import the driver's rlhfc (:mod:`.hygiene`)."""
        if ray.is_initialized():
            return
        if self.ray_address:
            ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR")
        else:
            need_cpu = sum(b.get("CPU", 0) for b in self.plan.placement.bundles)
            tmp = os.path.join(self.out, "ray")
            if len(tmp) > 40:  # Ray adds ~62 bytes to it for its sockets; unix socket paths hold 107
                tmp = tempfile.mkdtemp(prefix="rlhfc-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
            self.ray_temp = tmp   # set first: a Ray that fails to start may leave files there
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need_cpu)), include_dashboard=False,
                     log_to_driver=False, logging_level="ERROR", _temp_dir=tmp)
        self.started_ray = True
        check_worker_code(ray, same_machine=not self.ray_address)

    def check_resources(self, ray) -> None:
        have = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in self.plan.placement.bundles:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        for k, v in need.items():
            if have.get(k, 0) + 1e-9 < v:
                kind = self.plan.cluster.device
                raise JobError(f"the plan needs {v:g} {k} ({kind}) but the Ray cluster has {have.get(k, 0):g}",
                               "run it on a matching cluster with --ray-address, or compile a program whose "
                               "cluster is `devices = cpu:N` to run locally")

    def _reserve(self, ray):
        from ray.util.placement_group import placement_group

        placement = self.plan.placement
        strategy = placement.strategy
        if len(ray.nodes()) < len(placement.bundles):
            strategy = "PACK"   # a local (one-node) Ray runs a multi-node plan on this machine
        bundles = [dict(b) for b in placement.bundles]
        pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=60)
        except Exception:
            raise JobError("the Ray cluster cannot reserve the plan's devices "
                           f"({bundles})", "check `ray status`, or compile for a smaller cluster")
        return pg

    def _create_workers(self, ray) -> dict[str, Any]:
        """One group per placed worker — ``ranks`` worker actors holding its train backend (one rank for a
        one-process backend) — and each group's ``ready`` reference."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.plan.cluster.gpu
        refs = {}
        hosts = self._hosts(ray)
        for name, w in self.plan.placement.workers.items():
            model = self.plan.models[w.model]
            check_backend(w, self.plan.run.precision)
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=w.bundle)
            rollout = {"engine": w.engine, "folder": os.path.join(os.path.abspath(self.out), "vllm"),
                       "tools": os.path.join(os.path.abspath(self.out), "tools"),   # tool calls' working folders
                       "plugins": list(self.plan.plugins)}   # imported in the worker before it builds its engine
            if w.gpu_memory_utilization:   # a CUDA engine's share of its GPU, as the compiler priced it
                rollout["gpu_memory"] = w.gpu_memory_utilization
            # the driver's settings the engine reads (set or not): a worker's environment is its Ray's
            rollout["env"] = {k: os.environ[k] for k in rollout_traits(w.engine).driver_env if k in os.environ}
            args = (w.model, model.spec.as_dict(), model.init.as_dict(), self.seed)
            common = dict(device="cuda" if gpu else "cpu", precision=self.plan.run.precision, rollout=rollout,
                          trainer=w.trainer)
            if w.offload:   # its optimizer state and step on the host (rlhfc.runtime.train.offload)
                common["offload"] = True
            if w.process is not None:   # a process shared with other models (rlhfc.runtime.worker.host)
                host = hosts[w.process]
                self.workers[name] = WorkerGroup(name, [HostedRank(host, name, w.model)], model=w.model)
                refs[name] = host.add.remote(name, args, dict(threads=w.threads, cores=list(w.cores) or None,
                                                              **common))
                continue
            if not train_traits(w.trainer).dims:   # one process
                actor_cls = ray.remote(num_cpus=w.num_cpus, num_gpus=w.num_gpus, max_restarts=0)(ModelWorker)
                handles = [actor_cls.options(scheduling_strategy=where).remote(
                    *args, threads=w.threads, cores=list(w.cores) or None, **common)]
            else:   # the ranks share the worker's devices: one core (or GPU) each, round robin
                store = ray.get(ray.remote(num_cpus=0)(_free_port).options(scheduling_strategy=where).remote())
                actor_cls = ray.remote(num_cpus=w.num_cpus / w.ranks, num_gpus=w.num_gpus / w.ranks,
                                       max_restarts=0)(ModelWorker)
                cores = list(w.cores)[::-1] if w.reversed_stages else list(w.cores)   # a fused pair's second model
                handles = [actor_cls.options(scheduling_strategy=where).remote(
                    *args, threads=1, cores=[cores[r % len(cores)]] if cores else None, rank=r, world=w.ranks,
                    store=store, dist_backend="nccl" if gpu else "gloo", tp=w.tp, pp=w.pp, **common)
                    for r in range(w.ranks)]
            group = WorkerGroup(name, handles, model=w.model)
            self.workers[name] = group
            refs[name] = group.ready.remote()   # the health check: every rank has built its model
        return refs

    def _hosts(self, ray) -> dict[str, Any]:
        """One :class:`ModelHost` actor per shared ``process`` of the placement, holding the Ray resources of
        every worker it hosts (they share a bundle and its cores)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        members: dict[str, list[WorkerPlan]] = {}
        for w in self.plan.placement.workers.values():
            if w.process is not None:
                members.setdefault(w.process, []).append(w)
        hosts = {}
        for process, ws in members.items():
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=ws[0].bundle)
            host_cls = ray.remote(num_cpus=sum(w.num_cpus for w in ws), num_gpus=sum(w.num_gpus for w in ws),
                                  max_restarts=0, max_concurrency=MAX_CALLS)(ModelHost)
            hosts[process] = host_cls.options(scheduling_strategy=where).remote(list(ws[0].cores) or None)
        return hosts

    def shutdown(self) -> None:
        """Stop Ray if this job started it and remove its temporary folder (also after a Ray that failed to
        start). On a Ray the job found running (``--ray-address``, or one the calling process started) Ray
        keeps running and the job gives back what it took: its workers are killed and its placement group
        removed, so the next job in the same process finds the devices free."""
        try:
            if self.started_ray:
                import_ray().shutdown()
            else:
                self._release()
        finally:
            if getattr(self, "ray_temp", None):
                remove_ray_temp(self.ray_temp)

    def _release(self) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            return
        for group in self.workers.values():
            try:
                group.kill()
            except Exception:   # already dead (a killed worker is why some jobs end)
                pass
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:   # already removed
                pass
            self.pg = None


def check_backend(w: WorkerPlan, precision: str = "fp32") -> None:
    """Check what ``w``'s train backend needs before its workers start: its package installed, the run's
    precision (the rollout engine checks its own package when it starts)."""
    traits = train_traits(w.trainer)
    if precision not in traits.precisions:
        raise JobError(f"model '{w.model}' runs under trainer = {traits.name}, which runs "
                       f"{' or '.join(traits.precisions)} only, but the plan asks for precision = {precision}",
                       f"compile with precision = {traits.precisions[0]}, or another trainer")
    if traits.package and not installed(traits.package):
        raise JobError(f"model '{w.model}' runs under trainer = {traits.name} but {traits.package} is not "
                       "installed", traits.install)


def installed(package: str) -> bool:
    """Whether ``package`` (a dotted import name) can be imported."""
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:   # its parent package is missing
        return False


def _free_port() -> tuple[str, int]:
    """(this node's address, a free port on it): the rendezvous of a data-parallel group, run as a Ray
    task on the group's node."""
    import ray

    return open_store(ray.util.get_node_ip_address())
