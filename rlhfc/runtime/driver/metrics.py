"""Metrics of a run: one JSON line per step (``OUT/metrics.jsonl``), TensorBoard scalars, a progress line.

:func:`step_metrics` turns a step's values into the metric row (which values are the rollout,
reward, KL pair and train statistics comes from the plan's ``metrics`` roles); :class:`MetricsLog`
writes rows; :class:`Progress` shows them live; :func:`summarize` prints the end-of-run summary.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
from typing import Any

from rlhfc.contract.plan import MetricRoles, Plan, WorkerPlan
from rlhfc.runtime.data.values import Rollout, TokenValues


def step_metrics(roles: MetricRoles, overcommit: dict[str, dict], step: int, values: dict[str, Any],
                 seconds: float, ahead: bool = False) -> dict[str, float]:
    """The metric row of one step; ``roles`` is the plan's ``metrics``, ``overcommit`` the driver's state;
    ``ahead``: the rollout was generated ahead (asynchronous rollout): its staleness is counted against this
    step's weights (``staleness_mean``/``_max``), not the generating ones."""
    m: dict[str, float] = {"step": step}
    roll: Rollout | None = values.get(roles.rollout) if roles.rollout else None
    scores = values.get(roles.reward) if roles.reward else None
    if isinstance(scores, TokenValues):   # per-token rewards (env_turn_rewards): each row's return
        scores = scores.row_sums()
    if scores is not None:
        m["reward_mean"] = float(scores.float().mean())
        m["reward_std"] = float(scores.float().std()) if scores.numel() > 1 else 0.0
    if roles.kl:
        logp, ref = (values.get(n) for n in roles.kl)
        if isinstance(logp, TokenValues) and isinstance(ref, TokenValues):
            diff = TokenValues(logp.values - ref.values, logp.mask)
            m["kl"] = diff.mean()
    for key, name in (("policy", roles.policy_train), ("value", roles.value_train)):
        stats = values.get(name) if name else None
        if not stats:
            continue
        if key == "policy":
            m["policy_loss"] = stats.get("pg_loss", stats.get("loss", float("nan")))
            for k in ("entropy", "clipfrac", "approx_kl", "grad_norm", "lr", "dropped_groups", "kept_samples",
                      "sample_rounds", "sampled_groups", "rollout_logprob_diff_mean", "rollout_logprob_diff_max",
                      "tis_weight_mean", "behaviour_weight_mean", "behaviour_weight_max", "behaviour_masked_frac",
                      "proximal_alpha_mean"):
                if k in stats:
                    m[f"policy_{k}" if k in ("grad_norm", "lr") else k] = stats[k]
        else:
            m["value_loss"] = stats.get("vf_loss", stats.get("loss", float("nan")))
            if "vf_clipfrac" in stats:
                m["value_clipfrac"] = stats["vf_clipfrac"]
            if "lr" in stats:
                m["value_lr"] = stats["lr"]
    m.setdefault("kl", float("nan"))
    m.setdefault("policy_loss", float("nan"))
    m.setdefault("value_loss", float("nan"))
    m.setdefault("reward_mean", float("nan"))
    if roll is not None:
        lengths = roll.batch.response_lengths.float()
        m["response_len_mean"] = float(lengths.mean())
        m["response_len_std"] = float(lengths.std()) if lengths.numel() > 1 else 0.0
        m["response_len_max"] = float(lengths.max())
        m["decode_steps"] = roll.decode_steps
        m.update(padding_efficiency(roll))
        m["gen_version"] = roll.version
        m.update(roll.engine)   # rollout = vllm: refit_s, refit_mb, refit_buckets, engine_start_s
        m["samples"] = roll.size
        if roll.born:   # versions behind the weights that train on them (this step's under asynchronous rollout)
            stale = [(step if ahead else roll.version) - b for b in roll.born]
            if not ahead:   # samples overcommit carried in (generated ahead is not carried: staleness says it)
                m["carried"] = sum(1 for x in stale if x > 0)
            m["staleness_max"] = max(stale)
            m["staleness_mean"] = sum(stale) / len(stale)
        for stage, state in overcommit.items():
            m["overcommit_delta"] = state["delta"]
            m["carry_next"] = len(state["carry"])
    m["step_time_s"] = seconds
    m["samples_per_s"] = (m.get("samples", 0) / seconds) if seconds > 0 else 0.0
    return m


def padding_efficiency(roll: Rollout) -> dict[str, float]:
    """The samples' tokens over the tokens computed for them: ``pad_eff_generate`` (prompt tokens and the
    response tokens fed back, against the padded prompts and the decode batch's slots) and
    ``pad_eff_forward`` (prompt and response tokens against what a forward of the whole rollout computes:
    one rectangle, or length groups under ``unpad``; a streamed stage's forwards ran per chunk)."""
    from rlhfc.runtime.train.packing import computed_tokens

    b = roll.batch
    prompts, responses = float(b.prompt_lengths.sum()), float(b.response_lengths.sum())
    out = {"pad_eff_forward": (prompts + responses) / max(computed_tokens(b, roll.unpad), 1)}
    if roll.computed_tokens:
        fed = prompts + float((b.response_lengths - 1).clamp(min=0).sum())
        out["pad_eff_generate"] = min(1.0, fed / roll.computed_tokens)
    return out


