"""Guards against training on garbage: the errors a stage raises when a value it produced is unusable.

A stage that produced a NaN or infinite reward, score, value, advantage, loss or gradient raises
:class:`NonFiniteError`; a reward function that fails raises :class:`RewardError`. The driver turns
either into a stage error (``Job.compute`` for driver-side stages, ``Job.get`` for remote ones) before
anything of the step is trained on or checkpointed, so the last good checkpoint stays the latest.
Both carry one message argument only, so they cross Ray's process boundary intact.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["NonFiniteError", "RewardError", "check_finite", "short"]


class NonFiniteError(ValueError):
    """A value that must be finite is NaN or infinite (the message names what and which sample)."""


class RewardError(ValueError):
    """A reward function raised or returned something that is not a number (the message names the sample)."""


_STOP = "; the run stops here, before anything of this step is trained on or checkpointed"


def short(text: str, limit: int = 60) -> str:
    """A prompt as a message shows it: quoted, cut to ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def check_finite(values: torch.Tensor, what: str, *, mask: torch.Tensor | None = None,
                 prompts: Sequence[str] | None = None) -> torch.Tensor:
    """Return ``values`` if every entry (every ``mask``-ed entry) is finite; else raise
    :class:`NonFiniteError` naming ``what``, the first bad sample (row) and its prompt."""
    ok = torch.isfinite(values)
    if mask is not None:
        ok = ok | ~mask.to(torch.bool)
    if bool(ok.all()):
        return values
    bad = ~ok
    rows = bad.reshape(bad.shape[0], -1).any(dim=1) if bad.dim() > 0 else bad.reshape(1)
    row = int(torch.nonzero(rows)[0, 0])
    value = float(values.reshape(values.shape[0], -1)[row][bad.reshape(bad.shape[0], -1)[row]][0]) \
        if values.dim() > 0 else float(values)
    where = f" for sample {row}" if values.dim() > 0 else ""
    prompt = f" (prompt {short(prompts[row])})" if prompts is not None and row < len(prompts) else ""
    count = int(rows.sum())
    more = f" ({count} samples in all)" if count > 1 else ""
    raise NonFiniteError(f"{what} is {_text(value)}{where}{prompt}{more}{_STOP}")


def _text(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
