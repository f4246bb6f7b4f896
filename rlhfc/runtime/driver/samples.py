"""What people look at: ``OUT/samples.jsonl`` and the same samples as TensorBoard text.

Every step writes ``run { log_samples = N }`` samples of its rollout (default 4; 0 writes none), spread
evenly over the batch (rows ``i * B // N``, so with ``n`` samples per prompt several prompts show). One
JSON object per sample and line::

    {"step": 3, "row": 0, "prompt": "...", "response": "...", "reward": 0.42,
     "scores": {"scores": 0.42, ...}, "response_tokens": 7}

``reward`` is the value the metrics call the reward (``reward_mean`` averages it over the batch; null when
the pipeline has none); ``scores`` holds every per-sequence value of the step (``SeqFloat``: the reward
model's or rule's scores, a KL-penalised reward, ...), by value name. ``fields``: the data fields of the
sample's prompt, when the pipeline's data has any (:func:`sample_rows`'s ``fields`` argument; absent
otherwise). A multi-turn generate's sample also has ``turns``, its trajectory as ``[[who, text], ...]``
(``who``: ``policy``, a tool's name or ``env``: what the loss trains on and what it does not), and with an
environment ``env_reward``. ``versions``: the weights versions that generated the response, as runs
``[[version, tokens], ...]`` in response order (several for a sample ``overcommit`` carried over; a version is the
number of train steps the weights had taken).

On resume :meth:`SampleLog.trim` keeps the lines of the steps before the checkpoint (as ``metrics.jsonl``),
and :meth:`SampleLog.open` writes them again as TensorBoard text into the fresh events file that replaces
the old ones (:meth:`rlhfc.runtime.driver.metrics.MetricsLog.open_tensorboard`), so no sample is lost or doubled.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

import torch

from rlhfc.runtime.data.values import Rollout, TokenValues
from rlhfc.runtime.rollout.agent import ENV_REWARD, ENV_TURN_REWARDS, TURNS

from .metrics import trim_jsonl

__all__ = ["SampleLog", "sample_rows", "DEFAULT_LOG_SAMPLES"]

#: samples per step when the run block does not say (``run { log_samples = N }``)
DEFAULT_LOG_SAMPLES = 4


def _number(x: float) -> float | None:
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


def sample_rows(step: int, roll: Rollout, values: dict[str, Any], reward: str | None, n: int,
                fields: Sequence[dict] | None = None) -> list[dict]:
    """The ``n`` sample rows of one step (see module docstring). ``values``: the step's values by name;
    ``reward``: the name of the reward value (the plan's ``metrics.reward``); ``fields``: per sample of the
    rollout (in batch order), the data fields of its prompt — the hook for data sources with fields."""
    size = roll.size
    if n <= 0 or size == 0:
        return []
    picked = sorted({i * size // min(n, size) for i in range(min(n, size))})
    seq = {name: v for name, v in values.items()
           if torch.is_tensor(v) and v.ndim == 1 and v.shape[0] == size and v.is_floating_point()}
    per_token = values.get(reward) if reward else None
    if isinstance(per_token, TokenValues) and per_token.values.shape[0] == size:   # env_turn_rewards: the row's sum
        seq[reward] = per_token.row_sums()
    lengths = roll.batch.response_lengths.tolist()
    rows = []
    for i in picked:
        row = {"step": step, "row": i, "prompt": roll.prompts[i], "response": roll.responses[i],
               "reward": _number(seq[reward][i]) if reward in seq else None,
               "scores": {name: _number(v[i]) for name, v in seq.items()}, "response_tokens": int(lengths[i])}
        if i < len(roll.versions):   # the weights versions that generated its tokens (several when carried)
            row["versions"] = roll.versions[i]
        if fields is not None:
            row["fields"] = dict(fields[i])
        extra = roll.fields[i] if i < len(roll.fields) else {}
        if TURNS in extra:   # a multi-turn generate's trajectory: who said what
            row["turns"] = extra[TURNS]
            row.get("fields", {}).pop(TURNS, None)
        if ENV_REWARD in extra:
            row["env_reward"] = _number(extra[ENV_REWARD])
            row.get("fields", {}).pop(ENV_REWARD, None)
        if ENV_TURN_REWARDS in extra:   # [[response column, reward], ...]: each environment step's
            row["env_turn_rewards"] = [[int(c), _number(r)] for c, r in extra[ENV_TURN_REWARDS]]
            row.get("fields", {}).pop(ENV_TURN_REWARDS, None)
        rows.append(row)
    return rows


class SampleLog:
    """``OUT/samples.jsonl`` and TensorBoard text (tag ``samples``), ``n`` samples per step."""

    def __init__(self, out: str, n: int = DEFAULT_LOG_SAMPLES):
        self.path = os.path.join(out, "samples.jsonl")
        self.n = int(n)
        self.tb = None

    def trim(self, upto: int) -> tuple[list[dict], list[str]]:
        """On resume: keep the samples of steps before ``upto``; returns them and notes on dropped lines."""
        return trim_jsonl(self.path, upto, "sample row")

    def open(self, tb, replay: list[dict] | None = None) -> None:
        """Write text to ``tb`` (the metrics' SummaryWriter, or None); first the ``replay`` rows (on resume:
        the kept ones, whose events files :class:`MetricsLog` removed)."""
        self.tb = tb
        if tb is None or not replay:
            return
        by_step: dict[int, list[dict]] = {}
        for row in replay:
            by_step.setdefault(row["step"], []).append(row)
        for step, rows in sorted(by_step.items()):
            self._tb_write(step, rows)
        tb.flush()

    def write(self, step: int, roll: Rollout | None, values: dict[str, Any], reward: str | None,
              fields: Sequence[dict] | None = None) -> list[dict]:
        """Append the step's sample rows (none without a rollout or with ``n = 0``); returns them."""
        rows = sample_rows(step, roll, values, reward, self.n, fields) if roll is not None else []
        if not rows:
            return rows
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            fh.flush()
            os.fsync(fh.fileno())
        if self.tb is not None:
            self._tb_write(step, rows)
            self.tb.flush()
        return rows

    def _tb_write(self, step: int, rows: list[dict]) -> None:
        self.tb.add_text("samples", to_markdown(rows), step)


def to_markdown(rows: list[dict]) -> str:
    """A step's samples as a Markdown table (TensorBoard renders it)."""
    def cell(text: str) -> str:
        return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", " ") + "`" if text else ""

    lines = ["| row | prompt | response | reward |", "| --- | --- | --- | --- |"]
    for r in rows:
        reward = "—" if r.get("reward") is None else f"{r['reward']:+.4f}"
        lines.append(f"| {r['row']} | {cell(r['prompt'])} | {cell(r['response'])} | {reward} |")
    return "\n".join(lines)
