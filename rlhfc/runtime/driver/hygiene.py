"""Ray hygiene of a job: its workers run the driver's rlhfc, and the Ray it started leaves nothing behind.

* :func:`check_worker_code` runs a tiny Ray task on every node and compares the rlhfc each one imports
  with the driver's: the version everywhere, and on a Ray the job started itself (one machine) also the
  folder it is imported from. A mismatch is a :class:`~rlhfc.runtime.errors.JobError` naming both before
  any worker is created. (Ray workers put the driver's current folder first on ``sys.path``, so a stale
  ``rlhfc/`` checkout there would otherwise shadow the installed package in the workers only.)
* :func:`remove_ray_temp` removes the temporary folder of a Ray the job started, once Ray is shut down.

Nothing here imports compiler code.
"""

from __future__ import annotations

import os
import shutil
import time

from rlhfc.runtime.errors import JobError

__all__ = ["check_worker_code", "code_identity", "remove_ray_temp"]


def code_identity() -> dict[str, str | None]:
    """The rlhfc this process imports: its ``version`` and the ``path`` of its package folder."""
    import rlhfc

    where = getattr(rlhfc, "__file__", None)
    return {"version": getattr(rlhfc, "__version__", None),
            "path": os.path.realpath(os.path.dirname(where)) if where else None}


def _probe():
    """The Ray task body: ``code_identity()`` as seen by a worker process. Defined inside a function so Ray
    ships its code by value: a worker whose rlhfc is another (or none) still runs it."""

    def identity():
        import os

        try:
            import rlhfc
        except ImportError as exc:   # pragma: no cover - a node without rlhfc
            return {"version": None, "path": None, "error": f"{type(exc).__name__}: {exc}"}
        where = getattr(rlhfc, "__file__", None)
        return {"version": getattr(rlhfc, "__version__", None),
                "path": os.path.realpath(os.path.dirname(where)) if where else None,
                "host": os.uname().nodename}

    return identity


def check_worker_code(ray, same_machine: bool, timeout_s: float = 120.0) -> dict[str, dict]:
    """Check that Ray workers on every alive node import the driver's rlhfc (the same version; with
    ``same_machine`` — a Ray this job started — also the same package folder). Returns what each node
    (by node id) reported; raises :class:`JobError` naming both versions and folders otherwise."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    driver = code_identity()
    task = ray.remote(num_cpus=0, max_retries=0)(_probe())
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    try:
        found = ray.get(refs, timeout=timeout_s)
    except Exception as exc:   # noqa: BLE001 - a node whose workers cannot even start a task
        cause = getattr(exc, "cause", None) or exc
        raise JobError(f"a Ray worker could not report which rlhfc it runs: {type(cause).__name__}: {cause}",
                       "check that every node of the Ray cluster has rlhfc installed and can start workers "
                       "(`ray status`)") from None
    report = {}
    for node, got in zip(nodes, found):
        where = node.get("NodeManagerAddress", node["NodeID"][:8])
        report[node["NodeID"]] = got
        if got.get("error"):
            raise JobError(f"Ray workers on node {where} cannot import rlhfc ({got['error']}); the driver runs "
                           f"rlhfc {driver['version']} from {driver['path']}",
                           "install the driver's rlhfc on every node of the Ray cluster")
        other_version = got["version"] != driver["version"]
        other_folder = same_machine and got["path"] != driver["path"]
        if other_version or other_folder:
            raise JobError(f"Ray workers on node {where} import rlhfc {got['version']} from {got['path']}, but the "
                           f"driver runs rlhfc {driver['version']} from {driver['path']}",
                           "the workers must run the driver's rlhfc: a folder named rlhfc in the current folder "
                           "(Ray workers import from it first) shadows the installed package, so run from "
                           "another folder; on a cluster, install the same rlhfc version on every node")
    return report


def remove_ray_temp(path: str, wait_s: float = 10.0) -> bool:
    """Remove Ray's temporary folder ``path`` after ``ray.shutdown()``; Ray's processes may still be
    writing their last log lines as they exit, so retry for up to ``wait_s``. True when it is gone."""
    deadline = time.monotonic() + wait_s
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
