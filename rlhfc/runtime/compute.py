"""Driver-side compute stages (``compute.*`` ops): cheap tensor math on gathered values.

Each function takes the runtime values of its IR operands, in operand order,
and the op's attributes as keywords; names match the IR ops. Rewards, scores,
values, advantages and returns are checked where they enter or leave a stage: a
NaN or infinity raises :class:`~rlhfc.runtime.guards.NonFiniteError` naming the
value and the sample, which the driver reports as the stage's error.
"""

from __future__ import annotations

import torch

from . import ppo
from .guards import check_finite
from .rewards import resolve_rule, rule_scores
from .values import PolicyLossInput, Rollout, TokenValues, ValueLossInput


def sample_logprobs(rollout: Rollout, *, temperature: float) -> TokenValues:
    """The log-probs generation kept for the rollout's tokens (the ``reuse_logprobs`` pass)."""
    if rollout.logprobs is None:
        raise ValueError("the rollout carries no sampling log-probs: its generate stage needs the annotation "
                         "logprobs = true (the reuse_logprobs pass sets it)")
    return TokenValues(rollout.logprobs, rollout.mask)


def gae(rewards, values: TokenValues, logp: TokenValues | None = None, ref_logp: TokenValues | None = None, *,
        gamma: float, lam: float, kl_coef: float, estimator: str, whiten: bool) -> tuple[TokenValues, TokenValues]:
    """Advantages and returns. ``rewards``: sequence scores [B] (KL-penalised with
    ``logp``/``ref_logp`` when given) or per-token rewards (TokenValues)."""
    mask = values.mask
    if isinstance(rewards, TokenValues):
        check_finite(rewards.values, "a per-token reward", mask=rewards.mask)
    else:
        check_finite(rewards, "a score")
    check_finite(values.values, "a value estimate", mask=mask)
    if isinstance(rewards, TokenValues):
        token_rewards = rewards.values
    elif logp is not None and ref_logp is not None:
        token_rewards = ppo.kl_penalized_rewards(rewards, logp.values, ref_logp.values, mask, kl_coef, estimator)
    else:
        token_rewards = ppo.kl_penalized_rewards(rewards, torch.zeros_like(values.values),
                                                 torch.zeros_like(values.values), mask, 0.0)
    adv, ret = ppo.gae(token_rewards, values.values, mask, gamma=gamma, lam=lam)
    check_finite(token_rewards, "a KL-penalised reward (the KL of logp and ref_logp)", mask=mask)
    if whiten:
        adv = ppo.masked_whiten(adv, mask)
        adv = adv * mask.to(adv.dtype)
    check_finite(adv, "an advantage", mask=mask)
    check_finite(ret, "a return", mask=mask)
    return TokenValues(adv, mask), TokenValues(ret, mask)


def kl_penalty(scores: torch.Tensor, logp: TokenValues, ref_logp: TokenValues, *, coef: float,
               estimator: str) -> TokenValues:
    """Per-token rewards: ``-coef * KL`` on each token plus the score on the last."""
    check_finite(scores, "a score")
    out = ppo.kl_penalized_rewards(scores, logp.values, ref_logp.values, logp.mask, coef, estimator)
    return TokenValues(check_finite(out, "a KL-penalised reward (the KL of logp and ref_logp)", mask=logp.mask),
                       logp.mask)


def group_advantages(rollout: Rollout, scores: torch.Tensor, *, method: str, normalize_std: bool,
                     group: int) -> TokenValues:
    """GRPO / RLOO advantages over groups of ``group`` samples of one prompt, on every response token."""
    check_finite(scores, "a score", prompts=rollout.prompts)
    if method == "rloo":
        seq = ppo.rloo_advantages(scores, group) if group > 1 else torch.zeros_like(scores)
    else:
        seq = ppo.group_advantages(scores, group, normalize_std=normalize_std)
    check_finite(seq, "an advantage", prompts=rollout.prompts)
    return TokenValues(ppo.broadcast_to_tokens(seq, rollout.mask), rollout.mask)


def rule(rollout: Rollout, *, fn: str, extract: str = "") -> torch.Tensor:
    """Score each sample with the Python rule ``fn`` ("module:function"), which gets the data fields of the
    sample's prompt it names and the answer ``extract`` cuts out of the response; errors name ``fn``, the
    sample and its prompt."""
    return rule_scores(resolve_rule(fn), rollout.prompts, rollout.responses, name=fn, fields=rollout.fields,
                       extract=extract)


def ppo_clip(rollout: Rollout, logp: TokenValues, advantages: TokenValues, ref_logp: TokenValues | None = None, *,
             clip: float, entropy_coef: float, kl_coef: float, estimator: str,
             temperature: float = 1.0) -> PolicyLossInput:
    """Bundle what the policy's train step needs (the loss itself is computed per minibatch there)."""
    return PolicyLossInput(rollout, logp.values, advantages.values,
                           ref_logp.values if ref_logp is not None else None,
                           clip, entropy_coef, kl_coef, estimator, temperature)


def value_loss(rollout: Rollout, values: TokenValues, returns: TokenValues, *, clip: float) -> ValueLossInput:
    """Bundle what the critic's train step needs."""
    return ValueLossInput(rollout, values.values, returns.values, clip)
