"""Data-parallel ranks: one model's replicas sharded with FSDP2 over a process group (the ``fsdp`` backend).

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
  (:func:`rlhfc.runtime.train.loop.train_epochs`). Metrics are summed over the ranks the same way.
- **generation**: the ranks gather the full weights into an unsharded copy; each decodes its share of
  the rows (every row samples from its own random stream, so the group samples the tokens one rank
  samples) and rank 0 answers with the gathered rollout. Streamed generation (``generate_chunks``) is
  still decoded by rank 0 alone: its chunks and the overcommit cut-off follow the finish order over
  all rows.
  On an engine with weights of its own (vLLM) no unsharded copy is built: each rank owns an engine, refitted
  from the shards (each parameter gathered in turn, in buckets) at the plan's reshard stage or before a
  generate, and decodes its share on it (:mod:`rlhfc.runtime.rollout.vllm`); streamed, rank 0's engine
  decodes every row while the others start and refit theirs with it (collectives).
- **weights out** (``get_weights``, ``sync_export``, ``save``): gathered in full on every
  rank (a collective), answered or written by rank 0; **weights in** (``set_weights``,
  ``sync_import``, ``load``): every rank takes its shard of the full tensors. Checkpoints hold
  full tensors, so a run saved under one layout resumes under another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rlhfc.runtime.data.values import Rollout
from rlhfc.runtime.models.build import build_model

from .backend import GroupBackend, init_group, row_share, rows_of

#: the methods of the model wrappers (rlhfc.runtime.models.build) that run a forward besides ``forward``
FORWARD_METHODS = ("forward_logits", "decode_step", "values", "score", "token_outputs")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model (the largest ``nn.ModuleList`` inside it)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters())))


def shard_model(model: nn.Module, device: str = "cpu", offload: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over the default process group: each block, then the root. With
    ``offload``, FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the optimizer step
    on the host (pinned memory on CUDA), each block's parameters brought to the device for its compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method

    cuda = device.startswith("cuda")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
    for block in blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
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


class FsdpBackend(GroupBackend):
    """Rank ``rank`` of a data-parallel group of ``world`` ranks (see module docstring); ``store``: (host, port)
    of the group's rendezvous (rank 0 hosts it: :func:`rlhfc.runtime.train.backend.open_store`)."""

    pack = False   # FSDP gathers weights in every forward: all ranks must run the same number of them

    def __init__(self, host, model: nn.Module, *, rank: int = 0, world: int = 1,
                 store: tuple[str, int] | None = None, dist_backend: str = "gloo", tp: int = 1, pp: int = 1,
                 offload: bool = False):
        if tp != 1 or pp != 1:
            raise ValueError(f"the fsdp trainer splits a model over data-parallel ranks only, not tp = {tp}, pp = {pp}")
        if store is None:
            raise ValueError("the fsdp trainer's ranks need their group's rendezvous (store = (host, port))")
        super().__init__(host, model, rank=rank, world=world)
        self.fsdp_offload = bool(offload)   # FSDP2 offloads itself: its optimizer is a plain AdamW on the host
        self._tcp = init_group(f"rlhfc-dp/{host.name}", store, self.rank, self.world, dist_backend)
        shard_model(self.model, self.device, offload=self.fsdp_offload)
        self._replica: nn.Module | None = None
        self._replica_version: int | None = None   # the weights version the gathered copy holds
        self.gathered = (0, 0)

    # -- forwards: each rank its share of the rows ------------------------------------------------
    def rows(self, rollout: Rollout) -> Rollout:
        lo, hi = row_share(rollout.size, self.rank, self.world)
        # a rollout of fewer rows than ranks (a streamed chunk) leaves some ranks none: they still take part in
        # the forward's parameter gathers, on the rollout's first row as a stand-in whose result they drop
        self._stand_in = rows_of(rollout, 0, 1) if hi == lo and rollout.size else None
        return rows_of(rollout, lo, hi)

    # FSDP2 keeps the root module's parameters gathered after a forward (backward would gather them
    # again); a forward-only stage reshards them, so memory is freed and model.parameters() are the
    # sharded ones again (an optimizer built on gathered copies would update throwaway tensors)
    def forward(self, rollout, fn):
        stand_in, self._stand_in = getattr(self, "_stand_in", None), None
        try:
            if rollout.size == 0 and stand_in is not None:
                return super().forward(stand_in, fn)[:0]
            return super().forward(rollout, fn)
        finally:
            self.model.reshard()

    def score_text(self, input_ids, mask):
        try:
            return super().score_text(input_ids, mask)
        finally:
            self.model.reshard()

    # -- training: every rank its share of every minibatch ------------------------------------------
    def make_optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        self.model.reshard()   # the optimizer must hold the sharded parameters
        return super().make_optimizer(lr, weight_decay)

    def train_epochs(self, optimizer, batch, loss_fn, **kwargs) -> dict:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t)
            return t

        out = super().train_epochs(optimizer, batch, loss_fn, shard=(self.rank, self.world), reduce=reduce, **kwargs)
        self.weights_changed()
        return out

    # -- generation: a gathered copy, or the shards an engine refits from ----------------------------
    def generation_model(self, engine) -> nn.Module:
        """The unsharded copy, gathered (a collective of every rank) unless it holds the current weights; for an
        engine with weights of its own, the sharded model (the engine gathers each parameter as it refits)."""
        if not engine.decodes_trainer_copy:
            return self.model
        if self._replica is not None and self._replica_version == self.host.version:
            return self._replica
        state = full_state(self.model)
        if self._replica is None:
            self._replica = build_model(self.model.spec, seed=0, device=self.device)
        self._replica.load_state_dict(state)
        self._replica_version = self.host.version
        self.gathered = (sum(t.numel() * t.element_size() for t in state.values()) * (self.world - 1) // self.world,
                         len(state))
        return self._replica

    def reshard(self, engine, bucket_mb: int) -> tuple[int, int]:
        """Every rank gathers the full weights into its generation copy now (FSDP gathers tensor by tensor, so
        ``bucket_mb`` does not apply): (bytes received, gathers). For an engine with weights of its own the copy
        is each rank's engine: refitted here, in buckets of ``bucket_mb``, when it runs (else the first
        generate starts it and refits): (bytes received, buckets)."""
        if not engine.decodes_trainer_copy:
            if not engine.refit_pending():
                return 0, 0
            engine.prepare(self.model, bucket_mb)
            stats = self.host.engine_stats
            mb, buckets = stats.get("refit_mb", 0.0), stats.get("refit_buckets", 0.0)
            return int(mb * 2**20 * (self.world - 1) / self.world), int(buckets)
        fresh = self._replica is not None and self._replica_version == self.host.version
        self.generation_model(engine)
        return (0, 0) if fresh else self.gathered

    # -- weights in the single-rank layout -----------------------------------------------------------
    def full_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in full_state(self.model).items()}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        load_full_state(self.model, weights)
        self.weights_changed()

    def state_items(self):
        return full_state(self.model).items()

    def import_bucket(self, bucket: dict) -> None:
        load_full_state(self.model, {k: torch.from_numpy(v.copy()) for k, v in bucket.items()})
        self.weights_changed()

    def weights_changed(self) -> None:
        self._replica_version = None

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    def _placed(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """Optimizer state loaded in full, as the shard of parameter ``index`` this rank holds."""
        from torch.distributed.tensor import distribute_tensor

        param = [p for g in self.optimizer.param_groups for p in g["params"]][index]
        if hasattr(param, "device_mesh") and full.dim() > 0:
            return distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements)
        return full
