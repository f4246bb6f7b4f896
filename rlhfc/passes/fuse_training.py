"""``fuse_training`` (RLHFuse's fused actor/critic training): two pipeline-parallel train stages on the same
devices run as one interleaved schedule.

When two models train with ``pp = P > 1`` stages on the same devices, each model's 1F1B schedule leaves
pipeline bubbles: its first stage idles while micro-batches travel to the last and back. RLHFuse (NSDI '25, arXiv
2409.13221) places the second model's stages in reverse (its stage ``s`` on the device of the first's stage
``P − 1 − s``) and runs both at once, so each fills the other's bubbles; the order each device runs the two
models' operations in is searched (:func:`rlhfc.cost.fused_schedule.search`, simulated annealing, with its lower
bound max(critical path, busiest device)). This pass finds such pairs and writes the order into both train stages
(``fused = {role, with, orders}``): the orders are the searched schedule made executable by the runtime
(:func:`rlhfc.cost.fused_schedule.device_orders`: each model's operations in its rank's own 1F1B order), and the
megatron backend runs them (:mod:`rlhfc.runtime.train.fused`). The second model's ranks are pinned to the cores
of the devices in reverse (the plan's ``reversed_stages``).

Exact: each model's ranks run the same operations in the same order as unfused, only when each starts changes
(bit for bit: tests/runtime/test_fused_train.py; with tail_migrate too, tests/e2e/test_fused_run.py). A pair qualifies when both train stages run under a backend with
pipeline stages (its ``pp`` dimension) with the same ``pp > 1`` and ``tp``, ``dp = 1``, on the same mesh, in the
same overlap group (launched together: the ``parallelize`` pass), on batches of the same size cut into the same
minibatches and epochs (so each minibatch's schedule pairs with the other's). Elsewhere the pass does nothing
(documented, not an error: -O2 runs it on every program); ``explain`` says which pair it fused, the searched
schedule's gain and its gap to the lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.cost.fused_pairs import fuse_key, pair_schedule
from rlhfc.cost.fused_schedule import device_orders
from rlhfc.ir import Module, plan

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class FuseTraining(Pass):
    name = "fuse_training"
    description = "train two pipeline-parallel models on the same devices as one interleaved schedule (RLHFuse)"
    exact = True
    iterations: int = field(default=2000, metadata={"doc": "simulated-annealing moves of the schedule search"})

    def run(self, module: Module) -> Module:
        trains = [s for s in module.graph.stages if s.op == "train"]
        for s in trains:
            plan.set_fused(s, None)   # idempotent: its own marks only
        keyed: dict = {}
        for s in trains:
            key = fuse_key(module, s)
            if key is not None:
                keyed.setdefault(key, []).append(s)
        for stages in keyed.values():
            if len(stages) < 2:
                continue
            first, second = stages[0], stages[1]
            schedule = pair_schedule(module, first, second, iterations=self.iterations)
            orders, span = device_orders(schedule)
            text = [" ".join(f"{m}{k}{j}" for m, k, j in o) for o in orders]
            gain = max(1.0, schedule.unfused / span) if span > 0 else 1.0
            for role, (s, other) in enumerate(((first, second), (second, first))):
                plan.set_fused(s, plan.Fused(role, other.name, tuple(text), gain))
        return module
