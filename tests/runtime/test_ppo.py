import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfc.runtime.rl import ppo
from rlhfc.runtime.train import loop

FAST = settings(max_examples=40, deadline=None)


@st.composite
def masked_batch(draw, min_b=1, max_b=6, max_r=10, allow_empty_rows=True):
    """(x, mask) with right-padded masks: each row a prefix of ones."""
    b = draw(st.integers(min_b, max_b))
    r = draw(st.integers(1, max_r))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    lo = 0 if allow_empty_rows else 1
    lengths = [draw(st.integers(lo, r)) for _ in range(b)]
    mask = torch.tensor([[1] * n + [0] * (r - n) for n in lengths], dtype=torch.long)
    x = torch.randn(b, r, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    return x, mask, g


# ----------------------------------------------------------------------------- masked reductions


@FAST
@given(masked_batch())
def test_masked_mean_and_sum(data):
    x, mask, _ = data
    garbage = torch.where(mask.bool(), x, torch.tensor(float("nan"), dtype=x.dtype))
    vals = x[mask.bool()]
    assert torch.isclose(ppo.masked_sum(garbage, mask), vals.sum())
    expected = vals.mean() if vals.numel() else torch.tensor(0.0, dtype=x.dtype)
    assert torch.isclose(ppo.masked_mean(garbage, mask), expected)


@FAST
@given(masked_batch(allow_empty_rows=False), st.booleans())
def test_whitening_gives_zero_mean_unit_std(data, unbiased):
    x, mask, _ = data
    n = int(mask.sum())
    vals = x[mask.bool()]
    if n < 3 or vals.std() < 1e-3:
        return
    w = ppo.masked_whiten(x, mask, unbiased=unbiased)
    wv = w[mask.bool()]
    assert abs(float(wv.mean())) < 1e-6
    # the std is var / (var + eps) under the root: 1 up to eps = 1e-8 against the variance
    var = float(vals.var(unbiased=unbiased))
    assert math.isclose(float(wv.std(unbiased=unbiased)), math.sqrt(var / (var + 1e-8)), rel_tol=1e-6)
    assert (w[~mask.bool()] == 0).all()
    kept = ppo.masked_whiten(x, mask, shift_mean=False, unbiased=unbiased)[mask.bool()]
    assert math.isclose(float(kept.mean()), float(vals.mean()), rel_tol=1e-6, abs_tol=1e-6)


# ----------------------------------------------------------------------------- KL


@FAST
@given(masked_batch())
def test_kl_estimators(data):
    logp, _, g = data
    logp = -logp.abs()
    for est in ppo.KL_ESTIMATORS:
        assert torch.equal(ppo.kl_penalty(logp, logp, est), torch.zeros_like(logp))
    ref = logp + torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    d = logp - ref
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(ppo.kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d)
    assert (ppo.kl_penalty(logp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError):
        ppo.kl_penalty(logp, ref, "k4")


@FAST
@given(masked_batch(), st.floats(0.0, 1.0))
def test_kl_penalized_rewards(data, kl_coef):
    logp, mask, g = data
    ref = logp + torch.randn(logp.shape, generator=g, dtype=logp.dtype)
    scores = torch.randn(logp.shape[0], generator=g, dtype=logp.dtype)
    rewards = ppo.kl_penalized_rewards(scores, logp, ref, mask, kl_coef, "k1")
    kl = ppo.masked_sum(logp - ref, mask, dim=1)
    has = mask.sum(1) > 0
    torch.testing.assert_close(rewards.sum(1), torch.where(has, scores, 0.0) - kl_coef * kl)
    assert (rewards[~mask.bool()] == 0).all()
    for i, n in enumerate(mask.sum(1).tolist()):
        if n:
            base = -kl_coef * (logp[i, n - 1] - ref[i, n - 1])
            assert torch.isclose(rewards[i, n - 1], base + scores[i])


# ----------------------------------------------------------------------------- GAE


@FAST
@given(masked_batch())
def test_gae_lam1_gamma1_zero_values_is_reward_to_go(data):
    rewards, mask, _ = data
    adv, ret = ppo.gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    masked = torch.where(mask.bool(), rewards, 0.0)
    to_go = masked.flip(1).cumsum(1).flip(1) * mask
    torch.testing.assert_close(adv, to_go)
    torch.testing.assert_close(ret, to_go)


@FAST
@given(masked_batch(), st.floats(0.5, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_direct_sum_and_ignores_padding(data, gamma, lam):
    rewards, mask, g = data
    values = torch.randn(rewards.shape, generator=g, dtype=rewards.dtype)
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    # garbage after the mask must not leak in
    noisy_r = torch.where(mask.bool(), rewards, 1e6)
    noisy_v = torch.where(mask.bool(), values, -1e6)
    adv2, ret2 = ppo.gae(noisy_r, noisy_v, mask, gamma, lam)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    # A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end = 0
    for i, n in enumerate(mask.sum(1).tolist()):
        v = values[i, :n].tolist() + [0.0]
        deltas = [rewards[i, t].item() + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            expect = sum((gamma * lam) ** l * deltas[t + l] for l in range(n - t))
            assert math.isclose(adv[i, t].item(), expect, rel_tol=1e-9, abs_tol=1e-9)
            assert math.isclose(ret[i, t].item(), expect + v[t], rel_tol=1e-9, abs_tol=1e-9)
    assert (adv[~mask.bool()] == 0).all() and (ret[~mask.bool()] == 0).all()


# ----------------------------------------------------------------------------- losses


@FAST
@given(masked_batch(allow_empty_rows=False), st.floats(0.05, 0.5))
def test_clipped_loss_equals_unclipped_inside_clip_range(data, clip):
    old, mask, g = data
    adv = torch.randn(old.shape, generator=g, dtype=old.dtype)
    log_ratio = (torch.rand(old.shape, generator=g, dtype=old.dtype) * 2 - 1) * math.log1p(clip) * 0.9
    new = (old + log_ratio).requires_grad_(True)
    loss, metrics = ppo.policy_loss(new, old, adv, mask, clip=clip)
    unclipped = ppo.masked_mean(-adv * torch.exp(new - old), mask)
    torch.testing.assert_close(loss, unclipped)
    assert metrics["clipfrac"] == 0.0
    loss.backward()
    assert new.grad is not None and (new.grad[~mask.bool()] == 0).all()


def test_policy_loss_clips_and_has_no_gradient_when_clipped():
    old = torch.zeros(1, 2)
    new = torch.tensor([[1.0, -1.0]], requires_grad=True)  # ratios e and 1/e
    adv = torch.tensor([[1.0, -1.0]])  # both would push further out of the clip range
    loss, metrics = ppo.policy_loss(new, old, adv, torch.ones(1, 2), clip=0.2)
    assert math.isclose(loss.item(), (-1.2 + 0.8) / 2, rel_tol=1e-6)
    assert metrics["clipfrac"] == 1.0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(1, 2))


def test_policy_loss_extra_terms():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g)
    new = old + 0.01
    ref = old - 0.3
    adv = torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    ent = torch.rand(3, 4, generator=g)
    base, _ = ppo.policy_loss(new, old, adv, mask)
    full, m = ppo.policy_loss(new, old, adv, mask, entropy=ent, entropy_coef=0.1, ref_logp=ref, kl_coef=0.2)
    kl = ppo.masked_mean(ppo.kl_penalty(new, ref, "k3"), mask)
    torch.testing.assert_close(full, base - 0.1 * ppo.masked_mean(ent, mask) + 0.2 * kl)
    assert {"pg_loss", "clipfrac", "approx_kl", "entropy", "kl", "ratio", "loss"} <= m.keys()


@FAST
@given(masked_batch(allow_empty_rows=False), st.floats(0.05, 1.0))
def test_value_loss(data, clip):
    old, mask, g = data
    ret = torch.randn(old.shape, generator=g, dtype=old.dtype)
    small = old + (torch.rand(old.shape, generator=g, dtype=old.dtype) * 2 - 1) * clip * 0.99
    loss, m = ppo.value_loss(small, old, ret, mask, clip=clip)
    torch.testing.assert_close(loss, 0.5 * ppo.masked_mean((small - ret) ** 2, mask))
    assert m["vf_clipfrac"] == 0.0
    unclipped, _ = ppo.value_loss(old + 5.0, old, ret, mask, clip=None)
    clipped, _ = ppo.value_loss(old + 5.0, old, ret, mask, clip=clip)
    assert clipped >= unclipped - 1e-12


# ----------------------------------------------------------------------------- group baselines


@FAST
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 10_000), st.booleans())
def test_group_advantages_sum_to_zero_per_group(groups, n, seed, normalize):
    scores = torch.randn(groups * n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = ppo.group_advantages(scores, n, normalize_std=normalize)
    assert adv.shape == scores.shape
    torch.testing.assert_close(adv.view(groups, n).sum(1), torch.zeros(groups, dtype=torch.float64))
    if normalize and n > 1:
        g = scores.view(groups, n)
        torch.testing.assert_close(adv.view(groups, n), (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6))


@FAST
@given(st.integers(1, 5), st.integers(2, 6), st.integers(0, 10_000))
def test_rloo_advantages(groups, n, seed):
    scores = torch.randn(groups * n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = ppo.rloo_advantages(scores, n)
    torch.testing.assert_close(adv.view(groups, n).sum(1), torch.zeros(groups, dtype=torch.float64))
    g = scores.view(groups, n)
    i = 0
    others = torch.cat([g[0, :i], g[0, i + 1 :]])
    assert torch.isclose(adv[0], g[0, 0] - others.mean())
    # RLOO is the group-centred score scaled by n / (n - 1)
    torch.testing.assert_close(adv, ppo.group_advantages(scores, n, normalize_std=False) * n / (n - 1))


def test_group_layout_errors_and_broadcast():
    with pytest.raises(ValueError):
        ppo.group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        ppo.rloo_advantages(torch.zeros(4), 1)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert ppo.broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


# ----------------------------------------------------------------------------- training loop


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def _regression_loss(model, mb):
    pred = mb["x"] @ model.w
    loss = ((pred - mb["y"]) ** 2).mean()
    return loss, {"rows": float(mb["x"].shape[0]), "scale": mb["scale"]}


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 3, generator=g)
    return {"x": x, "y": x @ torch.tensor([1.0, -2.0, 0.5]), "scale": 3}


def test_train_epochs_steps_and_averages():
    model = _Linear()
    opt = loop.make_optimizer(model, lr=0.1)
    seen = []

    def loss_fn(m, mb):
        seen.append(mb["x"].shape[0])
        return _regression_loss(m, mb)

    metrics = loop.train_epochs(model, opt, _data(), loss_fn, epochs=3, minibatches=4, max_grad_norm=1.0, generator=torch.Generator().manual_seed(0))
    assert seen == [3, 3, 2, 2] * 3
    assert metrics["rows"] == pytest.approx(2.5) and metrics["scale"] == 3
    assert {"loss", "grad_norm"} <= metrics.keys() and not model.training
    assert model.w.abs().sum() > 0


def test_train_epochs_is_deterministic_and_learns():
    def run(seed):
        model = _Linear()
        opt = loop.make_optimizer(model, lr=0.05)
        g = torch.Generator().manual_seed(seed)
        out = [loop.train_epochs(model, opt, _data(), _regression_loss, 2, 2, None, g)["loss"] for _ in range(30)]
        return model.w.detach().clone(), out

    w1, l1 = run(0)
    w2, l2 = run(0)
    w3, _ = run(1)
    assert torch.equal(w1, w2) and l1 == l2 and not torch.equal(w1, w3)
    assert l1[-1] < 0.1 * l1[0]


def test_train_epochs_clips_gradients():
    model = _Linear()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = _data()
    data["y"] = data["y"] * 1000
    loop.train_epochs(model, opt, data, _regression_loss, 1, 1, max_grad_norm=0.5)
    assert model.w.norm().item() == pytest.approx(0.5, rel=1e-5)


def test_train_epochs_rejects_bad_minibatches():
    with pytest.raises(ValueError, match="minibatches"):
        loop.train_epochs(_Linear(), torch.optim.SGD(_Linear().parameters(), lr=1.0), _data(), _regression_loss, 1, 11)
