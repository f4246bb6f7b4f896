"""The cost commands: ``explain`` (what the compiler decided and predicts) and ``profile`` (measure this
machine, :mod:`rlhfc.calibrate`)."""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from rlhfc.ir import CompileError, Diagnostic

from .app import app, print_diagnostics
from .load import load
from .optimise import PLACEMENT_HELP, ROLLOUT_HELP, optimise


def resolve_profile(path: str | None, no_profile: bool, device_kind: str):
    """The profile ``explain`` prices with: ``--profile``, none with ``--no-profile``, else this machine's
    default one for ``device_kind`` when ``rlhfc profile`` saved one."""
    from rlhfc.cost import ProfileError, find_default_profile, load_profile

    if no_profile:
        return None
    if path:
        try:
            return load_profile(path)
        except ProfileError as exc:
            raise CompileError([Diagnostic("error", str(exc), None,
                                           "create one with `rlhfc profile FILE --out PATH`")]) from None
    return find_default_profile(device_kind)


@app.command()
def explain(
    file: str = typer.Argument(..., help=".rlhf or .rlir file"),
    opt: Optional[str] = typer.Option(None, "-O", "--opt-level", help="optimisation level 0-3"),
    passes: Optional[str] = typer.Option(None, "--passes", help="run exactly these passes: a,b{opt=1},..."),
    fmt: str = typer.Option("text", "--format", "-f", help="text | json | html | dot | trace (the predicted timeline as Chrome/Perfetto trace events)"),
    out: Optional[str] = typer.Option(None, "-o", "--output", help="write here instead of stdout"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers passes"),
    profile: Optional[str] = typer.Option(None, "--profile", help="measured profile (default: this machine's, "
                                          "from `rlhfc profile`, when there is one)"),
    no_profile: bool = typer.Option(False, "--no-profile", help="use catalog figures only"),
    steps: int = typer.Option(3, "--steps", min=1, max=50, help="steps to simulate (unrolled)"),
    lengths: str = typer.Option("auto", "--response-lengths",
                                help="response-length law (priced, and searched by placement): auto | max | "
                                     "geometric:P | lognormal:F:S"),
    strict: bool = typer.Option(False, "--strict", help="exit 2 when the plan does not fit in memory"),
    placement: Optional[str] = typer.Option(None, "--placement", help=PLACEMENT_HELP),
    compare: bool = typer.Option(False, "--compare", help="print rlhfc's plan beside the plans of DeepSpeed-Chat, "
                                 "OpenRLHF, verl and NeMo-Aligner (baseline:NAME), predicted step times and ratios"),
    rollout: Optional[str] = typer.Option(None, "--rollout", help=ROLLOUT_HELP),
    turns: Optional[float] = typer.Option(None, "--turns", min=1.0, help="multi-turn generates: the mean policy "
                                          "turns per trajectory to price (a run's turns_mean; default: max_turns, "
                                          "an upper bound)"),
    tool_s: Optional[float] = typer.Option(None, "--tool-s", min=0.0, help="multi-turn generates: seconds a tool's "
                                           "own function takes per call, on top of the sandbox's (default 0)"),
    measured: Optional[str] = typer.Option(None, "--turns-from", help="multi-turn generates: price the turns and the "
                                           "tool seconds per call a run measured (RUN/metrics.jsonl: turns_mean, "
                                           "tool_s / tool_calls); --turns and --tool-s override"),
):
    """Explain a compiled program: IR after each pass, placement, predicted timeline, bottleneck, memory."""
    from rlhfc.cost import CostConfig, response_dist
    from rlhfc.explain import FORMATS, build_report, render

    if fmt not in FORMATS:
        raise CompileError([Diagnostic("error", f"unknown --format '{fmt}'", None,
                                       f"use one of {', '.join(FORMATS)}")])
    try:
        response_dist(lengths, 8, vocab=100, pretrained=False)
    except (ValueError, IndexError) as exc:
        raise CompileError([Diagnostic("error", f"bad --response-lengths: {exc}", None,
                                       "e.g. --response-lengths max or lognormal:0.25:1.0")]) from None
    if measured:
        got_turns, got_tool_s = measured_turns(measured)
        turns = turns if turns is not None else got_turns
        tool_s = tool_s if tool_s is not None else got_tool_s
    if compare:
        if fmt not in ("text", "json"):
            raise CompileError([Diagnostic("error", f"--compare prints text or json, not {fmt}", None,
                                           "use --format text (the default) or --format json")])
        return _compare(file, opt, passes, plugin, placement, steps, (profile, no_profile, lengths, turns, tool_s),
                        out, fmt)
    module, _ = load(file, plugin)
    # an explicit --profile prices the placement search too (as `compile --profile`); the machine's default
    # profile prices only what explain reports, so explain shows the plan `compile` emits
    done = optimise(module, opt, passes, placement=placement, memory_check=False, response_lengths=lengths,
                    profile=profile, rollout=rollout)
    module = done.module
    prof = resolve_profile(profile, no_profile, module.cluster.device)
    report = build_report(module, records=done.records, level=done.level, passes=done.passes, steps=steps,
                          source=file, config=CostConfig(profile=prof, response_lengths=lengths, turns=turns,
                                                         tool_s=tool_s))
    text = render(report, fmt)
    _emit(text, out)
    diags = []
    for issue in report.issues:
        try:
            loc = module.graph.stage(issue.stage).ir_loc or module.graph.stage(issue.stage).loc
        except KeyError:
            loc = None
        diags.append(Diagnostic("error", issue.message, loc, issue.hint))
    if diags:
        if strict:
            raise CompileError(diags)
        print_diagnostics(diags)


def measured_turns(run: str) -> tuple[float | None, float | None]:
    """(mean policy turns per trajectory, a tool call's own seconds beyond the sandbox's) a run measured: the
    mean of its steps' ``turns_mean``, and its tools' waiting seconds over their calls less
    :data:`~rlhfc.cost.model.TOOL_CALL_S` (None where it made no calls)."""
    import json

    from rlhfc.cost.model import TOOL_CALL_S

    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        why = "does not exist" if not os.path.isdir(run) else "has no metrics.jsonl"
        raise CompileError([Diagnostic("error", f"--turns-from: run folder {run} {why}", None,
                                       "give the --out folder of a run of this program (default runs/<program>)")])
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:   # a line a crash cut short
                continue
            if isinstance(row, dict):
                rows.append(row)
    turns = [float(r["turns_mean"]) for r in rows if isinstance(r.get("turns_mean"), (int, float))]
    if not turns:
        raise CompileError([Diagnostic("error", f"--turns-from: {run}/metrics.jsonl has no turns_mean", None,
                                       "give the run folder of a multi-turn generate's job")])
    calls = sum(float(r.get("tool_calls") or 0.0) for r in rows)
    seconds = sum(float(r.get("tool_s") or 0.0) for r in rows)
    per_call = max(0.0, seconds / calls - TOOL_CALL_S) if calls else None
    return max(1.0, sum(turns) / len(turns)), per_call


def _emit(text: str, out: str | None) -> None:
    """Write ``text`` to ``out`` (saying so on stderr), or to stdout without ``-o``."""
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text)
        typer.echo(f"wrote {out}", err=True)
    else:
        typer.echo(text, nl=False)


