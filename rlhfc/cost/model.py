"""Per-stage time and memory of an annotated IR: :class:`CostModel`.

Why this file is long: it is the one cost model class — what each stage computes, where, and at what price —
and its methods share the model's state (profile, hardware, per-stage caches): a stage's own thread speed-up
and its price on the vLLM engine are methods too (the engine's rules over numbers: :mod:`rlhfc.cost.engine`).

For every stage the model works out *what* it computes (rows, prompt and
response lengths, the response-length distribution, epochs and minibatches)
from the IR alone, *where* from its annotations (:mod:`rlhfc.ir.plan`),
and prices it with :mod:`rlhfc.cost.formulas` on the cluster's device kind
(:mod:`rlhfc.cost.hardware`). When a profile of this device kind holds a fit for
the stage's model shape, the measured fit prices the stage instead of the
analytical roofline ("source" says which).

Backends: on ``cpu`` clusters the torch backend runs each model in one process
with as many threads as the mesh has cores (``dp``/``tp``/``pp`` do not split
work there). Generation decodes a static batch padded to its longest prompt,
from which finished rows leave once a quarter of it has finished (so a decode
step costs the live rows plus up to a quarter more: :data:`COMPACT_OVERHANG`).
Forwards and training compute rows padded to ``max_new_tokens``; after the
``unpad`` pass, in length groups each cut to its own longest row (the torch
trainer: :func:`rlhfc.cost.lengths.packed_tokens`, one call per group) or cut
to the longest response of the batch or minibatch (FSDP ranks, which must run
the same calls).
On GPU clusters generation is priced as an inference engine (vLLM): continuous
batching (the active batch shrinks as samples finish) on packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from rlhfc.contract.rules import DECODE_COMPACT_FRACTION
from rlhfc.contract.engines import DEFAULT_ROLLOUT, rollout_traits
from rlhfc.ir import Module, Stage

from . import formulas as F
from .hardware import device_spec
from rlhfc.ir import plan
from rlhfc.ir.plan import RECOMPUTE_POLICIES, Layout, overcommit_delta
from .lengths import LengthDist, PromptLengths, packed_tokens, prompt_lengths, response_dist
from .profile import Profile, model_key
from .engine import (VLLM_CPU_KV_BYTES, VLLM_GPU_MEMORY_FRACTION, VLLM_GPU_MIN_FRACTION, VLLM_GPU_OVERHEAD_BYTES,
                     VLLM_MAX_SEQS, VLLM_STEP_S, predict_refit, vllm_entry, vllm_generate_fit)
from .arrays import arch_numbers, hw_numbers, layout_arrays  # noqa: F401  (the formulas' inputs; re-exported)
from .pricing import PriceInputs, _bound, price  # noqa: F401 - price and PriceInputs re-exported
from .shared import shared_cache

#: the torch engine drops finished rows from the decode batch once a quarter of it has finished (the contract's
#: DECODE_COMPACT_FRACTION), so a decode step carries, on average, half that fraction more rows than are live
COMPACT_OVERHANG = 1.0 + DECODE_COMPACT_FRACTION / 2

#: fixed per-call cost of a remote stage (Ray call + moving its arguments), by cluster kind
DISPATCH_S = {"cpu": 0.002, "gpu": 0.01}

#: driver-side ops priced without a profile: seconds = a + b * rows * response tokens
DEFAULT_COMPUTE = {
    "load": (1e-5, 1e-6),
    "compute.gae": (3e-4, 4e-8),
    "compute.kl_penalty": (1e-4, 1e-8),
    "compute.group_advantages": (2e-4, 1e-8),
    "compute.rule": (5e-5, 1e-6),
    "compute.ppo_clip": (2e-5, 0.0),
    "compute.value_loss": (2e-5, 0.0),
}
DEFAULT_OTHER_COMPUTE = (1e-4, 1e-8)

#: seconds one sandboxed tool call costs besides the tool's own work: the fork of its zygote, the exchange of
#: arguments and result (:mod:`rlhfc.runtime.rollout.sandbox`; measured about 2.6 ms per call on the 2-core VM,
#: calls of one batch forked one after another, so a turn's calls add)
TOOL_CALL_S = 0.003


#: one crossing of a process boundary through Ray's object store (pickled, stored, read, unpickled): a fixed part
#: and a rate, measured with ``benchmarks/rlhfuse.py --move`` on a 2-vCPU Intel Xeon VM (0.8-134 MB of KV caches: ~2 ms
#: plus ~0.55 GB/s); what a migrated tail's KV caches pay twice (rank to driver, driver to rank)
STORE_CROSSING_S = 2e-3
STORE_CROSSING_BW = 0.55e9


@dataclass
class CostConfig:
    """Knobs of the cost model.

    ``profile``: measured rates (``rlhfc profile``), used for stages whose device
    kind and model shape it covers. ``response_lengths``: the response-length law
    (:func:`rlhfc.cost.lengths.response_dist`). ``dispatch_s``: per-remote-stage
    overhead (None: 2 ms on CPU clusters, 10 ms on GPU clusters; 0 for in-process
    measurements). ``batching``: ``static``/``continuous``/``auto`` (cpu static, GPU continuous).
    ``engine``: price every generate stage on this rollout engine (``torch``/``vllm``; None: the plan's,
    :func:`rlhfc.ir.plan.stage_engine`; vLLM's pricing: :mod:`rlhfc.cost.engine`).

    Multi-turn generates (:meth:`CostModel.turn_work`): ``turns``, the mean policy turns per trajectory (None:
    the generate's ``max_turns``, an upper bound; a run reports it as ``turns_mean``); ``tool_s``, the seconds a
    tool's own function takes per call, on top of the sandbox's fork and exchange (:data:`TOOL_CALL_S`; None: 0);
    ``obs_tokens``, the tokens a tool's or the environment's answer adds per turn (None: as many as a policy turn's
    mean).
    """

    profile: Profile | None = None
    response_lengths: str = "auto"
    dispatch_s: float | None = None
    batching: str = "auto"
    engine: str | None = None
    turns: float | None = None
    tool_s: float | None = None
    obs_tokens: float | None = None


@dataclass
class StageCost:
    """The price of one stage under its layout.

    ``time_s``: duration; ``parts``: its split (compute / memory / comm / overhead,
    prefill / decode for generation); ``bound``: the largest part; ``source``:
    ``profile`` (measured fit), ``analytic`` (roofline on catalog or profiled
    rates) or ``driver`` (a cheap stage on the driver). Memory, per device of the
    mesh: ``weights_bytes`` (the model's shard), ``state_bytes`` (gradients +
    optimizer, train stages), ``transient_bytes`` (activations / KV cache while it
    runs). ``work``: what was priced (rows, seq, prompt, max_new_tokens, steps).
    """

    stage: str
    op: str
    model: str | None
    layout: Layout | None
    time_s: float
    parts: dict = field(default_factory=dict)
    bound: str = ""
    source: str = ""
    flops: float = 0.0
    weights_bytes: float = 0.0
    state_bytes: float = 0.0
    transient_bytes: float = 0.0
    work: dict = field(default_factory=dict)
    #: generate stages: seconds after the stage starts at which the k-th sample (k = 1..rows) has finished
    finish_offsets: tuple = ()

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.state_bytes + self.transient_bytes


class _Grown:
    """Prompt lengths plus ``add`` tokens: a multi-turn generate's rows at a later turn (prompt + trajectory)."""

    def __init__(self, prompts: PromptLengths, add: float):
        self.prompts, self.add = prompts, float(add)

    def mean(self) -> float:
        return self.prompts.mean() + self.add

    def expected_max(self, n: int) -> float:
        return self.prompts.expected_max(n) + self.add


def _trajectory_dist(turn: LengthDist, live: list[float], obs: float, width: int) -> LengthDist:
    """The length law of a multi-turn trajectory: ``j`` policy turns (the probability of exactly ``j``:
    ``live[j-1] - live[j]``) of independent lengths ``turn``, with ``obs`` answer tokens after each but the last,
    cut at ``width`` tokens."""
    pmf = np.zeros(width + 1)
    conv = np.array([1.0])
    one = np.concatenate([[0.0], turn.array()])   # P(turn length = l), l = 0..T
    gap = int(round(obs))
    for j in range(1, len(live) + 1):
        p = live[j - 1] - (live[j] if j < len(live) else 0.0)
        conv = np.convolve(conv, one)
        if p <= 0:
            if j < len(live) and gap:
                conv = np.concatenate([np.zeros(gap), conv])
            continue
        n = min(len(conv), width + 1)
        pmf[:n] += p * conv[:n]
        pmf[width] += p * conv[n:].sum()
        if gap:
            conv = np.concatenate([np.zeros(gap), conv])
        if len(conv) > width + 1:   # every length past the width ends at it, whatever comes after
            conv = np.concatenate([conv[:width], [conv[width:].sum()]])
    pmf = pmf[1:] / max(pmf[1:].sum(), 1e-300)
    return LengthDist(tuple(float(x) for x in pmf))


#: cost-model classes by the prefix of a plan's strategy: a module registers its own (rlhfc.cost.baselines:
#: ``baseline:``), and ``CostModel(module)`` is one of them when the module's strategy has the prefix
STRATEGY_PRICERS: dict[str, type] = {}


class CostModel:
    """Prices the stages of ``module`` (per-stage time, memory per device, generation finish times)."""

    def __new__(cls, module: Module, config: CostConfig | None = None):
        if cls is CostModel:   # a baseline's plan is priced with its system's terms (rlhfc.cost.baselines)
            strategy = plan.strategy(module) or ""
            cls = next((sub for prefix, sub in STRATEGY_PRICERS.items() if strategy.startswith(prefix)), cls)
        return super().__new__(cls)

    def __init__(self, module: Module, config: CostConfig | None = None):
        self.module = module
        self.config = config or CostConfig()
        self.cluster = module.cluster
        self.kind = module.cluster.device
        self.gpu = self.kind != "cpu"
        prof = self.config.profile
        self.profile = prof if (prof is not None and prof.device_kind == self.kind) else None
        self.spec = device_spec(self.kind, self.profile)
        if module.cluster.memory is not None and module.cluster.memory > 0:   # the program's memory = "..."
            self.spec = replace(self.spec, memory=float(module.cluster.memory))
        batching = self.config.batching
        self.continuous = (batching == "continuous") or (batching == "auto" and self.gpu)
        self.dispatch = self.config.dispatch_s if self.config.dispatch_s is not None else \
            DISPATCH_S["gpu" if self.gpu else "cpu"]
        shared, c = shared_cache(), self.config   # inside shared_prices(): one cache per configuration
        self._cache: dict = {} if shared is None else \
            shared.setdefault((id(c.profile), c.response_lengths, c.dispatch_s, c.batching, c.engine, self.kind,
                               c.turns, c.tool_s, c.obs_tokens), {})

    # -- what a stage computes -------------------------------------------------------------------
    def rollout_source(self, stage: Stage) -> Stage | None:
        """The generate stage whose rollout ``stage`` (transitively) consumes."""
        g = self.module.graph
        todo, seen = list(stage.inputs), set()
        while todo:
            v = todo.pop(0)
            if id(v) in seen:
                continue
            seen.add(id(v))
            try:
                p = g.producer(v)
            except KeyError:
                continue
            if p.op == "generate":
                return p
            todo.extend(p.inputs)
        return None

    def pretrained(self, model_name: str) -> bool:
        m = self.module.models.get(model_name)
        seen = set()
        while m is not None and m.name not in seen:
            seen.add(m.name)
            if m.init == "pretrained":
                return True
            init = m.init
            m = self.module.models.get(getattr(init, "name", "")) if not isinstance(init, str) else None
        return False

    def prompt_lengths(self, gen: Stage) -> PromptLengths:
        g = self.module.graph
        src = None
        if gen.inputs:
            try:
                load = g.producer(gen.inputs[0])
                src = self.module.data.get(load.target or "")
            except KeyError:
                src = None
        return prompt_lengths(src, self.pretrained(gen.target or ""))

    def response_lengths(self, gen: Stage) -> LengthDist:
        model = self.module.models[gen.target]
        return response_dist(self.config.response_lengths, int(gen.attrs.get("max_new_tokens", 32)),
                             vocab=model.vocab, pretrained=self.pretrained(gen.target))

    def engine(self, stage: Stage) -> str:
        """The rollout engine a generate stage is priced on (the configuration's, else the plan's)."""
        return self.config.engine or plan.stage_engine(self.module, stage)

    def own_weights(self, stage: Stage) -> bool:
        """Whether the stage's engine holds weights of its own (vLLM): priced with its own fitted rates, its
        refit and its memory (:mod:`rlhfc.cost.engine`), not the trainer's decode loop."""
        return rollout_traits(self.engine(stage)).own_weights

    def generation_work(self, gen: Stage, micro: int = 1, continuous: bool | None = None) -> dict:
        """Rows, lengths and per-step weights of one wave of a generate stage (see formulas.generate_time).

        With ``microbatches = M`` the replicas generate their prompts in M waves one after another; a wave
        holds ``rows`` = (B + delta) / M prompts and decodes until its own longest response ends.
        ``continuous``: price continuous batching (vLLM) or the torch loop's static batch (default: the
        configuration's batching)."""
        continuous = self.continuous if continuous is None else continuous
        key = ("gen", gen.name, micro, continuous)
        if key in self._cache:
            return self._cache[key]
        if plan.multi_turn(gen):
            work = self.turn_work(gen, micro, continuous)
        else:
            B = gen.outputs[0].type.batch or 1
            work = self._decode_work(self.response_lengths(gen), self.prompt_lengths(gen), B, overcommit_delta(gen),
                                     micro, continuous)
        self._cache[key] = work
        return work

    def _decode_work(self, dist: LengthDist, prompts, B: int, delta: int, micro: int, continuous: bool) -> dict:
        """One decode call's work (:meth:`generation_work`): ``B`` + ``delta`` prompts of lengths ``prompts``
        whose responses follow ``dist``, in ``micro`` waves."""
        n = B + delta
        micro = max(1, int(micro))
        wave = max(1, -(-n // micro))
        T = dist.T
        t = np.arange(T, dtype=np.float64)
        steps_w = dist.kth_running(B, n) if (delta and micro == 1) else dist.p_running(wave)
        if continuous:
            active = np.clip(dist.expected_active(wave) / np.maximum(steps_w, 1e-12), 1.0, wave)
            prompt = prompts.mean()
            kv_tokens = float(np.max(dist.expected_active(wave) * (prompt + t + 1))) if T else 0.0
        else:   # one padded batch; finished rows leave it (COMPACT_OVERHANG)
            live = dist.expected_active(wave) / np.maximum(steps_w, 1e-12)
            active = np.clip(live * COMPACT_OVERHANG, 1.0, wave)
            prompt = prompts.expected_max(wave)
            kv_tokens = float(wave * (prompt + steps_w.sum()))
        if micro > 1 and not continuous:
            # the torch engine runs the M waves as one continuous batch of `wave` slots: prompts join as rows
            # finish (rlhfc.runtime.rollout.decoding). While prompts wait, the slots stay about full (a quarter frees
            # before they join); then the last `wave` rows drain like one wave. Same row-steps, fewer steps.
            queue = max(n - wave, 0) * dist.mean() / (wave * (2.0 - COMPACT_OVERHANG))
            f = (queue + dist.expected_max(wave)) / max(micro * float(steps_w.sum()), 1e-12)
            steps_w, active = steps_w * f, np.minimum(active / f, float(wave))
        order = dist.order_stats(wave)
        row_steps = float(np.sum(steps_w * active))
        useful = float(wave * (prompts.mean() + dist.mean()))
        computed = float(wave * prompt + row_steps)
        return {"dist": dist, "rows": float(wave), "batch": B, "delta": delta, "waves": micro, "prompt": float(prompt),
                "T": T, "t": t, "steps_w": steps_w, "active": active, "kv_tokens": kv_tokens,
                "decode_rows": row_steps / max(float(steps_w.sum()), 1e-12),
                "useful_tokens": useful, "computed_tokens": computed,
                "expected_steps": float(steps_w.sum()), "mean_response": dist.mean(),
                "order": order, "prompt_mean": prompts.mean(), "prompt_max": prompts.expected_max(n)}

    def turn_work(self, gen: Stage, micro: int = 1, continuous: bool | None = None) -> dict:
        """The work of a multi-turn generate (tools or an environment between the policy's turns,
        :mod:`rlhfc.runtime.rollout.agent`), as the runtime runs it: each turn is one decode call over the
        trajectories still going, every row re-prefilled with its prompt and its trajectory so far (the turn's
        prompt grows by a policy turn and an answer per turn), then the turn's tool calls.

        ``turns`` (:class:`CostConfig`) trajectories' mean turns ``E``: every trajectory takes the first
        ``floor(E)`` turns and a fraction ``E - floor(E)`` one more (default ``max_turns``: every trajectory
        takes every turn, an upper bound). A policy turn's length follows the response-length law cut at
        ``turn_tokens``; an answer adds ``obs_tokens``. Each trajectory that goes on after a turn made one call
        (of a tool: :data:`TOOL_CALL_S` + ``tool_s`` each; an environment's step runs in the worker and costs
        nothing here). The rollout's response is the whole trajectory (its length law: the turns' sum, cut at
        ``max_new_tokens``). Returned: :meth:`generation_work`'s keys for the whole trajectory and ``turns``,
        one decode work per turn, with ``tool_s`` (seconds of tool calls over all turns, on one process)."""
        continuous = self.continuous if continuous is None else continuous
        model = self.module.models[gen.target]
        B = gen.outputs[0].type.batch or 1
        width = int(gen.attrs.get("max_new_tokens", 32))
        K = max(1, int(gen.attrs.get("max_turns", 1)))
        budget = min(int(gen.attrs.get("turn_tokens", 0) or width), width)
        given = self.config.turns
        E = float(min(max(given, 1.0), K)) if given is not None else float(K)
        turn = response_dist(self.config.response_lengths, budget, vocab=model.vocab,
                             pretrained=self.pretrained(gen.target))
        obs = float(self.config.obs_tokens) if self.config.obs_tokens is not None else turn.mean()
        tools = bool(gen.attrs.get("tools"))
        per_call = TOOL_CALL_S + float(self.config.tool_s or 0.0)
        prompts = self.prompt_lengths(gen)
        live = [min(max(E - k, 0.0), 1.0) for k in range(K)]   # fraction of the trajectories taking turn k + 1
        turns, calls = [], 0.0
        for k, f in enumerate(live):
            if f <= 0:
                break
            rows = max(1, int(round(B * f)))
            grown = _Grown(prompts, min(k * (turn.mean() + obs), float(width)))
            turns.append(self._decode_work(turn, grown, rows, 0, micro, continuous))
            if k + 1 < K and live[k + 1] > 0:
                calls += B * live[k + 1]
        traj = _trajectory_dist(turn, live, obs, width)
        whole = self._decode_work(traj, prompts, B, 0, micro, continuous)   # the rollout's shape, read downstream
        whole.update(turns=turns, tool_s=calls * per_call if tools else 0.0, tool_calls=calls if tools else 0.0,
                     env_steps=0.0 if tools else calls, expected_turns=E, max_turns=K, turn_tokens=budget,
                     obs_tokens=obs, turns_source="given" if given is not None else "max_turns (upper bound)",
                     kv_tokens=max(w["kv_tokens"] for w in turns),
                     expected_steps=float(sum(w["expected_steps"] for w in turns)),
                     computed_tokens=float(sum(w["computed_tokens"] for w in turns)))
        return whole

    def sequence_work(self, stage: Stage, rows: float | None = None) -> dict:
        """Rows and sequence length of a forward/train stage on the rollout it reads."""
        gen = self.rollout_source(stage)
        batch = next((v.type.batch for v in stage.inputs if v.type.batch), None) or 1
        rows = float(rows if rows is not None else batch)
        if gen is None:
            return {"rows": rows, "seq": 64.0, "prompt": 32.0, "response": 32.0}
        gw = self.generation_work(gen)
        useful = rows * (gw["prompt_mean"] + gw["mean_response"])
        calls = 1.0
        if self.continuous:
            prompt, response = gw["prompt_mean"], gw["mean_response"]
        elif plan.flag(gen, "unpad"):  # rows of a batch (or minibatch, when training) in length groups
            group = gw["batch"]
            if stage.op == "train" and plan.flag(stage, "unpad"):
                group = -(-group // max(1, int(stage.attrs.get("minibatches", 1))))
            group = max(1, int(group))
            prompt = gw["prompt_max"]
            if self._packs(stage):
                tokens, groups = packed_tokens(gw["dist"], self.prompt_lengths(gen), group)
                response, calls = tokens / group - prompt, float(groups)
            else:   # one rectangle cut to the longest response
                response = gw["dist"].expected_max(group)
        else:  # the torch backend pads prompts to the batch's longest and responses to max_new_tokens
            prompt, response = gw["prompt_max"], float(gw["T"])
        return {"rows": rows, "seq": float(prompt + response), "prompt": float(prompt), "response": float(response),
                "calls": calls, "useful_tokens": float(useful), "computed_tokens": float(rows * (prompt + response))}

    def _packs(self, stage: Stage) -> bool:
        """Whether the stage's worker packs unpadded rows in length groups (torch does; FSDP and megatron
        ranks run one cropped rectangle, every rank making the same calls). Named trainers need no layout."""
        run = self.module.run.trainer
        if run != plan.AUTO and not plan.backend_traits(run).solo:
            return plan.backend_traits(run).packs_rows
        trainer, _ = plan.worker_layout(self.module, stage.target, plan.stage_mesh(self.module, stage))
        return plan.backend_traits(trainer).packs_rows

    def _processes(self, stage: Stage, layout: Layout):
        """The (dp, tp, pp) processes that run ``stage`` under ``layout`` on a CPU cluster, or None for one
        process: the model's fixed layout or the candidate's split, under the run's trainer. A group
        generates on full copies, each rank its share of the rows (dp = ranks); a streamed generate is
        decoded by rank 0 alone (one process on one core)."""
        fixed = plan.fixed_layout(self.module.models.get(stage.target or ""))
        par = fixed or plan.Parallel(layout.dp, layout.tp, layout.pp)
        if not plan.backend_traits(plan.resolve_trainer(self.module.run.trainer, par)).dims:
            return None
        if stage.op == "generate":
            return plan.Parallel(1, 1, 1) if plan.stream(stage) is not None else plan.Parallel(par.size, 1, 1)
        return par

    # -- pricing -----------------------------------------------------------------------------------
    def layout(self, stage: Stage) -> Layout:
        sig = plan.layout_signature(stage)
        if sig is None:   # the home mesh depends on the model's other stages
            return plan.stage_layout(self.module, stage)
        key = ("layout", stage.name, stage.target, sig)
        if key not in self._cache:   # parsed once: a stage's layout is read for every task and chunk priced
            self._cache[key] = plan.stage_layout(self.module, stage)
        return self._cache[key]

    def _fit(self, model, primitive: str):
        if self.profile is None:
            return None
        return self.profile.fit(model_key(model), primitive)

    def stage_cost(self, stage: Stage, layout: Layout | None = None, rows: float | None = None) -> StageCost:
        """Price ``stage`` (under ``layout``, default its annotations; ``rows`` overrides the batch: a chunk)."""
        family = stage.op.split(".", 1)[0]
        model = self.module.models.get(stage.target or "") if family in ("generate", "forward", "train") else None
        on_mesh = model is not None or (family in ("sync", "offload", "onload") and stage.target in self.module.models)
        if on_mesh and layout is None:
            layout = self.layout(stage)
        key = ("stage", stage.name, layout, rows, repr(plan.recompute_decision(stage)),
               self._packs(stage) if model is not None and not self.continuous and family != "generate" else None)
        if key in self._cache:
            return self._cache[key]
        if model is None:
            cost = self._driver_cost(stage, rows)
        else:
            cost = self._model_cost(stage, model, layout, rows)
            gain = self.fused_gain(stage)
            if gain:   # a fused pair's pipelines fill each other's bubbles: each priced at its share of the gain
                cost = replace(cost, time_s=cost.time_s / gain, parts={k: v / gain for k, v in cost.parts.items()},
                               work={**cost.work, "fused_gain": gain})
        self._cache[key] = cost
        return cost

    def fused_gain(self, stage: Stage) -> float | None:
        """A fused train stage's predicted gain (``fused = {gain}``, the ``fuse_training`` pass: the unfused
        pipelines' time over the searched fused schedule's), priced on GPU clusters: there the two stages would
        run one after another with their pipelines' bubbles, fused they take the fused schedule's time. On a CPU
        cluster the simulator already shares the cores between the two trains as they run at the same time (no
        bubble is priced), so the gain is not counted twice (None)."""
        f = plan.fused(stage)
        return f.gain if f is not None and f.gain > 1.0 and not self.spec.is_cpu else None

    def tail_phases(self, gen: Stage, ranks: int, below: int) -> tuple[float, float]:
        """The two phases of a migrated generate (the ``tail_migrate`` pass), in seconds: each of the ``ranks``
        processes decodes its own share of the rows until fewer than ``below`` of them decode (a generate of
        that share priced on its own — every process pays the whole per-step overhead, so on an overhead-bound
        CPU the split saves little and takes a core per rank), then one process decodes the rows left: the
        whole batch's decode after all but ``ranks · (below − 1)`` of its rows have finished, plus moving them
        there (:meth:`tail_move`, by the plan's ``move``)."""
        layout = self.layout(gen)
        B = gen.outputs[0].type.batch or 1
        per = -(-B // max(ranks, 1))
        inp = self.price_inputs(gen, [layout])
        work = self._decode_work(self.response_lengths(gen), self.prompt_lengths(gen), per, 0, 1, self.continuous)
        work.update(self._torch_extras(gen, self.module.models[gen.target], work))
        share = {k: float(np.asarray(v).reshape(-1)[0])
                 for k, v in price(np, replace(inp, work=work), self.dispatch).items()}
        head = self._finish_offsets(share, work)[min(per - 1, max(0, per - below))]
        whole = self.stage_cost(gen)
        offsets = whole.finish_offsets or (whole.time_s - self.dispatch,)
        left = min(len(offsets) - 1, ranks * (below - 1))
        tail = max(whole.time_s - self.dispatch - offsets[len(offsets) - 1 - left], 0.0)
        t = plan.tail(gen)
        move = self.tail_move(gen, ranks, below)[t.move if t is not None else "prefill"]
        return head, tail + move

    def tail_move(self, gen: Stage, ranks: int, below: int) -> dict[str, float]:
        """What continuing a migrated tail on one rank costs (the ``tail_migrate`` pass's ``move``): about
        ``ranks · (below − 1)`` rows, each of the expected prompt plus the tokens the length law gives a rank's
        ``(rows − below + 1)``-th finisher, either re-prefilled (a forward of those tokens: matrix products and
        attention at the device's inference rate, plus a per-layer overhead) or moved with their KV caches (their
        bytes through Ray's object store twice — rank to driver to rank, :data:`STORE_CROSSING_S` and
        :data:`STORE_CROSSING_BW` each, plus the host link both ways on a GPU — and a forward of each row's last
        token over its cache). The seconds of both and the rows and tokens they price."""
        model = self.module.models[gen.target]
        arch, spec = arch_numbers(model), self.spec
        per = -(-(gen.outputs[0].type.batch or 1) // max(ranks, 1))
        rows = float(max(1, ranks * (below - 1)))
        stats = self.response_lengths(gen).order_stats(per)
        tokens = self.prompt_lengths(gen).mean() + float(stats[min(len(stats) - 1, max(0, per - below))])
        rate = spec.peak_flops * spec.infer_eff
        prefill = (2.0 * arch["mm"] * rows * tokens + 2.0 * arch["L"] * arch["h"] * rows * tokens ** 2) / rate \
            + arch["L"] * spec.layer_overhead
        step = (2.0 * arch["mm"] * rows + 4.0 * arch["L"] * arch["h"] * rows * tokens) / rate \
            + arch["L"] * spec.layer_overhead
        nbytes = arch["kv_tok"] * spec.bytes_per_param * rows * tokens
        crossing = STORE_CROSSING_S + nbytes / STORE_CROSSING_BW
        if not spec.is_cpu:   # off the device and back on over its host link
            crossing += spec.latency + nbytes / (spec.host_bw * spec.net_eff)
        return {"rows": rows, "tokens": tokens, "kv_bytes": nbytes, "prefill": prefill, "kv": 2.0 * crossing + step}

    def _driver_cost(self, stage: Stage, rows: float | None) -> StageCost:
        op = stage.op
        batch = rows or next((v.type.batch for v in stage.outputs + stage.inputs if v.type.batch), None) or 1
        width = 1.0
        gen = self.rollout_source(stage) if stage.inputs else None
        if gen is not None:
            width = float(self.generation_work(gen)["T"])
        fit = self.profile.compute_fit(op) if self.profile is not None else None
        a, b = (fit if fit else DEFAULT_COMPUTE.get(op, DEFAULT_OTHER_COMPUTE))
        layout = None
        if op.split(".")[0] in ("sync", "offload", "onload"):
            a, b = 0.0, 0.0  # weight transfers: priced by the simulator, on the model's mesh
            layout = self.layout(stage)
        t = float(a + b * batch * width)
        model = stage.target if stage.target in self.module.models else None
        return StageCost(stage.name, op, model, layout, t, {"overhead": t} if not layout else {"comm": t},
                         "overhead" if not layout else "comm", "profile" if fit else
                         ("driver" if not layout else "transfer"), work={"rows": float(batch), "response": width})

    def price_inputs(self, stage: Stage, layouts: list[Layout], rows: float | None = None,
                     threads: int | None = None) -> PriceInputs:
        """The formulas' inputs for ``stage`` under each of ``layouts`` (a model stage); ``threads``: with the
        profile's fits timed at that many threads, unscaled (:meth:`stage_speedup`)."""
        model = self.module.models[stage.target]
        family = stage.op.split(".", 1)[0]
        key = model_key(model)
        prof_threads = self.profile.model_threads(key) if self.profile is not None and threads is None else None
        lay = layout_arrays(layouts, self.spec, self.cluster.per_node, prof_threads,
                            [self._processes(stage, l) for l in layouts] if self.spec.is_cpu else None,
                            self.model_speedup(stage))
        _fit = self._fit if threads is None else (lambda m, prim: self.profile.fit_at(key, prim, threads))
        opt_fit = None
        if family == "generate":
            micro = {l.microbatches for l in layouts}
            if len(micro) > 1:
                raise ValueError("price_inputs: generate layouts must share one microbatches value")
            work = dict(self.generation_work(stage, micro.pop())) if not self.own_weights(stage) else \
                self._vllm_inputs(stage, model, lay)   # continuous batching, waves of what vLLM runs at once
            if rows is not None:
                work["rows"] = float(rows)
            work.update(self._torch_extras(stage, model, work))
        else:
            work = self.sequence_work(stage, rows)
            if family == "train":
                work.update(epochs=float(stage.attrs.get("epochs", 1)),
                            minibatches=float(max(1, min(stage.attrs.get("minibatches", 1), work["rows"]))))
                opt_fit = self._fit(model, "optimizer")
                if plan.offload(stage):
                    work["offload"] = 1.0
                work["call_s"] = float(_fit(model, "train_call") or 0.0)
                traced = plan.recompute_decision(stage)
                if traced is not None and traced.kept is not None:
                    work.update(rc_kept=float(traced.kept), rc_autograd=float(traced.autograd or 0),
                                rc_seconds=float(traced.seconds or 0.0))
                    lay["rc"] = 0.0 * lay["rc"]
        fit = _fit(model, family)
        if family == "generate" and self.own_weights(stage):   # its own fit, else the torch rates (assumed)
            fit = self._vllm_fit(model, fit)
        grid = _fit(model, family + "_grid") if fit is not None and family in ("forward", "train") else None
        return PriceInputs(family, hw_numbers(self.spec), arch_numbers(model), work, lay, fit, opt_fit,
                           [l.recompute for l in layouts], grid)

    def _model_cost(self, stage: Stage, model, layout: Layout, rows: float | None) -> StageCost:
        inp = self.price_inputs(stage, [layout], rows)
        out = price(np, inp, self.dispatch)
        first = {k: float(np.asarray(v).reshape(-1)[0]) for k, v in out.items()}
        work, arch = inp.work, inp.arch
        if inp.family == "generate":
            flops = 2 * arch["mm"] * work["rows"] * work["waves"] * (work["prompt"] + work["expected_steps"])
            summary = {"rows": work["rows"] * work["waves"], "batch": work["batch"], "overcommit": work["delta"],
                       "waves": work["waves"],
                       "prompt": work["prompt"], "max_new_tokens": work["T"],
                       "expected_steps": work["expected_steps"], "mean_response": work["mean_response"],
                       "decode_rows": work["decode_rows"], "useful_tokens": work["useful_tokens"],
                       "computed_tokens": work["computed_tokens"]}
            finish = self._finish_offsets(first, work)
            if "turns" in work:   # a multi-turn generate: its decode calls' flops; its rollout arrives whole
                flops = sum(2 * arch["mm"] * w["rows"] * w["waves"] * (w["prompt"] + w["expected_steps"])
                            for w in work["turns"])
                summary.update({k: work[k] for k in ("max_turns", "expected_turns", "turns_source", "turn_tokens",
                                                     "obs_tokens", "tool_calls", "env_steps")},
                               tool_s=first.get("tools", 0.0), tools=bool(work["tool_calls"]),
                               turn_rows=[w["rows"] * w["waves"] for w in work["turns"]],
                               turn_s=[float(np.asarray(F.generate_time(np, inp.hw, inp.arch, w, inp.lay, inp.fit)
                                                        ["total"]).reshape(-1)[0]) for w in work["turns"]])
                finish = self._turn_finish_offsets(first, work, summary["turn_s"])
            if self.own_weights(stage):   # its source; the refit of a trained model's new weights first
                self._add_refit(stage, model, first, summary)
        else:
            rc = 0 if "rc_kept" in work else RECOMPUTE_POLICIES.index(layout.recompute)
            factor = 1.0 if inp.family == "forward" else F.TRAIN_FLOP_FACTOR[rc] * work["epochs"]
            flops = factor * 2 * arch["mm"] * work["rows"] * work["seq"]
            summary = {k: v for k, v in work.items()}
            finish = ()
        parts = {k: v for k, v in first.items() if k not in ("total", "weights_bytes", "state_bytes",
                                                             "transient_bytes")}
        return StageCost(stage.name, stage.op, model.name, layout, first["total"], parts, _bound(parts),
                         "profile" if inp.fit is not None else "analytic", float(flops), first["weights_bytes"],
                         first["state_bytes"], first["transient_bytes"], summary, finish)

    @staticmethod
    def padding_efficiency(cost: StageCost) -> float | None:
        """Useful tokens / computed tokens of a model stage (prompt and response tokens the samples have,
        against what the stage computes: padding, finished rows still in the decode batch); None for stages
        that do not compute on a rollout's tokens."""
        useful, computed = cost.work.get("useful_tokens"), cost.work.get("computed_tokens")
        if not useful or not computed:
            return None
        return float(min(1.0, useful / computed))

    def _turn_finish_offsets(self, res: dict, work: dict, turn_s: list[float]) -> tuple:
        """Seconds into a multi-turn generate at which the k-th trajectory ends: those that end after turn
        ``j`` (a share ``live[j] - live[j+1]`` of the batch, :meth:`turn_work`'s law) when turn ``j``'s decode and
        the tool calls before it are done — what a streamed multi-turn generate hands on after each turn. The last
        turn's trajectories end with the stage."""
        batch, total = int(work["batch"]), float(res["total"] - self.dispatch)
        E, K = float(work["expected_turns"]), int(work["max_turns"])
        live = [min(max(E - k, 0.0), 1.0) for k in range(K)] + [0.0]
        after = [live[j + 1] for j in range(len(turn_s))]   # who calls a tool (or steps) after turn j
        tools = float(res.get("tools", 0.0))
        per_call = tools / max(sum(after), 1e-12)
        out, at = [], 0.0
        for j, seconds in enumerate(turn_s[:-1]):
            at += seconds
            ending = int(round(batch * (live[j] - live[j + 1])))
            out += [min(at, total)] * max(0, min(ending, batch - len(out)))
            at += per_call * after[j]
        out += [total] * (batch - len(out))   # the last turn's: with the stage
        return tuple(float(x) for x in out)

    def _finish_offsets(self, res: dict, work: dict) -> tuple:
        """Seconds into the stage at which the k-th sample (k = 1..batch) finishes: waves run one after
        another; inside a wave the k-th response ends at the expected k-th order statistic of the lengths
        (decode steps taken as equally expensive)."""
        waves = int(work.get("waves", 1))
        total = (res["total"] - self.dispatch) / waves
        prefill = res.get("prefill", 0.0) / waves
        w = work["steps_w"]
        decode = max(total - prefill, 0.0)
        cum = np.concatenate([[0.0], np.cumsum(w)])
        frac = cum / max(cum[-1], 1e-12)
        at = np.interp(np.asarray(work["order"], dtype=np.float64), np.arange(len(cum)), frac)
        within = [prefill + decode * x for x in at]
        out = [j * total + x for j in range(waves) for x in within]
        return tuple(float(x) for x in out[: int(work["batch"])])

    # -- a stage's own thread speed-up on a CPU cluster ----------------------------------------------
    def model_speedup(self, stage: Stage) -> tuple | None:
        """The stage's model's measured speed-up for its primitive over the grid (one table per model, what the
        layout arrays scale candidate meshes' thread counts with); None off a CPU or without 1-thread points."""
        if self.profile is None or not self.spec.is_cpu or stage.target not in self.module.models:
            return None
        return self.profile.thread_speedup(model_key(self.module.models[stage.target]), stage.op.split(".")[0])

    def stage_speedup(self, stage: Stage, rows: float | None = None) -> tuple | None:
        """``(s(1) = 1, s(2), ..., s(count))`` of ``stage`` (``rows``: a chunk's) on its mesh of ``count``
        cores, counts between the measured ones interpolated, beyond them held; None when the profile timed its
        model at one count only (the host's probe then prices thread counts) or the stage runs off a CPU.

        At -O2 the stages that overlap on the same cores run with fewer torch threads than their mesh has
        (:func:`rlhfc.ir.schedule.stage_threads`: one each on two cores). ``rlhfc profile`` times each model on
        1 thread too, right after each point at its workers' count (``at_threads``). Small models' calls do not
        scale like the host's matmul probe: on the 2-core VM of docs/benchmarks.md a second thread made them no
        faster, the fixed cost of a call (dozens of small kernels, each waking the other thread) larger, while
        the probe said 1.7x. So the simulator prices a call on ``a`` cores' worth of CPU from the stage's own
        times at the measured counts, for this stage's rows and lengths: ``s(n) = T(1) / T(n)``, each ``T`` the
        fit (and correction grid) of the points timed at ``n`` threads."""
        prof = self.profile
        if prof is None or not self.spec.is_cpu or stage.target not in self.module.models or \
                stage.op.split(".")[0] not in ("generate", "forward", "train"):
            return None
        cache = ("speedup", stage.name, self.layout(stage), rows, repr(plan.recompute_decision(stage)),
                 self._packs(stage) if not self.continuous and not stage.op.startswith("generate") else None)
        if cache in self._cache:
            return self._cache[cache]
        counts = prof.thread_counts(model_key(self.module.models[stage.target]))
        times = {}
        for t in counts:
            try:
                inp = self.price_inputs(stage, [self.layout(stage)], rows, threads=t)
            except (KeyError, ValueError):
                continue
            if inp.fit is not None:
                times[t] = float(np.asarray(price(np, inp, 0.0)["total"]).reshape(-1)[0])
        out = None
        if 1 in times and len(times) > 1 and all(v > 0 for v in times.values()):
            xs = sorted(times)
            speed = [times[1] / times[x] for x in xs]
            count = max(xs[-1], self.layout(stage).count)
            out = tuple(float(np.interp(n, xs, speed)) for n in range(1, count + 1))
        self._cache[cache] = out
        return out

    # -- the vLLM rollout engine: its decoding, refit and memory (the rules: rlhfc.cost.engine's docstring) ----
    def vllm_concurrency(self, model, prompt: float, max_new: float) -> int:
        """Requests vLLM decodes at once for ``model``: ``max_num_seqs`` or what the KV cache holds at
        ``prompt + max_new`` tokens each (the profile's recorded engine figures when it has them)."""
        entry, _ = vllm_entry(self.profile, model_key(model))
        entry = entry or {}
        seqs = int(entry.get("max_num_seqs") or VLLM_MAX_SEQS)
        per_token = float(arch_numbers(model)["kv_tok"]) * self.spec.bytes_per_param
        if entry.get("kv_tokens"):
            kv_tokens = float(entry["kv_tokens"])
        elif self.spec.is_cpu:
            kv_tokens = VLLM_CPU_KV_BYTES / max(per_token, 1.0)
        else:   # the KV cache is what the engine's fraction leaves beside its weights and overhead
            kv_tokens = self.gpu_kv_bytes(model, self.gpu_fraction(model)) / max(per_token, 1.0)
        fits = int(kv_tokens // max(prompt + max_new, 1.0))
        return max(1, min(seqs, fits))

    def gpu_kv_bytes(self, model, fraction: float) -> float:
        """KV-cache bytes a CUDA engine of ``model`` gets from ``gpu_memory_utilization = fraction``: the share
        of the device less its weight copy and :data:`~rlhfc.cost.engine.VLLM_GPU_OVERHEAD_BYTES`."""
        copy = arch_numbers(model)["N"] * self.spec.bytes_per_param
        return max(0.0, fraction * self.spec.memory - copy - VLLM_GPU_OVERHEAD_BYTES)

    def gpu_fraction(self, model, dp: int | None = None) -> float:
        """``gpu_memory_utilization`` for the CUDA vLLM engine of ``model``: what it needs — its weight copy, KV
        cache for every row of one rank's share of its largest generate stage at prompt + ``max_new_tokens``
        tokens (at most ``max_num_seqs`` rows at once), and :data:`~rlhfc.cost.engine.VLLM_GPU_OVERHEAD_BYTES` —,
        as a share of the device rounded up to 0.01, between :data:`~rlhfc.cost.engine.VLLM_GPU_MIN_FRACTION`
        and vLLM's default 0.9. Not all of the device (vLLM's default): the trained model co-located with it
        keeps its weights, gradients and optimizer state on the device while the engine generates, and vLLM
        refuses to start when less than its fraction is free. A stage's ``gpu_memory`` annotation, when the
        compiler set it, is the answer; ``dp`` overrides the stage's data-parallel ranks (each rank's engine
        decodes its share)."""
        gens = [s for s in self.module.graph.stages if s.op == "generate" and s.target == model.name]
        marked = [plan.gpu_memory(s) for s in gens if plan.gpu_memory(s) is not None]   # passes.engine.set_gpu_memory
        if marked and dp is None:
            return max(marked)
        arch = arch_numbers(model)
        entry, _ = vllm_entry(self.profile, model_key(model))
        seqs = int((entry or {}).get("max_num_seqs") or VLLM_MAX_SEQS)
        kv = 0.0
        for s in gens:
            one = self.generation_work(s, 1, continuous=True)
            ranks = dp if dp is not None else max(1, int(self.layout(s).dp))
            rows = min(seqs, math.ceil((int(one["batch"]) + int(one["delta"])) / max(1, ranks)))
            kv = max(kv, rows * (float(one["prompt"]) + float(one["T"])) * arch["kv_tok"] * self.spec.bytes_per_param)
        need = arch["N"] * self.spec.bytes_per_param + kv + VLLM_GPU_OVERHEAD_BYTES
        return min(VLLM_GPU_MEMORY_FRACTION,
                   max(VLLM_GPU_MIN_FRACTION, math.ceil(100.0 * need / self.spec.memory) / 100.0))

    def vllm_work(self, stage: Stage, model, dp: int = 1) -> tuple[dict, int, str]:
        """(the generation work of one wave under continuous batching, the waves, the fit's source) of
        generate ``stage`` on vLLM (:mod:`rlhfc.cost.engine`). ``dp``: the generating group's data-parallel
        ranks, each of which runs an engine on its share of the rows, so the waves are those of one rank's share."""
        one = self.generation_work(stage, 1, continuous=True)
        n = int(one["batch"]) + int(one["delta"])
        share = math.ceil(n / max(1, int(dp)))
        waves = max(1, math.ceil(share / self.vllm_concurrency(model, one["prompt"], one["T"])))
        work = dict(one if waves == 1 else self.generation_work(stage, waves, continuous=True))
        return work, waves, "profile" if vllm_generate_fit(self.profile, model) is not None else "assumed"

    def vllm_step_overhead(self, model) -> float:
        """Seconds per decode step added to the torch rates under the catalog assumption (0 with a vLLM fit)."""
        if vllm_generate_fit(self.profile, model) is not None:
            return 0.0
        return VLLM_STEP_S["cpu" if self.spec.is_cpu else "gpu"]

    def refit_seconds(self, model, nbytes: float, bucket_mb: int) -> tuple[float, str]:
        """(seconds, source) of a refit of ``model``'s ``nbytes`` of weights in buckets of ``bucket_mb`` MiB
        (:mod:`rlhfc.cost.engine`): ``profile`` when the per-layer term was measured, else ``assumed``."""
        entry, _ = vllm_entry(self.profile, model_key(model))
        per_layer = (entry or {}).get("fit", {}).get("refit_layer_s")
        return predict_refit(nbytes, model.layers, bucket_mb, self.spec, per_layer), \
            "profile" if per_layer is not None else "assumed"

    def full_bytes(self, model) -> float:
        """Bytes of the whole model in the engine's dtype (what a rank's engine holds and a refit loads)."""
        return float(arch_numbers(model)["N"] * self.spec.bytes_per_param)

    def engine_bytes(self, model, dp: int | None = None) -> dict[str, float]:
        """Device memory the vLLM engine of ``model`` takes besides the trainer's own copy: ``{"resident": bytes
        held for the whole run, "transient": bytes held while its generate stages run}``.

        On CPU the engine never sleeps: its copy of the weights (in the model's dtype) and its KV-cache
        reservation (``VLLM_CPU_KVCACHE_SPACE``, :data:`~rlhfc.cost.engine.VLLM_CPU_KV_BYTES`; the profile's
        recorded KV tokens when it has them) stay for the whole run. On CUDA the runtime puts the engine to
        sleep (level 1) after every generate call, which offloads its weights to host memory and frees its KV
        cache, so it holds memory only while a generate stage runs — then its ``gpu_memory_utilization`` share
        of the device (:meth:`gpu_fraction`: its weights copy, the KV cache its rows need and vLLM's overhead),
        in place of the torch decode loop's KV cache."""
        arch = arch_numbers(model)
        copy = arch["N"] * self.spec.bytes_per_param
        if not self.spec.is_cpu:
            return {"resident": 0.0, "transient": max(copy, self.gpu_fraction(model, dp) * self.spec.memory)}
        entry, _ = vllm_entry(self.profile, model_key(model))
        kv_tokens = (entry or {}).get("kv_tokens")
        kv = float(kv_tokens) * arch["kv_tok"] * self.spec.bytes_per_param if kv_tokens else float(VLLM_CPU_KV_BYTES)
        return {"resident": float(copy + kv), "transient": 0.0}

    def add_refit_batched(self, stage: Stage, model, out: dict, layouts=None) -> None:
        """What :meth:`stage_cost` adds for the vLLM engine, on a batch of candidate layouts' prices
        (:func:`rlhfc.cost.batched.evaluate`): the refit of the whole model (every rank's engine holds it,
        whatever the candidate's layout), and the engine's awake footprint, as the per-stage price has (on
        GPUs each candidate's: its ``dp`` sets the rows a rank's engine holds KV cache for, :meth:`gpu_fraction`)."""
        if model.trainable:
            bucket = plan.refit_mb(stage) or 64
            refit = self.refit_seconds(model, self.full_bytes(model), bucket)[0]   # the whole model on every rank
            out["total"] = np.asarray(out["total"], dtype=np.float64) + refit
        if self.spec.is_cpu or not layouts:
            awake = self.engine_bytes(model)["transient"]
        else:
            by_dp = {dp: self.engine_bytes(model, dp)["transient"] for dp in {int(x.dp) for x in layouts}}
            awake = np.array([by_dp[int(x.dp)] for x in layouts], dtype=np.float64)
        if np.any(awake):
            out["transient_bytes"] = 0.0 * np.asarray(out["transient_bytes"], dtype=np.float64) + awake

    def _vllm_inputs(self, stage: Stage, model, lay: dict) -> dict:
        """The work of one wave of ``stage`` on vLLM; sets the layout arrays' ``mb`` to the waves. A group of
        ``dp`` ranks runs an engine per rank (:mod:`rlhfc.runtime.rollout.vllm`), each on its share of the rows:
        the formulas divide each wave's rows by ``dp``, and the waves are one share's (candidate layouts of
        different ``dp`` are priced with the fewest ranks' waves, an upper bound for the others)."""
        dp = int(np.min(np.asarray(lay["dp"]))) if np.size(lay["dp"]) else 1
        work, waves, _ = self.vllm_work(stage, model, dp)
        lay["mb"] = 0.0 * lay["mb"] + waves
        return work

    def _vllm_fit(self, model, torch_fit):
        """The generate fit vLLM is priced with: its own (profile), else the torch fit plus the assumed per-step
        overhead, else None (the roofline under continuous batching)."""
        fit = vllm_generate_fit(self.profile, model)
        if fit is not None or torch_fit is None:
            return fit
        return list(torch_fit[:2]) + [torch_fit[2] + self.vllm_step_overhead(model)] + list(torch_fit[3:])

    def _add_refit(self, stage: Stage, model, first: dict, summary: dict) -> None:
        """Record the engine in a generate's summary and add a trained model's refit to its time (and, on GPUs,
        the engine's awake footprint to its transient memory: :meth:`engine_bytes`)."""
        summary["engine"], summary["engine_source"] = "vllm", self.vllm_work(stage, model)[2]
        if model.trainable:
            bucket = plan.refit_mb(stage) or 64   # the realloc pass's, else the runtime's default
            # every rank's engine holds the whole model, whatever the trainer's layout: it loads all of it
            first["refit"], summary["refit_source"] = self.refit_seconds(model, self.full_bytes(model), bucket)
            first["total"] += first["refit"]
        awake = self.engine_bytes(model)["transient"]
        if awake:
            first["transient_bytes"] = awake
            summary["gpu_memory_utilization"] = self.gpu_fraction(model)

    def _torch_extras(self, stage: Stage, model, work: dict) -> dict:
        """A torch-engine generate's ``lp`` (fraction its kept log-probs add) and ``chunk_s`` (seconds its
        streamed chunks add), from the profile (:mod:`rlhfc.cost.engine`); {} without a profile or on vLLM."""
        if self.profile is None or self.own_weights(stage):
            return {}
        key, chunk = model_key(model), plan.stream_chunk(stage)
        lp = self.profile.fit(key, "generate_logprobs") if plan.flag(stage, "logprobs") else None
        per = self.profile.fit(key, "generate_chunk") if chunk else None
        return {"lp": float(lp or 0.0), "chunk_s": float(per or 0.0) * (math.ceil(work["batch"] / chunk) if chunk else 0)}

    def all_costs(self) -> dict[str, StageCost]:
        return {s.name: self.stage_cost(s) for s in self.module.graph.stages}

    def with_config(self, **changes) -> "CostModel":
        return CostModel(self.module, replace(self.config, **changes))


def engine_prices(module: Module, stages, config: CostConfig | None = None) -> dict[str, float]:
    """Seconds of ``stages`` (generate stages of one model) on the default engine and on the one ``rollout =
    auto`` weighs against it (:func:`rlhfc.ir.plan.auto_engine`), each under the plan's layouts, an engine with
    its own weights with its refit when the model is trained: ``{"torch": s, "vllm": s}``."""
    base = config or CostConfig()
    out = {}
    for engine in (DEFAULT_ROLLOUT, plan.auto_engine()):
        cm = CostModel(module, replace(base, engine=engine))
        out[engine] = float(sum(cm.stage_cost(s).time_s for s in stages))
    return out
