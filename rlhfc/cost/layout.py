"""Where and how a stage runs, read from its annotations (docs/ir.md, "Annotations").

Absent annotations take the defaults the runtime uses: every device of the
cluster, pure data parallelism, one micro-batch, no recomputation, no overlap
group, no streaming, no overcommitment. A missing ``tp``/``pp`` inside
``parallel`` is 1 and a missing ``dp`` is what makes ``dp*tp*pp`` the mesh size.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.ir import Cluster, Module, Stage

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A stage's placement: devices ``first .. first+count-1`` (node-major) and its parallel split."""

    first: int
    count: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    recompute: str = "none"

    @property
    def devices(self) -> range:
        return range(self.first, self.first + self.count)

    def nodes(self, per_node: int) -> list[int]:
        """The nodes the mesh touches."""
        return sorted({d // per_node for d in self.devices})

    def tp_inter_node(self, per_node: int) -> bool:
        """Whether one tensor-parallel group crosses a node boundary (groups are consecutive devices)."""
        return self.tp > 1 and (self.tp > per_node or self.first % per_node + self.tp > per_node)

    def dp_inter_node(self, per_node: int) -> bool:
        """Whether the data-parallel replicas (or pipeline stages) sit on more than one node."""
        return len(self.nodes(per_node)) > 1

    def same_placement(self, other: "Layout") -> bool:
        return (self.first, self.count, self.dp, self.tp, self.pp) == \
            (other.first, other.count, other.dp, other.tp, other.pp)

    def describe(self, per_node: int) -> str:
        last = self.first + self.count - 1
        nodes = self.nodes(per_node)
        where = f"{self.first}" if self.count == 1 else f"{self.first}-{last}"
        where += f" (node {nodes[0]})" if len(nodes) == 1 else f" (nodes {nodes[0]}-{nodes[-1]})"
        return where

    def parallel_text(self, cpu: bool = False) -> str:
        """``dp2 tp4 pp1`` (+ micro-batches, recompute); on CPU clusters the mesh's cores are one process's
        threads, so ``2 threads``."""
        text = f"{self.count} thread{'s' if self.count > 1 else ''}" if cpu else f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.microbatches > 1:
            text += f" mb{self.microbatches}"
        if self.recompute != "none":
            text += f" rc:{self.recompute}"
        return text


def _int(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def stage_layout(stage: Stage, cluster: Cluster) -> Layout:
    """The layout of ``stage`` from its ``mesh``/``parallel``/``microbatches``/``recompute`` annotations."""
    ann = stage.annotations
    total = cluster.nodes * cluster.per_node
    mesh = ann.get("mesh")
    first, count = 0, total
    if isinstance(mesh, dict):
        first = mesh.get("first", 0) if isinstance(mesh.get("first"), int) else 0
        count = _int(mesh.get("count"), total)
    par = ann.get("parallel") if isinstance(ann.get("parallel"), dict) else {}
    tp, pp = _int(par.get("tp"), 1), _int(par.get("pp"), 1)
    dp = _int(par.get("dp"), max(1, count // (tp * pp)))
    recompute = ann.get("recompute", "none")
    return Layout(first, count, dp, tp, pp, _int(ann.get("microbatches"), 1),
                  recompute if recompute in RECOMPUTE else "none")


def overlap_group(stage: Stage):
    """The stage's ``overlap`` group id, or None."""
    g = stage.annotations.get("overlap")
    return g if isinstance(g, int) and not isinstance(g, bool) else None


def stream_chunk(stage: Stage) -> int | None:
    """``stream = {chunk = C}`` (or the shorthand ``stream = C``) on a generate stage, else None."""
    s = stage.annotations.get("stream")
    value = s.get("chunk") if isinstance(s, dict) else s
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def overcommit_delta(stage: Stage) -> int:
    """``overcommit = {delta = D}`` on a generate stage (0 when absent)."""
    o = stage.annotations.get("overcommit")
    value = o.get("delta") if isinstance(o, dict) else o
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def module_strategy(module: Module) -> str | None:
    s = module.annotations.get("strategy")
    return s if isinstance(s, str) else None


def worker_key(stage: Stage, cluster: Cluster) -> tuple[str, tuple[int, int]]:
    """The worker process that runs a model stage: one per (model, mesh), as the runtime starts them."""
    lay = stage_layout(stage, cluster)
    return stage.target, (lay.first, lay.count)


def cpu_workers(module: Module) -> dict[tuple[str, tuple[int, int]], dict]:
    """Per worker (model, mesh): its ``devices`` (global indices), its ``share`` of them (a device shared
    by k workers gives each 1/k) and the torch ``threads`` it runs on a CPU cluster (one per whole core
    of its share). ``sync`` stages also start a worker on their destination mesh. The runtime's
    placement (:func:`rlhfc.codegen.plan.placement`) uses the same rule."""
    total = module.cluster.num_devices
    keys: dict[tuple[str, tuple[int, int]], list[int]] = {}
    for s in module.graph.stages:
        if s.target not in module.models or s.op.split(".", 1)[0] not in ("generate", "forward", "train", "sync"):
            continue
        meshes = [worker_key(s, module.cluster)[1]]
        if s.op == "sync" and isinstance(s.attrs.get("to_first"), int) and isinstance(s.attrs.get("to_count"), int):
            meshes.append((s.attrs["to_first"], s.attrs["to_count"]))
        for first, count in meshes:
            keys.setdefault((s.target, (first, count)), list(range(first, min(total, first + count))))
    return {key: {"devices": keys[key], **share} for key, share in device_shares(keys).items()}


def device_shares(devices_by_worker: dict) -> dict:
    """Each worker's ``share`` of its devices (a device used by k workers gives each 1/k) and the torch
    ``threads`` it runs on CPU (one per whole core of its share). Devices are any hashable ids."""
    load: dict = {}
    for devices in devices_by_worker.values():
        for d in devices:
            load[d] = load.get(d, 0) + 1
    out = {}
    for key, devices in devices_by_worker.items():
        share = sum(1.0 / load[d] for d in devices)
        out[key] = {"share": share, "threads": max(1, int(share + 1e-9))}
    return out
