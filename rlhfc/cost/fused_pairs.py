"""Which train stages of a program fuse into one pipeline schedule (RLHFuse), and their searched schedule.

The IR side of :mod:`rlhfc.cost.fused_schedule`: the ``fuse_training`` pass marks the pairs, ``explain`` redraws
their schedule, both from here so they agree.
"""

from __future__ import annotations

from rlhfc.contract.engines import train_traits
from rlhfc.ir import Module, Stage, plan

from .fused_schedule import Pipeline, Schedule, search


def micro_batches(rows: int, pp: int) -> int:
    """The micro-batches the megatron backend cuts ``rows`` into on ``pp`` stages: the largest count up to
    ``2 · pp`` that divides the rows (:meth:`rlhfc.runtime.train.megatron.MegatronBackend._microbatches`)."""
    if pp == 1:
        return 1
    return max(m for m in range(1, min(rows, 2 * pp) + 1) if rows % m == 0)


def fuse_key(module: Module, s: Stage) -> tuple | None:
    """What two train stages must share to fuse (None: this one cannot): a backend with pipeline stages, the
    same ``pp > 1`` and ``tp`` with ``dp = 1`` on the same mesh, one overlap group (launched together), the same
    epochs, batch and minibatches (each minibatch's schedule pairs with the other's)."""
    if s.op != "train":
        return None
    mesh = plan.stage_mesh(module, s)
    trainer, lay = plan.worker_layout(module, s.target, mesh)
    if "pp" not in train_traits(trainer).dims or lay.pp < 2 or lay.dp != 1:
        return None
    batch = s.inputs[0].type.batch if s.inputs and s.inputs[0].type.batch else None
    group = plan.overlap_group(s)
    if batch is None or group is None:
        return None
    return (mesh, lay.pp, lay.tp, group, int(s.attrs.get("epochs", 1)), batch, int(s.attrs.get("minibatches", 1)))


def pair_schedule(module: Module, first: Stage, second: Stage, *, iterations: int = 2000) -> Schedule:
    """The searched fused schedule of two train stages that fuse (:func:`fuse_key`): each a pipeline of the
    backend's micro-batches (:func:`micro_batches`) whose per-stage forward comes from the cost model's unfused
    price of its train stage (1F1B's ``micro + pp − 1`` slots of a forward and a backward, the backward twice the
    forward). Seeded: the same program gives the same schedule."""
    from .model import CostModel

    key = fuse_key(module, first)
    pp, rows = key[1], key[5] // key[6]
    micro = micro_batches(rows, pp)
    cm = CostModel(module)
    pipes = []
    for s in (first, second):
        seconds = float(cm.stage_cost(s).time_s) * (cm.fused_gain(s) or 1.0)   # its unfused price
        forward = max(seconds / (3.0 * (micro + pp - 1)), 1e-9)
        pipes.append(Pipeline(s.target, micro, forward, 2.0 * forward))
    return search(pp, pipes[0], pipes[1], iterations=iterations, seed=0, time_limit_s=10.0)
