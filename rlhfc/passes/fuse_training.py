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
(bit for bit: tests/e2e/test_fused_run.py). A pair qualifies when both train stages run under a backend with
pipeline stages (its ``pp`` dimension) with the same ``pp > 1`` and ``tp``, ``dp = 1``, on the same mesh, in the
same overlap group (launched together: the ``parallelize`` pass), on batches of the same size cut into the same
minibatches and epochs (so each minibatch's schedule pairs with the other's). Elsewhere the pass does nothing
(documented, not an error: -O2 runs it on every program); ``explain`` says which pair it fused, the searched
schedule's gain and its gap to the lower bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.contract.engines import train_traits
from rlhfc.cost.fused_schedule import Pipeline, device_orders, search
from rlhfc.ir import Module, plan

from .base import Pass, register_pass


def micro_batches(rows: int, pp: int) -> int:
    """The micro-batches the megatron backend cuts ``rows`` into on ``pp`` stages: the largest count up to
    ``2 · pp`` that divides the rows (:meth:`rlhfc.runtime.train.megatron.MegatronBackend._microbatches`)."""
    if pp == 1:
        return 1
    return max(m for m in range(1, min(rows, 2 * pp) + 1) if rows % m == 0)


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
            s.annotations.pop(plan.Fused.key, None)   # idempotent: its own marks only
        keyed: dict = {}
        for s in trains:
            key = self._key(module, s)
            if key is not None:
                keyed.setdefault(key, []).append(s)
        for key, stages in keyed.items():
            if len(stages) < 2:
                continue
            first, second = stages[0], stages[1]
            pp, rows = key[1], key[5] // key[6]
            micro = micro_batches(rows, pp)
            pipes = [self._pipeline(module, s, micro, pp) for s in (first, second)]
            schedule = search(pp, pipes[0], pipes[1], iterations=self.iterations, seed=0, time_limit_s=10.0)
            orders, _ = device_orders(schedule)
            text = [" ".join(f"{m}{k}{j}" for m, k, j in o) for o in orders]
            for role, (s, other) in enumerate(((first, second), (second, first))):
                s.annotations[plan.Fused.key] = plan.Fused(role, other.name, tuple(text)).print()
        return module

    @staticmethod
    def _key(module: Module, s) -> tuple | None:
        """What two train stages must share to fuse (None: this one cannot)."""
        mesh = plan.stage_mesh(module, s)
        trainer, lay = plan.worker_layout(module, s.target, mesh)
        if "pp" not in train_traits(trainer).dims or lay.pp < 2 or lay.dp != 1:
            return None
        batch = s.inputs[0].type.batch if s.inputs and s.inputs[0].type.batch else None
        group = plan.overlap_group(s)
        if batch is None or group is None:
            return None
        return (mesh, lay.pp, lay.tp, group, int(s.attrs.get("epochs", 1)), batch, int(s.attrs.get("minibatches", 1)))

    @staticmethod
    def _pipeline(module: Module, s, micro: int, pp: int) -> Pipeline:
        """The stage's pipeline as the search sees it: one micro-batch's forward through one stage from the
        cost model's price of the train stage (1F1B's ``(micro + pp − 1)`` slots of a forward and a backward,
        the backward twice the forward)."""
        from rlhfc.cost import CostModel

        seconds = float(CostModel(module).stage_cost(s).time_s)
        forward = max(seconds / (3.0 * (micro + pp - 1)), 1e-9)
        return Pipeline(s.target, micro, forward, 2.0 * forward)