def model_ranks(workers: dict[str, WorkerPlan]) -> dict[str, int]:
    """Processes per model: the ``ranks`` of each of its workers in the plan's ``placement.workers``,
    summed over the workers that host it (a model with a generation copy on other devices counts both
    groups). Written into every metrics row as ``ranks``."""
    out: dict[str, int] = {}
    for w in workers.values():
        out[w.model] = out.get(w.model, 0) + w.ranks
    return out


class MetricsLog:
    """``OUT/metrics.jsonl`` (NaN written as null, fsynced per row) and, when installed, TensorBoard.

    On resume, :meth:`trim` keeps the complete rows of the steps before the checkpoint (dropping, and
    saying so, a partial last line a crash left mid-write) and :meth:`open_tensorboard` rewrites the
    TensorBoard events from those rows into a fresh events file and removes the old files, so no step
    appears twice in TensorBoard."""

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, "metrics.jsonl")
        self.tb = None

    def open_tensorboard(self, replay: list[dict] | None = None) -> None:
        """Open the TensorBoard writer; with ``replay`` (on resume: the kept rows) first write those rows
        to it and remove the events files of earlier sessions, which also hold the steps to be redone."""
        old = sorted(glob.glob(os.path.join(self.out, "events.out.tfevents.*")))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.out)
        except Exception:  # tensorboard missing: metrics.jsonl still has everything
            self.tb = None
            return
        if replay is None:
            return
        for m in replay:
            self._tb_write(m)
        self.tb.flush()
        for path in old:
            try:
                os.remove(path)
            except OSError:
                pass

    def write(self, m: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                 for k, v in m.items()}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self.tb is not None:
            self._tb_write(m)
            self.tb.flush()

    def _tb_write(self, m: dict) -> None:
        for k, v in m.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                self.tb.add_scalar(k, v, m["step"])

    def trim(self, upto: int) -> tuple[list[dict], list[str]]:
        """On resume: keep the rows of steps before ``upto`` (later ones will be recomputed); returns the
        kept rows and notes on what was dropped that was not a complete row (:func:`trim_jsonl`)."""
        return trim_jsonl(self.path, upto, "metrics row")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def trim_jsonl(path: str, upto: int, what: str = "row") -> tuple[list[dict], list[str]]:
    """Keep the rows of a run folder's JSON-lines log (``metrics.jsonl``, ``samples.jsonl``: one object with
    an int ``step`` a line) whose step is before ``upto``; returns the kept rows and notes on dropped lines
    that were not a complete ``what`` (a partial last line a crash left mid-write). The file is replaced
    atomically, so a crash here loses nothing."""
    if not os.path.isfile(path):
        return [], []
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    tail = lines.pop()   # b"" when the file ends with a newline; else a line cut off mid-write
    if _parse_row(tail) is not None:   # only its newline is missing: a complete row
        lines.append(tail)
        tail = b""
    kept, rows, notes = [], [], []
    for i, raw in enumerate(lines, 1):
        row = _parse_row(raw)
        if row is None:
            if raw.strip():
                notes.append(f"dropped line {i} of {path}: not a {what} ({_clip(raw)})")
            continue
        if row["step"] < upto:
            kept.append(raw + b"\n")
            rows.append(row)
    if tail.strip():
        notes.append(f"dropped the partial last line of {path} (cut off by a crash while it was "
                     f"written): {_clip(tail)}")
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.writelines(kept)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return rows, notes


def _parse_row(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _clip(raw: bytes, n: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= n else text[:n] + "…")


class Progress:
    """A rich progress bar showing reward, KL, losses and throughput per step."""

    def __init__(self, enabled: bool, total: int, start: int, plan: Plan):
        self.enabled = enabled
        self.total, self.start = total, start
        self.plan = plan

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        # piped output (logs, CI) has no width: give the line room instead of squeezing it to 80 columns
        console = None if sys.stdout.isatty() else Console(width=150)
        self.progress = Progress(TextColumn("[bold]{task.fields[name]}"), BarColumn(bar_width=24),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 transient=False, console=console)
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.total, completed=self.start,
                                           name=self.plan.module, stats="starting workers…")
        return self

    def update(self, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        stats = (f"reward {_fmt(m.get('reward_mean'))}  kl {_fmt(m.get('kl'))}  "
                 f"pg {_fmt(m.get('policy_loss'))}  vf {_fmt(m.get('value_loss'))}  "
                 f"{m.get('samples_per_s', 0):.1f} samples/s")
        self.progress.update(self.task, advance=1, stats=stats)

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)
        return False


def _fmt(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.3f}"


def summarize(history: list[dict[str, float]], out: str) -> str:
    """A short end-of-run summary: first vs last reward, KL, throughput."""
    if not history:
        return f"nothing to do; run folder: {out}"
    k = min(5, len(history))
    first = [h["reward_mean"] for h in history[:k] if h.get("reward_mean") is not None]
    last = [h["reward_mean"] for h in history[-k:] if h.get("reward_mean") is not None]
    sps = sum(h["samples_per_s"] for h in history) / len(history)
    lines = [f"trained steps {history[0]['step']}..{history[-1]['step']} — run folder: {out}"]
    if first and last:
        lines.append(f"mean reward: first {k} steps {sum(first) / len(first):+.4f} -> last {k} steps "
                     f"{sum(last) / len(last):+.4f}")
    lines.append(f"mean throughput: {sps:.1f} samples/s; metrics: {out}/metrics.jsonl")
    return "\n".join(lines)
