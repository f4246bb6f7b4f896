"""The vLLM rollout engine (``run { rollout = vllm }``): a ``vllm.LLM`` owned by the generating model's worker.

Same weights, no hub: the engine starts from the worker's own model — its Hugging Face module written once
with ``save_pretrained`` into ``<run folder>/vllm/<model>/hf`` (the seeded initial weights, or those of the
model's local folder) — and vLLM's files (compile caches, temporary files) stay under that folder too.
The engine runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so its model is reachable
for refit; on CPU with ``enforce_eager`` (no compilation), in the model's dtype.

Refit (:meth:`VllmEngine.refit`): the trainer's parameters go into the running engine in buckets of about
``bucket_mb`` MiB, in memory, through vLLM's own weight loader (``model.load_weights`` on an iterator of
``(Hugging Face name, tensor)`` pairs, which fuses q/k/v and gate/up as vLLM lays them out) — no
safetensors round trip on disk.

A group of ranks (``trainer = fsdp`` or ``megatron``): every rank owns an engine of the whole model. The
ranks' ``torch.distributed`` world is already up, so the engine starts with vLLM's ``external_launcher``
backend, which adopts that world (``RANK``/``LOCAL_RANK`` set from the rank) instead of starting its own;
with tensor and pipeline size 1 vLLM lays the world out as that many independent engines. The start is a
collective (vLLM builds its process groups over the world), so every rank starts its engine in the same
call. Rank 0 writes only the model's config; the engines start on vLLM's placeholder weights and are
refitted with the trainer's before they generate: an FSDP2 rank gathers each parameter (``full_tensor``)
into the current bucket, a megatron rank refits from its gathered single-rank copy. Each rank then decodes
its share of the rows (:meth:`rlhfc.runtime.worker.base.ModelWorker.generate`), seeded from its own rows' keys.

Generation (:meth:`VllmEngine.stream`) has the contract of :func:`rlhfc.runtime.rollout.decoding.generate_stream`:
one :class:`FinishedSample` per row as vLLM finishes it (per-request outputs of the engine's step loop, so
the ``stream`` pass's chunks leave as requests complete), and with ``stop_after`` the unfinished requests
aborted once that many are done, each returned as a :class:`PartialSample` with its tokens so far (the
``overcommit`` pass carries them; resumed, the partial response is part of the prompt).

Seeding, one per batch: the requests go in unseeded, and every engine step of the call samples from a
generator state of its own, seeded once from the batch's key (:func:`batch_seed` of its row keys) and
swapped in as the process's default generator around each step (vLLM samples unseeded requests from the
default generator: on CPU one draw per row of the persistent batch). A seed per request instead makes vLLM
draw each request's noise from its own generator at every step, and on CUDA turns off its FlashInfer
sampler (docs/benchmarks.md: on this CPU the cost could not be told from noise). The tokens of a call
follow from its rows, in order, and its key — not from what the engine generated before (each call starts on
an empty persistent batch, so its rows take slots 0.. in order, as in a fresh engine) — so a run is
reproducible and a resumed step (same rows, carried partial samples first, same key from the checkpointed
sampling generator) regenerates the uninterrupted run's tokens. Unlike the torch engine's per-row streams,
a row's tokens depend on the other rows of its call: the same prompts split into other calls (another
generation layout: a group of another size, a streamed call that rank 0 decodes alone) sample other
tokens, which no exactness guarantee of rlhfc compares across layouts on vLLM.
``seeds`` (one per row, vLLM's per-request generators) remains for a caller that needs rows independent.
The log-prob of each sampled token is vLLM's (``processed_logprobs``: log-softmax of logits / T — what the
sampler drew from); a resumed row's carried tokens get vLLM's prompt log-probs (temperature 1).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Iterator, Sequence

import torch

from .base import RolloutEngine
from .decoding import FinishedSample, PartialSample

__all__ = ["VllmEngine", "VllmRollout", "EngineError", "engine_env", "batch_seed", "INSTALL_HINT"]

#: how to install vLLM (the ``[vllm]`` extra; the README has the CUDA install)
INSTALL_HINT = "install the extra: pip install -c constraints.txt -e '.[vllm]'"


def batch_seed(keys: Sequence[int]) -> int:
    """One 63-bit seed for a call's rows from their keys, in order (stable across machines and Pythons)."""
    digest = hashlib.blake2b(",".join(str(int(k)) for k in keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EngineError(RuntimeError):
    """The vLLM engine of a model failed, stopped, or cannot start; the message names the model."""


#: where engines keep their compile caches (vLLM's, TorchInductor's: the kernels and precompiled headers an
#: engine's start builds, about half a minute on a 2-core CPU) when it is set, shared by every engine and run
#: that sets it, instead of each engine's own folder: ``RLHFC_VLLM_CACHE=~/.cache/rlhfc-vllm rlhfc run ...``
#: (the driver's value, forwarded to the workers: the engine's ``driver_env`` in rlhfc.contract.engines)
SHARED_CACHE_ENV = "RLHFC_VLLM_CACHE"


def engine_env(folder: str, shared: str | None = None) -> None:
    """Point vLLM's files into ``folder`` and run its engine in this process (before ``import vllm``); the
    compile caches go to the folder ``shared`` instead where it is not empty — in a job the driver's
    ``$RLHFC_VLLM_CACHE`` (:data:`SHARED_CACHE_ENV`), passed with the worker's rollout options since a Ray
    worker's environment is the one its Ray started with; None: this process's own ``$RLHFC_VLLM_CACHE``."""
    shared = os.environ.get(SHARED_CACHE_ENV) if shared is None else shared
    for key, sub in (("VLLM_CACHE_ROOT", "cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TMPDIR", "tmp")):
        where = os.path.join(shared, sub) if shared and key != "TMPDIR" else os.path.join(folder, sub)
        os.makedirs(where, exist_ok=True)
        os.environ[key] = where
    # Python caches its temp folder at the first tempfile call, before TMPDIR changed: vLLM's own temp files
    # (e.g. its file:// rendezvous, vllm_dist_*) would land in /tmp, outside the run folder
    tempfile.tempdir = os.environ["TMPDIR"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process: refit reaches it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # its chat-template warm-up warns without a tokenizer
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB of KV cache on CPU (vLLM's default is larger)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # the worker already holds its cores


class VllmEngine:
    """A vLLM engine for ``model`` (a :class:`~rlhfc.runtime.models.build.PolicyModel`) of worker ``name``.

    ``version``: the trainer version of the weights the engine holds (the worker refits when its own is newer).
    ``max_seqs``: requests decoded at once (vLLM's continuous batching; None = vLLM's default).
    ``gpu_memory``: on CUDA, vLLM's ``gpu_memory_utilization`` (the plan's; None: vLLM's default).
    ``rank``: (rank, world) of the worker's group, whose ``torch.distributed`` world is up: the engine joins it
    (a collective; :func:`_rank_options`) and starts at version -1, to be refitted before it generates.
    ``shared_cache``: the compile caches' folder (:func:`engine_env`)."""

    def __init__(self, model, folder: str, *, name: str, seed: int, device: str = "cpu",
                 max_seqs: int | None = None, version: int = 0, rank: tuple[int, int] | None = None,
                 gpu_memory: float | None = None, shared_cache: str | None = None):
        self.name, self.folder, self.version, self.calls, self.device = name, folder, version, 0, device
        engine_env(folder, shared_cache)
        hf_dir = os.path.join(folder, "hf")
        options = {"max_num_seqs": max_seqs} if max_seqs else {}
        if rank is not None:   # a rank of a group: vLLM joins the group's world (the module docstring)
            options.update(_rank_options(model, hf_dir, *rank, device))
            self.version = -1   # started on placeholder weights: the first refit brings the trainer's
        elif not os.path.isfile(os.path.join(hf_dir, "config.json")):
            model.hf.save_pretrained(hf_dir)   # once: the same seeded weights the trainer starts from
        try:
            from vllm import LLM
        except ImportError as exc:
            raise EngineError(f"model '{name}' generates under rollout = vllm, but vLLM cannot be imported "
                              f"({exc}); {INSTALL_HINT}") from exc
        threads = torch.get_num_threads()
        set_threads = torch.set_num_threads
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        #: on CUDA the engine sleeps between generate calls (its KV cache freed, weights offloaded to host
        #: memory) while the co-located trainer trains: vLLM's sleep mode (CUDA only; untested here)
        self.sleeps, self.asleep = device.startswith("cuda"), False
        if self.sleeps:
            options["enable_sleep_mode"] = True
            if gpu_memory:   # the share the compiler priced (a co-located trainer keeps the rest), not vLLM's 0.9
                options["gpu_memory_utilization"] = float(gpu_memory)
        try:
            self.llm = LLM(model=hf_dir, skip_tokenizer_init=True, enforce_eager=device == "cpu", dtype=dtype,
                           seed=seed, generation_config="vllm", enable_prefix_caching=False,
                           logprobs_mode="processed_logprobs", **options)
        except Exception as exc:
            raise EngineError(f"the vLLM engine of model '{name}' did not start: {type(exc).__name__}: {exc}") from exc
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process (it binds its
            # OpenMP threads to cores; rlhfc starts it with VLLM_CPU_OMP_THREADS_BIND=nobind, so nothing is
            # bound): put the real one back, or the worker's per-call thread counts and this restore would
            # silently do nothing once an engine has started
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)   # vLLM lowers the process's torch threads for serving

    # -- weights -----------------------------------------------------------------------------------
    def refit(self, model, version: int, bucket_mb: int = 64) -> dict[str, float]:
        """Load ``model``'s parameters into the engine in buckets of about ``bucket_mb`` MiB; returns
        ``refit_s`` (seconds), ``refit_mb`` (MiB moved) and ``refit_buckets``.

        One reload session of vLLM's layerwise in-place reload (what its ``reload_weights`` does for a
        single iterator): the engine's layers are reset, each bucket goes through the model's
        ``load_weights`` (checkpoint names; a layer is processed into its kernel layout once all its
        tensors arrived), and the session is finalised. An FSDP2-sharded model's parameters are gathered
        one by one (``full_tensor``: a collective, in the same order on every rank of its group), so a rank
        holds one bucket of full tensors at a time, never a second full copy of the model."""
        start, total, buckets = time.perf_counter(), 0, 0
        limit = max(1, int(bucket_mb)) * 2**20
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        self._rpc("refit", _reload_begin)
        for name, p in model.hf.named_parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t   # an FSDP2 shard: gathered (a collective)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= limit:
                self._rpc("refit", _reload_bucket, bucket)
                total, buckets, bucket, size = total + size, buckets + 1, [], 0
        if bucket:
            self._rpc("refit", _reload_bucket, bucket)
            total, buckets = total + size, buckets + 1
        self._rpc("refit", _reload_end)
        self.version = int(version)
        return {"refit_s": time.perf_counter() - start, "refit_mb": total / 2**20, "refit_buckets": float(buckets)}

    # -- sleep mode (CUDA) --------------------------------------------------------------------------
    def sleep(self) -> float:
        """After a generate call, on CUDA: free the KV cache and offload the weights to host memory (vLLM's
        sleep level 1) so the trainer has the device's memory; a no-op on CPU. Returns the seconds it took."""
        if not self.sleeps or self.asleep or self.llm is None:
            return 0.0
        start = time.perf_counter()
        self._call("sleep", lambda: self.llm.sleep(level=1))
        self.asleep = True
        return time.perf_counter() - start

    def wake_up(self) -> float:
        """Before a refit or generate call: the weights back on the device and the KV cache reallocated."""
        if not self.asleep:
            return 0.0
        start = time.perf_counter()
        self._call("wake_up", self.llm.wake_up)
        self.asleep = False
        return time.perf_counter() - start

    def _rpc(self, what: str, fn, *args):
        """``fn(vllm_worker, *args)`` on the engine's worker (in this process: tensors are not copied)."""
        return self._call(what, lambda: self.llm.collective_rpc(fn, args=args))

    def _call(self, what: str, fn):
        if self.llm is None:
            raise EngineError(f"the vLLM engine of model '{self.name}' is not running (it was shut down); "
                              f"{what} needs it")
        try:
            return fn()
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"the vLLM engine of model '{self.name}' failed during {what}: "
                              f"{type(exc).__name__}: {exc}") from exc

    # -- generation --------------------------------------------------------------------------------
    def stream(self, rows: Sequence[Sequence[int]], budgets: Sequence[int], *, eos_id: int, temperature: float,
               top_p: float, seed: int | None = None, seeds: Sequence[int] | None = None,
               stop_after: int | None = None, logprobs: bool = False,
               resumed: Sequence[int] | None = None) -> Iterator[FinishedSample | PartialSample]:
        """Generate up to ``budgets[i]`` tokens after each row (prompt, and a carried partial response of
        ``resumed[i]`` tokens); yield samples as they finish (:mod:`module docstring <rlhfc.runtime.rollout.vllm>`).
        ``seed``: the call's one seed (unseeded requests); else ``seeds``: one per row."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        resumed = list(resumed or [0] * len(rows))
        engine, call = self.llm.llm_engine if self.llm is not None else None, self.calls
        self.calls += 1
        ids = [f"{call}-{i}" for i in range(len(rows))]
        # each request's output once, when it finishes; under stop_after (overcommit) its tokens every step,
        # for those aborted unfinished (vLLM returns nothing for an aborted request)
        kind = RequestOutputKind.DELTA if stop_after is not None else RequestOutputKind.FINAL_ONLY
        for i, row in enumerate(rows):
            params = SamplingParams(n=1, temperature=float(temperature), top_p=float(top_p),
                                    max_tokens=int(budgets[i]), stop_token_ids=[int(eos_id)],
                                    seed=None if seeds is None else int(seeds[i]),
                                    logprobs=0 if logprobs else None,
                                    prompt_logprobs=0 if logprobs and resumed[i] else None, detokenize=False,
                                    output_kind=kind)
            self._call("generate", lambda: engine.add_request(ids[i], TokensPrompt(prompt_token_ids=list(row)), params))
        index = {r: i for i, r in enumerate(ids)}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(rows))}      # each request's tokens so far
        lps: dict[int, list[float]] = {i: [] for i in range(len(rows))}        # and their log-probs
        left, done, step = set(range(len(rows))), 0, 0
        rng = _StepGenerators(seed if seeds is None else None, self.device)
        try:
            while left:
                if stop_after is not None and done >= stop_after:
                    break
                outs = self._call("generate", lambda: rng.run(engine.step))
                step += 1
                for out in outs:   # the tokens each request gained this step (FINAL_ONLY: all, once finished)
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    comp = out.outputs[0]
                    new = list(comp.token_ids)
                    tokens[i] += new
                    if logprobs:
                        if resumed[i] and out.prompt_logprobs:   # a carried part: vLLM's prompt log-probs
                            carried = list(rows[i])[len(rows[i]) - resumed[i]:]
                            plp = out.prompt_logprobs[len(rows[i]) - resumed[i]:]
                            lps[i] += [float(d[t].logprob) if d else 0.0 for d, t in zip(plp, carried)]
                        lps[i] += [float(d[t].logprob) for d, t in zip(comp.logprobs or [], new)]
                    if not out.finished:
                        continue
                    left.discard(i)
                    done += 1
                    got = tuple(tokens[i])
                    yield FinishedSample(i, tuple(rows[i]), got, bool(got) and got[-1] == eos_id, step - 1,
                                         tuple(lps[i]), float(len(rows[i]) + max(len(got) - 1, 0)))
            if left:   # stop_after reached: the rest are carried with their tokens so far
                self._call("abort", lambda: engine.abort_request([ids[i] for i in sorted(left)]))
                for i in sorted(left):
                    yield PartialSample(i, tuple(rows[i]), tuple(tokens[i]))
                left = set()
        finally:
            if left and self.llm is not None:   # the consumer stopped early: free the engine's requests
                engine.abort_request([ids[i] for i in sorted(left)])
            self.sleep()   # CUDA: the trainer gets the KV cache's memory until the next call

    def shutdown(self) -> None:
        """Stop the engine (a later call is an :class:`EngineError` naming the model)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass


class _StepGenerators:
    """The random state one generate call samples from: seeded from ``seed`` (None: the process's own state,
    untouched) and swapped in as the default generator (CPU, and the CUDA device's) around each engine step."""

    def __init__(self, seed: int | None, device: str):
        self.cuda = device.startswith("cuda") and torch.cuda.is_available()
        self.state = None
        if seed is not None:
            outer = self._get()
            torch.random.default_generator.manual_seed(int(seed))   # as torch.manual_seed, on this process's
            if self.cuda:                                              # CPU and CUDA device only
                torch.cuda.manual_seed(int(seed))
            self.state = self._get()
            self._set(outer)

    def _get(self):
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None

    def _set(self, state) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1])

    def run(self, fn):
        if self.state is None:
            return fn()
        outer = self._get()
        self._set(self.state)
        try:
            return fn()
        finally:
            self.state = self._get()
            self._set(outer)


def _reload_begin(worker) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _reload_bucket(worker, bucket) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.get_model().load_weights(iter(bucket))


def _reload_end(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    if getattr(worker.vllm_config.model_config.hf_config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        # a tied output layer (gpt2) gets no tensor of its own in the reload, so its kernel layout (on CPU a
        # prepacked GEMM of the embedding) is rebuilt from the reloaded embedding
        with set_current_vllm_config(worker.vllm_config):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _rank_options(model, hf_dir: str, rank: int, world: int, device: str) -> dict:
    """vLLM's options for the engine of rank ``rank`` of a ``world``-rank group whose ``torch.distributed``
    world is up (a collective: every rank calls it). Rank 0 writes the model's config once (no weights: the
    engine starts on vLLM's placeholder weights and is refitted with the trainer's before it generates); the
    ``external_launcher`` backend makes vLLM adopt the group's world instead of starting its own, and with
    tensor and pipeline size 1 its layout (external data parallel × 1 × 1) gives every rank an engine of
    its own that generates independently of the others."""
    import torch.distributed as dist

    if rank == 0 and not os.path.isfile(os.path.join(hf_dir, "config.json")):
        model.hf.config.save_pretrained(hf_dir)
    dist.barrier()
    local = torch.cuda.current_device() if device.startswith("cuda") else rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world))
    return {"distributed_executor_backend": "external_launcher", "load_format": "dummy"}


class VllmRollout(RolloutEngine):
    """The ``vllm`` rollout engine of a worker (:class:`~rlhfc.runtime.rollout.base.RolloutEngine`): its
    :class:`VllmEngine` (``engine``) starts at the first :meth:`prepare` and is refitted from the worker's
    weights whenever their version moved on; the rows of a call sample from one generator seeded with
    :func:`batch_seed` of their keys (the module docstring: a data-parallel rank's keys are its share's, so the
    ranks sample from different seeds). ``slots`` is vLLM's own continuous batching here (its scheduler admits
    requests as KV-cache blocks free up)."""

    decodes_trainer_copy = False   # its own weights, refitted from the trainer's (an FSDP rank's shards)

    def __init__(self, worker, options):
        super().__init__(worker, options)
        self.engine: VllmEngine | None = None

    def _driver_env(self, key: str) -> str | None:
        """The driver's value of ``key`` ("" where the driver has none); None outside a job (no options
        ``env``: this process's environment is the caller's)."""
        env = self.options.get("env")
        return None if env is None else env.get(key, "")

    def prepare(self, model, refit_mb: int = 64) -> None:
        """Bring the engine up to the worker's weights: started at the first call (``engine_start_s``), woken up
        (CUDA: ``engine_wake_s``), and refitted when the worker's weights version is not the engine's
        (``refit_s``, ``refit_mb``, ``refit_buckets``); the statistics are kept in ``worker.engine_stats`` for the
        next rollout. On a rank of a group (a worker with ``rank`` and ``world``) every rank calls it together:
        the start builds vLLM's process groups over the group's world, and an FSDP2 refit gathers each
        parameter; all ranks hold the same weights version, so they agree on whether to refit."""
        worker = self.worker
        if self.engine is None:
            start = time.perf_counter()
            folder = os.path.join(os.path.abspath(self.options.get("folder") or "vllm"), worker.name)
            ranked = worker.backend.grouped
            written = not ranked and not os.path.isfile(os.path.join(folder, "hf", "config.json"))
            self.engine = VllmEngine(model, folder, name=worker.name, seed=worker.seed, device=worker.device,
                                     version=worker.version if written else -1,
                                     rank=(worker.backend.rank, worker.backend.world) if ranked else None,
                                     gpu_memory=self.options.get("gpu_memory"),
                                     shared_cache=self._driver_env(SHARED_CACHE_ENV))
            worker.engine_stats["engine_start_s"] = time.perf_counter() - start
        wake = self.engine.wake_up()   # CUDA: the engine slept while the trainer trained
        if wake:
            worker.engine_stats["engine_wake_s"] = wake
        if self.engine.version != worker.version:
            worker.engine_stats.update(self.engine.refit(model, worker.version, refit_mb))

    def refit_pending(self) -> bool:
        return self.engine is not None and self.engine.version != self.worker.version

    def stream(self, model, rows, max_new_tokens: int, *, refit_mb: int = 64, eos_id: int, pad_id: int,
               temperature: float, top_p: float, budgets=None, stop_after=None, logprob_temperature=None,
               resumed=None, row_keys=None, slots=None):
        del pad_id, slots   # the engine decodes its own copy of the weights
        self.prepare(model, refit_mb)
        keys = list(row_keys) if row_keys is not None else list(range(len(rows)))
        return self.engine.stream(rows, list(budgets) if budgets is not None else [max_new_tokens] * len(rows),
                                  eos_id=eos_id, temperature=temperature, top_p=top_p,
                                  seed=batch_seed(keys), stop_after=stop_after,
                                  logprobs=logprob_temperature is not None, resumed=resumed)

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
