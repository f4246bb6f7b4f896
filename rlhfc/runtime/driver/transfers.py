"""The driver's weight transfers between worker groups (:class:`rlhfc.runtime.job.Job` inherits them): a
``sync`` stage copies a model's trained weights to its copy on another mesh, a reshard stage has a group
gather its training layout into full copies for generation. Each names its stage when a worker fails and
is timed on the job's timeline."""

from __future__ import annotations

import time

from rlhfc.runtime.errors import JobError

from .cluster import import_ray as _ray


class WeightTransfers:
    """Mixed into :class:`~rlhfc.runtime.job.Job` (which provides ``plan``, ``collectives``,
    ``current_stage``, ``_timed`` and ``_ray_failure``)."""

    def sync(self, stage: str, src, dst, *, bucket_mb: int, after=None, transport: str = "object_store") \
            -> dict[str, float]:
        """Copy ``src``'s weights to ``dst`` (worker groups on two meshes) in buckets: through Ray's object
        store, or (``transport="collective"``) as broadcasts in a two-rank process group of the pair — NCCL
        when the workers are on GPUs, gloo on CPU — set up on the first sync and kept."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            if transport == "collective":
                if stage not in self.collectives:
                    backend = "nccl" if self.plan.cluster.gpu else "gloo"
                    host, port = ray.get(src.sync_open.remote(stage))
                    ray.get([src.sync_join.remote(stage, 0, host, port, backend),
                             dst.sync_join.remote(stage, 1, host, port, backend)])
                    self.collectives[stage] = backend
                sent, received = src.sync_send.remote(stage, bucket_mb), dst.sync_recv.remote(stage, bucket_mb)
                (version, nbytes, buckets), _ = ray.get([sent, received])
            elif transport == "object_store":
                refs, version, nbytes = ray.get(src.sync_export.remote(bucket_mb))
                ray.get([dst.sync_import.remote(r) for r in refs])
                buckets = len(refs)
            else:
                raise JobError(f"stage '{stage}': unknown weight transport {transport!r}",
                               "use object_store or collective (realloc{transport=...})")
            ray.get(dst.set_version.remote(version))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        out = {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - t0}
        self._timed(stage, t0, kind="sync",
                    value={"bytes": int(nbytes), "buckets": int(buckets), "transport": transport})
        return out

    def reshard(self, stage: str, group, *, bucket_mb: int, after=None) -> dict[str, float]:
        """Reshard a worker group's training layout into its generation layout (every rank all-gathers a
        full copy of the weights, in buckets of ``bucket_mb``) right after training, so generation finds it."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            nbytes, buckets = ray.get(group.reshard.remote(bucket_mb))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        out = {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - t0}
        self._timed(stage, t0, kind="sync", value={"bytes": int(nbytes), "buckets": int(buckets), "transport": "reshard"})
        return out
