"""``realloc`` (ReaL's parameter reallocation, Baidu's weight "refit"): keep copies of a trained model in sync.

When a trained model has stages on a mesh other than its train stage's (e.g.
``separate`` puts the actor's generation on its own devices), each such mesh
holds a copy of the weights. Right after the train stage, a ``sync`` stage
sends the new weights to every other mesh::

    %actor_sync = sync @actor(%actor_train) {bucket_mb = 64, to_first = 0, to_count = 1,
                                             transport = "object_store"}
                  annot {mesh = {first = 1, count = 1}} : Metrics

Its cost is bytes / bandwidth per destination (``rlhfc.cost.sync``). The
runtime moves the weights in buckets, by ``transport``: ``object_store``
(through Ray's object store; the default on CPU clusters) or ``collective``
(the sender and the receiver form a two-rank process group and the sender
broadcasts each flat bucket: NCCL between GPUs, the default on GPU clusters;
gloo on CPU, where it is tested). Frozen models need no sync: every copy is built
from the same initial weights. ``transport = auto`` takes ``object_store`` for a model whose generate runs
ahead of training (asynchronous rollout): its copy imports the weights between the generations it runs, and
neither the trainer nor the driver waits for it, where a broadcast would hold the trainer until the copy
finished the generation in flight and joined it.

**Resharding for generation** (verl's 3D-HybridEngine idea). A model that trains as a
worker group of several ranks (``fsdp`` shards, ``megatron`` tensor/pipeline pieces) and
generates on the same mesh gets a ``sync`` onto its own mesh after its train stage::

    %actor_sync = sync @actor(%actor_train) {bucket_mb = 64, to_first = 0, to_count = 2,
                                             transport = "collective"} annot {mesh = {first = 0, count = 2}} : Metrics

The group's ranks all-gather their pieces in buckets of ``bucket_mb`` (gloo on CPU, NCCL on
GPUs) into the generation layout: a full copy on every rank, each rank decoding its share
of the rows (dp = ranks). The simulator prices the gather (:func:`rlhfc.cost.sync.sync_time`
from the training layout to that one). Without the stage the ranks would gather lazily at
the first generate, unpriced.

Exact: the copy holds bit-identical weights before it is used again.

Under ``run { rollout = vllm }`` the generating worker's vLLM engine holds one more copy: the pass marks
each generate stage of a trained model ``refit_mb = N`` (option ``refit_mb``), the bucket size in MiB in
which that worker loads its new weights into the engine, in memory, before it generates with them
(:meth:`rlhfc.runtime.rollout.vllm.VllmEngine.refit`; each step's ``refit_s`` metric).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.contract.engines import rollout_traits
from rlhfc.ir import Module, Stage, Value, ValueType
from rlhfc.ir.plan import (TRANSPORTS, Mesh, Sync, generates_ahead, overlap_group, set_refit_mb, stage_engine,
                           stage_mesh, worker_ranks)

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class Realloc(Pass):
    name = "realloc"
    description = "insert sync stages where a trained model is used on another mesh"
    exact = True
    bucket_mb: int = field(default=64, metadata={"doc": "transfer bucket size in MiB"})
    refit_mb: int = field(default=64, metadata={"doc": "bucket size in MiB of the vLLM engine's refit (rollout = vllm)"})
    transport: str = field(default="auto", metadata={
        "doc": "object_store, collective (NCCL/gloo broadcast), or auto: collective on GPU clusters, except to a "
               "generating copy that runs ahead (asynchronous rollout)"})

    def __post_init__(self) -> None:
        if self.bucket_mb < 1 or self.refit_mb < 1:
            raise ValueError("bucket_mb and refit_mb must be >= 1")
        if self.transport not in ("auto",) + TRANSPORTS:
            raise ValueError(f"transport must be auto, {' or '.join(TRANSPORTS)}")

    def run(self, module: Module) -> Module:
        g = module.graph
        def transport(model: str) -> str:
            if self.transport != "auto":
                return self.transport
            ahead = generates_ahead(module, model)   # a broadcast would wait for the generation in flight
            return "object_store" if module.cluster.device == "cpu" or ahead else "collective"

        for s in [s for s in g.stages if s.op == "sync"]:   # idempotent: recompute from the placement
            g.remove(s)
        for train in [s for s in g.stages if s.op == "train"]:
            home = stage_mesh(module, train)
            others: list[Mesh] = []
            for s in g.stages_on(train.target):
                mesh = stage_mesh(module, s)
                if s.op != "sync" and mesh != home and mesh not in others:
                    others.append(mesh)
            # after the train's overlap group: the driver awaits the train to send its weights, and a sync
            # between two trains launched together would hold the second back until the first is done
            group = overlap_group(train)
            at = 1 + max(i for i, s in enumerate(g.stages)
                         if s is train or (group is not None and overlap_group(s) == group))
            generates_here = any(s.op == "generate" and stage_mesh(module, s) == home
                                 for s in g.stages_on(train.target))
            if generates_here and worker_ranks(module, train.target, home) > 1:
                out = Value(g.fresh_name(f"{train.target}_reshard"), ValueType("Metrics"))
                sync = Stage("sync", train.target, [train.outputs[0]], [out],
                             Sync(home, self.bucket_mb, "collective").attrs(), {Mesh.key: home.print()}, train.loc)
                g.insert(at, sync)
                at += 1
            for dest in others:
                out = Value(g.fresh_name(f"{train.target}_sync"), ValueType("Metrics"))
                sync = Stage("sync", train.target, [train.outputs[0]], [out],
                             Sync(dest, self.bucket_mb, transport(train.target)).attrs(), {Mesh.key: home.print()},
                             train.loc)
                g.insert(at, sync)
                at += 1
        for s in g.stages:
            set_refit_mb(s, None)
            if s.op == "generate" and rollout_traits(stage_engine(module, s)).own_weights and \
                    any(t.op == "train" and t.target == s.target for t in g.stages):
                set_refit_mb(s, self.refit_mb)
        module.refresh_versions()
        return module
