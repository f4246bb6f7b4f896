"""Worker groups: the single-controller handle the generated step function calls.

``w.<worker>`` in a generated ``step(job, w)`` is a :class:`WorkerGroup`, not a bare Ray actor:
the driver talks to a group, and the group decides which of its ranks (Ray actors hosting a
:class:`~rlhfc.runtime.worker.ModelWorker`) do the work. Today every group has one rank and is a
transparent stand-in for its actor. The parallel worker-groups issue (dp > 1) fills in the rest
without changing the generated code.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import JobError

#: How each ``ModelWorker`` method will run on a group of dp > 1 ranks (not implemented yet):
#:
#: * ``split`` — the batch (prompts, or the rows of a rollout / loss input) is cut into contiguous
#:   shards, one per rank; each rank runs the method on its shard and the results are gathered back in
#:   row order (``train``: each rank trains on its shard, gradients are all-reduced inside the group,
#:   and the per-rank statistics are averaged). ``generate_chunks`` merges the ranks' chunk streams.
#: * ``each`` — every rank gets the same call (state all replicas share: start-up, checkpoint load,
#:   weights arriving from a sync, the weights version).
#: * ``root`` — rank 0 answers for the group (all ranks hold the same weights: checkpoint save,
#:   weights leaving by a sync).
#:
#: The collective transfer methods (``open_group``, ``join_group``, ``send_weights``,
#: ``recv_weights``) are left out: with dp > 1 a sync's process group spans the sender's rank 0 and
#: every receiving rank, which that issue designs.
DP_RULES: dict[str, str] = {
    "generate": "split", "generate_chunks": "split", "logprobs": "split", "values": "split",
    "score": "split", "train": "split",
    "ready": "each", "load": "each", "set_weights": "each", "import_bucket": "each", "set_version": "each",
    "save": "root", "get_weights": "root", "export_buckets": "root", "get_version": "root",
}

_HOW = {
    "split": "by splitting its batch over the ranks and gathering the results in row order",
    "each": "on every rank",
    "root": "on rank 0 for the whole group",
}


class WorkerGroup:
    """The ranks (Ray actor handles) that host one model on one mesh, called as one worker.

    **Now (one rank).** Every method call goes to rank 0 unchanged: ``group.train`` *is* rank 0's
    actor method, so ``group.train.remote(...)`` returns the same ``ObjectRef`` (and
    ``group.generate_chunks.remote(...)`` the same streaming generator) as the actor would, and
    errors surface exactly as before (``Job.get`` / ``Job.stream`` / ``Job.sync`` name the stage).

    **Later (dp > 1, the parallel worker-groups issue).** A group of ``n`` ranks holds ``n``
    data-parallel replicas; :data:`DP_RULES` says how each method will run (split the batch over the
    ranks and gather results in row order, call every rank, or call rank 0). Until then a group
    with more than one rank can be built (and :meth:`kill`-ed), but calling any worker method on it
    raises a :class:`JobError` naming the group and the method.

    Attributes of the group itself (``name``, ``model``, ``ranks``, ``size``, ``kill``) shadow
    worker methods of the same name; ``ModelWorker`` has none (a test checks it).
    """

    def __init__(self, name: str, ranks: Sequence[Any], *, model: str | None = None):
        if not ranks:
            raise ValueError(f"worker group '{name}' needs at least one rank")
        self.name = name
        self.model = model or name
        self.ranks: list[Any] = list(ranks)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __getattr__(self, method: str):
        ranks = self.__dict__.get("ranks")
        if method.startswith("_") or ranks is None:   # dunders, and lookups before __init__ (copy, pickle)
            raise AttributeError(method)
        if len(ranks) == 1:
            return getattr(ranks[0], method)
        return _Unsplit(self, method)

    def kill(self, no_restart: bool = True) -> None:
        """Kill every rank's process (tests use it to simulate a dead worker)."""
        import ray

        for actor in self.ranks:
            ray.kill(actor, no_restart=no_restart)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, model={self.model!r}, ranks={len(self.ranks)})"


class _Unsplit:
    """A worker method of a group with more than one rank: refuses until dp > 1 execution exists."""

    def __init__(self, group: WorkerGroup, method: str):
        self.group, self.method = group, method

    def remote(self, *args, **kwargs):
        raise self.error()

    def options(self, **kwargs):
        raise self.error()

    def error(self) -> JobError:
        how = _HOW.get(DP_RULES.get(self.method, ""))
        later = f"; data-parallel groups will run it {how}" if how else ""
        return JobError(f"worker group '{self.group.name}' has {self.group.size} ranks, but "
                        f"'{self.method}' cannot run on more than one rank yet{later}",
                        "data-parallel worker groups (dp > 1) are not implemented; "
                        "give each (model, mesh) one rank")
