"""``rlhfc compare``: the predicted timeline beside a run's measured one, per stage and per step.

:func:`measured_from_trace` reads a run's ``trace.json`` (:mod:`rlhfc.runtime.worker.trace`'s layout, read as
plain JSON: the compiler does not import the runtime) and :func:`measured_from_metrics` its
``metrics.jsonl`` (``step_time_s``; per stage the driver's ``wait_s``, a stage's run time only where
nothing overlapped it). :func:`compare` sets them beside the simulation of the run's own plan:

* per stage, the *busy* seconds of one step: measured, the sum of the stage's spans in that step (a
  streamed forward's chunks add up); predicted, :attr:`rlhfc.cost.scheduling.Task.busy` of the
  simulation's steady-state step (its chunks, slowed as the simulator shares the cores) less the
  per-call dispatch the cost model adds to each call of a worker stage (``dispatch_s``: the driver's
  Ray round trip, which a worker's own span does not contain; the step time keeps it);
* per step, the step's wall time against the predicted steady-state step time.

Measured figures are medians over the steps after the first (step 0 pays the workers' warm-up) when the
run has more than one step. Error = (predicted − measured) / measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

#: op families whose stages run on workers: the per-stage error the summary reports is over these
WORKER_FAMILIES = ("generate", "forward", "train")


@dataclass
class Measured:
    """Seconds measured per step: ``steps[k]``; per stage: ``stages[name][k]``; ``source``: trace or metrics."""

    source: str
    steps: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)
    unnamed: list = field(default_factory=list)   # spans whose stage the trace could not name (?method)
    load: dict = field(default_factory=dict)      # per step: the machine's 1-minute load average (trace)
    cores: int | None = None                      # the driver machine's cores (trace)


def measured_from_trace(trace: dict) -> Measured:
    """Per step and per stage seconds of a measured ``trace.json`` (``ValueError`` if it is not one)."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("no traceEvents list")
    m = Measured("trace")
    m.cores = (trace.get("otherData") or {}).get("cores")
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        step, dur = args.get("step"), float(e.get("dur", 0.0)) / 1e6
        if not isinstance(step, int):
            continue
        if e.get("cat") == "step":
            m.steps[step] = dur
            if isinstance(args.get("load1"), (int, float)):
                m.load[step] = float(args["load1"])
        elif e.get("cat") != "wait":
            stage = str(args.get("stage") or e.get("name"))
            if stage.startswith("?"):
                m.unnamed.append(stage)
                continue
            m.stages.setdefault(stage, {})
            m.stages[stage][step] = m.stages[stage].get(step, 0.0) + dur
            m.ops[stage] = args.get("op", "")
    return m


def measured_from_metrics(rows: list[dict]) -> Measured:
    """Per step ``step_time_s`` and per stage ``wait_s`` of ``metrics.jsonl`` rows."""
    m = Measured("metrics")
    for r in rows:
        k = r.get("step")
        if not isinstance(k, int):
            continue
        if isinstance(r.get("step_time_s"), (int, float)):
            m.steps[k] = float(r["step_time_s"])
        for stage, secs in (r.get("wait_s") or {}).items():
            m.stages.setdefault(stage, {})[k] = float(secs)
    return m


def _steady(per_step: dict) -> tuple[float | None, list[int]]:
    """The median over the steps after the first (all steps when there is only one)."""
    keys = sorted(per_step)
    used = keys[1:] if len(keys) > 1 else keys
    return (statistics.median(per_step[k] for k in used) if used else None), used


