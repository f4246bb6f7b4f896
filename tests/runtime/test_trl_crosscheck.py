"""Cross-check the PPO math against TRL 1.12's PPO trainer (``trl.experimental.ppo``).

Where TRL exposes a function (masked_mean / masked_var / masked_whiten, its
``forward`` helper, ``selective_log_softmax``) we call it; where the formula is
inline in ``PPOTrainer.train`` (GAE, KL, policy and value losses) the reference
below restates that formula as TRL writes it (TRL marks padding with
``INVALID_LOGPROB`` and boolean ``padding_mask`` tensors instead of 0/1 masks).
"""

import pytest
import torch

pytest.importorskip("trl")
trl_ppo = pytest.importorskip("trl.experimental.ppo.ppo_trainer")
from trl.trainer.utils import selective_log_softmax  # noqa: E402

from rlhfc.runtime.rl import ppo  # noqa: E402
from rlhfc.runtime.rollout.generation import generate, response_logprobs  # noqa: E402


def _random_case(seed, b=6, r=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    lengths[0] = r
    idx = torch.arange(r).expand(b, r)
    padding_mask = idx >= lengths[:, None]  # TRL: True on padding
    mask = (~padding_mask).long()
    t = lambda: torch.randn(b, r, generator=g, dtype=torch.float64)  # noqa: E731
    return g, mask, padding_mask, t


@pytest.mark.parametrize("seed", range(5))
def test_masked_reductions_match_trl(seed):
    _, mask, padding_mask, t = _random_case(seed)
    x = t()
    keep = ~padding_mask
    torch.testing.assert_close(ppo.masked_mean(x, mask), trl_ppo.masked_mean(x, keep))
    torch.testing.assert_close(ppo.masked_mean(x, mask, dim=1), trl_ppo.masked_mean(x, keep, 1))
    torch.testing.assert_close(ppo.masked_var(x, mask), trl_ppo.masked_var(x, keep))
    torch.testing.assert_close(ppo.masked_var(x, mask, unbiased=False), trl_ppo.masked_var(x, keep, unbiased=False))
    for shift in (True, False):
        ours = ppo.masked_whiten(x, mask, shift_mean=shift)
        theirs = torch.masked_fill(trl_ppo.masked_whiten(x, keep, shift_mean=shift), padding_mask, 0)
        torch.testing.assert_close(ours, theirs)


def _trl_gae(rewards, values, gamma, lam):
    # PPOTrainer.train, "6. compute advantages and returns"
    lastgaelam = 0
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    return advantages, advantages + values


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_and_whitened_advantages_match_trl(seed, gamma, lam):
    _, mask, padding_mask, t = _random_case(seed)
    rewards, values = t(), t()
    # TRL zeroes what lies past the response before its GAE loop.
    rewards_z = rewards.masked_fill(padding_mask, 0)
    values_z = values.masked_fill(padding_mask, 0)
    adv_trl, ret_trl = _trl_gae(rewards_z, values_z, gamma, lam)
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, adv_trl.masked_fill(padding_mask, 0))
    torch.testing.assert_close(ret, ret_trl.masked_fill(padding_mask, 0))
    white_trl = torch.masked_fill(trl_ppo.masked_whiten(adv_trl, ~padding_mask), padding_mask, 0)
    torch.testing.assert_close(ppo.masked_whiten(adv, mask), white_trl)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_matches_trl(seed, estimator):
    g, mask, _, t = _random_case(seed)
    logprobs, ref_logprobs = -t().abs(), -t().abs()
    logr = ref_logprobs - logprobs
    kl_trl = -logr if estimator == "k1" else (logr.exp() - 1) - logr
    torch.testing.assert_close(ppo.kl_penalty(logprobs, ref_logprobs, estimator), kl_trl)


@pytest.mark.parametrize("seed", range(5))
def test_policy_and_value_losses_match_trl(seed):
    g, mask, padding_mask, t = _random_case(seed)
    cliprange, cliprange_value = 0.2, 0.2
    mb_logprobs = -t().abs()
    new_logprobs = mb_logprobs + 0.3 * t()
    mb_advantage = t()
    # TRL fills padding of both log-prob tensors with INVALID_LOGPROB
    new_trl = torch.masked_fill(new_logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    old_trl = torch.masked_fill(mb_logprobs, padding_mask, trl_ppo.INVALID_LOGPROB)
    ratio = torch.exp(new_trl - old_trl)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = trl_ppo.masked_mean(torch.max(pg_losses, pg_losses2), ~padding_mask)
    pg_clipfrac = trl_ppo.masked_mean((pg_losses2 > pg_losses).double(), ~padding_mask)
    logprobs_diff = new_trl - old_trl

    loss, metrics = ppo.policy_loss(new_logprobs, mb_logprobs, mb_advantage, mask, clip=cliprange)
    torch.testing.assert_close(loss, pg_loss)
    assert metrics["clipfrac"] == pytest.approx(pg_clipfrac.item())
    # TRL's approxkl averages over every position; padding contributes zeros there
    n, total = mask.sum().item(), mask.numel()
    assert metrics["approx_kl"] * n / total == pytest.approx((0.5 * (logprobs_diff**2).mean()).item())

    mb_values, mb_return = t(), t()
    vpred = mb_values + 0.5 * t()
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss = 0.5 * trl_ppo.masked_mean(torch.max(vf_losses1, vf_losses2), ~padding_mask)
    vf_clipfrac = trl_ppo.masked_mean((vf_losses2 > vf_losses1).double(), ~padding_mask)
    vloss, vmetrics = ppo.value_loss(vpred, mb_values, mb_return, mask, clip=cliprange_value)
    torch.testing.assert_close(vloss, vf_loss)
    assert vmetrics["vf_clipfrac"] == pytest.approx(vf_clipfrac.item())


@torch.no_grad()
def test_response_logprobs_match_trl_forward(policy):
    """TRL's ``forward`` derives mask and positions from ``!= pad`` and reads
    logits[:, context_length - 1 : -1]; with left-padded prompts that must give
    our response log-probs."""
    prompts = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13]]
    batch = generate(policy, prompts, 10, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(0), temperature=1.5)
    context_length = batch.prompt_len
    out = trl_ppo.forward(policy.hf, batch.input_ids, 0)
    logits = out.logits[:, context_length - 1 : -1] / 1.5
    theirs = selective_log_softmax(logits, batch.responses)
    ours = response_logprobs(policy, batch, temperature=1.5)
    torch.testing.assert_close(ours, theirs * batch.response_mask, atol=1e-5, rtol=1e-5)
