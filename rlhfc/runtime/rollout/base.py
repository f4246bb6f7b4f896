"""Rollout engines: the one interface a worker decodes through, and rlhfc's own torch decoder behind it.

A worker holds one :class:`RolloutEngine`, built by :func:`build_rollout` from the registered traits of the
plan's engine name (:mod:`rlhfc.contract.engines`: the traits say what the compiler priced, ``runtime`` names
the class). The worker does everything around decoding — prompts to token rows, carried partial samples,
per-row random keys, rollouts from samples — and asks the engine only to decode rows:

* :meth:`RolloutEngine.prepare` brings the engine up to the worker's weights before a generate (start, wake,
  refit; on a rank of a group every rank calls it together: an engine's start and refit may be collectives);
* :meth:`RolloutEngine.stream` decodes token rows and yields each :class:`FinishedSample` as it finishes
  (with ``stop_after``, then a :class:`PartialSample` per unfinished row): the contract of
  :func:`rlhfc.runtime.rollout.decoding.generate_stream`, which the torch engine is;
* :meth:`RolloutEngine.sleep` frees what the engine holds while the trainer trains (a no-op where nothing
  is held).

``decodes_trainer_copy``: the engine decodes on the worker's own module (a sharded trainer gathers a full
copy for it first); an engine with weights of its own is refitted from the shards instead.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator, Sequence

from rlhfc.contract.engines import RolloutTraits, rollout_traits
from rlhfc.contract.plugins import import_plugin

from .decoding import FinishedSample, PartialSample, generate_stream


class RolloutEngine:
    """The interface of a rollout engine hosted by ``worker``; ``options`` are the plan's (``folder``: where
    the engine may write its files; ``gpu_memory``: a CUDA engine's share of its GPU)."""

    #: set by :func:`build_rollout` from the registry
    traits: RolloutTraits
    decodes_trainer_copy = True

    def __init__(self, worker, options: dict[str, Any]):
        self.worker, self.options = worker, dict(options)

    @property
    def name(self) -> str:
        return self.traits.name

    def prepare(self, model, refit_mb: int = 64) -> None:
        """Bring the engine up to the worker's weights — ``model``, the single-rank module the train backend
        generates from (a sharded FSDP model, whose parameters an engine with weights of its own gathers as it
        refits) — with statistics into ``worker.engine_stats``."""

    def refit_pending(self) -> bool:
        """Whether the engine is running and holds older weights than the worker."""
        return False

    def stream(self, model, rows: Sequence[Sequence[int]], max_new_tokens: int, *, refit_mb: int = 64,
               **sampling) -> Iterator[FinishedSample | PartialSample]:
        """Decode ``rows`` (token ids) with the sampling arguments of
        :func:`~rlhfc.runtime.rollout.decoding.generate_stream`; ``model`` is the worker's (unsharded) module."""
        raise NotImplementedError

    def sleep(self) -> None:
        """Free what the engine holds while the trainer trains."""

    def shutdown(self) -> None:
        """Stop the engine (a worker that outlives it errors naming it at the next generate)."""


class TorchDecoder(RolloutEngine):
    """rlhfc's KV-cached decode loop on the worker's own module (:func:`~rlhfc.runtime.rollout.decoding.generate_stream`):
    the trainer's forward, so its log-probs are the trainer's; nothing to start or refit."""

    def stream(self, model, rows, max_new_tokens, *, refit_mb=64, **sampling):
        return generate_stream(model, rows, max_new_tokens, **sampling)


def build_rollout(options: dict[str, Any], worker) -> RolloutEngine:
    """The rollout engine ``options["engine"]`` names (the registry's class), for ``worker``, after importing
    the job's ``options["plugins"]`` (where an engine of a plugin registers)."""
    for spec in options.get("plugins") or ():
        import_plugin(spec)
    traits = rollout_traits(options.get("engine") or "torch")
    module, _, name = traits.runtime.partition(":")
    cls = getattr(importlib.import_module(module), name)
    engine = cls(worker, options)
    engine.traits = traits
    return engine
