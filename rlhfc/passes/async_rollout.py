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

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0 (0: synchronous)")
        if self.behaviour_cap <= 1:
            raise ValueError("behaviour_cap must be > 1 (the weight of a token whose policy did not change is 1)")

    def run(self, module: Module) -> Module:
        stated = module.run.staleness
        k = stated if stated is not None else self.staleness
        changed = False
        for gen in module.graph.stages:
            if gen.op != "generate":
                continue
            plan.unset(gen, plan.AsyncRollout.key)
            if k > 0 and plan.can_run_ahead(module, gen):
                gen.annotations[plan.AsyncRollout.key] = plan.AsyncRollout(k, self.behaviour_cap).print()
                changed = True
        if changed and stated is None:
            plan.note_changes_training(module, "async_rollout")
        module.refresh_versions()
        return module
