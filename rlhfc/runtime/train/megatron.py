"""Tensor- and pipeline-parallel ranks with megatron-core (the ``megatron`` train backend).

A worker group of ``dp × tp × pp`` ranks hosts one model as a megatron-core ``GPTModel`` (the local,
pure-PyTorch layer spec: no Transformer Engine, no Apex). The group is one ``torch.distributed``
world (gloo on CPU, NCCL on CUDA) split by ``parallel_state.initialize_model_parallel`` in megatron's
rank order — tensor-parallel ranks fastest, then data-parallel, then pipeline stages:
``rank = (pp_rank · dp + dp_rank) · tp + tp_rank``.

Every rank builds the single-rank model's seeded weights (Hugging Face layout), converts them
(:mod:`rlhfc.runtime.models.megatron_convert`) and keeps its piece, so every layout starts from the same model.

How each stage runs:

- **forwards** (``logprobs``, ``values``, ``score``) and **training** go through megatron's pipeline
  schedule (``get_forward_backward_func``: no pipelining for ``pp = 1``; with stages, 1F1B over up to
  2·pp equal microbatches, each weighted by its share of the response tokens). Rows are
  split over data-parallel ranks as under FSDP; the tensor-parallel ranks of a replica see the same rows.
  The last stage gathers the vocabulary-parallel logits and hands them, in the rollout's layout, to
  the same log-prob, value and loss code a single rank runs; the rank with ``tp_rank = 0`` of the last
  stage answers each data-parallel share.
- Rows are left-padded prompts followed by right-padded responses. megatron's rotary embedding counts
  positions from each sequence's first column, so each row is shifted to start at column 0 before the
  forward and the outputs are shifted back: with a causal mask no real token then sees padding, and
  positions match the single-rank model (which counts them from the attention mask).
- **training**: gradients are summed over data-parallel ranks, the tied GPT-2 embedding's over its two stages, and
  clipped by the norm over all pieces; AdamW steps on each rank's pieces (element-wise, so the result
  is the single-rank step up to the rounding of the sums).
- **generation**: the ranks gather the full weights into a single-rank copy each — at the plan's reshard
  stage right after training (:meth:`MegatronBackend.reshard`, buckets of the stage's ``bucket_mb``), or
  lazily at the first generate after the weights changed (a tensor-parallel generation layout is not
  built); every rank decodes its share of the rows, each row
  from its own random stream, so the group samples the tokens one rank samples; rank 0 answers.
  Streamed generation is decoded by rank 0 alone (as under FSDP). On vLLM each rank's engine (the whole
  model, not tensor-parallel) is refitted from that copy (:mod:`rlhfc.runtime.rollout.vllm`).
- **weights out** and **checkpoints**: gathered in Hugging Face layout (tensor all-gathers within each
  replica's model-parallel group, in buckets; every rank knows the others' shapes from the spec); rank 0 answers ``get_weights``
  and writes checkpoints — full tensors, so a run saved under one layout resumes under any other.
  **Weights in**: every rank takes its piece.

The model itself, and the shims megatron-core needs on a machine without CUDA: :mod:`rlhfc.runtime.models.megatron`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from rlhfc.runtime.data.values import Rollout
from rlhfc.runtime.models import megatron_convert as conv
from rlhfc.runtime.models.build import normalize_spec
from rlhfc.runtime.models.megatron import Outputs, build_gpt, cpu_shims, local_state, roll_rows, row_shifts
from rlhfc.runtime.rl.ppo import loss_units
from rlhfc.runtime.rollout.generation import RolloutBatch

from .backend import GROUP_TIMEOUT_S, GroupBackend, init_group, row_share, rows_of
from .fused import FusedGate, gated, parse_orders
from .loop import take_rows

#: the most a rank sends in one all-gather when the pieces are put together (MiB)
GATHER_BUCKET_MB = 64


class MegatronBackend(GroupBackend):
    """Rank ``rank`` of a ``dp × tp × pp`` megatron-core group hosting one model (see module docstring).

    ``store``: (host, port) of the group's rendezvous (:func:`rlhfc.runtime.train.backend.open_store`)."""

    def __init__(self, host, model: nn.Module, *, rank: int = 0, world: int = 1,
                 store: tuple[str, int] | None = None, dist_backend: str = "gloo", tp: int = 1, pp: int = 1,
                 offload: bool = False):
        if host.precision != "fp32":
            raise ValueError(f"the megatron trainer runs fp32 only, not precision = {host.precision}")
        if store is None:
            raise ValueError("the megatron trainer's ranks need their group's rendezvous (store = (host, port))")
        super().__init__(host, model, rank=rank, world=world, offload=offload)   # offload: HostAdamW on its pieces
        from megatron.core import parallel_state as ps

        self.tp, self.pp = int(tp), int(pp)
        if model.spec.get("source") or model.spec.get("dtype", "float32") not in ("float32", "fp32"):
            raise ValueError(f"model '{host.name}': the megatron trainer builds float32 models from a config "
                             "(hf(...) folders and other dtypes are not supported yet); use trainer = fsdp or torch")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"a group of {world} ranks cannot hold tp = {tp} × pp = {pp}")
        self._tcp = init_group(f"rlhfc-mp/{host.name}", store, self.rank, self.world, dist_backend)
        cpu_shims()
        ps.initialize_model_parallel(self.tp, self.pp, distributed_timeout_minutes=max(1, GROUP_TIMEOUT_S // 60))
        self.ps = ps
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.spec = normalize_spec(model.spec)
        self.replica = model                # Hugging Face layout: generation and the checkpoint order
        self.model = build_gpt(self.spec, self.tp, self.pp, self.device)
        self._load_full({k: v for k, v in self.replica.state_dict().items()})
        self._fresh = True                  # the replica holds the current weights
        #: the Hugging Face parameter names in the single-rank model's order (the checkpoint's optimizer order)
        self.hf_params = [n for n, _ in self.replica.named_parameters()]
        self._needed = set(self.replica.state_dict())   # what a weight sync must bring
        self._incoming: dict[str, torch.Tensor] = {}
        self.gathered = (0, 0)

    # -- layout ---------------------------------------------------------------------------------
    @property
    def answers(self) -> bool:
        """Whether this rank answers its data-parallel share (tp rank 0 of the last stage)."""
        return self.tp_rank == 0 and self.pp_rank == self.pp - 1

    def _pieces(self, local: dict[str, torch.Tensor], bucket_mb: int = GATHER_BUCKET_MB) -> dict[str, torch.Tensor]:
        """Every model-parallel rank's local tensors gathered and put together in the Hugging Face layout (a
        collective of the whole group; each data-parallel replica gathers its own, identical, pieces)."""
        return self._pieces_of([local], bucket_mb)[0]

    def _pieces_of(self, locals_: list[dict[str, torch.Tensor]], bucket_mb: int = GATHER_BUCKET_MB) -> list[dict]:
        """:meth:`_pieces` of several same-shaped states (the weights, or Adam's two moments) in one gather.

        Each rank flattens its tensors (by name, state after state) and the ranks all-gather them in buckets
        of at most ``bucket_mb``; a rank knows every other rank's names and shapes from the spec (the
        converter run on shapes only), so nothing but the numbers travels."""
        group = self.ps.get_model_parallel_group()
        dtype = next(iter(locals_[0].values())).dtype
        mine = torch.cat([local[k].detach().reshape(-1).to(dtype) for local in locals_ for k in sorted(local)]) \
            if locals_[0] else torch.zeros(0, dtype=dtype)
        layouts = self._rank_shapes()
        longest = len(locals_) * max(sum(math.prod(sh) for sh in shapes.values()) for shapes in layouts.values())
        step = max(1, bucket_mb * 2**20 // max(1, mine.element_size()))
        mp_world = self.tp * self.pp
        flats = [torch.empty(longest, dtype=dtype, device=mine.device) for _ in range(mp_world)]
        padded = torch.zeros(longest, dtype=dtype, device=mine.device)
        padded[:mine.numel()] = mine
        for lo in range(0, longest, step):
            hi = min(longest, lo + step)
            parts = [torch.empty(hi - lo, dtype=dtype, device=mine.device) for _ in range(mp_world)]
            dist.all_gather(parts, padded[lo:hi].contiguous(), group=group)
            for flat, part in zip(flats, parts):
                flat[lo:hi] = part
        self.gathered = (longest * mine.element_size() * (mp_world - 1), math.ceil(longest / step))
        out = []
        ranks = dist.get_process_group_ranks(group)
        per_rank = {i: 0 for i in range(len(ranks))}   # where the next state starts in each rank's flat
        for _ in locals_:
            pieces = {}
            for i, global_rank in enumerate(ranks):
                coords = self._coords(global_rank)
                state, at = {}, per_rank[i]
                for name in sorted(layouts[coords]):
                    shape = layouts[coords][name]
                    n = math.prod(shape)
                    state[name] = flats[i][at:at + n].view(shape).cpu()
                    at += n
                per_rank[i] = at
                pieces[coords] = state
            out.append(conv.from_megatron(conv.unshard(pieces, self.spec, self.tp, self.pp), self.spec, self.tp))
        return out

    def _coords(self, global_rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a rank of this group (megatron's order: tensor-parallel ranks fastest, then
        data-parallel, then stages)."""
        return global_rank % self.tp, global_rank // (self.tp * self.dp)

    def _rank_shapes(self) -> dict[tuple[int, int], dict[str, tuple]]:
        """Every (tp_rank, pp_rank)'s local tensor names and shapes, from the spec alone (cached)."""
        if getattr(self, "_shapes", None) is None:
            meta = {k: torch.empty(v.shape, device="meta") for k, v in self.replica.state_dict().items()}
            full = conv.to_megatron(meta, self.spec, self.tp)
            self._shapes = {(t, p): {k: tuple(v.shape) for k, v in conv.shard(full, self.spec, self.tp, t, self.pp,
                                                                                 p).items()}
                            for t in range(self.tp) for p in range(self.pp)}
        return self._shapes

    def _piece_of(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's local tensors of a full Hugging Face-layout state."""
        full = conv.to_megatron(hf, self.spec, self.tp)
        return conv.shard(full, self.spec, self.tp, self.tp_rank, self.pp, self.pp_rank)

    def _load_full(self, hf: dict[str, torch.Tensor]) -> None:
        mine = self._piece_of(hf)
        params = local_state(self.model)
        if set(mine) != set(params):
            raise ValueError(f"weights for '{self.host.name}' do not match its megatron layout: "
                             f"{sorted(set(mine) ^ set(params))[:4]}")
        with torch.no_grad():
            for key, value in mine.items():
                params[key].copy_(value.to(params[key].dtype))
        self._fresh = False

    # -- the pipeline schedule ------------------------------------------------------------------
    def _microbatches(self, rows: int) -> int:
        """How many microbatches a call of ``rows`` rows is cut into: one without stages; with ``pp`` stages
        the largest count up to 2·pp that divides the rows (the p2p messages need one shape), so the stages
        work on different microbatches at once."""
        if self.pp == 1:
            return 1
        return max(m for m in range(1, min(rows, 2 * self.pp) + 1) if rows % m == 0)

    def _schedule(self, ids: torch.Tensor, mask: torch.Tensor, on_output: Callable, *, forward_only: bool) -> list:
        """The rows through megatron's schedule in equal microbatches. ``on_output(out, rows)`` runs on the
        last stage for each microbatch (``rows``: its slice of the rows) with the model's outputs in the rows'
        own layout (logits [b, T, V] or head outputs [b, T]); it returns (loss, extra) for training, or
        anything for a forward. Returns the forward's results in microbatch order (last stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        shift = row_shifts(mask)
        rows, width = ids.shape
        m = self._microbatches(rows)
        size = rows // m
        rolled = roll_rows(ids, shift, 1).to(self.device)
        positions = torch.arange(width, device=self.device).expand(size, width)
        causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=self.device), 1)[None, None]
        last = self.ps.is_pipeline_last_stage()
        results: list = []

        def step(data, model):   # megatron calls it once per microbatch, in order
            i = next(data)
            part = slice(i * size, (i + 1) * size)
            out = model(rolled[part], positions, causal)   # True: masked out
            if not last:
                return out, None
            if self.spec["head"] == "lm":
                out = gather_from_tensor_model_parallel_region(out)
            else:
                out = out.squeeze(-1)
            out = roll_rows(out.float(), shift[part], -1)
            if forward_only:
                results.append(on_output(out, part))
                return out, None
            return out, lambda o: on_output(o, part)

        gate = None if forward_only else getattr(self, "gate", None)
        with torch.set_grad_enabled(not forward_only), (gated(gate) if gate else contextlib.nullcontext()):
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter(range(m)), model=[self.model],
                                        num_microbatches=m, seq_length=width, micro_batch_size=size,
                                        forward_only=forward_only)
        return results

    def fuse(self, fused: dict | None) -> None:
        """The next training call's schedules run in the fused order ``fused["orders"]`` (per device; this rank's
        device: its pipeline stage, reversed for the second model), meeting the other model's ranks in the
        TCPStore ``fused["store"]`` (:mod:`rlhfc.runtime.train.fused`); None: unfused."""
        if not fused:
            gate, self.gate = getattr(self, "gate", None), None
            if gate is not None:
                self.last_log = gate.log   # what ran when (kind, micro-batch, schedule, start, end)
            return
        if self.pp < 2:
            super().fuse(fused)
        model = int(fused["model"])
        device = self.pp_rank if model == 0 else self.pp - 1 - self.pp_rank
        self.gate = FusedGate(tuple(fused["store"]), parse_orders(fused["orders"])[device], model, device,
                              f"{fused['key']}/dp{self.dp_rank}tp{self.tp_rank}")

    # -- forwards: each data-parallel rank its share of the rows ---------------------------------
    def rows(self, rollout: Rollout) -> Rollout:
        return rows_of(rollout, *row_share(rollout.size, self.dp_rank, self.dp))

    def forward(self, rollout: Rollout, fn: Callable) -> torch.Tensor | None:
        """``fn(outputs, batch)`` on this rank's rows (:meth:`rows`) through the pipeline schedule; the model's
        outputs come as :class:`~rlhfc.runtime.models.megatron.Outputs`, which the log-prob, value and score
        code reads as it reads a single-rank model. None on a rank that does not answer."""
        batch = rollout.batch.to(self.device)
        with torch.no_grad():
            outs = self._schedule(batch.input_ids, batch.attention_mask,
                                  lambda o, rows: fn(Outputs(o), batch.select(range(rows.start, rows.stop))),
                                  forward_only=True)
        return torch.cat(outs).cpu() if self.answers else None

    def score_text(self, input_ids, mask):
        raise ValueError(f"reward model '{self.host.name}' under the megatron trainer scores rollouts of its own "
                         "tokenizer only")

    # -- training --------------------------------------------------------------------------------
    def train_epochs(self, optimizer, batch, loss_fn, **kwargs) -> dict:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=self.ps.get_data_parallel_group())
            return t

        if self.dp > 1:
            kwargs.update(shard=(self.dp_rank, self.dp), reduce=reduce)
        self._fresh = False
        return super().train_epochs(optimizer, batch, loss_fn, backward=self._backward, clip=self._clip, **kwargs)

    def _backward(self, model, part: dict, loss_fn: Callable, scale: float):
        """Forward and backward of one minibatch part in microbatches. The losses are token means, so each
        microbatch's loss is weighted by its share of the part's response tokens (times the microbatch count,
        which megatron's schedule divides by): the gradient, loss and metrics are the whole part's."""
        batch = RolloutBatch.from_dict(part)
        how = part.get("loss_agg", "token_mean")   # a seq-mean loss weighs microbatches by rows
        tokens = loss_units(batch.response_mask, how).clamp(min=1)
        m = self._microbatches(batch.batch_size)
        totals: dict[str, float] = {}

        def on_output(out, rows):
            piece = take_rows(part, torch.arange(rows.start, rows.stop))
            share = float(loss_units(piece["response_mask"], how) / tokens) if m > 1 else 1.0
            loss, metrics = loss_fn(Outputs(out), piece)
            for k, v in {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}.items():
                totals[k] = totals.get(k, 0.0) + share * v
            return loss * (scale * share * m) if m > 1 else loss * scale, {}

        self._schedule(batch.input_ids, batch.attention_mask, on_output, forward_only=False)
        if self.pp > 1:   # the loss and metrics live on the last stage
            box = [totals]
            dist.broadcast_object_list(box, src=self.ps.get_pipeline_model_parallel_last_rank(),
                                       group=self.ps.get_pipeline_model_parallel_group())
            totals = box[0]
        self._reduce_grads()
        loss = totals.pop("loss")
        return torch.tensor(loss, dtype=torch.float64), totals

    def _reduce_grads(self) -> None:
        """Sum gradients over the data-parallel ranks (then average), and the tied embedding's over its stages."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=self.ps.get_data_parallel_group())
                p.grad.div_(self.dp)
        if conv.tied(self.spec) and self.pp > 1 and self.ps.is_rank_in_embedding_group():
            first = self.ps.is_pipeline_first_stage()
            weight = (self.model.embedding.word_embeddings.weight if first else self.model.output_layer.weight)
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            dist.all_reduce(weight.grad, group=self.ps.get_embedding_group())

    def _clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm over every rank's pieces (each replicated tensor counted once)."""
        duplicate = None
        if conv.tied(self.spec) and self.pp > 1 and self.ps.is_pipeline_last_stage():
            duplicate = self.model.output_layer.weight   # the last stage's copy of the embedding
        split = {id(p) for n, p in self.model.named_parameters() if conv.partition_dim(self.spec, n) is not None}
        sq = torch.zeros((), dtype=torch.float32)
        for p in params:
            if p.grad is None or p is duplicate:
                continue
            if id(p) in split or self.tp_rank == 0:
                sq = sq + p.grad.detach().float().norm() ** 2
        if self.tp * self.pp > 1:
            dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
        return norm

    # -- generation: a single-rank copy on every rank -----------------------------------------------
    def _refresh(self, bucket_mb: int = GATHER_BUCKET_MB) -> tuple[int, int]:
        """Bring every rank's single-rank copy up to date (a collective; nothing to do when unchanged).
        Returns (bytes this rank received, buckets)."""
        if self._fresh:
            return 0, 0
        self.replica.load_state_dict(self._pieces(local_state(self.model), bucket_mb))
        self._fresh = True
        return self.gathered

    def generation_model(self, engine) -> nn.Module:
        """The single-rank copy, gathered first if the weights changed (a collective); an engine with weights of
        its own refits from it (a tensor-parallel generation layout is not built)."""
        self._refresh()
        return self.replica

    def reshard(self, engine, bucket_mb: int) -> tuple[int, int]:
        """Every rank gathers the full weights into its generation copy now."""
        return self._refresh(bucket_mb)

    # -- weights: Hugging Face layout -----------------------------------------------------------------
    def full_weights(self) -> dict[str, torch.Tensor]:
        return self._pieces(local_state(self.model))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._load_full(weights)

    def state_items(self):
        return self.full_weights().items()

    def import_bucket(self, bucket: dict) -> None:
        """Take one bucket of Hugging Face-layout tensors; once every tensor of the model has come, each rank
        keeps its pieces (the converter needs a layer's query, key and value together)."""
        self._incoming.update({k: torch.from_numpy(v.copy()) for k, v in bucket.items()})
        if self._incoming.keys() >= self._needed:
            self._load_full(self._incoming)
            self._incoming = {}

    def weights_changed(self) -> None:
        self._fresh = False

    # -- optimizer state: Hugging Face layout, the single-rank model's order --------------------------
    def _optimizer_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state in full, Hugging Face layout: {state key: {parameter name: tensor}} (a collective)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        per_key: dict[str, dict[str, torch.Tensor]] = {}
        own = getattr(self.optimizer, "device_param", lambda q: q)   # an offloaded optimizer's masters
        for p, state in self.optimizer.state.items():
            for key, t in state.items():
                per_key.setdefault(key, {})[names[id(own(p))]] = t
        steps = [float(t) for t in per_key.get("step", {}).values()]   # a scalar per tensor: the same count everywhere
        out = {"step": {n: torch.tensor(steps[0] if steps else 0.0) for n in self.hf_params}}
        moments = [{n: per_key.get(k, {}).get(n, torch.zeros_like(p)) for n, p in self.model.named_parameters()}
                   for k in ("exp_avg", "exp_avg_sq")]
        out["exp_avg"], out["exp_avg_sq"] = self._pieces_of(moments)   # both moments in one gather
        return out

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict | None]:
        if self.optimizer is None:
            return {}, None
        state = self._optimizer_by_name()
        tensors = {f"opt.{index}.{key}": by_name[name].detach().cpu().contiguous()
                   for index, name in enumerate(self.hf_params) for key, by_name in state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(self.hf_params)))}
                  for g in self.optimizer.state_dict()["param_groups"][:1]]
        return tensors, {"param_groups": groups, "state_keys": {str(i): sorted(state) for i in range(len(self.hf_params))}}

    def load_optimizer(self, tensors: dict[str, torch.Tensor], opt: dict) -> None:
        params = list(self.model.named_parameters())
        local: dict[str, dict[str, torch.Tensor]] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            hf = {name: tensors[f"opt.{i}.{key}"] for i, name in enumerate(self.hf_params)}
            hf |= {k: torch.zeros_like(v) for k, v in self.replica.state_dict().items() if k not in hf}   # tied copy
            local[key] = self._piece_of(hf)
        step = tensors["opt.0.step"] if "opt.0.step" in tensors else torch.tensor(0.0)
        state = {i: {"step": step.clone(), "exp_avg": local["exp_avg"][n].clone(),
                     "exp_avg_sq": local["exp_avg_sq"][n].clone()} for i, (n, _) in enumerate(params)}
        mine = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": state, "param_groups": [
            {**opt["param_groups"][0], "params": g["params"]} for g in mine]})
        self._fresh = False
