"""Run a compiled program as a benchmark: emit its job, run it in this process (Ray workers as in `rlhfc run`)
and time the steps after a warm-up. Shared by the overlap and throughput benchmarks."""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Callable


def run_compiled(module, level: str, source_path: str, work: str, *, warmup: int, steps: int | None = None,
                 probe: Callable | None = None, trace: bool = False) -> dict:
    """Emit ``module`` (already optimised at ``level``) as a job under ``work`` and run it; the clock starts
    when step ``warmup`` starts. Returns the measured metric rows, the wall seconds they took and, with a
    ``probe(job)``, its values at the clock's start and end. ``trace``: the run writes its measured timeline
    (``trace`` in the result: the path of its ``trace.json``); the seconds the driver spends draining the
    workers' spans between steps are left out of the wall time (a job run without ``--trace`` does not
    spend them)."""
    from rlhfc.codegen import emit_job
    from rlhfc.passes import PIPELINES
    from rlhfc.runtime.job import Job

    job_dir = os.path.join(work, f"job_{level}")
    base = level.split("-")[0]   # "O3-sync": -O3 without async_rollout (benchmarks/overlap.py)
    emit_job(module, job_dir, source_path=source_path, opt_level=base, passes=PIPELINES[base])
    spec = importlib.util.spec_from_file_location(f"bench_{level}_{time.time_ns()}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    marks: dict = {}

    def step(job, w):
        if marks.get("calls", 0) == warmup:
            marks["t0"] = time.perf_counter()
            marks["probe0"] = probe(job) if probe else None
            marks["collect0"] = job.timeline.collect_s if job.timeline is not None else 0.0
        marks["calls"] = marks.get("calls", 0) + 1
        return mod.step(job, w)

    out = os.path.join(work, f"run_{level}")
    job = Job(job_dir, out=out, steps=steps, progress=False, trace=trace)
    try:
        rows = job.run(step)
        wall = time.perf_counter() - marks["t0"]
        if job.timeline is not None:   # the spans drained after the warm-up steps
            wall -= job.timeline.collect_s - marks["collect0"]
        probe1 = probe(job) if probe else None
    finally:
        job.shutdown()
    return {"rows": rows[warmup:], "wall": wall, "probe": (marks["probe0"], probe1), "first": rows[0] if rows else None,
            "trace": os.path.join(out, "trace.json") if trace else None}
