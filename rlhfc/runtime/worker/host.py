"""One process hosting several models' workers (``plan.json``: workers with the same ``process``).

A worker process pays its start-up once: importing torch and transformers and building a model's classes
takes ~8 CPU-seconds per process on the 2-core VM of ``docs/benchmarks.md`` — 20 of a tiny four-model
job's 33 seconds were its four processes starting. Colocated models that run in the torch engines keep no
state of their process's own, so where their stages never run at the same time the compiler places them in
one process (verl's hybrid-engine worker does the same): :class:`ModelHost` is that process, a Ray actor
holding one :class:`~rlhfc.runtime.worker.base.ModelWorker` per hosted model.

What a process of its own guarantees, a host keeps:

* **each model's calls run one at a time, in the order the driver made them**, as an actor's do: the
  driver's handle (:class:`HostedRank`) numbers each model's calls, and the host runs call ``k`` of a
  model only after its call ``k - 1`` finished;
* **calls of different models may run at the same time** (a threaded actor, one thread per call), so
  nothing waits on a call queued behind it (the plan keeps models whose stages overlap in processes of
  their own: one interpreter would serialise their Python, 15 % slower steps measured);
* **arguments resolve in that order**: a call's ``ObjectRef`` arguments travel unresolved and are
  fetched once its turn came (a failed upstream stage fails the call as it would fail the actor's);
* each call runs with its own torch threads and the host's cores (both are per thread on Linux).

A model's worker keeps its own random generators (sampling, training), and its state of torch's
process-wide generator is swapped in around each of its stages and kept between them (saved and restored by
its checkpoints as in a process of its own). Models with dropout (which draws from that generator while
training) still keep a process of their own, as do engines that start a runtime of their own (vLLM) and
multi-rank groups
(:func:`rlhfc.ir.schedule.shared_processes` decides).

Nothing here imports compiler code.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Any

import torch

from .base import ModelWorker

#: calls a host runs at once (a stream's consumers and a step's launched stages wait in threads)
MAX_CALLS = 64


def _resolve(ray, args: list, kwargs: dict) -> tuple[list, dict]:
    """Fetch the top-level ``ObjectRef`` arguments, as Ray does for an actor call."""
    refs = [a for a in args if isinstance(a, ray.ObjectRef)] + [v for v in kwargs.values()
                                                                  if isinstance(v, ray.ObjectRef)]
    if not refs:
        return args, kwargs
    got = dict(zip(refs, ray.get(refs)))
    return ([got[a] if isinstance(a, ray.ObjectRef) else a for a in args],
            {k: got[v] if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()})


class ModelHost:
    """The process of several models' workers (see the module docstring)."""

    def __init__(self, cores: list[int] | None = None):
        self.cores = set(cores) if cores and hasattr(os, "sched_setaffinity") and \
            max(cores) < (os.cpu_count() or 1) else None
        self.workers: dict[str, ModelWorker] = {}
        self.done: dict[str, int] = {}          # per model: how many of its calls finished
        self.turn = threading.Condition()
        self.building = threading.Lock()        # model builds seed the process's RNG: one at a time

    def _pin(self) -> None:
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)   # this thread (and the OpenMP threads it starts)

    def add(self, name: str, args: tuple, kwargs: dict) -> dict:
        """Build model ``name``'s worker here (``ModelWorker(*args, **kwargs)``); answers its ``ready()``."""
        return self.build(name, args, kwargs).ready()

    def build(self, name: str, args: tuple, kwargs: dict) -> ModelWorker:
        self._pin()
        with self.building:
            self.workers[name] = worker = ModelWorker(*args, **kwargs)
            worker.own_rng = torch.get_rng_state()   # what its own process would hold: the seed it set
        with self.turn:
            self.done[name] = 0
            self.turn.notify_all()
        return worker

    def _wait_turn(self, name: str, seq: int) -> None:
        with self.turn:
            self.turn.wait_for(lambda: self.done.get(name, -1) >= seq)

    def _finish(self, name: str) -> None:
        with self.turn:
            self.done[name] += 1
            self.turn.notify_all()

    def call(self, name: str, seq: int, method: str, args: list, kwargs: dict) -> Any:
        """Call ``seq`` of model ``name``: ``worker.method(*args, **kwargs)`` once the calls before it ran."""
        import ray

        self._wait_turn(name, seq)
        try:
            self._pin()
            args, kwargs = _resolve(ray, args, kwargs)
            with self._random_state(name, method):
                return getattr(self.workers[name], method)(*args, **kwargs)
        finally:
            self._finish(name)

    def call_stream(self, name: str, seq: int, method: str, args: list, kwargs: dict):
        """:meth:`call` of a generator method (a Ray streaming generator): the model's turn is held until the
        generator ends."""
        import ray

        self._wait_turn(name, seq)
        try:
            self._pin()
            args, kwargs = _resolve(ray, args, kwargs)
            with self._random_state(name, method):
                yield from getattr(self.workers[name], method)(*args, **kwargs)
        finally:
            self._finish(name)

    @contextlib.contextmanager
    def _random_state(self, name: str, method: str):
        """Around a stage call: torch's process-wide generator holds the model's state (its own process would),
        and the model keeps what the stage left. Stages of models sharing a process never run at the same time
        (the plan shares only those), so the swap is theirs alone; other calls (saves, syncs) leave it be."""
        worker = self.workers[name]
        if not getattr(getattr(ModelWorker, method, None), "stage", False):
            yield
            return
        torch.set_rng_state(worker.own_rng)
        try:
            yield
        finally:
            worker.own_rng = torch.get_rng_state()


def streams(method: str) -> bool:
    """Whether ``ModelWorker.method`` is a generator (a Ray streaming generator on an actor)."""
    return inspect.isgeneratorfunction(getattr(ModelWorker, method, None))


class HostedRank:
    """The driver's handle of one model on a :class:`ModelHost`, used as its actor handle would be:
    ``rank.method.remote(*args, **kwargs)`` returns what the actor's call would (an ``ObjectRef``, or a
    streaming generator for a generator method), numbered in the model's call order."""

    def __init__(self, host, name: str, model: str | None = None):
        self.host, self.name, self.model = host, name, model or name
        self.calls = 0
        self.lock = threading.Lock()   # the driver may call from several threads

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self, method)

    def _submit(self, method: str, args: tuple, kwargs: dict):
        with self.lock:
            seq, self.calls = self.calls, self.calls + 1
            entry = self.host.call_stream if streams(method) else self.host.call
            return entry.remote(self.name, seq, method, list(args), dict(kwargs))

    def __repr__(self) -> str:
        return f"HostedRank({self.name!r})"


class _HostedMethod:
    def __init__(self, rank: HostedRank, method: str):
        self.rank, self.method = rank, method

    def remote(self, *args, **kwargs):
        return self.rank._submit(self.method, args, kwargs)

    def options(self, **kwargs):
        return self
