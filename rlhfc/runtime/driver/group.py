"""Worker groups: the single-controller handle the generated step function calls.

``w.<worker>`` in a generated ``step(job, w)`` is a :class:`WorkerGroup`, not a bare Ray actor:
the driver talks to a group, and the group decides which of its ranks (Ray actors hosting a
:class:`~rlhfc.runtime.worker.base.ModelWorker`) do the work: a one-rank group is a transparent stand-in
for its actor; on a group of several ranks each worker method runs as its ``@dispatch`` mode says
(:mod:`rlhfc.runtime.worker.dispatch`), so the generated code is the same for every group size.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlhfc.runtime.errors import JobError
from rlhfc.runtime.train.backend import join
from rlhfc.runtime.worker.base import ModelWorker
from rlhfc.runtime.worker.dispatch import dispatch_mode


class WorkerGroup:
    """The ranks (Ray actor handles) that host one model on one mesh, called as one worker.

    **Now (one rank).** Every method call goes to rank 0 unchanged: ``group.train`` *is* rank 0's
    actor method, so ``group.train.remote(...)`` returns the same ``ObjectRef`` (and
    ``group.generate_chunks.remote(...)`` the same streaming generator) as the actor would, and
    errors surface exactly as before (``Job.get`` / ``Job.stream`` / ``Job.sync`` name the stage).

    **Data parallel (dp > 1).** A group of ``n`` ranks holds ``n`` data-parallel ranks of one model;
    the mode each worker method is marked with says how it runs (:mod:`rlhfc.runtime.worker.dispatch`: split
    the rows and join them in row order, or have every rank take part and answer with rank 0's result). Either way ``.remote(...)`` returns one
    ``ObjectRef`` (the job's gather actor joins the ranks' results, :class:`_Gatherer`), so the generated code and ``Job`` are
    the same for every group size. A method with no rule raises a :class:`JobError` naming it.

    Attributes of the group itself (``name``, ``model``, ``ranks``, ``size``, ``kill``) shadow
    worker methods of the same name; ``ModelWorker`` has none (a test checks it).
    """

    def __init__(self, name: str, ranks: Sequence[Any], *, model: str | None = None):
        if not ranks:
            raise ValueError(f"worker group '{name}' needs at least one rank")
        self.name = name
        self.model = model or name
        self.ranks: list[Any] = list(ranks)
        self.pending: list = []   # the other ranks' streams of the last streamed call (kept alive)

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

        for actor in self.ranks:   # a model hosted with others (HostedRank): its host process dies
            ray.kill(getattr(actor, "host", actor), no_restart=no_restart)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, model={self.model!r}, ranks={len(self.ranks)})"


class _Unsplit:
    """A worker method of a group with more than one rank."""

    def __init__(self, group: WorkerGroup, method: str):
        self.group, self.method = group, method

    def remote(self, *args, **kwargs):
        rule = dispatch_mode(ModelWorker, self.method)
        if rule is None:
            raise self.error()
        import ray

        if rule == "stream":
            streams = [getattr(r, self.method).remote(*args, **kwargs) for r in self.group.ranks]
            self.group.pending = streams[1:]   # the other ranks' (empty) streams: keep them alive
            return streams[0]
        refs = [getattr(r, self.method).remote(*args, **kwargs) for r in self.group.ranks]
        return _gather(ray).remote(self.group.name, rule, refs)

    def options(self, **kwargs):
        return self

    def error(self) -> JobError:
        return JobError(f"worker group '{self.group.name}' has {self.group.size} ranks, but '{self.method}' "
                        "cannot run on a data-parallel group yet",
                        "collective weight syncs need one rank per group: use realloc{transport=object_store}")


class RankFailed(RuntimeError):
    """One rank of a worker group died or raised; the message names the group and the rank."""


_GATHERERS: dict = {}


class _Gatherer:
    """Answers for the groups' calls: one threaded Ray actor per Ray session (``max_concurrency``: every call in
    flight waits in a thread of its own). A Ray task per call would do the same work, but a task blocked in
    ``ray.wait`` holds a worker process, so a step's streamed forward chunks (a call per chunk and group) made
    Ray start a fresh Python process for most of them — each importing torch — and let them go once idle: seconds
    of CPU a step on a small machine, for a few milliseconds of joining."""

    def gather(self, group: str, rule: str, refs: list):
        """Wait for every rank of a call and answer for the group: the ranks' forward results joined in row order
        (``split``), or rank 0's result (``all``). Fails as soon as one rank fails, naming it — the other ranks
        may be blocked in a collective with the failed one."""
        import ray

        results: list = [None] * len(refs)
        where = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = where[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise RankFailed(f"rank {rank} of worker group '{group}' died ({type(exc).__name__})") from None
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None) or exc
                    raise RankFailed(f"rank {rank} of worker group '{group}' failed: "
                                     f"{type(cause).__name__}: {cause}") from None
        if rule == "split":
            # ranks that hold no share (megatron's other tensor-parallel ranks and stages) give None
            return join([r for r in results if r is not None])
        return results[0]


def _gather(ray):
    """What answers for a group's call: the ``gather`` method of this Ray session's :class:`_Gatherer`, started at
    its first call (the refs travel inside a list, so the actor gets them unresolved and fails as soon as one rank
    fails)."""
    context = ray.get_runtime_context()
    session = (context.get_node_id(), context.get_job_id())   # a Ray started again in this process: another node
    if session not in _GATHERERS:
        _GATHERERS.clear()   # an earlier session's actor went with its Ray
        _GATHERERS[session] = ray.remote(num_cpus=0, max_concurrency=1024)(_Gatherer).remote()
    return _GATHERERS[session].gather
