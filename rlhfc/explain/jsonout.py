"""The JSON explanation (``--format json``): machine-readable predictions.

Top level: ``module``, ``opt_level``, ``passes``, ``cluster``, ``device``,
``predicted_step_time_s``, ``steps_simulated``, ``stages`` (per stage:
``placement`` {``mesh`` {first, count}, ``nodes``} or ``"driver"``, ``parallel``
{dp, tp, pp} or null, ``microbatches``, ``recompute``, ``overlap``, ``stream``,
``start_s``/``end_s`` within the steady-state step, ``duration_s``, ``parts``,
``bound``, ``source``, ``memory_bytes_per_device``, ``work``), ``devices``
(per device ``index``, ``node``, ``peak_memory_bytes``, ``capacity_bytes``,
``busy_s``, ``utilisation``, ``resident``), ``workers`` (what the job runs, as ``plan.json``
says: per worker ``worker``, ``model``, ``mesh``, ``trainer``, ``dp``, ``tp``, ``pp``, ``ranks``),
``timeline`` (every simulated task),
``critical_path``, ``bottleneck``, ``diagnostics``, ``notes`` and ``search`` (null unless the placement
pass searched: ``strategy``, ``candidates`` priced, ``proposals``, ``seconds``, ``trajectory`` of
``[candidate, best seconds per step]``, ``seeds`` (each strategy's plan's price), ``best_s``, ``fits``).
"""

from __future__ import annotations

import json

import numpy as np

from rlhfc.ir import plan
from rlhfc.ir.plan import overlap_group, stream_chunk

from .report import Report, worker_rows


def _clean(x):
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_clean(v) for v in x.tolist()]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def report_dict(report: Report) -> dict:
    m = report.module
    sim = report.sim
    c = m.cluster
    last = {t.stage: t for t in sim.step_tasks()}
    t0 = min((t.start for t in last.values()), default=0.0)
    stages = []
    for s in m.graph.stages:
        cost = report.costs[s.name]
        task = last.get(s.name)
        lay = cost.layout
        entry = {
            "name": s.name, "op": s.op, "model": cost.model,
            "placement": ({"mesh": {"first": lay.first, "count": lay.count}, "nodes": lay.nodes(c.per_node)}
                          if lay else "driver"),
            "parallel": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp} if lay else None,
            "microbatches": lay.microbatches if lay else None,
            "recompute": lay.recompute if lay else None,
            "overlap": overlap_group(s), "stream": stream_chunk(s),
            "start_s": (task.start - t0) if task else None, "end_s": (task.end - t0) if task else None,
            "duration_s": cost.time_s, "parts": cost.parts, "bound": cost.bound, "source": cost.source,
            "sync_s": task.sync_s if task else 0.0,
            "flops": cost.flops,
            "memory_bytes_per_device": {"weights": cost.weights_bytes, "grads_optimizer": cost.state_bytes,
                                        "activations_kv": cost.transient_bytes, "total": cost.total_bytes},
            "work": {k: v for k, v in cost.work.items() if not isinstance(v, np.ndarray)},
        }
        if task and task.chunks:
            entry["chunks"] = [{"start_s": a - t0, "end_s": b - t0, "rows": r} for a, b, r in task.chunks]
        stages.append(entry)
    devices = [{"index": d.index, "node": d.node, "peak_memory_bytes": d.peak_memory_bytes,
                "capacity_bytes": d.capacity_bytes, "busy_s": d.busy_s, "utilisation": d.utilisation,
                "resident": d.static, "peak_stages": d.peak_stages} for d in sim.devices]
    spec = report.cost_model.spec
    return _clean({
        "module": m.name, "source": report.source, "opt_level": report.level, "passes": report.passes,
        "cluster": {"name": c.name, "device": c.device, "nodes": c.nodes, "per_node": c.per_node},
        "device": {"name": spec.name, "rates_from": spec.source, "peak_flops": spec.peak_flops,
                   "memory_bandwidth": spec.hbm_bw, "memory_bytes": spec.memory},
        "profile": report.cost_model.profile.path if report.cost_model.profile else None,
        "changes_training": plan.changes_training(report.module),
        "predicted_step_time_s": sim.step_time_s, "steps_simulated": sim.steps, "makespan_s": sim.makespan_s,
        "stages": stages, "devices": devices, "workers": worker_rows(m),
        "timeline": [{"stage": t.stage, "step": t.step, "start_s": t.start, "end_s": t.end,
                      "devices": list(t.devices) if t.devices else None} for t in sim.tasks],
        "critical_path": [f"{t.stage}@{t.step}" for t in sim.critical_path],
        "bottleneck": sim.bottleneck,
        "memory_ok": not report.issues,
        "diagnostics": [{"severity": "error", "stage": i.stage, "device": i.device, "devices": i.devices,
                         "need_bytes": i.need_bytes, "capacity_bytes": i.capacity_bytes, "message": i.message,
                         "hint": i.hint} for i in report.issues],
        "notes": report.notes,
        "search": report.search,
    })


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=1) + "\n"
