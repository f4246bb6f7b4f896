"""``reuse_logprobs``: the policy's old log-probs come from sampling instead of a second forward.

PPO needs the log-prob of every response token under the weights that sampled
it ("old" log-probs). Written plainly, the program recomputes them with a full
forward of the actor over the rollout (``logp = actor.logprobs(roll)``) after
generation ends — on the critical path, on the generating model's worker.
Generation has already computed those numbers: the logits it sampled each token
from. The pass marks the generate stage ``logprobs = true`` (the worker keeps
``log_softmax(logits / T)`` of each sampled token) and turns the forward into a
driver-side ``compute.sample_logprobs`` that reads them from the rollout.

Applies to a ``forward.logprobs`` of the generating model on its own rollout,
at the generate's temperature (> 0), with no train stage of that model between
the two (the weights are those that sampled). With overcommitment a carried
sample resumes with a prefill of its partial response; the pass takes those
tokens' log-probs from that prefill, i.e. under the current weights — what the
forward would compute.

Exact in real arithmetic; in floating point, incremental decoding with a KV
cache and a full forward sum in a different order, so values can differ in the
last bits (measured ~1e-7). ``rlhfc passes`` lists it as exact up to rounding;
tested end to end against -O0 (docs/runtime.md, "Exactness").

Not on a generate stage that runs on vLLM (``run { rollout = vllm }``, or ``auto``'s choice): vLLM's sampled-token log-probs come from other kernels (and, on
CPU, other arithmetic) than the trainer's forward, so they are not the old log-probs PPO's ratio needs;
the trainer's forward stays, and the step records how far apart the two are
(``rollout_logprob_diff_mean``/``_max``; ``ppo_clip(..., tis_cap = C)`` corrects for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.contract.engines import rollout_traits
from rlhfc.ir import Module, plan

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class ReuseLogprobs(Pass):
    name = "reuse_logprobs"
    description = "take the policy's old log-probs from sampling instead of a second forward"
    exact = True
    rounding = True

    def run(self, module: Module) -> Module:
        g = module.graph
        changed = False
        for s in list(g.stages):
            if s.op != "forward.logprobs" or len(s.inputs) != 1:
                continue
            try:
                gen = g.producer(s.inputs[0])
            except KeyError:
                continue
            temperature = float(s.attrs.get("temperature", 1.0))
            if gen.op != "generate" or not rollout_traits(plan.stage_engine(module, gen)).trainer_numerics:
                continue
            if plan.async_rollout(module, gen) is not None:   # the forward is decoupled PPO's proximal policy
                continue
            if gen.target != s.target or temperature <= 0 \
                    or float(gen.attrs.get("temperature", 1.0)) != temperature:
                continue
            between = g.stages[g.stages.index(gen) + 1:g.stages.index(s)]
            if any(x.op == "train" and x.target == s.target for x in between):
                continue
            to_sample_logprobs(gen, s)
            changed = True
        if changed:
            module.refresh_versions()
        return module


def to_sample_logprobs(gen, forward) -> None:
    """Turn ``forward`` (the generating model's ``forward.logprobs`` over ``gen``'s rollout) into a driver-side
    ``compute.sample_logprobs`` reading the log-probs ``gen`` keeps (marked ``logprobs = true``)."""
    plan.set_flag(gen, "logprobs")
    forward.op, forward.target = "compute.sample_logprobs", None
    forward.attrs = {"temperature": float(forward.attrs.get("temperature", 1.0))}
    forward.annotations = {}


def to_forward_logprobs(gen, stage) -> None:
    """The inverse of :func:`to_sample_logprobs`: ``stage`` (a ``compute.sample_logprobs`` reading ``gen``'s
    rollout) becomes the generating model's ``forward.logprobs`` again, and ``gen`` keeps no sampling log-probs."""
    stage.op, stage.target = "forward.logprobs", gen.target
    stage.attrs = {"temperature": float(stage.attrs.get("temperature", 1.0))}
    stage.annotations = {}
    plan.unset(gen, "logprobs")


def reuses(module: Module) -> bool:
    """Whether the pass turned a forward of ``module`` into a :func:`take_back`-able ``compute.sample_logprobs``."""
    return any(s.op == "compute.sample_logprobs" for s in module.graph.stages)


def take_back(module: Module) -> Module:
    """The pass's decision taken back: each ``compute.sample_logprobs`` becomes the generating model's
    ``forward.logprobs`` over the rollout again (as the program wrote it) and the generate stage no longer
    keeps its sampled log-probs. The placement search prices a plan this way too (:data:`rlhfc.passes.layouts.
    OLD_LOGPROBS`): the baseline systems recompute them, and where a forward beside the others costs less
    than the log-probs' bookkeeping during generation (on 2 CPU cores) the forward is faster."""
    g = module.graph
    changed = False
    for s in g.stages:
        if s.op != "compute.sample_logprobs":
            continue
        gen = g.producer(s.inputs[0])
        ahead = plan.async_rollout(module, gen)
        if ahead is not None and ahead.proximal == "loglinear":   # A-3PO's: the loss interpolates from them
            continue
        to_forward_logprobs(gen, s)
        changed = True
    if changed:
        module.refresh_versions()
    return module
