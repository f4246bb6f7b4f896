"""The Ray actor that hosts one model: generation, forwards, training, weights, checkpoints.

A job creates one ``ModelWorker`` per (model, placement) with
``ray.remote(...)(ModelWorker)``; the class itself is plain Python so tests can
use it in-process. All randomness comes from two ``torch.Generator``s seeded
from the run seed and the model name (sampling, minibatch shuffling), whose
states are checkpointed, so runs are reproducible and resumable.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhfc.runtime.data.prompts import prompt_parts
from rlhfc.runtime.data.tokenizer import load_tokenizer
from rlhfc.runtime.data.values import CarryOver, PolicyLossInput, Rollout, TokenValues, ValueLossInput
from rlhfc.runtime.models.build import build_model, copy_weights, get_weights, set_weights
from rlhfc.runtime.models.precision import autocast, under_autocast
from rlhfc.runtime.models.recompute import apply_recompute
from rlhfc.runtime.rl.guards import NonFiniteError, check_finite
from rlhfc.runtime.rollout.base import build_rollout
from rlhfc.runtime.rollout.generation import (
    FinishedSample,
    PartialSample,
    collate,
    decode_responses,
    encode_prompts,
    response_logprobs,
    response_values,
    sequence_scores,
)
from rlhfc.runtime.train import loop
from rlhfc.runtime.train.packing import bucketed

from .allocator import retain_freed_memory, retaining
from .collective import GROUP_TIMEOUT_S, CollectiveSync  # noqa: F401 - GROUP_TIMEOUT_S re-exported
from .stages import stage_call
from .trace import TracedWorker


def derive_seed(seed: int, *parts: str) -> int:
    """A stable 31-bit seed from the run seed and names (same on every machine and Python)."""
    return zlib.crc32(":".join([str(seed), *parts]).encode()) & 0x7FFFFFFF


def tokenizer_id(spec: dict) -> str:
    return f"hf:{spec['source']}" if spec.get("source") else f"char:{spec['vocab']}"


class ModelWorker(CollectiveSync, TracedWorker):
    """Hosts model ``name`` built from ``spec``.

    ``init``: ``{"kind": "random"}``, ``{"kind": "pretrained"}`` (``spec["source"]``) or
    ``{"kind": "copy", "from": NAME, "spec": SRC_SPEC}`` — start from the initial
    weights of model NAME (built here from the same seed, so no transfer is needed).
    ``precision``: ``"fp32"``, or ``"bf16"`` — generation, forwards and the loss's forward run under bf16
    autocast; the weights, gradients and optimizer state stay as built (float32).
    ``rollout``: the engine of its generate calls and its options — ``{"engine": "torch"}`` (rlhfc's decode
    loop, the default) or another registered engine (:mod:`rlhfc.runtime.rollout.base`), e.g. ``{"engine": "vllm",
    "folder": DIR}``: a vLLM engine this worker starts at its first generate, in ``DIR/<name>``, refitted
    before a generate whenever the worker's weights version moved on.
    """

    def __init__(self, name: str, spec: dict, init: dict, seed: int, threads: int = 1, device: str = "cpu",
                 cores: list[int] | None = None, precision: str = "fp32", rollout: dict | None = None):
        if cores and device == "cpu" and hasattr(os, "sched_setaffinity") and max(cores) < (os.cpu_count() or 1):
            os.sched_setaffinity(0, set(cores))   # honour the plan's placement: this worker's CPU cores
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if device == "cpu":
            retain_freed_memory()   # freed activations stay for the next step: no page faults every step
        torch.set_num_threads(max(1, int(threads)))
        self.threads = max(1, int(threads))   # a call may ask for fewer (threads=N): cores follow the work
        torch.manual_seed(derive_seed(seed, name, "global"))
        self.name = name
        self.device = device
        self.spec = spec
        self.precision = precision
        autocast(device, precision)   # a precision it does not know is a ValueError here
        if init.get("kind") == "copy":
            src_name = init["from"]
            src = build_model(init["spec"], seed=derive_seed(seed, src_name, "init"), device=device)
            self.model = build_model(spec, seed=derive_seed(seed, name, "init"), device=device)
            copy_weights(src, self.model)
            del src
        else:
            self.model = build_model(spec, seed=derive_seed(seed, name, "init"), device=device)
        apply_recompute(self.model, spec.get("recompute"))   # the plan's activation recomputation (training only)
        self.tokenizer = load_tokenizer(self.model.spec)
        self.tok_id = tokenizer_id(self.model.spec)
        self.sample_gen = torch.Generator().manual_seed(derive_seed(seed, name, "sample"))
        self.train_gen = torch.Generator().manual_seed(derive_seed(seed, name, "train"))
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0
        self._stores: dict[str, Any] = {}    # collective sync: rendezvous stores this worker hosts, by key
        self._groups: dict[str, Any] = {}    # collective sync: two-rank process groups, by key
        self.rollout = dict(rollout or {"engine": "torch"})
        self.seed = seed
        self.rollout_engine = build_rollout(self.rollout, self)   # what decodes its generate calls
        self.engine_stats: dict[str, float] = {}   # its start/refit statistics, reported with the next rollout

    # -- bookkeeping ---------------------------------------------------------------------------
    def ready(self) -> dict:
        import ray

        return {"name": self.name, "params": sum(p.numel() for p in self.model.parameters()), "pid": os.getpid(),
                "threads": torch.get_num_threads(), "device": self.device, "cores": self.cores,
                "precision": self.precision, "allocator": "retain" if retaining() else "default",
                "node": ray.get_runtime_context().get_node_id()}

    def get_version(self) -> int:
        return self.version

    def _autocast(self):
        """The arithmetic of this worker's forwards (:mod:`rlhfc.runtime.models.precision`)."""
        return autocast(self.device, self.precision)

    def _check_tokens(self, rollout: Rollout) -> None:
        if rollout.tokenizer != self.tok_id:
            raise ValueError(f"model '{self.name}' uses tokenizer {self.tok_id} but the rollout was made with "
                             f"{rollout.tokenizer}; per-token stages need models that share a tokenizer")

    # -- stages --------------------------------------------------------------------------------
    @stage_call
    @torch.no_grad()
    def generate(self, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float,
                 n: int = 1, unpad: bool = False, logprobs: bool = False, chat: bool = False,
                 slots: int | None = None, refit_mb: int = 64) -> Rollout:
        """Generate one rollout; ``unpad``: as wide as its longest response instead of ``max_new_tokens``;
        ``logprobs``: also keep the sampled tokens' log-probs (``Rollout.logprobs``, the ``reuse_logprobs``
        pass); ``chat``: each prompt as a user turn in the tokenizer's chat template; ``slots``: at most that
        many rows decode at once, waiting prompts joining as rows finish (continuous batching; the plan's
        micro-batches of generation); ``refit_mb``: the vLLM engine's refit bucket size (rollout = vllm)."""
        return next(iter(self._generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                        top_p=top_p, n=n, chunk=0, unpad=unpad, logprobs=logprobs, chat=chat,
                                        slots=slots, refit_mb=refit_mb)))

    @stage_call
    def generate_chunks(self, prompts: list[str], *, chunk: int, max_new_tokens: int, temperature: float,
                        top_p: float, n: int = 1, take: int | None = None, carry: list[dict] | None = None,
                        unpad: bool = False, logprobs: bool = False, chat: bool = False, slots: int | None = None,
                        refit_mb: int = 64):
        """Streaming generation (a Ray streaming generator): yield Rollout chunks of ``chunk`` finished
        samples as they finish; with ``take``, stop once ``take`` samples are done and finally yield a
        :class:`CarryOver` with the unfinished ones (their partial tokens kept). ``unpad``: each chunk is
        as wide as its own longest response (the ``unpad`` pass) instead of ``max_new_tokens``;
        ``logprobs``: as in :meth:`generate`."""
        with torch.no_grad():
            yield from self._generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                      top_p=top_p, n=n, chunk=chunk, take=take, carry=carry or [], unpad=unpad,
                                      logprobs=logprobs, chat=chat, slots=slots, refit_mb=refit_mb)

    def _inputs(self, prompts, n: int, carry=(), chat: bool = False) -> list[dict]:
        """What a generation call decodes: carried partial samples first, then ``n`` samples per prompt
        (``chat``: its tokens are the prompt as a user turn of the chat template)."""
        parts = [prompt_parts(p) for p in prompts for _ in range(n)]
        texts = [t for t, _ in parts]
        ids = [self.tokenizer.encode_chat(t) for t in texts] if chat else encode_prompts(self.tokenizer, texts)
        return [dict(c) for c in carry] + [
            {"prompt": t, "prompt_ids": i, "partial": [], "born": self.version, "fields": f}
            for (t, f), i in zip(parts, ids)]

    def _decode(self, inputs: list[dict], *, max_new_tokens, temperature, top_p, take=None, logprobs=False,
                carry=False, share: tuple[int, int] | None = None, slots: int | None = None, refit_mb: int = 64):
        """Decode ``inputs`` (or only rows [lo, hi) of them: ``share``); yield a :class:`FinishedSample` (its
        ``index`` the row in ``inputs``, its response including a carried part) as each finishes, or, once
        ``take`` samples are done, a carry dict for each unfinished one. Row ``i`` samples from the random
        stream keyed ``base + i`` (``base`` one draw from this worker's sampling generator), so a share of the
        rows decodes the tokens the whole batch would."""
        base = int(torch.randint(0, 2**62, (1,), generator=self.sample_gen))
        lo, hi = share or (0, len(inputs))
        mine = inputs[lo:hi]
        rows = [list(c["prompt_ids"]) + list(c["partial"]) for c in mine]
        kw = dict(eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, temperature=temperature, top_p=top_p,
                  budgets=[max_new_tokens - len(c["partial"]) for c in mine] if carry else None,
                  stop_after=take, logprob_temperature=temperature if logprobs else None,
                  resumed=[len(c["partial"]) for c in mine], row_keys=list(range(base + lo, base + hi)), slots=slots)
        stream = self.rollout_engine.stream(self.model, rows, max_new_tokens, refit_mb=refit_mb, **kw)
        for item in under_autocast(stream, self.device, self.precision):
            c = inputs[lo + item.index]
            response = tuple(c["partial"]) + tuple(item.response_ids)
            if isinstance(item, PartialSample):
                yield {**c, "partial": list(response)}
                continue
            yield FinishedSample(lo + item.index, tuple(c["prompt_ids"]), response, item.eos, item.step, item.logprobs,
                                 item.computed)

    def _generate(self, prompts, *, max_new_tokens, temperature, top_p, n, chunk, take=None, carry=(),
                  unpad=False, logprobs=False, chat=False, slots=None, refit_mb=64):
        inputs = self._inputs(prompts, n, carry, chat)
        logprobs = logprobs or not self.rollout_engine.traits.trainer_numerics   # the behaviour policy's
        width_p = max(len(c["prompt_ids"]) for c in inputs)
        buf: list[FinishedSample] = []
        left: list[dict] = []
        size = chunk if chunk > 0 else len(inputs)
        width_r = None if unpad else max_new_tokens
        done = 0
        for item in self._decode(inputs, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 take=take, logprobs=logprobs, carry=bool(carry), slots=slots, refit_mb=refit_mb):
            if isinstance(item, dict):
                left.append(item)
                continue
            if take is not None and done == take:
                # more rows finished in the decoding step that brought the take-th: the step trains on
                # exactly `take`, so these (the later rows) are carried, cut before their last token,
                # which they sample again under the next step's weights
                left.append({**inputs[item.index], "partial": list(item.response_ids[:-1])})
                continue
            done += 1
            buf.append(item)
            if len(buf) == size:
                yield self._rollout(buf, inputs, width_p, width_r, logprobs)
                buf = []
        if buf:
            yield self._rollout(buf, inputs, width_p, width_r, logprobs)
        if take is not None:
            yield CarryOver(left)

    def _rollout(self, samples, inputs, width_p: int, width_r: int | None, with_logprobs: bool = False) -> Rollout:
        samples = sorted(samples, key=lambda x: x.index)
        batch = collate(samples, self.tokenizer.pad_id, prompt_len=width_p, response_width=width_r)
        rows = [s.index for s in samples]
        logprobs = None
        if with_logprobs:
            logprobs = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
            for row, s in enumerate(samples):
                logprobs[row, :len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
        return Rollout(batch, [inputs[i]["prompt"] for i in rows], decode_responses(self.tokenizer, batch),
                       self.name, self.version, self.tok_id, rows, [inputs[i]["born"] for i in rows],
                       max(s.step for s in samples) + 1, logprobs, unpad=width_r is None,
                       computed_tokens=sum(s.computed for s in samples),
                       fields=[inputs[i].get("fields") or {} for i in rows], engine=self._take_engine_stats(),
                       rollout_engine=self.rollout_engine.name)

    def _take_engine_stats(self) -> dict[str, float]:
        """The rollout engine's statistics since the last rollout (the first chunk of a stream carries them)."""
        stats, self.engine_stats = self.engine_stats, {}
        return stats

    #: whether forwards and training of unpadded rollouts run in length groups (every rank of an FSDP group
    #: must run the same number of forwards, so its ranks do not)
    _pack = True

    def _run_forward(self, fn, rollout: Rollout) -> torch.Tensor:
        """``fn(batch)`` on the rollout; under ``unpad``, in groups of rows of similar length
        (:func:`rlhfc.runtime.train.packing.bucketed`: computed tokens follow the real ones)."""
        batch = rollout.batch.to(self.device)
        with self._autocast():
            out = bucketed(fn, batch) if rollout.unpad and self._pack else fn(batch)
        return out.cpu()

    @stage_call
    @torch.no_grad()
    def logprobs(self, rollout: Rollout, *, temperature: float = 1.0) -> TokenValues:
        self._check_tokens(rollout)
        lp = self._run_forward(lambda b: response_logprobs(self.model, b, temperature), rollout)
        return TokenValues(lp, rollout.mask)

    @stage_call
    @torch.no_grad()
    def values(self, rollout: Rollout) -> TokenValues:
        self._check_tokens(rollout)
        values = self._run_forward(lambda b: response_values(self.model, b), rollout)
        check_finite(values, f"the value estimate of '{self.name}'", mask=rollout.mask, prompts=rollout.prompts)
        return TokenValues(values, rollout.mask)

    @stage_call
    @torch.no_grad()
    def score(self, rollout: Rollout) -> torch.Tensor:
        return check_finite(self._score(rollout), f"the score of reward model '{self.name}'", prompts=rollout.prompts)

    def _score(self, rollout: Rollout) -> torch.Tensor:
        if rollout.tokenizer == self.tok_id:
            return self._run_forward(lambda b: sequence_scores(self.model, b), rollout)
        # a reward model with its own tokenizer scores the text
        ids = encode_prompts(self.tokenizer, [p + r for p, r in zip(rollout.prompts, rollout.responses)])
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, x in enumerate(ids):
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        with self._autocast():
            return self.model.score(input_ids.to(self.device), mask.to(self.device)).cpu()

    @stage_call
    def train(self, loss: PolicyLossInput | ValueLossInput, *, lr: float, epochs: int, minibatches: int,
              max_grad_norm: float, weight_decay: float, unpad: bool = False, lr_schedule: str = "constant",
              warmup_steps: int = 0, total_steps: int = 0, micro_batch: int = 0) -> dict[str, float]:
        """PPO/value updates on ``loss``; ``unpad``: each minibatch drops the response columns that are
        padding in all of its rows (the ``unpad`` pass). A non-finite loss or gradient stops it before the
        optimizer step (:class:`NonFiniteError`); ``minibatches`` may not exceed the samples of the batch.
        The lr of this call is ``lr`` times the schedule's factor at train step ``self.version``
        (:func:`rlhfc.runtime.rl.algorithms.lr_factor`), so a resumed run continues the same sequence."""
        from rlhfc.runtime.rl.algorithms import lr_factor

        if self.optimizer is None:
            self.optimizer = self._make_optimizer(lr=lr, weight_decay=weight_decay)
        step_lr = lr * lr_factor(self.version, lr_schedule, warmup_steps, total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = step_lr
        self._check_tokens(loss.rollout)
        batch: dict[str, Any] = loss.rollout.batch.to(self.device).as_dict()
        if isinstance(loss, PolicyLossInput):
            if loss.stats and loss.rollout.size == 0:   # dynamic sampling left nothing to learn from
                self.version += 1
                return {**loss.stats, "lr": step_lr, "version": float(self.version)}
            minibatches = min(minibatches, loss.rollout.size) if loss.stats else minibatches
            batch["old_logp"] = loss.old_logp.to(self.device)
            batch["advantages"] = loss.advantages.to(self.device)
            batch["loss_agg"] = loss.loss_agg
            if loss.ref_logp is not None:
                batch["ref_logp"] = loss.ref_logp.to(self.device)
            fn = loop.actor_loss_fn(clip=loss.clip, clip_high=loss.clip_high, temperature=loss.temperature,
                                   entropy_coef=loss.entropy_coef,
                                   kl_coef=loss.kl_coef if loss.ref_logp is not None else 0.0,
                                   kl_estimator=loss.estimator, loss_agg=loss.loss_agg, ratio_level=loss.ratio)
        else:
            batch["old_values"] = loss.old_values.to(self.device)
            batch["returns"] = loss.returns.to(self.device)
            fn = loop.critic_loss_fn(clip=loss.clip)
        if minibatches > loss.rollout.size:
            raise ValueError(f"minibatches ({minibatches}) is more than the {loss.rollout.size} samples of the batch "
                             f"'{self.name}' trains on")
        kind = "policy" if isinstance(loss, PolicyLossInput) else "value"

        def guarded(model, mb):
            with self._autocast():   # the loss's forward; backward and the optimizer step run as built
                out, stats = fn(model, mb)
            if not bool(torch.isfinite(out.detach()).all()):
                raise NonFiniteError(f"the {kind} loss of '{self.name}' is {float(out.detach())} on a minibatch; the "
                                     "run stops before the optimizer step (nothing of this step is checkpointed)")
            return out, stats

        metrics = self._train_epochs(self.model, self.optimizer, batch, guarded, epochs=epochs, minibatches=minibatches,
                                     max_grad_norm=max_grad_norm or None, generator=self.train_gen, unpad=unpad,
                                     pack=self._pack, micro_batch=micro_batch)
        self.version += 1
        metrics.update(getattr(loss, "stats", {}), lr=step_lr, version=float(self.version))
        return metrics

    def _train_epochs(self, *args, **kwargs) -> dict[str, float]:
        """The training loop (a data-parallel rank runs its share: rlhfc.runtime.worker.fsdp)."""
        return loop.train_epochs(*args, **kwargs)

    def _make_optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW that refuses to step on a non-finite gradient (checked after clipping, which turns a
        non-finite norm into NaN gradients), so a bad minibatch never reaches the weights."""
        opt = loop.make_optimizer(self.model, lr=lr, weight_decay=weight_decay)
        name = self.name

        def finite_grads(optimizer, args, kwargs):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                local = [x.to_local() if hasattr(x, "to_local") else x for x in grads]   # sharded: this rank's part
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x.detach()) for x in local]))
                if not bool(torch.isfinite(norm)):
                    raise NonFiniteError(f"the gradient norm of '{name}' is {float(norm)}; the run stops before the "
                                         "optimizer step (nothing of this step is checkpointed)")

        opt.register_step_pre_hook(finite_grads)
        return opt

    # -- weights ---------------------------------------------------------------------------------
    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in get_weights(self.model).items()}

    def set_weights(self, weights: dict[str, torch.Tensor], version: int | None = None) -> int:
        set_weights(self.model, weights)
        if version is not None:
            self.version = version
        return self.version

    def sync_export(self, bucket_mb: int) -> tuple[list, int, int]:
        """Put the weights into the object store in buckets of about ``bucket_mb`` MiB (numpy arrays:
        zero-copy for the receiver). Returns (bucket refs, weights version, total bytes)."""
        import ray

        refs, total = [], 0
        for bucket in self._buckets(bucket_mb):
            arrays = {name: t.detach().to("cpu", copy=True).contiguous().numpy() for name, t in bucket}
            refs.append(ray.put(arrays))
            total += sum(a.nbytes for a in arrays.values())
        return refs, self.version, total

    def sync_import(self, bucket: dict) -> int:
        """Load one bucket of weights (exact copies) into this worker's model."""
        import warnings

        current = self.model.state_dict()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read only
            for name, array in bucket.items():
                current[name].copy_(torch.from_numpy(array))
        return len(bucket)

    def reshard(self, bucket_mb: int) -> tuple[int, int]:
        """Gather the training layout into the generation layout: one rank holds the whole model already."""
        return 0, 0

    def set_version(self, version: int) -> int:
        self.version = int(version)
        return self.version

    def _state_items(self):
        """The model's tensors in state-dict order (a data-parallel rank gathers them in full)."""
        return self.model.state_dict().items()

    # -- checkpoints (safetensors + JSON only: loading never unpickles) ----------------------------
    #: whether this worker writes the checkpoint files (one rank of a data-parallel group does)
    _writes = True

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of the optimizer state in full (a data-parallel rank gathers its shards)."""
        return tensor

    def _placed(self, index: int, full: torch.Tensor) -> torch.Tensor:
        """Optimizer state of parameter ``index`` loaded in full, as this worker holds it."""
        return full

    def save(self, folder: str) -> None:
        weights = {k: v.contiguous() for k, v in self.get_weights().items()}
        tensors = {"rng.sample": self.sample_gen.get_state(), "rng.train": self.train_gen.get_state(),
                   "rng.torch": torch.get_rng_state()}
        meta: dict[str, Any] = {"version": self.version, "name": self.name, "optimizer": None}
        if self.optimizer is not None:
            sd = self.optimizer.state_dict()
            for idx, state in sd["state"].items():
                for key, t in state.items():
                    tensors[f"opt.{idx}.{key}"] = self._full(torch.as_tensor(t)).detach().cpu().contiguous()
            meta["optimizer"] = {"param_groups": sd["param_groups"], "state_keys": {
                str(i): sorted(s.keys()) for i, s in sd["state"].items()}}
        self._write_files(folder, weights, tensors, meta)

    def _write_files(self, folder: str, weights: dict, tensors: dict, meta: dict) -> None:
        """The checkpoint's three files (on the rank that writes them)."""
        if not self._writes:
            return
        os.makedirs(folder, exist_ok=True)
        save_file(weights, os.path.join(folder, "weights.safetensors"))
        save_file(tensors, os.path.join(folder, "state.safetensors"))
        with open(os.path.join(folder, "state.json"), "w") as fh:
            json.dump(meta, fh)

    def _read_files(self, folder: str) -> tuple[dict, dict]:
        """Load a checkpoint's weights, random states and version; return its (tensors, meta) for the
        optimizer state."""
        self.set_weights(load_file(os.path.join(folder, "weights.safetensors")))
        tensors = load_file(os.path.join(folder, "state.safetensors"))
        with open(os.path.join(folder, "state.json")) as fh:
            meta = json.load(fh)
        self.sample_gen.set_state(tensors["rng.sample"])
        self.train_gen.set_state(tensors["rng.train"])
        torch.set_rng_state(tensors["rng.torch"])
        self.version = int(meta["version"])
        return tensors, meta

    def _optimizer_from(self, opt: dict) -> list[dict]:
        """A fresh optimizer with a checkpoint's hyper-parameters (its ``optimizer`` entry); its param groups."""
        groups = opt["param_groups"]
        self.optimizer = self._make_optimizer(lr=groups[0]["lr"], weight_decay=groups[0].get("weight_decay", 0.0))
        return groups

    def load(self, folder: str) -> int:
        tensors, meta = self._read_files(folder)
        opt = meta.get("optimizer")
        if opt is not None:
            groups = self._optimizer_from(opt)
            state = {int(i): {k: self._placed(int(i), tensors[f"opt.{i}.{k}"]) for k in keys}
                     for i, keys in opt["state_keys"].items()}
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        return self.version
