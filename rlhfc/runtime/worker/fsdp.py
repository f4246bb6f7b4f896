"""Data-parallel ranks: one model's replicas sharded with FSDP2 over a process group (the ``fsdp`` trainer).

A worker group of ``world`` ranks hosts one model on ``world`` devices (cores on a CPU
cluster). Every rank builds the same seeded initial weights, joins the group's
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) and shards the model with
``torch.distributed.fsdp.fully_shard`` — each transformer block, then the whole model —
so a rank keeps 1/world of every parameter and of the optimizer state.

How each stage runs on the group (the driver calls every rank; :mod:`rlhfc.runtime.driver.group`):

- **forwards** (``logprobs``, ``values``, ``score``): each rank runs its contiguous share of the
  rollout's rows (``rows = (rank, world)``); the group concatenates the results in row order.
  Per-row results equal the single-rank model's up to float rounding (batched products over
  fewer rows).
- **train**: every rank gets the whole loss input and draws the same minibatch order; each
  trains on its share of every minibatch, its loss weighted by its share of the minibatch's
  tokens, and FSDP averages the gradients in backward — the whole minibatch's gradient
  (:func:`rlhfc.runtime.rl.loop.train_epochs`). Metrics are summed over the ranks the same way.
- **generation**: the ranks gather the full weights into an unsharded copy; each decodes its share of
  the rows (every row samples from its own random stream, so the group samples the tokens one rank
  samples) and rank 0 answers with the gathered rollout. Streamed generation (``generate_chunks``) is
  still decoded by rank 0 alone: its chunks and the overcommit cut-off follow the finish order over
  all rows.
  On the vLLM engine (``rollout = vllm``) no unsharded copy is built: each rank owns an engine, refitted
  from the shards (each parameter gathered in turn, in buckets) at the plan's reshard stage or before a
  generate, and decodes its share on it (:mod:`rlhfc.runtime.rollout.vllm`); streamed, rank 0's engine
  decodes every row while the others start and refit theirs with it (collectives).
- **weights out** (``get_weights``, ``sync_export``, ``save``): gathered in full on every
  rank (a collective), answered or written by rank 0; **weights in** (``set_weights``,
  ``sync_import``, ``load``): every rank takes its shard of the full tensors. Checkpoints hold
  full tensors, so a run saved under one layout resumes under another.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.train import loop

from .base import GROUP_TIMEOUT_S, ModelWorker
from .stages import stage_call

#: the methods of the model wrappers (rlhfc.runtime.models.build) that run a forward besides ``forward``
FORWARD_METHODS = ("forward_logits", "decode_step", "values", "score", "token_outputs")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model (the largest ``nn.ModuleList`` inside it)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


def shard_model(model: nn.Module, device: str = "cpu") -> nn.Module:
    """Shard ``model`` in place with FSDP2 over the default process group: each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in FORWARD_METHODS:
        if callable(getattr(model, name, None)):
            register_fsdp_forward_method(model, name)
    return model


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer in full (a collective: every rank must call it)."""
    out = {}
    for key, value in model.state_dict().items():
        out[key] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a sharded model: each rank keeps its shard (exact copies)."""
    from torch.distributed.tensor import distribute_tensor

    current = model.state_dict()
    with torch.no_grad():
        for key, full in state.items():
            target = current[key]
            if hasattr(target, "device_mesh"):
                piece = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(piece.to_local())
            else:
                target.copy_(full)


def row_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous rows [lo, hi) of ``n`` that rank ``rank`` of ``world`` takes (as ``tensor_split``)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def rows_of(rollout: Rollout, lo: int, hi: int) -> Rollout:
    """The rollout's rows [lo, hi)."""
    from dataclasses import replace

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


