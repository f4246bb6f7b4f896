"""How much two processes on two cores of this machine really get done, side by side.

``core_scaling()`` times one pinned process doing 256x256 float32 matmuls, then
two such processes on two different cores at once, and returns the throughput
of the pair over that of one (2.0 on two independent cores; shared or
hyper-threaded vCPUs give less). Benchmarks that overlap work across cores print
it beside their speed-ups: it is the ceiling of any overlap on this machine at
the moment of the run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def _work(core: int, n: int, out) -> None:
    import torch

    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t = time.perf_counter()
    for _ in range(n):
        a @ a
    out.put(time.perf_counter() - t)


def core_scaling(n: int = 1500) -> float:
    """Throughput of two busy cores ÷ one (see the module docstring); 1.0 on a single-core machine."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < 2:
        return 1.0
    ctx = mp.get_context("spawn")
    q = ctx.Queue()

    def run(which):
        ps = [ctx.Process(target=_work, args=(c, n, q)) for c in which]
        for p in ps:
            p.start()
        times = [q.get() for _ in ps]
        for p in ps:
            p.join()
        return max(times)

    one = run(cores[:1])
    two = run(cores[:2])
    return 2.0 * one / two


if __name__ == "__main__":
    print(f"two cores deliver {core_scaling():.2f}x the throughput of one")
