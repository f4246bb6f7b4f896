"""Decoupled PPO (issue #37's correction for rollouts of older weights): ``policy_loss`` with behaviour log-probs
equals a direct computation of AReaL's decoupled objective on fixed tensors — the ratio clipped against the
proximal policy, each token weighted by exp(proximal - behaviour), tokens whose weight exceeds the cap dropped
from the surrogate but still counted by the token mean — and without them is the plain PPO loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfc.runtime.rl.ppo import policy_loss


def _direct(logp, prox, behav, adv, mask, eps, cap):
    """AReaL's formula, token by token in plain Python (no rlhfc code)."""
    total, count, kept_w, dropped = 0.0, 0, [], 0
    for i in range(len(logp)):
        for j in range(len(logp[i])):
            if not mask[i][j]:
                continue
            count += 1
            ratio = math.exp(logp[i][j] - prox[i][j])
            term = max(-adv[i][j] * ratio, -adv[i][j] * min(max(ratio, 1 - eps), 1 + eps))
            w = math.exp(prox[i][j] - behav[i][j])
            if cap is not None and w > cap:
                dropped += 1
                continue
            kept_w.append(w)
            total += term * w
    return total / max(count, 1), kept_w, dropped / max(count, 1)


@pytest.mark.parametrize("cap", [None, 1.5, 1.05])
def test_the_decoupled_loss_equals_areals_formula(cap):
    g = torch.Generator().manual_seed(3)
    B, R = 4, 6
    behav = -2.0 + 0.5 * torch.randn(B, R, generator=g, dtype=torch.float64)
    prox = behav + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)     # newer weights than the rollout's
    logp = (prox + 0.2 * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = torch.ones(B, R, dtype=torch.float64)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    loss, metrics = policy_loss(logp, prox, adv, mask, clip=0.2, behaviour_logp=behav, behaviour_cap=cap)
    want, kept, dropped = _direct(logp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), 0.2, cap)
    assert float(loss) == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert metrics["behaviour_masked_frac"] == pytest.approx(dropped)
    assert metrics["behaviour_weight_mean"] == pytest.approx(sum(kept) / len(kept))
    assert metrics["behaviour_weight_max"] == pytest.approx(max(kept))
    if cap == 1.05:
        assert 0 < dropped < 1   # the cap really masks some tokens here
    loss.backward()   # the weights carry no gradient: only the current policy's log-probs do
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())


def test_behaviour_equal_to_proximal_is_plain_ppo():
    g = torch.Generator().manual_seed(1)
    old = -2.0 + torch.randn(3, 5, generator=g)
    logp = old + 0.1 * torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, 5, generator=g), torch.ones(3, 5)
    plain, _ = policy_loss(logp, old, adv, mask)
    same, metrics = policy_loss(logp, old, adv, mask, behaviour_logp=old, behaviour_cap=2.0)
    assert float(same) == pytest.approx(float(plain), rel=1e-7)
    assert metrics["behaviour_weight_mean"] == pytest.approx(1.0) and metrics["behaviour_masked_frac"] == 0.0
