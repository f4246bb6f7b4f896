"""``async_rollout`` (AReaL, verl's one-step-off and fully-async modes): generation runs ahead of training.

The weights a step's ``generate`` reads cross a step boundary: ``version @actor %actor_train -> %roll [+1]``.
With a staleness bound K the edge reads ``[+1..+1+K]``: the generations of steps t+1 … t+K run with older
weights while step t computes its forwards and trains, on the meshes the placement gives generation and
training (a generating copy on its own mesh overlaps training; on the trainer's own worker the generation is
queued before the train call, so it overlaps the other models' stages). The driver launches generations under
AReaL's admission rule, ``(K + version + 1) · batch − in flight − accepted`` samples of room, draws their
prompts in launch order, and a weight sync to a generating copy is queued between its generations instead
of awaited (:meth:`rlhfc.runtime.job.Job.ahead`). Each sample records the weights version that generated it;
the run checks the bound from those records.

Correction: the step's recomputed log-probs (``actor.logprobs(roll)``, the weights at the start of the step)
are the *proximal* policy, the generating weights' own sampling log-probs the *behaviour* policy; the policy
loss is decoupled PPO (:func:`rlhfc.runtime.rl.ppo.policy_loss`): the clipped ratio against the proximal
policy, each token weighted by exp(proximal − behaviour) and dropped above ``behaviour_cap``.

**A-3PO** (``proximal = loglinear``; arXiv 2512.06547, AReaL's ``prox_logp_method = loglinear``): the proximal
forward is dropped (the policy's ``logprobs`` over the rollout become the sampling log-probs, as ``reuse_logprobs``
makes them) and the train step interpolates the proximal log-probs from the behaviour ones and the current
policy's, per sample: ``prox = behaviour + α (current − behaviour)`` with ``α = s / (s + 1)``, ``s`` the versions
the sample's weights lag the step's (0 for a fresh sample: the proximal policy is then the behaviour policy
itself). It saves a forward over the batch per step and changes the loss further (an approximation of decoupled
PPO; the KL reward, if any, reads the behaviour log-probs). ``proximal = auto`` (the default) prices the step both
ways (:mod:`rlhfc.passes.predict`) and takes ``loglinear`` when it is predicted at least 5 % faster; ``recompute``
always keeps the forward. A program's stated ``run { staleness = K }`` without the pass (-O0 to -O2)
is decoupled PPO with the forward.

The program's ``run { staleness = K }`` is part of its meaning and runs at every level, this pass or not;
the pass (in -O3, or named) gives K = ``staleness`` (default 1) to each generate of a trained model where the
program states none, and records the cap. ``staleness = 0`` in the program keeps the job synchronous.

NOT exact: the samples a step trains on come from older weights. It marks the module ``changes_training``.
It leaves alone a generate whose prompts another stage also reads (ReMax's greedy baseline generates from the
same prompts), one whose group is refilled (DAPO's dynamic sampling re-runs the round), and generates of
frozen models. A generate it marks is not streamed or overcommitted, and its log-prob forward is not replaced
by the sampling log-probs (``reuse_logprobs``): that forward is the proximal policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.ir import Module, plan

from .base import Pass, register_pass
from .predict import Faster
from .reuse_logprobs import to_forward_logprobs, to_sample_logprobs


@register_pass
@dataclass(frozen=True)
class AsyncRollout(Pass):
    name = "async_rollout"
    description = "generation runs up to K steps ahead of training, decoupled PPO corrects (changes training)"
    exact = False
    staleness: int = field(default=1, metadata={"doc": "versions a sample's weights may lag (where the program "
                                                       "states no run { staleness })"})
    behaviour_cap: float = field(default=5.0, metadata={
        "doc": "tokens whose behaviour weight exp(proximal - behaviour) exceeds it are dropped from the loss"})
    proximal: str = field(default="auto", metadata={
        "doc": "recompute: decoupled PPO's proximal forward; loglinear: A-3PO's interpolation, no forward; auto "
               "(the default): loglinear where the step is predicted at least 5 % faster"})
    when: str = field(default="always", metadata={
        "doc": "always: K wherever a generate can run ahead; faster (-O3): only where the step is predicted at "
               "least 5 % faster than the synchronous plan the passes before made (streamed, overcommitted)"})

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0 (0: synchronous)")
        if self.behaviour_cap <= 1:
            raise ValueError("behaviour_cap must be > 1 (the weight of a token whose policy did not change is 1)")
        if self.proximal not in plan.PROXIMAL_METHODS + ("auto",):
            raise ValueError(f"proximal must be one of {', '.join(plan.PROXIMAL_METHODS + ('auto',))}, "
                             f"not {self.proximal!r}")
        if self.when not in ("always", "faster"):
            raise ValueError(f"when must be always or faster, not {self.when!r}")

    def run(self, module: Module) -> Module:
        stated = module.run.staleness
        k = stated if stated is not None else self.staleness
        choose = self.when == "faster" and stated is None
        ahead = module.clone() if choose else module
        changed = False
        for gen in ahead.graph.stages:
            if gen.op != "generate":
                continue
            plan.unset(gen, plan.AsyncRollout.key)
            if k > 0 and plan.can_run_ahead(ahead, gen):
                gen.annotations[plan.AsyncRollout.key] = plan.AsyncRollout(k, self.behaviour_cap).print()
                take_back_sync_overlap(ahead, gen)
                changed = True
        if changed and not any(plan.overcommit(s) for s in ahead.graph.stages):
            plan.unnote_changes_training(ahead, "overcommit")   # it took back every overcommitment
        if changed and stated is None:
            plan.note_changes_training(ahead, "async_rollout")
        ahead.refresh_versions()
        faster = Faster()   # each candidate plan simulated once
        if changed and self.proximal != "recompute":
            interpolated = interpolate_proximal(ahead.clone())
            if self.proximal == "loglinear" or faster(interpolated, ahead):
                if interpolated.run.staleness is not None:   # the program's own bound, a loss it did not ask for
                    plan.note_changes_training(interpolated, "async_rollout")
                ahead = interpolated
        if choose and changed and not faster(ahead, module):
            return module   # -O3: the synchronous plan is predicted as fast
        return ahead


def take_back_sync_overlap(module: Module, gen) -> None:
    """What the passes before did to ``gen`` for a synchronous step, taken back now that it runs ahead: its
    stream (and its consumers' chunks), its overcommitment, and the reuse of its sampling log-probs in place of
    the proximal forward (the forward comes back; A-3PO may drop it again)."""
    for s in plan.stream_consumers(module.graph, gen):
        plan.unset(s, "stream_from")
    plan.unset(gen, plan.Stream.key, plan.Overcommit.key)
    roll = gen.outputs[0].name
    for s in module.graph.stages:
        if s.op == "compute.sample_logprobs" and s.inputs and s.inputs[0].name == roll:
            to_forward_logprobs(gen, s)


def proximal_forwards(module: Module, gen) -> list:
    """The forwards that give an asynchronous ``gen``'s loss its proximal policy: the generating model's
    ``forward.logprobs`` over the rollout, at the generate's temperature, with no train of the model between."""
    g = module.graph
    out = []
    for s in g.stages:
        if s.op != "forward.logprobs" or len(s.inputs) != 1 or s.target != gen.target:
            continue
        try:
            if g.producer(s.inputs[0]) is not gen:
                continue
        except KeyError:
            continue
        between = g.stages[g.stages.index(gen) + 1:g.stages.index(s)]
        if float(s.attrs.get("temperature", 1.0)) == float(gen.attrs.get("temperature", 1.0)) > 0 \
                and not any(x.op == "train" and x.target == s.target for x in between):
            out.append(s)
    return out


def interpolate_proximal(module: Module) -> Module:
    """``module`` with A-3PO on each asynchronous generate that has a proximal forward: the forward becomes the
    sampling log-probs (``compute.sample_logprobs``) and the annotation says ``proximal = loglinear``."""
    changed = False
    for gen in module.graph.stages:
        ahead = plan.async_rollout(module, gen) if gen.op == "generate" else None
        forwards = proximal_forwards(module, gen) if ahead is not None else []
        if not forwards:
            continue
        for s in forwards:
            to_sample_logprobs(gen, s)
        gen.annotations[plan.AsyncRollout.key] = plan.AsyncRollout(ahead.staleness, ahead.behaviour_cap,
                                                                   "loglinear").print()
        changed = True
    if changed:
        module.refresh_versions()
    return module

