"""What comes out of a run: ``rlhfc export`` (a checkpoint's model as a Hugging Face folder) and ``rlhfc plot``
(the run's curves as a PNG). Both read only the run folder (``metrics.jsonl``, ``checkpoints/``, ``job/``).

Bad input (no such run folder, no checkpoint or metrics, an unknown model, an output folder that is not
empty) is an error with a hint, exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional

import typer

from .app import app

#: the panels of ``rlhfc plot``: (title, y label, metric keys); a panel with no data is left out
PANELS = (
    ("Reward", "reward", ("reward_mean",)),
    ("KL (policy vs reference)", "KL", ("kl", "approx_kl")),
    ("Losses", "loss", ("policy_loss", "value_loss")),
    ("Response length", "tokens", ("response_len_mean", "response_len_max")),
    ("Throughput", "samples / s", ("samples_per_s",)),
    ("Policy statistics", "", ("entropy", "clipfrac", "value_clipfrac", "policy_grad_norm")),
)


class OutputError(Exception):
    """A run folder or output path ``rlhfc plot`` / ``export`` cannot use: message and hint."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


def _fail(message: str, hint: str | None, code: int = 2):
    typer.echo(f"rlhfc: error: {message}", err=True)
    if hint:
        typer.echo(f"  hint: {hint}", err=True)
    raise SystemExit(code)


# -- export ------------------------------------------------------------------------------------------
@app.command()
def export(
    run: str = typer.Argument(..., help="run folder (the --out of `rlhfc run`, default runs/<program>)"),
    output: str = typer.Option(..., "-o", "--output", help="folder to write (new or empty)"),
    step: Optional[int] = typer.Option(None, "--step", help="the checkpoint of this step (default: latest)"),
    model: Optional[str] = typer.Option(None, "--model", help="the model to export (default: the policy)"),
    job: Optional[str] = typer.Option(None, "--job", help="the job folder that ran (default RUN/job)"),
):
    """Write a checkpoint's model as a Hugging Face folder (config, safetensors, tokenizer).

    The policy (lm head) loads with AutoModelForCausalLM and gives the trainer's log-probs; a reward
    model (score head) loads with AutoModelForSequenceClassification, a critic (value head) with
    AutoModelForTokenClassification (num_labels = 1)."""
    from rlhfc.runtime.driver.export import ExportError, export_model, find_checkpoint, find_model

    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        _fail(f"{output} exists and is not an empty folder; nothing was written",
              "choose a new folder with -o (export never writes over files)")
    created = not os.path.exists(output)
    try:
        ckpt = find_checkpoint(run, step)
        name, spec, folder = find_model(run, ckpt, model, job)
        os.makedirs(output, exist_ok=True)
        if not os.path.isfile(os.path.join(job or os.path.join(run, "job"), "plan.json")):
            typer.echo(f"note: {run} has no job/plan.json: model '{name}' is built from the checkpoint's manifest "
                       "(a config model with the built-in tokenizer); for a model loaded with hf(...) give the job "
                       "folder that ran with --job", err=True)
        auto = export_model(spec, folder, output)
    except ExportError as exc:
        if created:   # leave nothing half-written behind
            shutil.rmtree(output, ignore_errors=True)
        _fail(exc.message, exc.hint, exc.exit_code)
    typer.echo(f"exported model '{name}' of {os.path.basename(ckpt)} to {output}\n"
               f"  load it with: transformers.{auto}.from_pretrained({output!r})")


# -- plot --------------------------------------------------------------------------------------------
def read_metrics(run: str) -> list[dict]:
    """The rows of ``RUN/metrics.jsonl`` (lines that are not JSON objects with a step are skipped)."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isdir(run):
        raise OutputError(f"run folder {run} does not exist", "give the --out folder of a run (default runs/<program>)")
    if not os.path.isfile(path):
        raise OutputError(f"run folder {run} has no metrics.jsonl", "a run writes one row per step it trains")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    if not rows:
        raise OutputError(f"{path} has no complete row yet", "plot it after the run's first step")
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_run(run: str, png: str) -> list[str]:
    """Draw the run's curves (:data:`PANELS` that have data) into ``png``; returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(run)
    panels = [(t, y, [(k, *_series(rows, k)) for k in keys]) for t, y, keys in PANELS]
    panels = [(t, y, [s for s in series if s[1]]) for t, y, series in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise OutputError(f"{run}/metrics.jsonl has no metric to plot", "its rows hold no reward, KL, loss, length "
                          "or throughput values")
    cols = 2 if len(panels) > 1 else 1
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, (title, ylabel, series) in zip(axes.flat, panels):
        for key, xs, ys in series:
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=key)
            if key == "reward_mean":
                _, std = _series(rows, "reward_std")
                if len(std) == len(ys):
                    ax.fill_between(xs, [m - s for m, s in zip(ys, std)], [m + s for m, s in zip(ys, std)],
                                    alpha=0.2, label="± reward_std")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{os.path.basename(os.path.normpath(run))}: steps {rows[0]['step']}..{rows[-1]['step']}")
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")   # a PNG whatever the name ends with
    plt.close(fig)
    return [p[0] for p in panels]


@app.command()
def plot(
    run: str = typer.Argument(..., help="run folder (the --out of `rlhfc run`, default runs/<program>)"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="PNG to write (default RUN/curves.png)"),
):
    """Draw a run's reward, KL, losses, response length and throughput curves (matplotlib) into a PNG."""
    png = output or os.path.join(run, "curves.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("rlhfc plot needs matplotlib, which is not installed", "pip install matplotlib (or the "
              "'plot' extra: pip install -c constraints.txt -e '.[plot]')", 1)
    try:
        titles = plot_run(run, png)
    except OutputError as exc:
        _fail(exc.message, exc.hint)
    typer.echo(f"wrote {png}: {', '.join(titles)}")
