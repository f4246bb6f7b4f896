"""The text explanation: IR after each pass (with changes marked), placement table, Gantt chart, bottleneck."""

from __future__ import annotations

import difflib

from rlhfc.cost.model import CostModel
from rlhfc.ir import plan

from .report import (Report, device_groups, fmt_bytes, fmt_seconds, ids_text, search_summary, worker_rows,
                     worker_text)

WIDTH = 64


def _pass_section(report: Report) -> list[str]:
    out = ["== IR after each pass (+ added, - removed)"]
    if not report.records:
        out.append("(no passes ran: the IR is the program as written)")
        out.append("")
        out.extend("  " + line for line in report.ir.rstrip("\n").splitlines())
        return out
    for rec in report.records:
        if not rec.changed:
            out.append(f"-- after {rec.spec}: no change")
            continue
        before, after = rec.before.splitlines(), rec.after.splitlines()
        diff = list(difflib.ndiff(before, after))
        n_add = sum(1 for d in diff if d.startswith("+ "))
        n_del = sum(1 for d in diff if d.startswith("- "))
        out.append(f"-- after {rec.spec}: {n_add} line(s) added, {n_del} removed")
        for d in diff:
            if d.startswith("? "):
                continue
            mark = {"+ ": "+ ", "- ": "- "}.get(d[:2], "  ")
            out.append(mark + d[2:])
    return out


def _placement(report: Report) -> list[str]:
    per_node = report.module.cluster.per_node
    rows = [("stage", "op", "model", "devices", "parallel", "time", "mem/device", "pad eff", "bound", "source")]
    for s in report.module.graph.stages:
        c = report.costs[s.name]
        if c.layout is None:
            devices, parallel, mem = "driver", "-", "-"
        else:
            devices = c.layout.describe(per_node)
            parallel = c.layout.parallel_text(report.module.cluster.device == "cpu")
            traced = plan.recompute_decision(s)
            if traced is not None and traced.kept is not None:   # the recompute pass's decision, not a coarse one
                parallel = parallel.replace(f"rc:{c.layout.recompute}", f"rc:{traced.policy}")
            if plan.offload(s):   # its optimizer state and step on the host (the offload pass)
                parallel += " opt:host"
            mem = fmt_bytes(c.total_bytes)
        eff = CostModel.padding_efficiency(c)
        rows.append((f"%{s.name}", s.op, f"@{c.model}" if c.model else "-", devices, parallel,
                     fmt_seconds(c.time_s), mem, f"{eff:.0%}" if eff is not None else "-", c.bound or "-", c.source))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["== Placement (per stage: devices, parallel layout, time, memory per device while it runs, padding "
           "efficiency = the samples' tokens / tokens computed)"]
    for i, r in enumerate(rows):
        out.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def _workers(report: Report) -> list[str]:
    """What the job runs per model (plan.json's workers): layout, trainer and processes."""
    trainer = report.module.run.trainer
    return [f"== Workers (what the job runs, per model and mesh: layout · trainer · processes; "
            f"run trainer = {trainer})"] + ["  " + worker_text(row) for row in worker_rows(report.module)]


def _gantt(report: Report) -> list[str]:
    sim = report.sim
    tasks = sim.step_tasks()
    if not tasks:
        return []
    t0 = min(t.start for t in tasks)
    span = max(max(t.end for t in tasks) - t0, 1e-12)
    scale = WIDTH / span
    name_w = max(len(t.stage) for t in tasks) + 1
    out = [f"== Predicted timeline: step {sim.steps} of {sim.steps} simulated (steady state), "
           f"{fmt_seconds(sim.step_time_s)} per step",
           " " * (name_w + 2) + _axis(span)]
    order = {s.name: i for i, s in enumerate(report.module.graph.stages)}
    for t in sorted(tasks, key=lambda t: (t.start, order[t.stage])):
        row = [" "] * WIDTH
        spans = [(a, b) for a, b, _ in t.chunks] if t.chunks else [(t.start, t.end)]
        for a, b in spans:
            lo = int((a - t0) * scale)
            hi = max(lo + 1, int(round((b - t0) * scale)))
            for i in range(max(lo, 0), min(hi, WIDTH)):
                row[i] = "#"
        where = "driver" if t.devices is None else (f"dev {t.devices[0]}" if t.devices[1] == 1 else
                                                    f"dev {t.devices[0]}-{t.devices[0] + t.devices[1] - 1}")
        out.append(f"%{t.stage:<{name_w}}|{''.join(row)}| {fmt_seconds(t.duration)}  {where}")
    return out