class DataParallelWorker(ModelWorker):
    """Rank ``rank`` of a data-parallel group of ``world`` ranks hosting one model (see module docstring).

    ``store``: (host, port) of the group's rendezvous (rank 0 hosts it: :func:`open_store`)."""

    _pack = False   # FSDP gathers weights in every forward: all ranks must run the same number of them

    def __init__(self, name: str, spec: dict, init: dict, seed: int, threads: int = 1, device: str = "cpu",
                 cores: list[int] | None = None, *, rank: int, world: int, store: tuple[str, int],
                 backend: str = "gloo", precision: str = "fp32", rollout: dict | None = None, tp: int = 1,
                 pp: int = 1):
        if tp != 1 or pp != 1:
            raise ValueError(f"the fsdp trainer splits a model over data-parallel ranks only, not tp = {tp}, pp = {pp}")
        super().__init__(name, spec, init, seed, threads, device, cores, precision, rollout)
        self.rank, self.world = int(rank), int(world)
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        tcp = dist.TCPStore(store[0], int(store[1]), self.world, self.rank == 0, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"rlhfc-dp/{name}", tcp), rank=self.rank,
                                world_size=self.world, timeout=timeout)
        self._tcp = tcp   # the store must outlive the group
        shard_model(self.model, device)
        self._replica: nn.Module | None = None
        self._replica_version: int | None = None   # the weights version the gathered copy holds

    # -- forwards: each rank its share of the rows ------------------------------------------------
    def _mine(self, rollout: Rollout) -> Rollout:
        return rows_of(rollout, *row_share(rollout.size, self.rank, self.world))

    # FSDP2 keeps the root module's parameters gathered after a forward (backward would gather them
    # again); a forward-only stage reshards them, so memory is freed and model.parameters() are the
    # sharded ones again (an optimizer built on gathered copies would update throwaway tensors)
    @stage_call
    def logprobs(self, rollout: Rollout, *, temperature: float = 1.0) -> TokenValues:
        try:
            return super().logprobs(self._mine(rollout), temperature=temperature)
        finally:
            self.model.reshard()

    @stage_call
    def values(self, rollout: Rollout) -> TokenValues:
        try:
            return super().values(self._mine(rollout))
        finally:
            self.model.reshard()

    @stage_call
    def score(self, rollout: Rollout) -> torch.Tensor:
        try:
            return super().score(self._mine(rollout))
        finally:
            self.model.reshard()

    # -- training: every rank its share of every minibatch ------------------------------------------
    def _make_optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.model.reshard()   # the optimizer must hold the sharded parameters
        return super()._make_optimizer(lr=lr, weight_decay=weight_decay)

    def _train_epochs(self, *args, **kwargs) -> dict[str, float]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t

        return loop.train_epochs(*args, shard=(self.rank, self.world), reduce=reduce, **kwargs)

    # -- generation: rank 0 samples every row on a gathered copy ------------------------------------
    def _generation_model(self) -> nn.Module:
        """The unsharded copy, gathered (a collective of every rank) unless it holds the current weights."""

        if self._replica is not None and self._replica_version == self.version:
            return self._replica
        state = full_state(self.model)
        if self._replica is None:
            self._replica = build_model(self.model.spec, seed=0, device=self.device)
        self._replica.load_state_dict(state)
        self._replica_version = self.version
        self.gathered = (sum(t.numel() * t.element_size() for t in state.values()) * (self.world - 1) // self.world,
                         len(state))
        return self._replica

    def reshard(self, bucket_mb: int) -> tuple[int, int]:
        """The plan's reshard stage: every rank gathers the full weights into its generation copy now (FSDP
        gathers tensor by tensor, so ``bucket_mb`` does not apply). Returns (bytes received, gathers).
        On vLLM the generation copy is each rank's engine: refitted here, in buckets of ``bucket_mb``, when it
        runs (else the first generate starts it and refits); returns (bytes received, buckets)."""
        if self._own_weights:
            if not self.rollout_engine.refit_pending():
                return 0, 0
            self.rollout_engine.prepare(bucket_mb)
            mb, buckets = self.engine_stats.get("refit_mb", 0.0), self.engine_stats.get("refit_buckets", 0.0)
            return int(mb * 2**20 * (self.world - 1) / self.world), int(buckets)
        fresh = self._replica is not None and self._replica_version == self.version
        self._generation_model()
        return (0, 0) if fresh else self.gathered

    def _weights_changed(self) -> None:
        self._replica_version = None

    @property
    def _own_weights(self) -> bool:
        """Whether this rank generates on an engine with weights of its own (refitted from the shards: no
        gathered copy)."""
        return not self.rollout_engine.decodes_trainer_copy

    @stage_call
    def generate(self, prompts: list[str], **kwargs):
        if self._own_weights:   # each rank its share on its own engine (e.g. rlhfc.runtime.rollout.vllm)
            return split_generate(self, prompts, self.rank, self.world, **kwargs)
        with _swapped(self, self._generation_model()):   # a collective: every rank gathers the weights
            return split_generate(self, prompts, self.rank, self.world, **kwargs)

    @stage_call
    def generate_chunks(self, prompts: list[str], **kwargs):
        # every rank: an engine's start and refit may be collectives
        self.rollout_engine.prepare(kwargs.get("refit_mb", 64))
        model = self.model if self._own_weights else self._generation_model()
        if self.rank != 0:
            skip_draw(self)
            return
        with _swapped(self, model):
            yield from super().generate_chunks(prompts, **kwargs)

    # -- weights ----------------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in full_state(self.model).items()}

    def set_weights(self, weights: dict[str, torch.Tensor], version: int | None = None) -> int:
        load_full_state(self.model, weights)
        self._weights_changed()
        if version is not None:
            self.version = version
        return self.version

    def sync_export(self, bucket_mb: int) -> tuple[list, int, int]:
        if self.rank == 0:
            return super().sync_export(bucket_mb)   # its buckets gather the full tensors
        full_state(self.model)                         # take part in the gathers
        return [], self.version, 0

    def _state_items(self):
        return full_state(self.model).items()

    def sync_import(self, bucket: dict) -> int:
        load_full_state(self.model, {k: torch.from_numpy(v.copy()) for k, v in bucket.items()})
        self._weights_changed()
        return len(bucket)

    # -- checkpoints: full tensors (layout-free), written by rank 0 ---------------------------------------
    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    @property
    def _writes(self) -> bool:
        return self.rank == 0

    def _placed(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """Optimizer state loaded in full, as the shard of parameter ``index`` this rank holds."""
        from torch.distributed.tensor import distribute_tensor

        param = [p for g in self.optimizer.param_groups for p in g["params"]][index]
        if hasattr(param, "device_mesh") and full.dim() > 0:
            return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements)
        return full

    def save(self, folder: str) -> None:
        super().save(folder)
        dist.barrier()   # the checkpoint is complete on disk when any rank returns

    def load(self, folder: str) -> int:
        self._weights_changed()
        return super().load(folder)


