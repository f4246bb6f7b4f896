"""What a placement search asks of every candidate plan, without the simulation's full record.

A search prices a thousand plans; for each it needs two numbers the simulator also gives — the seconds per step
and whether every device's peak fits — but not each device's statistics, the critical path or the tasks at
each peak. On a cluster whose devices run one task at a time (GPUs: :func:`rlhfc.cost.scheduling._schedule_exclusive`)
the tasks touching a device never overlap there, so its peak is what stays resident plus the largest
activations of one task that takes time on it: no sweep over the timeline, and for the memory check alone no
timeline at all. Both are the simulator's numbers exactly (tests compare them on every kind of plan); a CPU
cluster's processor sharing does overlap tasks, and is simulated in full.
"""

from __future__ import annotations

from rlhfc.ir import Module

from .model import CostModel
from .scheduling import _schedule_exclusive, footprints
from .simulator import _context, _intervals, _runs, resident_bytes, simulate, step_spans


def exclusive_peaks(module: Module, cm: CostModel) -> list[float]:
    """Each device's peak memory over a step, on devices that run one task at a time (not a CPU cluster):
    the memory check of :func:`rlhfc.cost.memory.fits`."""
    ctx, _ = _context(module, cm, 1, True, timeline=False)
    return _peaks(module, cm, ctx.costs, footprints(ctx))


def search_price(module: Module, cm: CostModel, steps: int) -> tuple[float, bool]:
    """(seconds per step over ``steps`` simulated steps, whether every device's peak is within its capacity):
    :func:`rlhfc.cost.simulate`'s ``step_time_s`` and ``not memory_issues``, without its statistics."""
    if cm.spec.is_cpu:
        sim = simulate(module, steps=steps, cost_model=cm)
        return sim.step_time_s, not any(d.peak_memory_bytes > d.capacity_bytes for d in sim.devices)
    ctx, _ = _context(module, cm, steps, True)
    tasks = _schedule_exclusive(ctx)
    _, _, step_time = step_spans(tasks, steps)
    held = [(t.resources, t.transient_bytes) for t in tasks if any(b > a for a, b in _intervals(t))]
    return step_time, all(peak <= cm.spec.memory for peak in _peaks(module, cm, ctx.costs, held))


def _peaks(module: Module, cm: CostModel, costs: dict, held) -> list[float]:
    """What stays resident on each device plus the largest of ``held``'s (devices, transient bytes) there."""
    c = module.cluster
    n = c.nodes * c.per_node
    top = [0.0] * n
    for res, transient in held:
        if transient:
            for a, b in _runs(res, n):
                top[a:b] = [transient if transient > x else x for x in top[a:b]]
    static = resident_bytes(module, costs, n, cm)
    bases: dict[int, float] = {}
    for stays in static:
        if id(stays) not in bases:
            bases[id(stays)] = sum(stays.values())
    return [bases[id(stays)] + extra for stays, extra in zip(static, top)]
