"""Functions run in spawned processes for the multi-rank tests (a rank of a gloo group each, or a vLLM engine
outside the test process): every result comes back, or the traceback of its failure, never a hang."""

from __future__ import annotations

import pickle
from typing import Any, Callable

import torch.multiprocessing as mp


def _spawned(key, fn, args, queue) -> None:
    try:
        queue.put((key, pickle.dumps(fn(*args))))   # bytes: torch shares tensors through file descriptors
    except BaseException:   # report, do not hang the parent
        import traceback

        queue.put((key, traceback.format_exc()))


def run_spawned(calls: list[tuple[Callable, tuple]], *, what: str = "process", timeout: float = 600) -> list[Any]:
    """``fn(*args)`` of each call in a spawned process of its own, all at once; their results in call order.
    A call that raised fails the test with its traceback (``what`` names the processes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(i, fn, args, queue)) for i, (fn, args) in enumerate(calls)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for i, res in sorted(results.items()):
        assert isinstance(res, bytes), f"{what} {i} failed:\n{res}"
    return [pickle.loads(results[i]) for i in range(len(calls))]
