"""Clip fractions count tokens that are really clipped, not float rounding at the clip boundary."""

from __future__ import annotations

import torch

from rlhfc.runtime.rl import ppo


def test_value_clipfrac_is_zero_when_no_value_moved_past_the_clip_range():
    """float32 values near zero (as a fresh critic's are) moved by less than the clip range:
    ``old + (V - old)`` differs from ``V`` in its last bit for about a third of the tokens, and counting
    those as clipped made ``value_clipfrac`` a coin flip over rounding (-O0 and -O2 disagreed on it by
    up to 4 points on examples/ppo_tiny.rlhf)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=g) * 0.05
    values = torch.randn(64, 32, generator=g) * 0.05
    values = torch.where((values - old).abs() < 0.2, values, old)      # none past the clip range
    returns = torch.randn(64, 32, generator=g)
    mask = torch.ones(64, 32)
    assert bool(((old + (values - old)) != values).any())          # the rounding the metric must ignore
    loss, m = ppo.value_loss(values, old, returns, mask, clip=0.2)
    assert m["vf_clipfrac"] == 0.0
    assert float(loss) == float(0.5 * ppo.masked_mean((values - returns) ** 2, mask))
    # moved past the range: counted (where the clipped error is the larger one), and the gradient is
    # the unclipped one's only where unclipped
    far = old + 0.5
    _, m = ppo.value_loss(far, old, returns, mask, clip=0.2)
    expect = ((old + 0.2 - returns) ** 2 > (far - returns) ** 2).float().mean()
    assert abs(m["vf_clipfrac"] - float(expect)) < 1e-6
