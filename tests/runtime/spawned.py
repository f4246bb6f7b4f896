"""Functions run in spawned processes for the multi-rank tests (a rank of a gloo group each, or a vLLM engine
outside the test process): every result comes back, or the traceback of its failure, never a hang.

The processes come from a fork server (:func:`context`) that imported torch, transformers, megatron-core and
the worker once: a fresh interpreter importing them costs ~10 s of CPU per rank on this 2-core machine, and the
multi-rank tests start about a hundred ranks. A forked child starts from the server's clean state (never the
test process's), as a spawned one does from nothing: the workers seed every generator they use."""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import torch.multiprocessing as mp


#: what the fork server imports before it forks a child (a module that is not installed is left out)
PRELOAD = ["torch", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "megatron.core", "rlhfc.runtime.worker.base"]


def context():
    """The multiprocessing context of the tests' rank processes: forks of one server with :data:`PRELOAD`
    imported (it starts at the first process and serves the rest of the test session)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _spawned(key, fn, args, queue, env=None) -> None:
    if env is not None:   # the test process's environment now (the fork server's is the one it started with)
        os.environ.clear()
        os.environ.update(env)
    try:
        queue.put((key, pickle.dumps(fn(*args))))   # bytes: torch shares tensors through file descriptors
    except BaseException:   # report, do not hang the parent
        import traceback

        queue.put((key, traceback.format_exc()))


def run_spawned(calls: list[tuple[Callable, tuple]], *, what: str = "process", timeout: float = 600) -> list[Any]:
    """``fn(*args)`` of each call in a process of its own (:func:`context`), all at once; their results in call order.
    A call that raised fails the test with its traceback (``what`` names the processes)."""
    ctx = context()
    queue = ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=_spawned, args=(i, fn, args, queue, env)) for i, (fn, args) in enumerate(calls)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for i, res in sorted(results.items()):
        assert isinstance(res, bytes), f"{what} {i} failed:\n{res}"
    return [pickle.loads(results[i]) for i in range(len(calls))]
