"""``rlhfc compare RUNDIR``: the prediction for a run's own plan beside what the run measured
(:mod:`rlhfc.explain.compare`).

The plan is the IR in ``RUNDIR/job/plan.json`` (or ``--job DIR``, or the job folder ``trace.json``
names); the measurement ``RUNDIR/trace.json`` (``rlhfc run --trace``), else ``RUNDIR/metrics.jsonl``.
Bad input (no such folder, neither file, no plan, a file that is not what it should be) is an error with a
hint, exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import typer

from rlhfc.contract.plan import PlanFormatError, load_plan

from .app import app
from .explain import resolve_profile


class _Bad(Exception):
    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


def _read_json(path: str, what: str, hint: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise _Bad(f"{path} is not a readable {what} ({type(exc).__name__}: {exc})", hint) from None


def _measured(run: str):
    """The run's measurement and the job folder its trace names (or None)."""
    from rlhfc.explain.compare import measured_from_metrics, measured_from_trace

    trace_path, metrics_path = os.path.join(run, "trace.json"), os.path.join(run, "metrics.jsonl")
    if os.path.isfile(trace_path):
        trace = _read_json(trace_path, "trace", "rerun with `rlhfc run FILE --trace` to write it again")
        try:
            measured = measured_from_trace(trace)
        except ValueError:
            raise _Bad(f"{trace_path} is not a trace rlhfc wrote (no traceEvents)",
                       "compare reads the trace.json of `rlhfc run --trace`") from None
        if (trace.get("otherData") or {}).get("kind") == "predicted":
            raise _Bad(f"{trace_path} is a predicted timeline (explain --format trace), not a measured one",
                       "give the folder of a run made with `rlhfc run FILE --trace`")
        return measured, (trace.get("otherData") or {}).get("job")
    if os.path.isfile(metrics_path):
        rows = []
        with open(metrics_path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
        return measured_from_metrics([r for r in rows if isinstance(r, dict)]), None
    raise _Bad(f"run folder {run} has no trace.json and no metrics.jsonl: nothing was measured there",
               f"train with the timeline on: rlhfc run FILE --trace --out {run}")


@app.command(name="compare")
def compare_cmd(
    run: str = typer.Argument(..., metavar="RUNDIR", help="run folder (rlhfc run --out; best made with --trace)"),
    job: Optional[str] = typer.Option(None, "--job", help="the job folder that ran (default RUNDIR/job, or the "
                                      "one trace.json names)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="measured profile (default: this machine's)"),
    no_profile: bool = typer.Option(False, "--no-profile", help="use catalog figures only"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of the table"),
):
    """Predicted vs measured, per stage and per step, for a run folder."""
    from rlhfc.cost import CostConfig
    from rlhfc.explain import build_report
    from rlhfc.explain.compare import compare, render_comparison
    from rlhfc.ir import parse_ir, verify

    try:
        if not os.path.isdir(run):
            raise _Bad(f"run folder {run} does not exist",
                       "give the --out folder of a run (default runs/<program>), made with `rlhfc run FILE --trace`")
        measured, traced_job = _measured(run)
        if not measured.steps:
            raise _Bad(f"{run} holds no completed step ({measured.source}: no step measured)",
                       "compare a run once it has trained at least one step")
        candidates = [job] if job else [os.path.join(run, "job"), *([traced_job] if traced_job else [])]
        plan_path = next((os.path.join(c, "plan.json") for c in candidates
                          if os.path.isfile(os.path.join(c, "plan.json"))), None)
        if plan_path is None:
            raise _Bad(f"no plan.json for the run in {run} (looked in {', '.join(candidates)})",
                       "give the job folder that ran with --job JOBDIR")
        try:
            ir = load_plan(plan_path).ir
        except PlanFormatError as exc:
            raise _Bad(exc.message, exc.hint) from None
        if not ir:
            raise _Bad(f"{plan_path} holds no IR", "recompile the job with `rlhfc compile FILE --emit job`")
    except _Bad as exc:
        typer.echo(f"rlhfc: error: {exc.message}\n  hint: {exc.hint}", err=True)
        raise SystemExit(2)
    module = parse_ir(ir, plan_path)
    verify(module)
    prof = resolve_profile(profile, no_profile, module.cluster.device)
    report = build_report(module, config=CostConfig(profile=prof), steps=3)
    result = compare(report.sim, module, measured, report.cost_model.dispatch)
    result.update(module=module.name, plan=plan_path, profile=prof.path if prof is not None else None,
                  device=report.device_label())
    if as_json:
        typer.echo(json.dumps(result, indent=1))
        return
    title = f"{module.name}: predicted ({report.device_label()}) vs measured"
    typer.echo(render_comparison(result, title), nl=False)