@contextmanager
def _swapped(worker: DataParallelWorker, model: nn.Module):
    """Run the single-rank code on the gathered copy, then put the sharded model back."""
    sharded, worker.model = worker.model, model
    try:
        yield
    finally:
        worker.model = sharded


def split_generate(worker: ModelWorker, prompts: list[str], rank: int, world: int, *, max_new_tokens: int,
                   temperature: float, top_p: float, n: int = 1, unpad: bool = False, logprobs: bool = False,
                   chat: bool = False, slots: int | None = None, refit_mb: int = 64):
    """Generation split over the ``world`` ranks of a group, each holding the full weights: rank ``rank``
    decodes its contiguous share of the rows (each row's own random stream: the tokens one rank would
    sample), the samples are gathered, and rank 0 answers with the rollout one rank would build. On vLLM
    each rank decodes its share on its own engine (one seed per rank's call, from its rows' keys) and the
    rollout keeps vLLM's log-probs, as one worker's does."""
    inputs = worker._inputs(prompts, n, chat=chat)
    logprobs = logprobs or not worker.rollout_engine.traits.trainer_numerics   # the behaviour policy's
    samples = list(worker._decode(inputs, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  logprobs=logprobs, share=row_share(len(inputs), rank, world),
                                  slots=-(-slots // world) if slots else None, refit_mb=refit_mb))
    parts: list = [None] * world
    dist.all_gather_object(parts, samples)
    if rank != 0:
        return None
    width_p = max(len(c["prompt_ids"]) for c in inputs)
    return worker._rollout([s for part in parts for s in part], inputs, width_p,
                           None if unpad else max_new_tokens, logprobs)


def skip_draw(worker: ModelWorker) -> None:
    """Advance the sampling generator as a decode call does, on a rank that does not decode (rank 0 streams
    every row), so every rank draws the same row keys in the next split generation."""
    torch.randint(0, 2**62, (1,), generator=worker.sample_gen)


def open_store(host: str = "127.0.0.1") -> tuple[str, int]:
    """A free (host, port) on this node for a group's rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]
