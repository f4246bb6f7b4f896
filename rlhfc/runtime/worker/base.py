"""The Ray actor that hosts one model: generation, forwards, training, weights, checkpoints.

Why this file is long: it is one idea, the worker and every call the driver makes of it. A job creates one ``ModelWorker`` per rank of each
placed worker group with ``ray.remote(...)(ModelWorker)``; the class itself is plain Python so tests can use
it in-process. It holds one train backend (:mod:`rlhfc.runtime.train.backend`: how this rank holds, computes
with, trains and saves the model — ``torch``, ``fsdp``, ``megatron`` or a plugin's) and one rollout engine
(:mod:`rlhfc.runtime.rollout.base`: what decodes — the torch decoder, vLLM or a plugin's), and does everything
the backends share: prompts to tokens, per-row sampling keys, rollouts, loss inputs, NaN guards, random
states, checkpoint files, weight transfers. Each method says how it runs on a group of ranks
(``@dispatch``, :mod:`.dispatch`).

All randomness comes from two ``torch.Generator``s seeded from the run seed and the model name (sampling,
minibatch shuffling), whose states are checkpointed, so runs are reproducible and resumable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from datetime import timedelta
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhfc.contract.rules import tokenizer_fingerprint
from rlhfc.runtime.data.prompts import prompt_parts
from rlhfc.runtime.data.tokenizer import load_tokenizer
from rlhfc.runtime.data.values import CarryOver, PolicyLossInput, Rollout, TokenValues, ValueLossInput, token_versions
from rlhfc.runtime.models.build import build_model, copy_weights
from rlhfc.runtime.models.precision import autocast, under_autocast
from rlhfc.runtime.models.recompute import apply_recompute
from rlhfc.runtime.rl.guards import NonFiniteError, check_finite
from rlhfc.runtime.rl.ppo import proximal_alpha
from rlhfc.runtime.rollout.agent import (ENV_REWARD, ENV_TURN_REWARDS, TURNS, AgentLoop, ChatTemplate, PlainText,
                                         tool_schema)
from rlhfc.runtime.rollout.base import build_rollout
from rlhfc.runtime.rollout.sandbox import EnvSandbox, EnvSpec, ToolSandbox, ToolSpec
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
from rlhfc.runtime.train.backend import GROUP_TIMEOUT_S, TrainBackend, build_backend

from .allocator import retain_freed_memory, retaining
from .dispatch import dispatch
from .stages import stage_call
from .trace import TracedWorker


def derive_seed(seed: int, *parts: str) -> int:
    """A stable 31-bit seed from the run seed and names (same on every machine and Python)."""
    return zlib.crc32(":".join([str(seed), *parts]).encode()) & 0x7FFFFFFF


def tokenizer_id(spec: dict) -> str:
    """Which tokenizer a model uses, as rollouts carry it: a folder's by content (two folders holding the same
    tokenizer files are one tokenizer), else the built-in one of its vocabulary."""
    if spec.get("source"):
        return f"hf:{tokenizer_fingerprint(spec['source']) or spec['source']}"
    return f"char:{spec['vocab']}"



def _migrated_tail(carry) -> bool:
    """Whether carried rows are tails handed back by ranks (``tail_migrate``): each names its random-stream key."""
    return bool(carry) and all("key" in c for c in carry)

class ModelWorker(TracedWorker):
    """Hosts model ``name`` built from ``spec`` — one rank of its worker group.

    ``init``: ``{"kind": "random"}``, ``{"kind": "pretrained"}`` (``spec["source"]``) or
    ``{"kind": "copy", "from": NAME, "spec": SRC_SPEC}`` — start from the initial
    weights of model NAME (built here from the same seed, so no transfer is needed).
    ``precision``: ``"fp32"``, or ``"bf16"`` — generation, forwards and the loss's forward run under bf16
    autocast; the weights, gradients and optimizer state stay as built (float32).
    ``rollout``: the engine of its generate calls and its options — ``{"engine": "torch"}`` (rlhfc's decode
    loop, the default) or another registered engine (:mod:`rlhfc.runtime.rollout.base`), e.g. ``{"engine": "vllm",
    "folder": DIR}``: a vLLM engine this worker starts at its first generate, in ``DIR/<name>``, refitted
    before a generate whenever the worker's weights version moved on.
    ``trainer``: the train backend (a registered name, :mod:`rlhfc.contract.engines`); a group backend's rank
    also gets ``rank``, ``world``, ``store`` (the group's rendezvous: (host, port),
    :func:`rlhfc.runtime.train.backend.open_store`), ``dist_backend`` (``gloo`` or ``nccl``), ``tp`` and ``pp``.
    """

    def __init__(self, name: str, spec: dict, init: dict, seed: int, threads: int = 1, device: str = "cpu",
                 cores: list[int] | None = None, precision: str = "fp32", rollout: dict | None = None, *,
                 trainer: str = "torch", rank: int = 0, world: int = 1, store: tuple[str, int] | None = None,
                 dist_backend: str = "gloo", tp: int = 1, pp: int = 1, offload: bool = False):
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
            model = build_model(spec, seed=derive_seed(seed, name, "init"), device=device)
            copy_weights(src, model)
            del src
        else:
            model = build_model(spec, seed=derive_seed(seed, name, "init"), device=device)
        apply_recompute(model, spec.get("recompute"))   # the plan's activation recomputation (training only)
        self.tokenizer = load_tokenizer(model.spec)
        self.tok_id = tokenizer_id(model.spec)
        self.sample_gen = torch.Generator().manual_seed(derive_seed(seed, name, "sample"))
        self.train_gen = torch.Generator().manual_seed(derive_seed(seed, name, "train"))
        self.version = 0
        #: the process-wide generator's state kept for this model while others use the process (:mod:`.host`);
        #: None: the process is this model's own
        self.own_rng: torch.Tensor | None = None
        self._stores: dict[str, Any] = {}    # collective sync: rendezvous stores this worker hosts, by key
        self._groups: dict[str, Any] = {}    # collective sync: two-rank process groups, by key
        self.rollout = dict(rollout or {"engine": "torch"})
        self.seed = seed
        self.engine_stats: dict[str, float] = {}   # its start/refit statistics, reported with the next rollout
        self.backend: TrainBackend = build_backend(trainer, self, model, self.rollout.get("plugins") or (), rank=rank,
                                                   world=world, store=store, dist_backend=dist_backend, tp=tp, pp=pp,
                                                   **({"offload": True} if offload else {}))
        self.rollout_engine = build_rollout(self.rollout, self)   # what decodes its generate calls

    def global_rng(self) -> torch.Tensor:
        """This model's state of torch's process-wide generator: the process's own, or (a model sharing its
        process with others, :mod:`.host`) the state its last stage left, which the host swaps in around each of
        its stages."""
        return self.own_rng.clone() if self.own_rng is not None else torch.get_rng_state()

    @property
    def model(self) -> torch.nn.Module:
        """The model as this rank trains it (sharded or converted under a group backend)."""
        return self.backend.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.backend.optimizer

    # -- bookkeeping ---------------------------------------------------------------------------
    @dispatch("all")
    def ready(self) -> dict:
        import ray

        return {"name": self.name, "params": sum(p.numel() for p in self.model.parameters()), "pid": os.getpid(),
                "threads": torch.get_num_threads(), "device": self.device, "cores": self.cores,
                "precision": self.precision, "allocator": "retain" if retaining() else "default",
                "trainer": self.backend.traits.name, "node": ray.get_runtime_context().get_node_id()}

    @dispatch("all")
    def get_version(self) -> int:
        return self.version

    @dispatch("all")
    def set_version(self, version: int) -> int:
        self.version = int(version)
        return self.version

    def _check_tokens(self, rollout: Rollout) -> None:
        if rollout.tokenizer != self.tok_id:
            raise ValueError(f"model '{self.name}' uses tokenizer {self.tok_id} but the rollout was made with "
                             f"{rollout.tokenizer}; per-token stages need models that share a tokenizer")

    # -- generation ------------------------------------------------------------------------------
    @dispatch("all")
    @stage_call
    @torch.no_grad()
    def generate(self, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float,
                 n: int = 1, unpad: bool = False, logprobs: bool = False, chat: bool = False,
                 slots: int | None = None, refit_mb: int = 64, tools: list[dict] | str = "",
                 env: dict | str = "", max_turns: int = 1, turn_tokens: int = 0) -> Rollout | None:
        """Generate one rollout; ``unpad``: as wide as its longest response instead of ``max_new_tokens``;
        ``logprobs``: also keep the sampled tokens' log-probs (``Rollout.logprobs``, the ``reuse_logprobs``
        pass); ``chat``: each prompt as a user turn in the tokenizer's chat template; ``slots``: at most that
        many rows decode at once, waiting prompts joining as rows finish (continuous batching; the plan's
        micro-batches of generation); ``refit_mb``: an engine's refit bucket size (rollout = vllm).

        On a group every rank decodes its contiguous share of the rows on the backend's generation module
        (each row's own random stream: the tokens one rank would sample), the samples are gathered, and rank 0
        answers with the rollout one rank would build (the other ranks answer None).

        ``tools`` (specs of :class:`~rlhfc.runtime.rollout.sandbox.ToolSpec`), ``env`` (``{name, path, cls}``),
        ``max_turns``, ``turn_tokens``: a multi-turn generate (:mod:`rlhfc.runtime.rollout.agent`): each row a
        trajectory of up to ``max_turns`` policy turns of ``turn_tokens`` tokens at most, with the tools' results
        and the environment's observations between them, all within ``max_new_tokens`` columns; the rollout's
        ``response_mask`` marks the policy's tokens, each sample's field ``ENV_REWARD`` its environment's
        summed reward."""
        model = self.backend.generation_model(self.rollout_engine)   # a collective where it gathers
        inputs = self._inputs(prompts, n, chat=chat)
        logprobs = logprobs or not self.rollout_engine.traits.trainer_numerics   # the behaviour policy's
        if tools or env or max_turns > 1:
            return self._generate_turns(model, inputs, max_new_tokens=max_new_tokens, temperature=temperature,
                                        top_p=top_p, unpad=unpad, logprobs=logprobs, slots=slots,
                                        refit_mb=refit_mb, tools=tools or [], env=env or None, max_turns=max_turns,
                                        turn_tokens=turn_tokens or max_new_tokens, chat=chat)
        world = self.backend.world
        samples = list(self._decode(model, inputs, max_new_tokens=max_new_tokens, temperature=temperature,
                                    top_p=top_p, logprobs=logprobs, share=self.backend.generation_share(len(inputs)),
                                    slots=-(-slots // world) if slots else None, refit_mb=refit_mb))
        parts = self.backend.gather(samples)
        if parts is None:
            return None
        width_p = max(len(c["prompt_ids"]) for c in inputs)
        return self._rollout([s for part in parts for s in part], inputs, width_p,
                             None if unpad else max_new_tokens, logprobs)

    def _generate_turns(self, model, inputs: list[dict], *, max_new_tokens: int, temperature: float, top_p: float,
                        unpad: bool, logprobs: bool, slots: int | None, refit_mb: int, tools: list[dict],
                        env: dict | None, max_turns: int, turn_tokens: int, chat: bool = False) -> Rollout | None:
        """A multi-turn generate: every rank runs the trajectories of its share of the rows (its tools' calls
        in sandboxes of its own), rank 0 builds the rollout from all of them. ``chat``: tool calls and results in
        the chat template's format (:class:`~rlhfc.runtime.rollout.agent.ChatTemplate`), else plain text."""
        lo, hi = self.backend.generation_share(len(inputs))
        world = self.backend.world
        trajs, tool_s = [], 0.0
        for trajs, _, tool_s in self._turns(model, inputs, (lo, hi), max_new_tokens=max_new_tokens,
                                            temperature=temperature, top_p=top_p, logprobs=logprobs,
                                            slots=-(-slots // world) if slots else None, refit_mb=refit_mb,
                                            tools=tools, env=env, max_turns=max_turns, turn_tokens=turn_tokens,
                                            chat=chat):
            pass
        parts = self.backend.gather((trajs, tool_s))
        if parts is None:
            return None
        trajs = [t for part, _ in parts for t in part]
        return self._trajectory_rollout(trajs, range(len(trajs)), inputs, None if unpad else max_new_tokens,
                                        logprobs, bool(env), AgentLoop.stats(trajs, max(s for _, s in parts),
                                                                             env=bool(env)))

    def _turns(self, model, inputs: list[dict], share: tuple[int, int], *, max_new_tokens: int, temperature: float,
               top_p: float, logprobs: bool, slots: int | None, refit_mb: int, tools: list[dict], env: dict | None,
               max_turns: int, turn_tokens: int, chat: bool):
        """The turn loop over rows ``share`` of ``inputs`` (:meth:`AgentLoop.iterate`'s yields); the
        environment's instances are let go when it ends. Row ``i`` samples from the random stream keyed
        ``base + i`` (one draw from the sampling generator), whichever share of the rows a process runs."""
        base = int(torch.randint(0, 2**62, (1,), generator=self.sample_gen))
        lo, hi = share
        fmt = ChatTemplate.of(self.tokenizer, tuple(tool_schema(t["name"], t["path"], t["function"]) for t in tools)) \
            if chat else PlainText()
        envs = self._env(env) if env else None
        loop = AgentLoop({spec["name"]: self._tool(spec) for spec in tools}, max_turns, turn_tokens,
                         env=envs.new if envs else None, env_name=env["name"] if env else "", format=fmt)
        kw = dict(eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, temperature=temperature, top_p=top_p,
                  logprob_temperature=temperature if logprobs else None, slots=slots)

        def decode(rows, *, budgets, resumed, row_keys):
            stream = self.rollout_engine.stream(model, rows, max(budgets), refit_mb=refit_mb, budgets=budgets,
                                                resumed=resumed, row_keys=row_keys, **kw)
            return under_autocast(stream, self.device, self.precision)

        try:
            yield from loop.iterate(decode, [c["prompt_ids"] for c in inputs[lo:hi]], width=max_new_tokens,
                                    keys=[base + i for i in range(lo, hi)], tokenizer=self.tokenizer,
                                    want_logprobs=logprobs,
                                    records=[{"prompt": c["prompt"], **(c.get("fields") or {})} for c in inputs[lo:hi]])
        finally:
            if envs is not None:
                envs.clear()   # the trajectories' instances are done with

    def _generate_turn_chunks(self, model, inputs: list[dict], *, chunk: int, max_new_tokens: int,
                              unpad: bool, logprobs: bool, tools: list[dict], env: dict | None, **kw):
        """A streamed multi-turn generate: rollouts of ``chunk`` trajectories as they end (those that end at a
        turn, in the order they ended), the last one with what is left; the trajectories are the unstreamed
        generate's. The step's agent metrics (:meth:`AgentLoop.stats`, over every trajectory) ride on the last
        chunk (merged chunks keep the last chunk's value of a statistic)."""
        size = chunk if chunk > 0 else len(inputs)
        width_r = None if unpad else max_new_tokens
        ready: list[int] = []
        sent, trajs, tool_s = 0, [], 0.0
        for trajs, ended, tool_s in self._turns(model, inputs, (0, len(inputs)), max_new_tokens=max_new_tokens,
                                                logprobs=logprobs, tools=tools, env=env, **kw):
            ready += ended
            while len(ready) >= size and sent + size < len(inputs):   # the last chunk waits for the metrics
                rows, ready, sent = ready[:size], ready[size:], sent + size
                yield self._trajectory_rollout(trajs, rows, inputs, width_r, logprobs, bool(env))
        yield self._trajectory_rollout(trajs, ready, inputs, width_r, logprobs, bool(env),
                                       AgentLoop.stats(trajs, tool_s, env=bool(env)))

    def _trajectory_rollout(self, trajs, rows, inputs: list[dict], width_r: int | None, logprobs: bool, env: bool,
                            stats: dict | None = None) -> Rollout:
        """The rollout of trajectories ``rows`` (rows of the batch): the policy's tokens are its loss mask, each
        sample's fields name its turns (and, ``env``, its environment's rewards); ``stats``: the agent metrics
        it carries.
        Every chunk of a batch has the prompt width of the whole batch (a chat template's prompt shows the
        tools' schemas)."""
        width_p = max(len(t.prompt_ids) for t in trajs)
        wanted = set(rows)
        samples = [s for s in AgentLoop.samples(trajs) if s.index in wanted]
        roll = self._rollout(samples, inputs, width_p, width_r, logprobs)
        policy = torch.zeros_like(roll.batch.response_mask)
        for row, i in enumerate(roll.rows):
            t = trajs[i]
            policy[row, :len(t.policy)] = torch.tensor(t.policy, dtype=policy.dtype)
        roll.batch.response_mask = roll.batch.response_mask * policy   # the loss mask: the policy's tokens
        if stats is not None:
            roll.engine.update(stats)
        roll.fields = [{**f, TURNS: trajs[i].turns_text(self.tokenizer),
                        **({ENV_REWARD: trajs[i].reward, ENV_TURN_REWARDS: [list(x) for x in trajs[i].turn_rewards]}
                           if env else {})}
                       for f, i in zip(roll.fields, roll.rows)]
        return roll

    def _env(self, spec: dict) -> EnvSandbox:
        """The sandboxed process of environment ``spec`` (started at its first instance, kept for the worker's
        life; its folder in the job's run folder, as the tools')."""
        envs = self.__dict__.setdefault("_envs", {})
        key = tuple(sorted(spec.items()))
        if key not in envs:
            envs[key] = EnvSandbox(EnvSpec(spec["name"], spec["path"], spec["cls"],
                                           **{k: spec[k] for k in ("timeout", "memory_mb") if k in spec}),
                                   root=self.rollout_engine.options.get("tools"))
        return envs[key]

    def _tool(self, spec: dict):
        """The sandbox of tool ``spec`` (started at its first call, kept for the worker's life)."""
        tools = self.__dict__.setdefault("_tools", {})
        key = tuple(sorted(spec.items()))
        if key not in tools:   # its calls' folders in the job's run folder (rollout option "tools") when it has one
            tools[key] = ToolSandbox(ToolSpec(**spec), root=self.rollout_engine.options.get("tools"))
        return tools[key]

    @dispatch("stream")
    @stage_call
    def generate_chunks(self, prompts: list[str], *, chunk: int, max_new_tokens: int, temperature: float,
                        top_p: float, n: int = 1, take: int | None = None, carry: list[dict] | None = None,
                        unpad: bool = False, logprobs: bool = False, chat: bool = False, slots: int | None = None,
                        refit_mb: int = 64, tools: list[dict] | str = "", env: dict | str = "", max_turns: int = 1,
                        turn_tokens: int = 0, split: bool = False, tail_below: int = 0, tail_kv: bool = False):
        """Streaming generation (a Ray streaming generator): yield Rollout chunks of ``chunk`` finished
        samples as they finish; with ``take``, stop once ``take`` samples are done and finally yield a
        :class:`CarryOver` with the unfinished ones (their partial tokens kept). ``unpad``: each chunk is
        as wide as its own longest response (the ``unpad`` pass) instead of ``max_new_tokens``;
        ``logprobs``: as in :meth:`generate`. On a group, rank 0 decodes every row (its chunks and the
        overcommit cut-off follow the finish order over all rows) while every rank brings its engine up to the
        weights with it (an engine's start and refit may be collectives). ``tools``, ``env``, ``max_turns``,
        ``turn_tokens``: a multi-turn generate whose trajectories are handed on as they end
        (:meth:`_generate_turn_chunks`; no ``take``: the overcommit pass leaves multi-turn generates alone).

        Long-tail migration (the ``tail_migrate`` pass; the driver calls each rank, :meth:`Job.stream`):
        ``split``: this rank decodes its own share of the rows and streams its own chunks (rows numbered in the
        batch); ``tail_below = k``: once fewer than ``k`` of its rows are still decoding it stops and yields a
        :class:`CarryOver` of them, each with its row and its random-stream key, and its process is free for
        other work; ``tail_kv``: each also carries its decode state (its KV cache and its tokens' log-probs:
        the engine's ``kv_moves``). A call whose ``carry`` items all have keys (the tails of every rank, on one
        rank) continues them: each row samples on from its own key at its own position, so its tokens are those
        it would have sampled without moving (the torch engine's row streams), from its carried KV cache where
        it has one, else from a prefill of its tokens so far (up to float rounding against the cache it
        replaces), and draws no new key."""
        with torch.no_grad():
            model = self.backend.generation_model(self.rollout_engine)
            self.rollout_engine.prepare(model, refit_mb)
            if split or _migrated_tail(carry):
                yield from self._generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_p=top_p, n=n, chunk=chunk, carry=carry or [], unpad=unpad,
                                          logprobs=logprobs, chat=chat, slots=slots, refit_mb=refit_mb,
                                          split=split, tail_below=tail_below, tail_kv=tail_kv)
                return
            if self.backend.rank != 0:
                # advance the sampling generator as a decode call does, so every rank draws the same row keys
                # in the next split generation
                torch.randint(0, 2**62, (1,), generator=self.sample_gen)
                return
            if tools or env or max_turns > 1:
                if take is not None or carry:
                    raise ValueError("a multi-turn generate carries no unfinished trajectories (take/carry)")
                inputs = self._inputs(prompts, n, chat=chat)
                yield from self._generate_turn_chunks(
                    model, inputs, chunk=chunk, max_new_tokens=max_new_tokens, unpad=unpad,
                    logprobs=logprobs or not self.rollout_engine.traits.trainer_numerics, tools=tools or [],
                    env=env or None, temperature=temperature, top_p=top_p, slots=slots, refit_mb=refit_mb,
                    max_turns=max_turns, turn_tokens=turn_tokens or max_new_tokens, chat=chat)
                return
            yield from self._generate(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
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

    def _decode(self, model, inputs: list[dict], *, max_new_tokens, temperature, top_p, take=None, logprobs=False,
                carry=False, share: tuple[int, int] | None = None, slots: int | None = None, refit_mb: int = 64,
                keyed: bool = False, kv: bool = False):
        """Decode ``inputs`` on ``model`` (or only rows [lo, hi) of them: ``share``); yield a :class:`FinishedSample` (its
        ``index`` the row in ``inputs``, its response including a carried part) as each finishes, or, once
        ``take`` samples are done, a carry dict for each unfinished one. Row ``i`` samples from the random
        stream keyed ``base + i`` (``base`` one draw from this worker's sampling generator), so a share of the
        rows decodes the tokens the whole batch would. ``keyed``: the unfinished rows' carry dicts name their
        key and row (``key``, ``row``: a migrated tail), and inputs that all bring a key decode with them (no
        draw); ``kv``: those carry dicts hold the row's decode ``state`` too, and inputs that bring one continue
        from it (no prefill)."""
        lo, hi = share or (0, len(inputs))
        mine = inputs[lo:hi]
        if keyed and mine and all("key" in c for c in mine):
            keys = [int(c["key"]) for c in mine]
        else:
            base = int(torch.randint(0, 2**62, (1,), generator=self.sample_gen))
            keys = list(range(base + lo, base + hi))
        rows = [list(c["prompt_ids"]) + list(c["partial"]) for c in mine]
        states = [c.get("state") for c in mine] if keyed and any(c.get("state") for c in mine) else None
        moving = {"carry_kv": True} if kv else {}
        kw = dict(eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, temperature=temperature, top_p=top_p,
                  budgets=[max_new_tokens - len(c["partial"]) for c in mine] if carry else None,
                  stop_after=take, logprob_temperature=temperature if logprobs else None,
                  resumed=[len(c["partial"]) for c in mine], row_keys=keys, slots=slots,
                  **({"states": states} if states else {}), **moving)
        stream = self.rollout_engine.stream(model, rows, max_new_tokens, refit_mb=refit_mb, **kw)
        for item in under_autocast(stream, self.device, self.precision):
            c = inputs[lo + item.index]
            response = tuple(c["partial"]) + tuple(item.response_ids)
            if isinstance(item, PartialSample):
                part = {**c, "partial": list(response), "versions": token_versions(c, len(response), self.version)}
                part.pop("state", None)
                if keyed:
                    part.update(key=keys[item.index], row=c.get("row", lo + item.index))
                    if item.state is not None:
                        part["state"] = item.state
                yield part
                continue
            yield FinishedSample(lo + item.index, tuple(c["prompt_ids"]), response, item.eos, item.step, item.logprobs,
                                 item.computed)

    def _generate(self, model, prompts, *, max_new_tokens, temperature, top_p, n, chunk, take=None, carry=(),
                  unpad=False, logprobs=False, chat=False, slots=None, refit_mb=64, split=False, tail_below=0,
                  tail_kv=False):
        inputs = self._inputs(prompts, n, carry, chat)
        keyed = split or _migrated_tail(carry)   # a migrated tail: rows and keys kept
        share = self.backend.generation_share(len(inputs)) if split else None
        if tail_below > 0:   # this rank stops once fewer than tail_below of its rows decode: they move
            rows = (share[1] - share[0]) if share else len(inputs)
            take = rows - tail_below + 1 if rows >= tail_below else None
        logprobs = logprobs or not self.rollout_engine.traits.trainer_numerics   # the behaviour policy's
        # a migrated tail keeps its batch's prompt width (its chunks merge with the other ranks')
        width_p = max(max(len(c["prompt_ids"]), c.get("width_p", 0)) for c in inputs)
        buf: list[FinishedSample] = []
        left: list[dict] = []
        size = chunk if chunk > 0 else len(inputs)
        width_r = None if unpad else max_new_tokens
        done = 0
        for item in self._decode(model, inputs, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 take=take, logprobs=logprobs, carry=bool(carry), slots=slots, refit_mb=refit_mb,
                                 share=share, keyed=keyed, kv=tail_kv and tail_below > 0):
            if isinstance(item, dict):
                left.append(item)
                continue
            if take is not None and done == take and not tail_below:
                # more rows finished in the decoding step that brought the take-th: the step trains on
                # exactly `take`, so these (the later rows) are carried, cut before their last token,
                # which they sample again under the next step's weights
                c = inputs[item.index]
                cut = len(item.response_ids) - 1
                left.append({**c, "partial": list(item.response_ids[:-1]),
                             "versions": token_versions(c, cut, self.version)})
                continue
            done += 1
            buf.append(item)
            if len(buf) == size:
                yield self._rollout(buf, inputs, width_p, width_r, logprobs)
                buf = []
        if buf:
            yield self._rollout(buf, inputs, width_p, width_r, logprobs)
        if take is not None:
            yield CarryOver([{**c, "width_p": width_p} for c in left] if tail_below else left)

    def _rollout(self, samples, inputs, width_p: int, width_r: int | None, with_logprobs: bool = False) -> Rollout:
        samples = sorted(samples, key=lambda x: inputs[x.index].get("row", x.index))
        rows = [inputs[s.index].get("row", s.index) for s in samples]   # in the batch (a migrated tail's own)
        # collate orders by index: numbered by position here, so its rows are these, in this order
        batch = collate([dataclasses.replace(s, index=k) for k, s in enumerate(samples)], self.tokenizer.pad_id,
                        prompt_len=width_p, response_width=width_r)
        logprobs = None
        if with_logprobs:
            logprobs = torch.zeros(batch.response_mask.shape, dtype=torch.float32)
            for row, s in enumerate(samples):
                logprobs[row, :len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
        at = [s.index for s in samples]   # the samples' inputs
        return Rollout(batch, [inputs[i]["prompt"] for i in at], decode_responses(self.tokenizer, batch),
                       self.name, self.version, self.tok_id, rows, [inputs[i]["born"] for i in at],
                       max(s.step for s in samples) + 1, logprobs, unpad=width_r is None,
                       computed_tokens=sum(s.computed for s in samples),
                       fields=[inputs[i].get("fields") or {} for i in at], engine=self._take_engine_stats(),
                       rollout_engine=self.rollout_engine.name,
                       versions=[token_versions(inputs[s.index], len(s.response_ids), self.version) for s in samples])

    def _take_engine_stats(self) -> dict[str, float]:
        """The rollout engine's statistics since the last rollout (the first chunk of a stream carries them)."""
        stats, self.engine_stats = self.engine_stats, {}
        return stats

    # -- forwards: each rank its share of the rows -------------------------------------------------
    @dispatch("split")
    @stage_call
    @torch.no_grad()
    def logprobs(self, rollout: Rollout, *, temperature: float = 1.0) -> TokenValues | None:
        self._check_tokens(rollout)
        mine = self.backend.rows(rollout)
        lp = self.backend.forward(mine, lambda m, b: response_logprobs(m, b, temperature))
        return None if lp is None else TokenValues(lp, mine.mask)

    @dispatch("split")
    @stage_call
    @torch.no_grad()
    def values(self, rollout: Rollout) -> TokenValues | None:
        self._check_tokens(rollout)
        mine = self.backend.rows(rollout)
        values = self.backend.forward(mine, response_values)
        if values is None:
            return None
        check_finite(values, f"the value estimate of '{self.name}'", mask=mine.mask, prompts=mine.prompts)
        return TokenValues(values, mine.mask)

    @dispatch("split")
    @stage_call
    @torch.no_grad()
    def score(self, rollout: Rollout) -> torch.Tensor | None:
        mine = self.backend.rows(rollout)
        scores = self._score(mine)
        if scores is None:
            return None
        return check_finite(scores, f"the score of reward model '{self.name}'", prompts=mine.prompts)

    def _score(self, rollout: Rollout) -> torch.Tensor | None:
        """Scores read at each sample's last token: the token ids as generated (EOS included) when this model
        shares the generating model's tokenizer, else its own encoding of the text."""
        if rollout.tokenizer == self.tok_id:
            return self.backend.forward(rollout, sequence_scores)
        # a reward model with its own tokenizer scores the text in its own tokens, with the special tokens a
        # reward model's training sees around a sample: BOS first, EOS last where the response ended with one
        ids = encode_prompts(self.tokenizer, [p + r for p, r in zip(rollout.prompts, rollout.responses)])
        ended = rollout.batch.eos.tolist()
        ids = [x + [self.tokenizer.eos_id] if ended[i] else x for i, x in enumerate(ids)]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, x in enumerate(ids):
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        return self.backend.score_text(input_ids, mask)

    # -- training --------------------------------------------------------------------------------
    @dispatch("all")
    @stage_call
    def train(self, loss: PolicyLossInput | ValueLossInput, *, lr: float, epochs: int, minibatches: int,
              max_grad_norm: float, weight_decay: float, unpad: bool = False, lr_schedule: str = "constant",
              warmup_steps: int = 0, total_steps: int = 0, micro_batch: int = 0,
              fused: dict | None = None) -> dict[str, float]:
        """PPO/value updates on ``loss``; ``unpad``: each minibatch drops the response columns that are
        padding in all of its rows (the ``unpad`` pass); ``fused``: the pipeline schedules run interleaved with
        another model's training on the same devices (:meth:`TrainBackend.fuse`). A non-finite loss or gradient stops it before the
        optimizer step (:class:`NonFiniteError`); ``minibatches`` may not exceed the samples of the batch.
        The lr of this call is ``lr`` times the schedule's factor at train step ``self.version``
        (:func:`rlhfc.runtime.rl.algorithms.lr_factor`), so a resumed run continues the same sequence."""
        from rlhfc.runtime.rl.algorithms import lr_factor

        if self.backend.optimizer is None:
            self.backend.optimizer = self._make_optimizer(lr=lr, weight_decay=weight_decay)
        step_lr = lr * lr_factor(self.version, lr_schedule, warmup_steps, total_steps)
        for group in self.backend.optimizer.param_groups:
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
            if loss.behaviour_logp is not None:   # decoupled PPO (asynchronous rollout)
                batch["behaviour_logp"] = loss.behaviour_logp.to(self.device)
            if loss.proximal == "loglinear":   # A-3PO: each sample's weight toward the current policy
                batch["proximal_alpha"] = proximal_alpha(loss.rollout.born, self.version).to(self.device)
            fn = loop.actor_loss_fn(clip=loss.clip, clip_high=loss.clip_high, temperature=loss.temperature,
                                   entropy_coef=loss.entropy_coef,
                                   kl_coef=loss.kl_coef if loss.ref_logp is not None else 0.0,
                                   kl_estimator=loss.estimator, loss_agg=loss.loss_agg, ratio_level=loss.ratio,
                                   behaviour_cap=loss.behaviour_cap)
        else:
            batch["old_values"] = loss.old_values.to(self.device)
            batch["returns"] = loss.returns.to(self.device)
            fn = loop.critic_loss_fn(clip=loss.clip)
        if minibatches > loss.rollout.size:
            raise ValueError(f"minibatches ({minibatches}) is more than the {loss.rollout.size} samples of the batch "
                             f"'{self.name}' trains on")
        kind = "policy" if isinstance(loss, PolicyLossInput) else "value"

        def guarded(model, mb):
            with autocast(self.device, self.precision):   # the loss's forward; backward and the optimizer step run as built
                out, stats = fn(model, mb)
            if not bool(torch.isfinite(out.detach()).all()):
                raise NonFiniteError(f"the {kind} loss of '{self.name}' is {float(out.detach())} on a minibatch; the "
                                     "run stops before the optimizer step (nothing of this step is checkpointed)")
            return out, stats

        self.backend.fuse(fused)
        try:
            metrics = self.backend.train_epochs(self.backend.optimizer, batch, guarded, epochs=epochs,
                                                minibatches=minibatches, max_grad_norm=max_grad_norm or None,
                                                generator=self.train_gen, unpad=unpad, micro_batch=micro_batch)
        finally:
            if fused:
                self.backend.fuse(None)
                # the operations as they ran (kind, micro-batch, schedule, start, end): the trace's sub-spans
                self._span_ops = list(getattr(self.backend, "last_log", []))
        self.version += 1
        metrics.update(getattr(loss, "stats", {}), lr=step_lr, version=float(self.version))
        return metrics

    def _make_optimizer(self, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        """AdamW that refuses to step on a non-finite gradient (checked after clipping, which turns a
        non-finite norm into NaN gradients), so a bad minibatch never reaches the weights."""
        opt = self.backend.make_optimizer(lr, weight_decay)
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

    # -- weights: in full, the single-rank model's layout ---------------------------------------------
    @dispatch("all")
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The weights in full, Hugging Face layout (a collective on a group: every rank gets them)."""
        return self.backend.full_weights()

    @dispatch("all")
    def set_weights(self, weights: dict[str, torch.Tensor], version: int | None = None) -> int:
        self.backend.load_weights(weights)
        if version is not None:
            self.version = version
        return self.version

    @dispatch("all")
    def sync_export(self, bucket_mb: int) -> tuple[list, int, int]:
        """Put the weights into the object store in buckets of about ``bucket_mb`` MiB (numpy arrays:
        zero-copy for the receiver). Returns (bucket refs, weights version, total bytes); on a group every
        rank takes part in gathering them and rank 0 puts them."""
        import ray

        buckets = self._buckets(bucket_mb)   # a collective on a group
        if not self.backend.writes:
            return [], self.version, 0
        refs, total = [], 0
        for bucket in buckets:
            arrays = {name: t.detach().to("cpu", copy=True).contiguous().numpy() for name, t in bucket}
            refs.append(ray.put(arrays))
            total += sum(a.nbytes for a in arrays.values())
        return refs, self.version, total

    @dispatch("all")
    def sync_import(self, bucket: dict) -> int:
        """Load one bucket of weights (exact copies) into this worker's model."""
        self.backend.import_bucket(bucket)
        return len(bucket)

    @dispatch("all")
    def reshard(self, bucket_mb: int) -> tuple[int, int]:
        """The plan's reshard stage: gather the training layout into the generation layout now (bytes this rank
        received, transfers; nothing where one rank holds the whole model)."""
        return self.backend.reshard(self.rollout_engine, bucket_mb)

    def _buckets(self, bucket_mb: int) -> list[list[tuple[str, torch.Tensor]]]:
        """The state dict cut into buckets of one dtype and about ``bucket_mb`` MiB, in state-dict order
        (both ends of a transfer build the same model, so they cut it the same way)."""
        limit = max(1, int(bucket_mb)) * 2**20
        out: list[list[tuple[str, torch.Tensor]]] = []
        size = 0
        for name, tensor in self.backend.state_items():
            if not out or size >= limit or out[-1][0][1].dtype != tensor.dtype:
                out.append([])
                size = 0
            out[-1].append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        return out

    # -- collective weight transfer (a sync stage with transport = "collective"; one-rank groups) ------
    # The sender and the receiver form a two-rank process group of their own (NCCL between GPUs, gloo on CPU)
    # and the sender broadcasts its weights in flat buckets, cut the same way at both ends.
    def sync_open(self, key: str) -> tuple[str, int]:
        """Start the rendezvous store of group ``key`` here (the sender's side): (host, port)."""
        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=GROUP_TIMEOUT_S), wait_for_workers=False)
        self._stores[key] = store
        return host, int(store.port)

    def sync_join(self, key: str, rank: int, host: str, port: int, backend: str) -> str:
        """Join the two-rank group ``key`` (rank 0 sends, rank 1 receives); blocks until both are in."""
        import torch.distributed as dist

        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        store = self._stores[key] if rank == 0 else dist.TCPStore(host, int(port), 2, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"rlhfc/{key}", store)
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, int(rank), 2)
        elif backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, int(rank), 2, timeout)
        else:
            raise ValueError(f"unknown collective backend {backend!r} (nccl or gloo)")
        self._groups[key] = (group, store)   # the store must outlive the group
        return backend

    def _broadcast(self, key: str, flat: torch.Tensor) -> None:
        import torch.distributed as dist

        group = self._groups[key][0]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([flat], opts).wait()

    def sync_send(self, key: str, bucket_mb: int) -> tuple[int, int, int]:
        """Broadcast the weights to the other rank of group ``key``: (version, bytes, buckets)."""
        total = 0
        buckets = self._buckets(bucket_mb)
        with torch.no_grad():
            for bucket in buckets:
                flat = torch.cat([t.detach().reshape(-1) for _, t in bucket])
                self._broadcast(key, flat)
                total += flat.numel() * flat.element_size()
        return self.version, total, len(buckets)

    def sync_recv(self, key: str, bucket_mb: int) -> int:
        """Receive the weights broadcast by rank 0 of group ``key`` into this worker's model (exact copies)."""
        buckets = self._buckets(bucket_mb)
        with torch.no_grad():
            for bucket in buckets:
                flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=bucket[0][1].dtype,
                                   device=bucket[0][1].device)
                self._broadcast(key, flat)
                at = 0
                for _, t in bucket:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()
        return len(buckets)

    # -- checkpoints (safetensors + JSON only: loading never unpickles; full tensors, written by rank 0) --
    @dispatch("all")
    def save(self, folder: str) -> None:
        weights = {k: v.contiguous() for k, v in self.backend.full_weights().items()}   # collectives on a group
        opt_tensors, opt_meta = self.backend.optimizer_state()
        tensors = {"rng.sample": self.sample_gen.get_state(), "rng.train": self.train_gen.get_state(),
                   "rng.torch": self.global_rng(), **opt_tensors}
        meta: dict[str, Any] = {"version": self.version, "name": self.name, "optimizer": opt_meta}
        if self.backend.writes:
            os.makedirs(folder, exist_ok=True)
            save_file(weights, os.path.join(folder, "weights.safetensors"))
            save_file(tensors, os.path.join(folder, "state.safetensors"))
            with open(os.path.join(folder, "state.json"), "w") as fh:
                json.dump(meta, fh)
        self.backend.barrier()   # the checkpoint is complete on disk when any rank returns

    @dispatch("all")
    def load(self, folder: str) -> int:
        """Load a checkpoint's weights, random states, version and optimizer state (each rank its part)."""
        self.backend.load_weights(load_file(os.path.join(folder, "weights.safetensors")))
        tensors = load_file(os.path.join(folder, "state.safetensors"))
        with open(os.path.join(folder, "state.json")) as fh:
            meta = json.load(fh)
        self.sample_gen.set_state(tensors["rng.sample"])
        self.train_gen.set_state(tensors["rng.train"])
        if self.own_rng is not None:   # hosted: the process's generator is this model's only during its stages
            self.own_rng = tensors["rng.torch"].clone()
        else:
            torch.set_rng_state(tensors["rng.torch"])
        self.version = int(meta["version"])
        opt = meta.get("optimizer")
        if opt is not None:
            groups = opt["param_groups"]
            self.backend.optimizer = self._make_optimizer(lr=groups[0]["lr"],
                                                          weight_decay=groups[0].get("weight_decay", 0.0))
            self.backend.load_optimizer(tensors, opt)
        self.backend.weights_changed()
        return self.version