def _axis(span: float) -> str:
    ticks = [0.0, span / 2, span]
    labels = [fmt_seconds(x) if x else "0" for x in ticks]
    middle = WIDTH // 2 - len(labels[1]) // 2
    line = labels[0].ljust(middle) + labels[1]
    return line.ljust(WIDTH - len(labels[2]) + 1) + labels[2]


def _devices(report: Report) -> list[str]:
    out = ["== Devices (busy = share of the steady-state steps; memory = peak / capacity)"]
    rows = [("devices", "node", "busy", "peak memory", "capacity", "resident (weights + grads/optimizer)")]
    for ids, d in device_groups(report):
        nodes = sorted({i // report.module.cluster.per_node for i in ids})
        node = str(nodes[0]) if len(nodes) == 1 else f"{nodes[0]}-{nodes[-1]}"
        flag = "  OVER" if d.peak_memory_bytes > d.capacity_bytes else ""
        per_model: dict = {}
        for k, v in d.static.items():
            per_model[k.split()[0]] = per_model.get(k.split()[0], 0.0) + v
        resident = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(per_model.items(), key=lambda kv: -kv[1]))
        rows.append((ids_text(ids), node, f"{d.utilisation * 100:.0f}%", fmt_bytes(d.peak_memory_bytes) + flag,
                     fmt_bytes(d.capacity_bytes), resident or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        out.append("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def render_text(report: Report) -> str:
    m = report.module
    sim = report.sim
    level = f"-{report.level}" if report.level else "custom pipeline"
    samples = sum(s.outputs[0].type.batch or 0 for s in m.graph.stages if s.op == "generate")
    head = [f"rlhfc explain: module @{m.name} at {level} (passes: {', '.join(report.passes) or 'none'})",
            f"cluster {report.device_label()}",
            f"predicted step time: {fmt_seconds(sim.step_time_s)} "
            f"({sim.steps} steps simulated; {samples} samples per step)"]
    if report.search:
        head.append(search_summary(report))
    changed = plan.changes_training(m)
    if changed:
        head.append(f"note: {', '.join(changed)} changes what the job trains on (not an exact optimisation: "
                    "-O2 and below never do this)")
    lines = head + [""] + _pass_section(report) + [""] + _placement(report) + [""] + _workers(report) + [""] + \
        _gantt(report) + [""] + _devices(report) + [""]
    b = sim.bottleneck
    lines.append("== Bottleneck")
    if b:
        lines.append(f"%{b['stage']} ({b['op']}{' on @' + b['model'] if b.get('model') else ''}) takes "
                     f"{fmt_seconds(b['seconds'])}, {b['share'] * 100:.0f}% of the step, {b['bound']}-bound")
        if b.get("hint"):
            lines.append(f"  hint: {b['hint']}")
    worst = max(sim.devices, key=lambda d: d.peak_memory_bytes / d.capacity_bytes, default=None)
    if worst is not None:
        lines.append(f"memory: device {worst.index} peaks at {fmt_bytes(worst.peak_memory_bytes)} of "
                     f"{fmt_bytes(worst.capacity_bytes)} ({worst.peak_memory_bytes / worst.capacity_bytes * 100:.0f}%)")
    if report.notes:
        lines += ["", "== Notes"] + [f"- {n}" for n in report.notes]
    if report.issues:
        lines += ["", "== Memory diagnostics"] + [f"error: {i.message}\n  hint: {i.hint}" for i in report.issues]
    return "\n".join(lines) + "\n"
