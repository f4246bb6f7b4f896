"""``threads``: run a CPU stage on fewer torch threads when its own measurements say that is faster.

A worker stage gets one torch thread per core it may use (:func:`rlhfc.ir.schedule.stage_threads`). Small
models' calls do not scale with threads: each of their dozens of small kernels wakes the other threads, and
on a machine shared with Ray's and the job's other processes a parallel region waits for its slowest
thread. ``rlhfc profile`` times every model at its workers' thread count and at 1 (``at_threads``); where
the stage's own fits say fewer threads are faster for its rows and lengths
(:meth:`rlhfc.cost.model.CostModel.stage_speedup`), by more than :data:`MIN_GAIN`, the pass marks the stage
``annot {threads = N}``. ``stage_threads`` then gives it at most N (the runtime runs the call with N, the
simulator prices the same count). Measured on the 2-core VM of docs/benchmarks.md: the tiny PPO job's
generation, alone on the node at -O2, took 46.7-47.5 ms on 2 threads and 31.9-32.8 ms on 1, the step 93-95 ms
against 76-78 ms.

Needs a profile with 1-thread points (the pass's ``profile`` option, ``--profile``; without one it changes
nothing: catalog rates scale like the host's matmul). Exact up to rounding: a reduction split over fewer
threads adds in another order. Idempotent: it first drops its own marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.cost import CostConfig, CostModel, ProfileError, load_profile
from rlhfc.ir import Module, plan
from rlhfc.ir.diagnostics import error
from rlhfc.ir.schedule import stage_threads

from .base import Pass, register_pass

#: the least measured gain (T(n) / T(k) - 1) for which a stage drops from n to k threads: the profile's
#: repetitions of one point scatter by a few per cent, and a smaller gain is inside that
MIN_GAIN = 0.05



@register_pass
@dataclass(frozen=True)
class ThreadsPass(Pass):
    name = "threads"
    description = "run a CPU stage on fewer torch threads where the profile measured that faster"
    exact = True
    rounding = True
    profile: str = field(default="", metadata={
        "doc": "measured profile with 1-thread points (a path, as explain's --profile; empty: no change)"})

    def run(self, module: Module) -> Module:
        for s in module.graph.stages:
            plan.set_threads_cap(s, None)
        if module.cluster.device != "cpu" or not self.profile:
            return module
        try:
            prof = load_profile(self.profile)
        except ProfileError as exc:
            raise error(f"threads: {exc}", None, "give a file `rlhfc profile` wrote, or no profile") from None
        cm = CostModel(module, CostConfig(profile=prof))
        for name, n in stage_threads(module).items():
            stage = module.graph.stage(name)
            speed = cm.stage_speedup(stage) if n > 1 else None
            if not speed:
                continue
            top = min(n, len(speed))
            best = max(range(1, top + 1), key=lambda k: (speed[k - 1], -k))
            if best < n and speed[best - 1] > speed[top - 1] * (1 + MIN_GAIN):
                plan.set_threads_cap(stage, best)
        return module