def _error(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas


def compare(sim, module, measured: Measured, dispatch_s: float = 0.0) -> dict:
    """Predicted vs measured rows: ``stages`` (per stage ``stage``, ``op``, ``predicted_s``, ``measured_s``,
    ``error``, ``per_step``), ``step`` (``predicted_s``, ``measured_s``, ``error``, ``per_step``),
    ``median_abs_stage_error`` over worker stages with both figures, ``steps_used``, ``dispatch_s``."""
    last = {t.stage: t for t in sim.step_tasks()}
    rows = []
    for s in module.graph.stages:
        t = last.get(s.name)
        pred = t.busy if t is not None else None
        if pred is not None and s.op.split(".")[0] in WORKER_FAMILIES and measured.source == "trace":
            pred = max(pred - dispatch_s * max(1, len(t.chunks)), 0.0)   # the worker's span has no dispatch
        meas, _ = _steady(measured.stages.get(s.name, {}))
        rows.append({"stage": s.name, "op": s.op, "predicted_s": pred, "measured_s": meas,
                     "error": _error(pred, meas),
                     "per_step": {str(k): v for k, v in sorted(measured.stages.get(s.name, {}).items())}})
    step_meas, used = _steady(measured.steps)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and r["op"].split(".")[0] in WORKER_FAMILIES]
    return {"source": measured.source, "steps_used": used, "stages": rows, "dispatch_s": dispatch_s,
            "step": {"predicted_s": sim.step_time_s, "measured_s": step_meas,
                     "error": _error(sim.step_time_s, step_meas),
                     "per_step": [{"step": k, "measured_s": v, "error": _error(sim.step_time_s, v)}
                                  for k, v in sorted(measured.steps.items())]},
            "median_abs_stage_error": statistics.median(errors) if errors else None,
            "load1": _steady(measured.load)[0] if measured.load else None, "cores": measured.cores,
            "unnamed_spans": sorted(set(measured.unnamed))}


def render_comparison(result: dict, title: str) -> str:
    from .report import fmt_seconds

    def secs(x):
        return "—" if x is None else fmt_seconds(x)

    def pct(x):
        return "—" if x is None else f"{x * 100:+.1f} %"

    used = result["steps_used"]
    span = f"step {used[0]}" if len(used) == 1 else f"steps {used[0]}-{used[-1]}" if used else "no steps"
    head = f"{title} ({result['source']}, median over {span}"
    head += "; step 0 is warm-up)" if used and used[0] > 0 else ")"
    lines = [head]
    if result["source"] == "metrics":
        lines.append("note: no trace.json: per stage these are the driver's waits (wait_s), a stage's run time "
                     "only where nothing overlapped it; run with --trace for the workers' own times")
    lines.append(f"{'stage':<16} {'op':<22} {'predicted':>10} {'measured':>10} {'error':>9}")
    for r in result["stages"]:
        if r["predicted_s"] is None and r["measured_s"] is None:
            continue
        lines.append(f"{r['stage']:<16} {r['op']:<22} {secs(r['predicted_s']):>10} {secs(r['measured_s']):>10} "
                     f"{pct(r['error']):>9}")
    st = result["step"]
    lines.append("")
    lines.append(f"per step: predicted {secs(st['predicted_s'])}, measured {secs(st['measured_s'])} "
                 f"({pct(st['error'])})")
    lines.append("  " + ", ".join(f"step {r['step']}: {secs(r['measured_s'])} ({pct(r['error'])})"
                                  for r in st["per_step"]))
    if result["source"] == "trace" and result.get("dispatch_s"):
        lines.append(f"(a worker stage's prediction leaves out the {fmt_seconds(result['dispatch_s'])} dispatch "
                     "priced per remote call, which its measured span does not contain; the step keeps it)")
    if result.get("load1") is not None:
        cores = result.get("cores")
        lines.append(f"machine load during the run: {result['load1']:.1f} (1-minute average)"
                     + (f" on {cores} cores" + ("; other processes competed for the cores, so stages ran slower "
                                               "than the profile's least-disturbed measurements"
                                               if result["load1"] > cores else "") if cores else ""))
    if result["median_abs_stage_error"] is not None:
        lines.append(f"median |error| over the stages on workers: {result['median_abs_stage_error'] * 100:.1f} %")
    if result["unnamed_spans"]:
        lines.append(f"note: spans the trace could not name a stage for (multi-rank groups): "
                     f"{', '.join(result['unnamed_spans'])}")
    return "\n".join(lines) + "\n"