def _compare(file, opt, passes, plugin, placement, steps, pricing, out, fmt) -> None:
    """``explain --compare``: compile the program as asked (rlhfc's plan), then once per baseline."""
    from rlhfc.cost.baselines import SYSTEMS
    from rlhfc.explain.baselines import compare_rows, render_compare, render_compare_json

    modules = []
    for name in [None] + [f"baseline:{b}" for b in SYSTEMS]:
        module, _ = load(file, plugin)
        done = optimise(module, opt, passes if name is None else None, placement=placement if name is None else name,
                        memory_check=False)
        title = "rlhfc" if name is None else SYSTEMS[name.split(":", 1)[1]].title
        modules.append(((placement or "rlhfc") if name is None else name, title, done.module))
    from rlhfc.cost import CostConfig

    profile, no_profile, lengths, turns, tool_s = pricing
    config = CostConfig(profile=resolve_profile(profile, no_profile, modules[0][2].cluster.device),
                        response_lengths=lengths, turns=turns, tool_s=tool_s)
    rows = compare_rows(modules, steps=steps, config=config)
    text = render_compare_json(rows) if fmt == "json" else render_compare(rows)
    _emit(text, out)


def _train_shapes(module) -> dict:
    """Each trained model's micro-batch shape under the program's compiled plan (its placement decides the
    rows), for the profile's checkpoint probe; the unplaced module's where compiling fails."""
    import copy
    import warnings

    from rlhfc.passes.recompute import train_shapes

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return train_shapes(optimise(copy.deepcopy(module), None, None, memory_check=False).module)
    except Exception:
        return train_shapes(module)


@app.command(name="profile")
def profile_cmd(
    file: Optional[str] = typer.Argument(None, help="program whose models to measure (default: the host only)"),
    out: Optional[str] = typer.Option(None, "-o", "--out", help="profile file (default: ~/.cache/rlhfc/"
                                      "profile-<device>.json, or $RLHFC_CACHE_DIR)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: the cluster's "
                                          "devices per node)"),
    quick: bool = typer.Option(False, "--quick", help="fewer points and repetitions (seconds per model)"),
    vllm: bool = typer.Option(True, "--vllm/--no-vllm", help="also time the vLLM engine of the generating models "
                              "when vLLM is installed (its speed and refit; adds an engine start per model)"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers ops"),
):
    """Measure this machine (CPU, or the GPU when there is one) for a program's models; save a profile."""
    from rlhfc.calibrate import run_profile
    from rlhfc.cost import default_profile_path

    module = load(file, plugin)[0] if file else None
    prof = run_profile(module, threads=threads, quick=quick, log=lambda msg: typer.echo(msg, err=True), vllm=vllm,
                       train_shapes=_train_shapes(module) if module is not None else None)
    path = out or default_profile_path(prof.device_kind, prof.device_name if prof.device_kind == "cpu"
                                       else prof.device_kind)
    prof.save(path)
    typer.echo(f"wrote {os.path.abspath(path)} ({len(prof.models)} model shape(s); "
               f"{prof.host.get('matmul_flops', 0) / 1e9:.1f} GFLOP/s matmul at {prof.threads} thread(s))",
               err=True)
