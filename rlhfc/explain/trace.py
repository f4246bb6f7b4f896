"""The predicted timeline (``--format trace``): the simulator's tasks as Chrome trace events.

The layout is the measured timeline's (``rlhfc run --trace``, :mod:`rlhfc.runtime.worker.trace`, described in
``docs/runtime.md``), so the two open side by side in Perfetto: ``pid 1`` the driver (``tid 1`` steps,
``tid 2`` driver-side stages), ``pid 2`` the syncs (a ``tid`` per ``sync`` stage), ``pid 10 + i`` the
i-th worker of the plan (:func:`rlhfc.ir.plan.workers`, the order of ``plan.json``'s
``placement.workers``) on ``tid 0``. A streamed forward has one span per chunk. ``args`` hold ``stage``,
``op``, ``step``, ``rows`` and ``tokens`` (expected prompt + response tokens) as the measured spans do,
plus ``bound`` and the simulator's ``waits_for``. The runtime may not import the compiler, so the layout's
numbers are repeated here (a test checks both sides agree).
"""

from __future__ import annotations

import json

from rlhfc.ir.plan import on_worker, stage_worker, workers

from .report import Report

DRIVER_PID, SYNC_PID, WORKER_PID0 = 1, 2, 10
STEPS_TID, DRIVER_TID = 1, 2


def trace_events(report: Report) -> dict:
    """The predicted timeline as a trace document: ``traceEvents``, ``displayTimeUnit``, ``otherData``."""
    module, sim = report.module, report.sim
    names = [w.name for w in workers(module).values()]
    pid = {name: WORKER_PID0 + i for i, name in enumerate(names)}
    stages = {s.name: s for s in module.graph.stages}
    syncs = [s.name for s in module.graph.stages if s.op == "sync"]
    meta = [{"name": "process_name", "ph": "M", "pid": DRIVER_PID, "args": {"name": "driver"}},
            {"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": STEPS_TID, "args": {"name": "steps"}},
            {"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": DRIVER_TID, "args": {"name": "driver stages"}}]
    if syncs:
        meta.append({"name": "process_name", "ph": "M", "pid": SYNC_PID, "args": {"name": "syncs"}})
        meta += [{"name": "thread_name", "ph": "M", "pid": SYNC_PID, "tid": i + 1, "args": {"name": s}}
                 for i, s in enumerate(syncs)]
    for name, p in pid.items():
        meta += [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"worker {name}"}},
                 {"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": p}},
                 {"name": "thread_name", "ph": "M", "pid": p, "tid": 0, "args": {"name": "all ranks"}}]
    us = lambda t: round(t * 1e6, 1)  # noqa: E731
    events = []
    for k, (a, b) in enumerate(sim.step_spans):
        events.append({"name": f"step {k}", "cat": "step", "ph": "X", "pid": DRIVER_PID, "tid": STEPS_TID,
                       "ts": us(a), "dur": us(b - a), "args": {"step": k}})
    for t in sim.tasks:
        s = stages[t.stage]
        cost = report.costs[t.stage]
        if s.op == "sync":
            where = (SYNC_PID, syncs.index(s.name) + 1)
        elif on_worker(module, s):
            where = (pid[stage_worker(module, s)], 0)
        else:
            where = (DRIVER_PID, DRIVER_TID)
        rows = float(cost.work.get("rows", 0.0) or 0.0)
        tokens = float(cost.work.get("useful_tokens", 0.0) or 0.0)
        args = {"stage": t.stage, "op": t.op, "step": t.step, "bound": cost.bound, "waits_for": t.waits_for}
        for a, b, n in (t.chunks or [(t.start, t.end, rows)]):
            share = {"rows": round(float(n), 2)}
            if tokens and rows:
                share["tokens"] = round(tokens * float(n) / rows, 1)
            events.append({"name": t.stage, "cat": t.op.split(".", 1)[0], "ph": "X", "pid": where[0],
                           "tid": where[1], "ts": us(a), "dur": us(b - a), "args": {**args, **share}})
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"module": module.name, "kind": "predicted", "steps": sim.steps,
                          "step_time_s": sim.step_time_s, "device": report.device_label()}}


def render_trace(report: Report) -> str:
    return json.dumps(trace_events(report)) + "\n"
