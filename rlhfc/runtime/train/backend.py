"""The train-backend interface: how one rank holds, computes with, trains and saves a worker's model.

A :class:`~rlhfc.runtime.worker.base.ModelWorker` holds one :class:`TrainBackend`, built by
:func:`build_backend` from the registered traits of the plan's trainer name (:mod:`rlhfc.contract.engines`:
``runtime`` names the class), and one rollout engine (:mod:`rlhfc.runtime.rollout.base`). The worker does what
every backend shares (tokens, sampling keys, rollouts, loss inputs, NaN guards, random states, checkpoint
files); the backend answers only what depends on how the model is laid out over ranks:

* **layout** — ``rank``/``world`` of its group, :meth:`rows` (the share of a forward's rows this rank
  computes), ``answers`` (whether this rank answers for its share), ``writes`` (whether this rank answers a
  whole-group call and writes checkpoints), :meth:`generation_share` and :meth:`gather` for split generation;
* **forwards** — :meth:`forward` runs ``fn(model_or_outputs, batch)`` on this rank's rows;
* **training** — :meth:`make_optimizer`, :meth:`train_epochs` (the loop of :mod:`rlhfc.runtime.train.loop` with
  the backend's reduction and clipping);
* **generation** — :meth:`generation_model` (the single-rank module the rollout engine decodes on or refits
  from: a gathered copy for a sharded model), :meth:`reshard` (the plan's reshard stage);
* **state in the single-rank layout** — :meth:`full_weights`, :meth:`load_weights`, :meth:`state_items`,
  :meth:`import_bucket`, :meth:`optimizer_state` / :meth:`load_optimizer`: checkpoints hold full tensors in
  the single-rank model's order, so a run saved under one layout resumes under any other.

This module also holds the one-process ``torch`` backend itself (the base class) and what the group backends
share: row shares, joining the ranks' results, the group's rendezvous.
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import nn

from rlhfc.contract.engines import TrainTraits, train_traits
from rlhfc.contract.plugins import import_plugin
from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.models.build import get_weights, set_weights
from rlhfc.runtime.models.precision import autocast

from . import loop
from .packing import bucketed

#: how long a collective rendezvous or transfer may wait for the other ranks (seconds)
GROUP_TIMEOUT_S = 300


class TrainBackend:
    """The ``torch`` backend — one process holds the whole model — and the interface every backend keeps.

    ``host``: the worker (its ``name``, ``device``, ``precision`` and ``engine_stats``); ``model``: the
    single-rank model the worker built from the run's seed (a group backend shards or converts it)."""

    #: set by :func:`build_backend` from the registry
    traits: TrainTraits
    #: whether its forwards and training run an unpadded batch in length groups
    pack = True
    #: whether its ranks form a process group (every rank of the group gets each call)
    grouped = False

    def __init__(self, host, model: nn.Module, *, rank: int = 0, world: int = 1, store: tuple[str, int] | None = None,
                 dist_backend: str = "gloo", tp: int = 1, pp: int = 1, offload: bool = False):
        if (world, tp, pp) != (1, 1, 1):
            raise ValueError(f"the torch trainer runs one process, not world = {world}, tp = {tp}, pp = {pp}")
        self.host, self.model = host, model
        self.rank, self.world = int(rank), int(world)
        self.device, self.precision = host.device, host.precision
        self.optimizer: torch.optim.Optimizer | None = None
        #: the optimizer's state and step on the host (the offload pass): :class:`~.offload.HostAdamW`
        self.offload = bool(offload)

    # -- layout ---------------------------------------------------------------------------------
    @property
    def answers(self) -> bool:
        """Whether this rank answers for its share of a forward's rows."""
        return True

    @property
    def writes(self) -> bool:
        """Whether this rank answers a call of the whole group and writes checkpoints."""
        return self.rank == 0

    def rows(self, rollout: Rollout) -> Rollout:
        """The rows of a forward this rank computes."""
        return rollout

    def generation_share(self, n: int) -> tuple[int, int]:
        """The rows [lo, hi) of ``n`` this rank decodes in a split generation."""
        return row_share(n, self.rank, self.world)

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj`` in rank order, on the rank that writes (None elsewhere); a collective."""
        return [obj]

    def barrier(self) -> None:
        """Wait for every rank of the group."""

    # -- forwards -------------------------------------------------------------------------------
    def forward(self, rollout: Rollout, fn: Callable) -> torch.Tensor | None:
        """``fn(model, batch)`` on ``rollout`` (this rank's rows, :meth:`rows`) under the worker's precision; on
        an unpadded rollout in length groups where the backend packs. None on a rank that does not answer."""
        batch = rollout.batch.to(self.device)
        with autocast(self.device, self.precision):
            out = bucketed(lambda b: fn(self.model, b), batch) if rollout.unpad and self.pack \
                else fn(self.model, batch)
        return out.cpu()

    def score_text(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A reward model's scores of rows in its own tokens (a rollout of another tokenizer, re-encoded)."""
        with autocast(self.device, self.precision):
            return self.model.score(input_ids.to(self.device), mask.to(self.device)).cpu()

    # -- training -------------------------------------------------------------------------------
    def make_optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """A fresh AdamW over the parameters this rank holds (on the host under ``offload``)."""
        if self.offload:
            from .offload import HostAdamW

            return HostAdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.999),
                             eps=1e-8, weight_decay=weight_decay, foreach=False)
        return loop.make_optimizer(self.model, lr=lr, weight_decay=weight_decay)

    def train_epochs(self, optimizer: torch.optim.Optimizer, batch: dict, loss_fn: Callable, **kwargs) -> dict:
        """The minibatch loop (:func:`rlhfc.runtime.train.loop.train_epochs`) on this rank's model."""
        return loop.train_epochs(self.model, optimizer, batch, loss_fn, pack=self.pack, **kwargs)

    # -- generation -----------------------------------------------------------------------------
    def generation_model(self, engine) -> nn.Module:
        """The single-rank module ``engine`` decodes on (or refits its own weights from); a collective on a
        group that must gather it."""
        return self.model

    def fuse(self, fused: dict | None) -> None:
        """Run the next training call's pipeline schedules in a fused order with another model's
        (:mod:`rlhfc.runtime.train.fused`; ``fused``: ``{"store", "orders", "model", "key"}``, None: unfused).
        Only a pipeline-parallel backend has a schedule to fuse."""
        if fused:
            raise ValueError(f"model '{self.host.name}': fused training needs a pipeline-parallel trainer "
                             "(megatron with pp > 1)")

    def reshard(self, engine, bucket_mb: int) -> tuple[int, int]:
        """The plan's reshard stage: bring the generation layout up to the trained weights now. Returns (bytes
        this rank received, transfers): one process holds the whole model already."""
        return 0, 0

    # -- state in the single-rank layout ----------------------------------------------------------
    def full_weights(self) -> dict[str, torch.Tensor]:
        """The weights in full, Hugging Face layout, on CPU (a collective on a group)."""
        return {k: v.detach().cpu() for k, v in get_weights(self.model).items()}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take full weights (exact copies): each rank keeps its part."""
        set_weights(self.model, weights)

    def state_items(self):
        """The model's tensors in state-dict order, in full (what a weight transfer sends, bucket by bucket)."""
        return self.model.state_dict().items()

    def import_bucket(self, bucket: dict) -> None:
        """Load one bucket of full tensors (numpy arrays from the object store) into the model."""
        import warnings

        current = self.model.state_dict()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read only
            for name, array in bucket.items():
                current[name].copy_(torch.from_numpy(array))

    def weights_changed(self) -> None:
        """The weights were replaced (a load): drop what was derived from them."""

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the optimizer state in full (a sharded rank gathers it)."""
        return tensor

    def _placed(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """Optimizer state of parameter ``index`` loaded in full, as this rank holds it."""
        return full

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict | None]:
        """The optimizer state in full, in the single-rank model's parameter order: (tensors named
        ``opt.<index>.<key>``, the checkpoint's ``optimizer`` entry); empty and None before the first train."""
        if self.optimizer is None:
            return {}, None
        sd = self.optimizer.state_dict()
        tensors = {f"opt.{idx}.{key}": self._full(torch.as_tensor(t)).detach().cpu().contiguous()
                   for idx, state in sd["state"].items() for key, t in state.items()}
        return tensors, {"param_groups": sd["param_groups"],
                         "state_keys": {str(i): sorted(s.keys()) for i, s in sd["state"].items()}}

    def load_optimizer(self, tensors: dict[str, torch.Tensor], opt: dict) -> None:
        """Load :meth:`optimizer_state`'s tensors and entry into ``self.optimizer`` (fresh, same hyper-parameters)."""
        state = {int(i): {k: self._placed(int(i), tensors[f"opt.{i}.{k}"]) for k in keys}
                 for i, keys in opt["state_keys"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": opt["param_groups"]})


class GroupBackend(TrainBackend):
    """What a backend whose ranks form one ``torch.distributed`` world shares: every rank gets each call, rank 0
    answers and writes."""

    grouped = True

    def __init__(self, host, model: nn.Module, *, rank: int = 0, world: int = 1, offload: bool = False, **_layout):
        TrainBackend.__init__(self, host, model, offload=offload)
        self.rank, self.world = int(rank), int(world)

    def gather(self, obj: Any) -> list | None:
        import torch.distributed as dist

        parts: list = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts if self.rank == 0 else None

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def build_backend(trainer: str, host, model: nn.Module, plugins=(), **layout) -> TrainBackend:
    """The train backend ``trainer`` names (the registry's class), for ``host``'s ``model``, after importing the
    job's ``plugins`` (where a backend of a plugin registers)."""
    for spec in plugins or ():
        import_plugin(spec)
    traits = train_traits(trainer or "torch")
    module, _, name = traits.runtime.partition(":")
    cls = getattr(importlib.import_module(module), name)
    backend = cls(host, model, **layout)
    backend.traits = traits
    return backend


# -- what the group backends share ------------------------------------------------------------------
def init_group(prefix: str, store: tuple[str, int], rank: int, world: int, dist_backend: str):
    """Join the group's ``torch.distributed`` world (rank 0 hosts the rendezvous store at ``store``); returns the
    store, which must outlive the group."""
    import torch.distributed as dist

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    tcp = dist.TCPStore(store[0], int(store[1]), world, rank == 0, timeout=timeout)
    dist.init_process_group(dist_backend, store=dist.PrefixStore(prefix, tcp), rank=rank, world_size=world,
                            timeout=timeout)
    return tcp


def row_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous rows [lo, hi) of ``n`` that rank ``rank`` of ``world`` takes (as ``tensor_split``)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def rows_of(rollout: Rollout, lo: int, hi: int) -> Rollout:
    """The rollout's rows [lo, hi)."""
    index = list(range(lo, hi))
    return replace(rollout, batch=rollout.batch.select(index), prompts=rollout.prompts[lo:hi],
                   responses=rollout.responses[lo:hi],
                   rows=rollout.rows[lo:hi] if rollout.rows else [],
                   born=rollout.born[lo:hi] if rollout.born else [],
                   fields=rollout.fields[lo:hi] if rollout.fields else [],
                   logprobs=rollout.logprobs[lo:hi] if rollout.logprobs is not None else None)


def join(parts: list):
    """Concatenate the ranks' forward results in row order (TokenValues or score tensors)."""
    if isinstance(parts[0], TokenValues):
        return TokenValues(torch.cat([p.values for p in parts]), torch.cat([p.mask for p in parts]))
    return torch.cat(parts)


def open_store(host: str = "127.0.0.1") -> tuple[str, int]:
    """A free (host, port) on this node for a group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]
