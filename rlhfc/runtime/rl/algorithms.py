"""The GRPO/PPO algorithm family beyond plain PPO: REINFORCE++, ReMax, DAPO, GSPO, learning-rate schedules.

Same conventions as :mod:`rlhfc.runtime.rl.ppo` (token tensors ``[B, R]`` response-aligned, sequence tensors
``[B]``, ``mask`` 1 on real response tokens, masked-out outputs exactly 0, groups of ``n`` samples of one
prompt laid out contiguously). Each function is the formula of its paper, cited in its docstring and in
docs/language.md; tests/runtime/test_algorithms.py checks each against a hand computation.
"""

from __future__ import annotations

import math

import torch

from . import ppo
from .ppo import LOSS_AGGS, aggregate, loss_units, sequence_log_ratio  # noqa: F401 - the family's losses, here too

# ----------------------------------------------------------------------------- advantages


def reinforce_pp_advantages(scores: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor | None = None,
                            ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, estimator: str = "k1",
                            group: int = 1, baseline: bool = False) -> torch.Tensor:
    """REINFORCE++ advantages [B, R] (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models").

    Per-token reward ``r_t = score·[t is the last token] − kl_coef·KL_t`` (KL_t of ``logp`` and ``ref_logp``
    by ``estimator``; no KL term when they are None); the advantage is the return to go ``A_t = Σ_{s≥t} r_s``
    (γ = 1), normalised over every response token of the batch: ``(A − mean) / sqrt(var + 1e-8)`` — a global
    normalisation, not per group. ``baseline``: subtract each group's mean score first (REINFORCE++ with
    baseline, for ``group`` > 1 samples per prompt).
    """
    scores = scores.to(mask.device, torch.float32)
    if baseline and group > 1:
        g = scores.view(-1, group)
        scores = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    if logp is None or ref_logp is None:
        logp = ref_logp = torch.zeros(mask.shape, dtype=scores.dtype, device=mask.device)
        kl_coef = 0.0
    rewards = ppo.kl_penalized_rewards(scores, logp, ref_logp, mask, kl_coef, estimator)
    returns = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])   # Σ_{s ≥ t} r_s
    return ppo.masked_whiten(returns, mask)


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax advantages [B] (Li et al., 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models"): ``score − greedy_score`` of the same prompt, the
    baseline being the reward of the greedy response. ``scores`` [P·n] hold ``n`` samples per prompt in a
    row, ``greedy_scores`` [P] one per prompt."""
    if scores.ndim != 1 or greedy_scores.ndim != 1 or not len(greedy_scores) or len(scores) % len(greedy_scores):
        raise ValueError(f"remax needs one baseline score per prompt: got {tuple(greedy_scores.shape)} baseline "
                         f"scores for {tuple(scores.shape)} samples")
    n = len(scores) // len(greedy_scores)
    return scores.float() - greedy_scores.float().to(scores.device).repeat_interleave(n)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment [B] (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning
    System at Scale", eq. 13): 0 for ``len ≤ max_len − buffer``, ``(max_len − buffer − len) / buffer`` up to
    ``max_len``, −1 beyond. Added to the score."""
    lengths = lengths.float()
    start = max_len - buffer
    soft = (start - lengths) / buffer if buffer > 0 else torch.full_like(lengths, -1.0)
    return torch.where(lengths <= start, torch.zeros_like(lengths),
                       torch.where(lengths <= max_len, soft, torch.full_like(lengths, -1.0)))


def uniform_groups(scores: torch.Tensor, group: int) -> torch.Tensor:
    """[B/group] bool: the groups whose scores are all equal — DAPO's dynamic sampling drops them, since their
    group-relative advantages are all 0 and only dilute the batch."""
    g = scores.view(-1, group)
    return (g == g[:, :1]).all(dim=1)


# ----------------------------------------------------------------------------- learning-rate schedules


def lr_factor(step: int, schedule: str = "constant", warmup: int = 0, total: int = 0) -> float:
    """The multiple of the base lr that train step ``step`` (0-based) uses.

    Warmup: ``(step + 1) / warmup`` for the first ``warmup`` steps (the first step is not wasted at lr 0).
    After it, with ``p = (step − warmup) / (total − warmup)``: ``constant`` 1, ``linear`` ``1 − p``,
    ``cosine`` ``(1 + cos(π p)) / 2`` — both reach 0 at step ``total``. ``total`` 0 (unknown) means constant.
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    p = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr schedule {schedule!r}; use constant, linear or cosine")


__all__ = ["LOSS_AGGS", "aggregate", "loss_units", "lr_factor", "overlong_penalty", "reinforce_pp_advantages",
           "remax_advantages", "sequence_log_ratio", "uniform_groups"]


def rollout_logprob_gap(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                        tis_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The rollout engine's log-probs against the trainer's on the same tokens: (the truncated importance
    weights ``min(exp(logp - rollout_logp), tis_cap)`` [B, R] — 1 without a cap or where masked —, stats).

    Stats: ``rollout_logprob_diff_mean`` / ``_max`` (|rollout − trainer| over the response tokens) and, with
    a cap, ``tis_weight_mean``. Truncated importance sampling: Yao et al. (2025), "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training" (verl's ``tis_imp_ratio_cap``)."""
    m = mask.bool()
    diff = (rollout_logp.float() - logp.float()).abs()[m]
    stats = {"rollout_logprob_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
             "rollout_logprob_diff_max": float(diff.max()) if diff.numel() else 0.0}
    weight = torch.ones_like(logp)
    if tis_cap is not None:
        ratio = torch.exp((logp - rollout_logp.to(logp.dtype)).clamp(max=50.0)).clamp(max=float(tis_cap))
        weight = torch.where(m, ratio, weight)
        stats["tis_weight_mean"] = float(weight[m].mean()) if m.any() else 1.0
    return weight.detach(), stats
