"""The compiler commands: ``check``, ``compile``, ``run`` and ``passes``."""

from __future__ import annotations

import os
import shlex
import shutil
from typing import List, Optional

import typer

from rlhfc.contract.plan import load_plan
from rlhfc.ir import CompileError, Diagnostic, print_module

from .app import app
from .load import load, load_plugins
from .optimise import PLACEMENT_HELP, ROLLOUT_HELP, Optimised, optimise


@app.command()
def check(file: str = typer.Argument(..., help=".rlhf or .rlir file"),
          plugin: List[str] = typer.Option([], "--plugin", help="import a module that registers passes/ops")):
    """Parse and verify a program; exit 0, or print diagnostics and exit 2."""
    module, _ = load(file, plugin)
    from rlhfc.cost.memory import unfittable
    from rlhfc.ir import DiagnosticSink

    sink = DiagnosticSink()   # a stage no plan can fit in memory is an error whatever the -O level
    unfittable(module, sink)
    sink.raise_if_errors()
    typer.echo(f"{file}: ok ({len(module.models)} models, {len(module.graph.stages)} stages)", err=True)


@app.command(name="compile")
def compile_cmd(
    file: str = typer.Argument(..., help=".rlhf or .rlir file"),
    opt: Optional[str] = typer.Option(None, "-O", "--opt-level", help="optimisation level 0-3 (-O2)"),
    passes: Optional[str] = typer.Option(None, "--passes", help="run exactly these passes: a,b{opt=1},..."),
    emit: str = typer.Option("ir", "--emit", help="ir | job"),
    out: Optional[str] = typer.Option(None, "-o", "--output", help="output file (ir) or folder (job)"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers passes"),
    print_after_all: bool = typer.Option(False, "--print-after-all", help="print the IR after every pass"),
    print_after: List[str] = typer.Option([], "--print-after", help="print the IR after this pass"),
    no_verify: bool = typer.Option(False, "--no-verify-each", help="skip the verifier between passes (debugging)"),
    placement: Optional[str] = typer.Option(None, "--placement", help=PLACEMENT_HELP),
    lengths: str = typer.Option("auto", "--response-lengths",
                                help="response-length law the placement search prices (as explain's): auto | "
                                     "max | geometric:P | lognormal:F:S"),
    profile: Optional[str] = typer.Option(None, "--profile", help="measured profile the placement search "
                                          "prices with (default: catalog rates; as explain --profile)"),
    rollout: Optional[str] = typer.Option(None, "--rollout", help=ROLLOUT_HELP),
):
    """Compile a program: optimise it and write canonical IR or a runnable job."""
    if emit not in ("ir", "job"):
        raise CompileError([Diagnostic("error", f"unknown --emit '{emit}'", None, "use --emit ir or --emit job")])
    module, _ = load(file, plugin)
    done = optimise(module, opt, passes, verify_each=not no_verify,
                    print_after={"*"} if print_after_all else set(print_after), placement=placement,
                    memory_check=True if emit == "job" else "warn", response_lengths=lengths, profile=profile,
                    rollout=rollout)
    if emit == "ir":
        ir = print_module(done.module)
        if out:
            with open(out, "w", encoding="utf-8") as fh:
                fh.write(ir)
        else:
            typer.echo(ir, nl=False)
        return
    if not out:
        raise CompileError([Diagnostic("error", "--emit job needs an output folder", None, "add -o job/")])
    emit_job(done, out, file, plugin)
    typer.echo(f"wrote {out}/main.py, {out}/plan.json", err=True)


def emit_job(done: Optimised, out: str, source: str, plugins: list[str] | None = None) -> None:
    """Write the job folder of an optimised module (``main.py``, ``plan.json``, the IR); the job imports
    ``plugins`` too."""
    from rlhfc.codegen import emit_job as write_job

    write_job(done.module, out, source_path=source, opt_level=done.level or "custom", passes=done.passes,
              plugins=plugins or ())


def default_run_dir(name: str, resume: bool) -> str:
    """runs/NAME for the first run, then runs/NAME-1, -2 …; --resume picks the newest existing one."""
    candidates = [os.path.join("runs", name)] + [os.path.join("runs", f"{name}-{i}") for i in range(1, 1000)]
    existing = [c for c in candidates if os.path.isdir(c) and os.listdir(c)]
    if resume:
        return existing[-1] if existing else candidates[0]
    return next(c for c in candidates if not (os.path.isdir(c) and os.listdir(c)))


def check_steps(value: Optional[int]) -> Optional[int]:
    """``--steps``: at least 1 (a usage error, exit 2, otherwise)."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"{value} is not a number of steps.\n  hint: --steps is the total number of "
                                 "steps to train, at least 1 (with --resume: including those the checkpoint "
                                 "already trained)")
    return value


@app.command()
def run(
    target: str = typer.Argument(..., help=".rlhf/.rlir program, or a job folder from `compile --emit job`"),
    opt: Optional[str] = typer.Option(None, "-O", "--opt-level", help="optimisation level 0-3"),
    passes: Optional[str] = typer.Option(None, "--passes", help="run exactly these passes"),
    steps: Optional[int] = typer.Option(None, "--steps", callback=check_steps,
                                        help="train this many steps in total (at least 1)"),
    out: Optional[str] = typer.Option(None, "--out", help="run folder (default runs/<program>)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run folder's latest checkpoint"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="use an existing Ray cluster"),
    plugin: List[str] = typer.Option([], "--plugin", help="import a module (or .py file) that registers passes"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    placement: Optional[str] = typer.Option(None, "--placement", help=PLACEMENT_HELP),
    trace: bool = typer.Option(False, "--trace", help="write the measured timeline, RUNDIR/trace.json "
                               "(Chrome/Perfetto trace events; compare it with `rlhfc compare RUNDIR`)"),
    rollout: Optional[str] = typer.Option(None, "--rollout", help=ROLLOUT_HELP),
    profile: Optional[str] = typer.Option(None, "--profile", help="measured profile the passes price with "
                                          "(default: catalog rates; as compile --profile)"),
):
    """Compile (if needed) and train: locally on Ray by default, or on a cluster with --ray-address.

    A new run never writes into a folder holding an earlier run (exit 2; continue that one with
    --resume). Ctrl-C stops the run, keeps the last complete checkpoint, prints the command that
    resumes it and exits with status 130."""
    from rlhfc.runtime.driver import checkpoint as ckpt
    from rlhfc.runtime.job import JobError, run_job

    def resume_command(folder: str) -> list[str]:
        """The exact command that continues this run from its latest checkpoint."""
        cmd = ["rlhfc", "run", target]
        cmd += ["-O", opt] if opt is not None else []
        cmd += ["--passes", passes] if passes is not None else []
        cmd += ["--placement", placement] if placement is not None else []
        cmd += ["--rollout", rollout] if rollout is not None else []
        cmd += ["--profile", profile] if profile is not None else []
        for p in plugin:
            cmd += ["--plugin", p]
        cmd += ["--steps", str(steps)] if steps is not None else []
        cmd += ["--out", folder, "--resume"]
        cmd += ["--ray-address", ray_address] if ray_address else []
        return cmd + (["--no-progress"] if no_progress else []) + (["--trace"] if trace else [])

    try:
        if os.path.isdir(target):
            if not os.path.isfile(os.path.join(target, "plan.json")):
                raise CompileError([Diagnostic("error", f"{target} is not a job folder (no plan.json)", None,
                                               "compile one with `rlhfc compile FILE --emit job -o DIR`")])
            job_dir = target
            out = out or default_run_dir(os.path.basename(os.path.normpath(target)), resume)
        else:
            if out is not None and not resume:   # before compiling: never write over an earlier run
                ckpt.check_fresh_run_folder(out, None, shlex.join(resume_command(out)))
            module, _ = load(target, plugin)
            done = optimise(module, opt, passes, placement=placement, rollout=rollout, profile=profile)
            out = out or default_run_dir(done.module.name, resume)
            job_dir = os.path.join(out, "job")
            if resume:
                emit_job_for_resume(done, out, target, plugin)
            else:
                emit_job(done, job_dir, target, plugin)
        run_job(job_dir, steps=steps, out=out, resume=resume, ray_address=ray_address,
                progress=not no_progress, resume_command=resume_command(out), trace=trace)
    except JobError as exc:
        typer.echo(f"rlhfc: {getattr(exc, 'label', 'error')}: {exc.message}", err=True)
        if exc.hint:
            typer.echo(f"  hint: {exc.hint}", err=True)
        raise SystemExit(getattr(exc, "exit_code", 1))


def emit_job_for_resume(done: Optimised, out: str, source: str, plugins: list[str] | None = None) -> None:
    """``run --resume``: write the new job beside ``OUT/job``, check the latest checkpoint's manifest against
    it, and only then replace ``OUT/job`` — a refused resume leaves the run's own job untouched."""
    from rlhfc.runtime.driver import checkpoint as ckpt

    root = ckpt.checkpoint_root(out)
    latest = ckpt.latest_checkpoint(root)
    if latest is None:
        raise ckpt.RunFolderError(f"--resume: no checkpoint in {root}", "run without --resume to start fresh")
    job_dir, new, old = (os.path.join(out, name) for name in ("job", ".job.new", ".job.old"))
    shutil.rmtree(new, ignore_errors=True)
    emit_job(done, new, source, plugins)
    try:
        ckpt.check_resume(latest, load_plan(os.path.join(new, "plan.json")))   # its notes are printed at the start
    except BaseException as exc:
        shutil.rmtree(new, ignore_errors=True)
        if isinstance(exc, ckpt.CheckpointMismatch) and os.path.isfile(os.path.join(job_dir, "main.py")):
            exc.hint += (f"; the job that wrote it is {job_dir}: "
                         f"{shlex.join(['python', os.path.join(job_dir, 'main.py'), '--resume', '--out', out])}")
        raise
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(job_dir):
        os.replace(job_dir, old)
    os.replace(new, job_dir)
    shutil.rmtree(old, ignore_errors=True)


@app.command(name="passes")
def passes_cmd(plugin: List[str] = typer.Option([], "--plugin", help="also list passes from this plugin")):
    """List every registered pass with its description and options."""
    from rlhfc.passes import PIPELINES, registered_passes

    load_plugins(plugin)
    for name, cls in registered_passes().items():
        levels = [lvl for lvl, names in PIPELINES.items() if name in names]
        tag = ("exact up to rounding" if cls.rounding else "exact") if cls.exact else "changes training"
        typer.echo(f"{name:<20} {cls.description}  [{tag}; {', '.join(levels) or 'by name only'}]")
        for opt, kind, default, doc in cls.option_help():
            typer.echo(f"    {opt}: {kind} = {default}" + (f"  — {doc}" if doc else ""))
