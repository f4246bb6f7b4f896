"""A stage's own thread speed-up on a CPU cluster, from the profile's timings at other thread counts.

At -O2 the stages that overlap on the same cores run with fewer torch threads than their mesh has
(:func:`rlhfc.ir.schedule.stage_threads`: one each on two cores). ``rlhfc profile`` times each model on
1 thread too, right after each point at its workers' count (``at_threads``). Small models' calls do not
scale like the host's matmul probe: on the 2-core VM of docs/benchmarks.md a second thread made them no
faster, the fixed cost of a call (dozens of small kernels, each waking the other thread) larger, while the
probe said 1.7x. So the simulator prices a call on ``a`` cores' worth of CPU from the stage's own times
at the measured counts, for this stage's rows and lengths: ``s(n) = T(1) / T(n)``, each ``T`` the fit (and
correction grid) of the points timed at ``n`` threads.
"""

from __future__ import annotations

import numpy as np

from rlhfc.ir import Stage, plan

from .pricing import price
from .profile import model_key


def model_speedup(cm, stage: Stage) -> tuple | None:
    """The stage's model's measured speed-up for its primitive over the grid (one table per model, what the
    layout arrays scale candidate meshes' thread counts with); None off a CPU or without 1-thread points."""
    if cm.profile is None or not cm.spec.is_cpu or stage.target not in cm.module.models:
        return None
    return cm.profile.thread_speedup(model_key(cm.module.models[stage.target]), stage.op.split(".")[0])


def stage_speedup(cm, stage: Stage, rows: float | None = None) -> tuple | None:
    """``(s(1) = 1, s(2), ..., s(count))`` of ``stage`` (``rows``: a chunk's) on its mesh of ``count``
    cores, counts between the measured ones interpolated, beyond them held; None when the profile timed its
    model at one count only (the host's probe then prices thread counts) or the stage runs off a CPU."""
    prof = cm.profile
    if prof is None or not cm.spec.is_cpu or stage.target not in cm.module.models or \
            stage.op.split(".")[0] not in ("generate", "forward", "train"):
        return None
    cache = ("speedup", stage.name, cm.layout(stage), rows, repr(plan.recompute_decision(stage)),
             cm._packs(stage) if not cm.continuous and not stage.op.startswith("generate") else None)
    if cache in cm._cache:
        return cm._cache[cache]
    counts = prof.thread_counts(model_key(cm.module.models[stage.target]))
    times = {}
    for t in counts:
        try:
            inp = cm.price_inputs(stage, [cm.layout(stage)], rows, threads=t)
        except (KeyError, ValueError):
            continue
        if inp.fit is not None:
            times[t] = float(np.asarray(price(np, inp, 0.0)["total"]).reshape(-1)[0])
    out = None
    if 1 in times and len(times) > 1 and all(v > 0 for v in times.values()):
        xs = sorted(times)
        speed = [times[1] / times[x] for x in xs]
        count = max(xs[-1], cm.layout(stage).count)
        out = tuple(float(np.interp(n, xs, speed)) for n in range(1, count + 1))
    cm._cache[cache] = out
    return out
