"""Cluster start-up: start or connect to Ray, reserve the plan's devices, create the worker groups.

The plan's ``placement`` holds one bundle per node and one entry per worker (a model on a mesh):
its bundle, CPU / GPU share, threads and cores. :meth:`Cluster.start` turns each entry into a
:class:`~rlhfc.runtime.group.WorkerGroup` of one rank — a Ray actor hosting a
:class:`~rlhfc.runtime.worker.ModelWorker` — and waits until every worker has built its model.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

from .errors import JobError
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


class Cluster:
    """The Ray side of one job: the connection, its placement group and its worker groups."""

    def __init__(self, plan: dict, out: str, seed: int, ray_address: str | None = None):
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
            need_cpu = sum(b.get("CPU", 0) for b in self.plan["placement"]["bundles"])
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
        for b in self.plan["placement"]["bundles"]:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        for k, v in need.items():
            if have.get(k, 0) + 1e-9 < v:
                kind = self.plan["cluster"]["device"]
                raise JobError(f"the plan needs {v:g} {k} ({kind}) but the Ray cluster has {have.get(k, 0):g}",
                               "run it on a matching cluster with --ray-address, or compile a program whose "
                               "cluster is `devices = cpu:N` to run locally")

    def _reserve(self, ray):
        from ray.util.placement_group import placement_group

        placement = self.plan["placement"]
        strategy = placement.get("strategy", "PACK")
        if len(ray.nodes()) < len(placement["bundles"]):
            strategy = "PACK"   # a local (one-node) Ray runs a multi-node plan on this machine
        pg = placement_group(placement["bundles"], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=60)
        except Exception:
            raise JobError("the Ray cluster cannot reserve the plan's devices "
                           f"({placement['bundles']})", "check `ray status`, or compile for a smaller cluster")
        return pg

    def _create_workers(self, ray) -> dict[str, Any]:
        """One group per placed worker — one rank; ``ranks`` data-parallel FSDP2 ranks (``trainer = fsdp``);
        or ``dp × tp × pp`` megatron-core ranks (``trainer = megatron``) — and each group's ``ready`` reference."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import ModelWorker

        use_gpu = self.plan["cluster"]["device"] != "cpu"
        refs = {}
        for name, w in self.plan["placement"]["workers"].items():
            model_name = w.get("model", name)
            model = self.plan["models"][model_name]
            ranks = int(w.get("ranks", 1))
            trainer = w.get("trainer") or ("fsdp" if ranks > 1 else "torch")
            where = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=w["bundle"])
            args = (model_name, model["spec"], model["init"], self.seed)
            device = "cuda" if use_gpu else "cpu"
            precision = self.plan["run"].get("precision", "fp32")
            engine = w.get("engine") or self.plan["run"].get("rollout", "torch")   # vLLM: an engine per rank
            engine = engine if engine in ("torch", "vllm") else "torch"   # rollout = auto: the worker's "engine"
            rollout = {"engine": engine, "folder": os.path.join(os.path.abspath(self.out), "vllm")}
            if w.get("gpu_memory_utilization"):   # a CUDA engine's share of its GPU, as the compiler priced it
                rollout["gpu_memory"] = float(w["gpu_memory_utilization"])
            if trainer == "torch" and ranks == 1:
                actor_cls = ray.remote(num_cpus=w["num_cpus"], num_gpus=w.get("num_gpus", 0),
                                       max_restarts=0)(ModelWorker)
                handles = [actor_cls.options(scheduling_strategy=where).remote(
                    *args, w.get("threads", 1), device, w.get("cores"), precision, rollout)]
            else:   # the ranks share the worker's devices: one core (or GPU) each, round robin
                store = ray.get(ray.remote(num_cpus=0)(_free_port).options(scheduling_strategy=where).remote())
                worker_cls, extra = _group_class(trainer, w, precision)
                actor_cls = ray.remote(num_cpus=w["num_cpus"] / ranks, num_gpus=w.get("num_gpus", 0) / ranks,
                                       max_restarts=0)(worker_cls)
                cores = w.get("cores") or []
                handles = [actor_cls.options(scheduling_strategy=where).remote(
                    *args, 1, device, [cores[r % len(cores)]] if cores else None, rank=r, world=ranks, store=store,
                    backend="nccl" if use_gpu else "gloo", rollout=rollout, **extra) for r in range(ranks)]
            group = WorkerGroup(name, handles, model=model_name)
            self.workers[name] = group
            refs[name] = group.ready.remote()   # the health check: every rank has built its model
        return refs

    def shutdown(self) -> None:
        """Stop Ray if this job started it (a connected cluster keeps running) and remove its temporary
        folder (also after a Ray that failed to start)."""
        try:
            if self.started_ray:
                import_ray().shutdown()
        finally:
            if getattr(self, "ray_temp", None):
                remove_ray_temp(self.ray_temp)


def _group_class(trainer: str, w: dict, precision: str = "fp32") -> tuple[type, dict]:
    """The worker class of a multi-rank group and its extra keyword arguments (the megatron trainer runs
    fp32 only: ``check`` refuses bf16 with it)."""
    if trainer == "megatron":
        import importlib.util

        from .mcore_model import INSTALL_HINT
        from .megatron import MegatronWorker

        if precision != "fp32":
            raise JobError(f"model '{w.get('model')}' runs under trainer = megatron, which runs fp32 only, but the "
                           f"plan asks for precision = {precision}", "compile with precision = fp32, or another trainer")
        if importlib.util.find_spec("megatron.core") is None:
            raise JobError(f"model '{w.get('model')}' runs under trainer = megatron but megatron-core is not "
                           "installed", INSTALL_HINT)
        return MegatronWorker, {"tp": int(w.get("tp", 1)), "pp": int(w.get("pp", 1))}
    from .parallel import DataParallelWorker

    return DataParallelWorker, {"precision": precision}


def _free_port() -> tuple[str, int]:
    """(this node's address, a free port on it): the rendezvous of a data-parallel group, run as a Ray
    task on the group's node."""
    import ray

    from .parallel import open_store

    return open_store(ray.util.get_node_ip_address())
