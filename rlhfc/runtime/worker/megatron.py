"""Tensor- and pipeline-parallel ranks with megatron-core (the ``megatron`` trainer).

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
  stage right after training (:meth:`MegatronWorker.reshard`, buckets of the stage's ``bucket_mb``), or
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

import math
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.models import megatron_convert as conv
from rlhfc.runtime.models.build import normalize_spec
from rlhfc.runtime.models.megatron import Outputs, build_gpt, cpu_shims, local_state, roll_rows, row_shifts
from rlhfc.runtime.rl.guards import check_finite
from rlhfc.runtime.rl.ppo import loss_units
from rlhfc.runtime.rollout.generation import RolloutBatch, response_logprobs, response_values, sequence_scores
from rlhfc.runtime.train import loop
from rlhfc.runtime.train.loop import take_rows

from .base import GROUP_TIMEOUT_S, ModelWorker
from .fsdp import row_share, rows_of, skip_draw, split_generate
from .stages import stage_call

#: the most a rank sends in one all-gather when the pieces are put together (MiB)
GATHER_BUCKET_MB = 64


class MegatronWorker(ModelWorker):
    """Rank ``rank`` of a ``dp × tp × pp`` megatron-core group hosting one model (see module docstring).

    ``store``: (host, port) of the group's rendezvous (:func:`rlhfc.runtime.worker.fsdp.open_store`)."""

    def __init__(self, name: str, spec: dict, init: dict, seed: int, threads: int = 1, device: str = "cpu",
                 cores: list[int] | None = None, *, rank: int, world: int, store: tuple[str, int], tp: int = 1,
                 pp: int = 1, backend: str = "gloo", rollout: dict | None = None, precision: str = "fp32"):
        if precision != "fp32":
            raise ValueError(f"the megatron trainer runs fp32 only, not precision = {precision}")
        super().__init__(name, spec, init, seed, threads, device, cores, rollout=rollout)   # the replica
        from megatron.core import parallel_state as ps

        self.rank, self.world, self.tp, self.pp = int(rank), int(world), int(tp), int(pp)
        if self.model.spec.get("source") or self.model.spec.get("dtype", "float32") not in ("float32", "fp32"):
            raise ValueError(f"model '{name}': the megatron trainer builds float32 models from a config "
                             "(hf(...) folders and other dtypes are not supported yet); use trainer = fsdp or torch")
        if self.world % (self.tp * self.pp):
            raise ValueError(f"a group of {world} ranks cannot hold tp = {tp} × pp = {pp}")
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        tcp = dist.TCPStore(store[0], int(store[1]), self.world, self.rank == 0, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"rlhfc-mp/{name}", tcp), rank=self.rank,
                                world_size=self.world, timeout=timeout)
        self._tcp = tcp   # the store must outlive the group
        cpu_shims()
        ps.initialize_model_parallel(self.tp, self.pp, distributed_timeout_minutes=max(1, GROUP_TIMEOUT_S // 60))
        self.ps = ps
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.spec = normalize_spec(self.model.spec)
        self.replica = self.model           # Hugging Face layout: generation and the checkpoint order
        self.model = build_gpt(self.spec, self.tp, self.pp, device)
        self._load_full({k: v for k, v in self.replica.state_dict().items()})
        self._fresh = True                  # the replica holds the current weights
        #: the Hugging Face parameter names in the single-rank model's order (the checkpoint's optimizer order)
        self.hf_params = [n for n, _ in self.replica.named_parameters()]
        self._needed = set(self.replica.state_dict())   # what a weight sync must bring
        self._incoming: dict[str, torch.Tensor] = {}

    # -- layout ---------------------------------------------------------------------------------
    @property
    def _answers(self) -> bool:
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
            raise ValueError(f"weights for '{self.name}' do not match its megatron layout: "
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

        with torch.set_grad_enabled(not forward_only):
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter(range(m)), model=[self.model],
                                        num_microbatches=m, seq_length=width, micro_batch_size=size,
                                        forward_only=forward_only)
        return results

    # -- forwards: each data-parallel rank its share of the rows ---------------------------------
    def _mine(self, rollout: Rollout) -> Rollout:
        return rows_of(rollout, *row_share(rollout.size, self.dp_rank, self.dp))

    def _forward(self, rollout: Rollout, fn: Callable) -> Any:
        mine = self._mine(rollout)
        batch = mine.batch.to(self.device)
        with torch.no_grad():
            outs = self._schedule(batch.input_ids, batch.attention_mask,
                                  lambda o, rows: fn(Outputs(o), batch.select(range(rows.start, rows.stop))),
                                  forward_only=True)
        return (torch.cat(outs).cpu(), mine) if self._answers else (None, mine)

    @stage_call
    def logprobs(self, rollout: Rollout, *, temperature: float = 1.0) -> TokenValues | None:
        self._check_tokens(rollout)
        lp, mine = self._forward(rollout, lambda m, b: response_logprobs(m, b, temperature))
        return TokenValues(lp, mine.mask) if lp is not None else None

    @stage_call
    def values(self, rollout: Rollout) -> TokenValues | None:
        self._check_tokens(rollout)
        v, mine = self._forward(rollout, lambda m, b: response_values(m, b))
        if v is None:
            return None
        check_finite(v, f"the value estimate of '{self.name}'", mask=mine.mask, prompts=mine.prompts)
        return TokenValues(v, mine.mask)

    def _score(self, rollout: Rollout) -> torch.Tensor | None:
        if rollout.tokenizer != self.tok_id:
            raise ValueError(f"reward model '{self.name}' under the megatron trainer scores rollouts of its own "
                             "tokenizer only")
        s, _ = self._forward(rollout, lambda m, b: sequence_scores(m, b))
        return s

    @stage_call
    def score(self, rollout: Rollout) -> torch.Tensor | None:
        s = self._score(rollout)
        return None if s is None else check_finite(s, f"the score of reward model '{self.name}'",
                                                   prompts=self._mine(rollout).prompts)

    # -- training --------------------------------------------------------------------------------
    def _train_epochs(self, *args, **kwargs) -> dict[str, float]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, group=self.ps.get_data_parallel_group())
            return t

        if self.dp > 1:
            kwargs.update(shard=(self.dp_rank, self.dp), reduce=reduce)
        self._fresh = False
        return loop.train_epochs(*args, backward=self._backward, clip=self._clip, **kwargs)

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

    # -- generation: rank 0 samples every row on the single-rank copy -----------------------------
    def _refresh(self, bucket_mb: int = GATHER_BUCKET_MB) -> tuple[int, int]:
        """Bring every rank's single-rank copy up to date (a collective; nothing to do when unchanged).
        Returns (bytes this rank received, buckets)."""
        if self._fresh:
            return 0, 0
        self.replica.load_state_dict(self._pieces(local_state(self.model), bucket_mb))
        self._fresh = True
        return self.gathered

    def reshard(self, bucket_mb: int) -> tuple[int, int]:
        """The plan's reshard stage: every rank gathers the full weights into its generation copy now."""
        return self._refresh(bucket_mb)

    @stage_call
    def generate(self, prompts: list[str], **kwargs):
        self._refresh()
        with _swapped(self):   # every rank decodes its share of the rows on its copy
            return split_generate(self, prompts, self.rank, self.world, **kwargs)

    @stage_call
    def generate_chunks(self, prompts: list[str], **kwargs):
        self._refresh()
        with _swapped(self):   # every rank starts and refits its engine from its copy (collectives)
            self.rollout_engine.prepare(kwargs.get("refit_mb", 64))
        if self.rank != 0:
            skip_draw(self)
            return
        with _swapped(self):
            yield from super().generate_chunks(prompts, **kwargs)

    # -- weights -----------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return self._pieces(local_state(self.model))

    def set_weights(self, weights: dict[str, torch.Tensor], version: int | None = None) -> int:
        self._load_full(weights)
        if version is not None:
            self.version = version
        return self.version

    def _state_items(self):
        return self.get_weights().items()

    def sync_export(self, bucket_mb: int) -> tuple[list, int, int]:
        if self.rank == 0:
            return super().sync_export(bucket_mb)   # its buckets gather the full tensors
        self.get_weights()                             # take part in the gather
        return [], self.version, 0

    def sync_import(self, bucket: dict) -> int:
        """Take one bucket of Hugging Face-layout tensors; once every tensor of the model has come, each rank
        keeps its pieces (the converter needs a layer's query, key and value together)."""
        self._incoming.update({k: torch.from_numpy(v.copy()) for k, v in bucket.items()})
        if self._incoming.keys() >= self._needed:
            self._load_full(self._incoming)
            self._incoming = {}
        return len(bucket)

    # -- checkpoints: Hugging Face layout, the single-rank model's optimizer order ------------------
    @property
    def _writes(self) -> bool:
        return self.rank == 0

    def _optimizer_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state in full, Hugging Face layout: {state key: {parameter name: tensor}} (a collective)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        per_key: dict[str, dict[str, torch.Tensor]] = {}
        for p, state in self.optimizer.state.items():
            for key, t in state.items():
                per_key.setdefault(key, {})[names[id(p)]] = t
        steps = [float(t) for t in per_key.get("step", {}).values()]   # a scalar per tensor: the same count everywhere
        out = {"step": {n: torch.tensor(steps[0] if steps else 0.0) for n in self.hf_params}}
        moments = [{n: per_key.get(k, {}).get(n, torch.zeros_like(p)) for n, p in self.model.named_parameters()}
                   for k in ("exp_avg", "exp_avg_sq")]
        out["exp_avg"], out["exp_avg_sq"] = self._pieces_of(moments)   # both moments in one gather
        return out

    def save(self, folder: str) -> None:
        weights = self.get_weights()
        tensors = {"rng.sample": self.sample_gen.get_state(), "rng.train": self.train_gen.get_state(),
                   "rng.torch": torch.get_rng_state()}
        meta: dict[str, Any] = {"version": self.version, "name": self.name, "optimizer": None}
        if self.optimizer is not None:
            state = self._optimizer_by_name()
            for index, name in enumerate(self.hf_params):
                for key, by_name in state.items():
                    tensors[f"opt.{index}.{key}"] = by_name[name].detach().cpu().contiguous()
            groups = [{k: v for k, v in g.items() if k != "params"} | {"params": list(range(len(self.hf_params)))}
                      for g in self.optimizer.state_dict()["param_groups"][:1]]
            meta["optimizer"] = {"param_groups": groups, "state_keys": {
                str(i): sorted(state) for i in range(len(self.hf_params))}}
        self._write_files(folder, {k: v.contiguous() for k, v in weights.items()}, tensors, meta)
        dist.barrier()   # the checkpoint is complete on disk when any rank returns

    def load(self, folder: str) -> int:
        tensors, meta = self._read_files(folder)
        opt = meta.get("optimizer")
        if opt is not None:
            groups = self._optimizer_from(opt)
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
                {**groups[0], "params": g["params"]} for g in mine]})
        self._fresh = False
        return self.version


class _swapped:
    """Run the single-rank generation code on the replica, then put the megatron model back."""

    def __init__(self, worker: MegatronWorker):
        self.worker = worker

    def __enter__(self):
        self.saved, self.worker.model = self.worker.model, self.worker.replica

    def __exit__(self, *exc):
        self.worker.model = self.saved
