"""Drawing the next token: temperature, top-k, top-p, and per-row random streams.

Generation used to draw every row's token from one shared ``torch.Generator``, so a row's tokens
depended on which other rows were in the batch. :func:`row_uniforms` gives each sample its own
stream instead — a counter-based generator (splitmix64's finaliser over the row's key and the token
position), a pure function of (key, position) — so a row samples the same tokens when finished rows
leave the decode batch, when rows are split over data-parallel ranks, or when they are decoded in
another batch altogether.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15


def _i64(x: int) -> int:
    """A 64-bit constant as torch's signed int64."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch shifts arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplications wrap around)."""
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def row_uniforms(keys: torch.Tensor, steps: torch.Tensor | int) -> torch.Tensor:
    """One uniform draw in [0, 1) per row (float64), a pure function of (row key, step).

    Each sample has its own random stream — a counter-based generator (splitmix64 over the key and the
    token position) — so a row draws the same numbers whatever else is in the batch: when finished rows
    leave the decode batch, when the rows are split over data-parallel ranks or into streamed chunks."""
    keys = keys.to(torch.long)
    steps = torch.as_tensor(steps, dtype=torch.long, device=keys.device)
    z = _mix(_mix(keys * _i64(_GOLDEN) + _i64(_GOLDEN)) ^ (steps + 1))
    return _shr(z, 11).to(torch.float64) * (2.0 ** -53)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    *,
    keys: torch.Tensor | None = None,
    steps: torch.Tensor | int = 0,
) -> torch.Tensor:
    """Draw one token per row from ``logits`` [B, V] -> [B] long.

    ``temperature <= 0`` is greedy (argmax, no draw). ``top_k > 0`` keeps the k
    largest logits; ``top_p < 1`` keeps the smallest set of most likely tokens
    whose probability reaches ``top_p`` (always at least one). With ``keys`` [B] each row draws from
    its own stream (:func:`row_uniforms` at ``steps``) by inverting its cumulative distribution;
    without, ``torch.multinomial`` draws from ``generator``.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p <= 0.0:  # a nucleus of mass 0 keeps just the most likely token
        top_p = 1e-12
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if keys is not None:
        cdf = probs.double().cumsum(-1)
        target = row_uniforms(keys.to(probs.device), steps) * cdf[:, -1]
        # the first token whose cumulative mass exceeds the target: never one of probability 0
        return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(1).to(logits.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
