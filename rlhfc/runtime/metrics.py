"""Metrics of a run: one JSON line per step (``OUT/metrics.jsonl``), TensorBoard scalars, a progress line.

:func:`step_metrics` turns a step's values into the metric row (which values are the rollout,
reward, KL pair and train statistics comes from the plan's ``metrics`` roles); :class:`MetricsLog`
writes rows; :class:`Progress` shows them live; :func:`summarize` prints the end-of-run summary.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

from .values import Rollout, TokenValues


def step_metrics(roles: dict, overcommit: dict[str, dict], step: int, values: dict[str, Any],
                 seconds: float) -> dict[str, float]:
    """The metric row of one step; ``roles`` is the plan's ``metrics``, ``overcommit`` the driver's state."""
    m: dict[str, float] = {"step": step}
    roll: Rollout | None = values.get(roles.get("rollout")) if roles.get("rollout") else None
    scores = values.get(roles.get("reward")) if roles.get("reward") else None
    if scores is not None:
        m["reward_mean"] = float(scores.float().mean())
        m["reward_std"] = float(scores.float().std()) if scores.numel() > 1 else 0.0
    if roles.get("kl"):
        logp, ref = (values.get(n) for n in roles["kl"])
        if isinstance(logp, TokenValues) and isinstance(ref, TokenValues):
            diff = TokenValues(logp.values - ref.values, logp.mask)
            m["kl"] = diff.mean()
    for key, name in (("policy", roles.get("policy_train")), ("value", roles.get("value_train"))):
        stats = values.get(name) if name else None
        if not stats:
            continue
        if key == "policy":
            m["policy_loss"] = stats.get("pg_loss", stats.get("loss", float("nan")))
            for k in ("entropy", "clipfrac", "approx_kl", "grad_norm"):
                if k in stats:
                    m[f"policy_{k}" if k == "grad_norm" else k] = stats[k]
        else:
            m["value_loss"] = stats.get("vf_loss", stats.get("loss", float("nan")))
            if "vf_clipfrac" in stats:
                m["value_clipfrac"] = stats["vf_clipfrac"]
    m.setdefault("kl", float("nan"))
    m.setdefault("policy_loss", float("nan"))
    m.setdefault("value_loss", float("nan"))
    m.setdefault("reward_mean", float("nan"))
    if roll is not None:
        lengths = roll.batch.response_lengths.float()
        m["response_len_mean"] = float(lengths.mean())
        m["response_len_max"] = float(lengths.max())
        m["decode_steps"] = roll.decode_steps
        m["gen_version"] = roll.version
        m["samples"] = roll.size
        if roll.born:
            stale = [roll.version - b for b in roll.born]
            m["carried"] = sum(1 for x in stale if x > 0)
            m["staleness_max"] = max(stale)
            m["staleness_mean"] = sum(stale) / len(stale)
        for stage, state in overcommit.items():
            m["overcommit_delta"] = state["delta"]
            m["carry_next"] = len(state["carry"])
    m["step_time_s"] = seconds
    m["samples_per_s"] = (m.get("samples", 0) / seconds) if seconds > 0 else 0.0
    return m


class MetricsLog:
    """``OUT/metrics.jsonl`` (NaN written as null, fsynced per row) and, when installed, TensorBoard."""

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, "metrics.jsonl")
        self.tb = None

    def open_tensorboard(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(self.out)
        except Exception:  # tensorboard missing: metrics.jsonl still has everything
            self.tb = None

    def write(self, m: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                 for k, v in m.items()}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self.tb is not None:
            for k, v in m.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                    self.tb.add_scalar(k, v, m["step"])
            self.tb.flush()

    def trim(self, upto: int) -> None:
        """On resume: keep the metric lines of steps before ``upto`` (later ones will be recomputed)."""
        if not os.path.isfile(self.path):
            return
        with open(self.path, encoding="utf-8") as fh:
            lines = [ln for ln in fh if ln.strip() and json.loads(ln)["step"] < upto]
        with open(self.path, "w", encoding="utf-8") as fh:
            fh.writelines(lines)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A rich progress bar showing reward, KL, losses and throughput per step."""

    def __init__(self, enabled: bool, total: int, start: int, plan: dict):
        self.enabled = enabled
        self.total, self.start = total, start
        self.plan = plan

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from rich.console import Console

        # piped output (logs, CI) has no width: give the line room instead of squeezing it to 80 columns
        console = None if sys.stdout.isatty() else Console(width=150)
        self.progress = Progress(TextColumn("[bold]{task.fields[name]}"), BarColumn(bar_width=24),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 transient=False, console=console)
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.total, completed=self.start,
                                           name=self.plan["module"], stats="starting workers…")
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
