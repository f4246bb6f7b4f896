"""What the compiler and the runtime agree on; both import it, neither copies its rules.

It imports nothing of rlhfc and no third-party package, so a job reads its plan without the compiler and
the compiler prices an engine without importing it.

* ``plan``     ``plan.json`` as typed, versioned dataclasses (:class:`Plan`, :func:`load_plan`).
* ``engines``  the registries of rollout engines and train backends: each one's traits (what the compiler
               checks and prices) and the runtime class that runs it, registered by the engine's own module.
* ``rules``    constants and names both sides use (the length-group cost, the decoder's compaction, the
               recompute op keys).
"""

from .engines import (RolloutTraits, TrainTraits, register_rollout, register_train, rollout_engines, rollout_traits,
                      train_backends, train_traits)
from .plan import PLAN_FORMAT, Plan, PlanFormatError, load_plan
from .rules import DECODE_COMPACT_FRACTION, GROUP_COST_TOKENS, op_key

__all__ = ["DECODE_COMPACT_FRACTION", "GROUP_COST_TOKENS", "PLAN_FORMAT", "Plan", "PlanFormatError", "RolloutTraits",
           "TrainTraits", "load_plan", "op_key", "register_rollout", "register_train", "rollout_engines",
           "rollout_traits", "train_backends", "train_traits"]
