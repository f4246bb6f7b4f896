"""Driver-side compute stages (``compute.*`` ops): cheap tensor math on gathered values.

Each function takes the runtime values of its IR operands, in operand order,
and the op's attributes as keywords; names match the IR ops. Rewards, scores,
values, advantages and returns are checked where they enter or leave a stage: a
NaN or infinity raises :class:`~rlhfc.runtime.rl.guards.NonFiniteError` naming the
value and the sample, which the driver reports as the stage's error.
"""

from __future__ import annotations

import torch

from rlhfc.contract.engines import rollout_traits
from rlhfc.runtime.data.values import PolicyLossInput, Rollout, TokenValues, ValueLossInput, select_rows
from rlhfc.runtime.rl import algorithms, ppo
from rlhfc.runtime.rl.guards import check_finite
from rlhfc.runtime.rollout.agent import ENV_REWARD, ENV_TURN_REWARDS

from .rewards import resolve_rule, rule_scores


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


def kl_penalty(scores, logp: TokenValues, ref_logp: TokenValues, *, coef: float,
               estimator: str) -> TokenValues:
    """Per-token rewards: ``-coef * KL`` on each token plus the score on the last (``scores`` [B]), or plus each
    token's own reward (``scores`` per-token rewards: :func:`env_turn_rewards`)."""
    if isinstance(scores, TokenValues):
        check_finite(scores.values, "a per-token reward", mask=scores.mask)
        kl = ppo.kl_penalty(logp.values, ref_logp.values, estimator)
        penalty = torch.where(logp.mask.bool(), -coef * kl, torch.zeros_like(kl))
        out = scores.values.to(penalty.dtype) + penalty
        return TokenValues(check_finite(out, "a KL-penalised reward (the KL of logp and ref_logp)", mask=logp.mask),
                           logp.mask)
    check_finite(scores, "a score")
    out = ppo.kl_penalized_rewards(scores, logp.values, ref_logp.values, logp.mask, coef, estimator)
    return TokenValues(check_finite(out, "a KL-penalised reward (the KL of logp and ref_logp)", mask=logp.mask),
                       logp.mask)


def group_advantages(rollout: Rollout, scores: torch.Tensor, logp: TokenValues | None = None,
                     ref_logp: TokenValues | None = None, *, method: str, normalize_std: bool, group: int,
                     kl_coef: float = 0.01, estimator: str = "k1", filter_groups: bool = False,
                     max_refill: int = 0) -> TokenValues:
    """GRPO / RLOO / REINFORCE++ advantages over groups of ``group`` samples of one prompt, on every response
    token; ``filter_groups``: mark the groups whose scores are all equal as left out (``TokenValues.keep``).
    ``max_refill``: read by the driver, which repeats the sampling round (rlhfc.runtime.rl.refill), not here."""
    check_finite(scores, "a score", prompts=rollout.prompts)
    if method.startswith("reinforce_pp"):
        adv = algorithms.reinforce_pp_advantages(
            scores, rollout.mask, logp.values if logp is not None else None,
            ref_logp.values if ref_logp is not None else None, kl_coef, estimator, group,
            baseline=method == "reinforce_pp_baseline")
        check_finite(adv, "an advantage", mask=rollout.mask)
        out = TokenValues(adv, rollout.mask)
    else:
        if method == "rloo":
            seq = ppo.rloo_advantages(scores, group) if group > 1 else torch.zeros_like(scores)
        else:
            seq = ppo.group_advantages(scores, group, normalize_std=normalize_std)
        check_finite(seq, "an advantage", prompts=rollout.prompts)
        out = TokenValues(ppo.broadcast_to_tokens(seq, rollout.mask), rollout.mask)
    if filter_groups:
        uniform = algorithms.uniform_groups(scores.cpu(), group)
        out.keep, out.dropped_groups = ~uniform.repeat_interleave(group), int(uniform.sum())
    return out


def remax(rollout: Rollout, scores: torch.Tensor, baseline: torch.Tensor) -> TokenValues:
    """ReMax advantages: each sample's score minus its prompt's greedy-response score, on every token."""
    check_finite(scores, "a score", prompts=rollout.prompts)
    check_finite(baseline, "a baseline score")
    seq = algorithms.remax_advantages(scores, baseline)
    return TokenValues(ppo.broadcast_to_tokens(seq, rollout.mask), rollout.mask)


def overlong(rollout: Rollout, scores: torch.Tensor, *, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO's overlong reward shaping: ``scores`` plus the soft length penalty of each response."""
    check_finite(scores, "a score", prompts=rollout.prompts)
    lengths = rollout.batch.response_lengths.to(scores.device)
    return scores.float() + algorithms.overlong_penalty(lengths, max_len, buffer)


def rule(rollout: Rollout, *, fn: str, extract: str = "") -> torch.Tensor:
    """Score each sample with the Python rule ``fn`` ("module:function"), which gets the data fields of the
    sample's prompt it names and the answer ``extract`` cuts out of the response; errors name ``fn``, the
    sample and its prompt."""
    return rule_scores(resolve_rule(fn), rollout.prompts, rollout.responses, name=fn, fields=rollout.fields,
                       extract=extract)


def ppo_clip(rollout: Rollout, logp: TokenValues, advantages: TokenValues, ref_logp: TokenValues | None = None, *,
             clip: float, entropy_coef: float, kl_coef: float, estimator: str, temperature: float = 1.0,
             clip_low: float | None = None, clip_high: float | None = None, loss_agg: str = "token_mean",
             ratio: str = "token", tis_cap: float | None = None,
             behaviour_cap: float | None = None, proximal: str = "recompute") -> PolicyLossInput:
    """Bundle what the policy's train step needs (the loss itself is computed per minibatch there). Rows the
    advantages leave out (``keep``: dynamic sampling) are dropped here, so the loss averages over the rest.

    When the rollout carries its engine's log-probs (``rollout = vllm``) the stats report how far they are
    from the trainer's ``logp`` (:func:`rlhfc.runtime.rl.algorithms.rollout_logprob_gap`) and, with ``tis_cap``,
    the advantages are weighted by the truncated importance ratio min(exp(logp - rollout logp), tis_cap) —
    the same loss as weighting each token's clipped surrogate by it, since the weight is positive and
    carries no gradient.

    ``behaviour_cap`` (asynchronous rollout: the samples were generated by older weights than the step's):
    decoupled PPO — ``logp`` is the proximal policy, the rollout's own log-probs the behaviour policy, and the
    train step weights each token by exp(logp − behaviour), dropping those above the cap (this weight stands
    in for TIS's, which corrects the same gap). ``proximal = "loglinear"`` (A-3PO): ``logp`` is the behaviour
    policy too (the sampling log-probs) and the train step interpolates the proximal one per sample
    (:func:`rlhfc.runtime.rl.ppo.policy_loss`)."""
    old, adv, ref = logp.values, advantages.values, ref_logp.values if ref_logp is not None else None
    stats: dict = {}
    if advantages.keep is not None:
        keep = advantages.keep.cpu()
        stats = {"dropped_groups": float(advantages.dropped_groups), "kept_samples": float(keep.sum())}
        if advantages.sample_rounds:   # refilled (rlhfc.runtime.rl.refill)
            stats.update(sample_rounds=float(advantages.sample_rounds),
                         sampled_groups=float(advantages.sampled_groups))
        index = keep.nonzero().flatten()
        rollout = select_rows(rollout, index)
        old, adv = old[index.to(old.device)], adv[index.to(adv.device)]
        ref = ref[index.to(ref.device)] if ref is not None else None
    if behaviour_cap is not None:
        if rollout.logprobs is None:
            raise ValueError("asynchronous rollout needs the generating weights' log-probs on the rollout (the "
                             "generate stage keeps them: logprobs=True)")
        return PolicyLossInput(rollout, old, adv, ref, clip if clip_low is None else clip_low, entropy_coef, kl_coef,
                               estimator, temperature, clip if clip_high is None else clip_high, loss_agg, ratio, stats,
                               rollout.logprobs.to(old.device), float(behaviour_cap), proximal)
    if rollout.logprobs is not None and not rollout_traits(rollout.rollout_engine).trainer_numerics:
        from rlhfc.runtime.rl.algorithms import rollout_logprob_gap

        weight, gap = rollout_logprob_gap(old, rollout.logprobs.to(old.device), rollout.mask.to(old.device), tis_cap)
        stats.update(gap)
        adv = adv * weight if tis_cap is not None else adv
    return PolicyLossInput(rollout, old, adv, ref, clip if clip_low is None else clip_low, entropy_coef, kl_coef,
                           estimator, temperature, clip if clip_high is None else clip_high, loss_agg, ratio, stats)


def value_loss(rollout: Rollout, values: TokenValues, returns: TokenValues, *, clip: float) -> ValueLossInput:
    """Bundle what the critic's train step needs."""
    return ValueLossInput(rollout, values.values, returns.values, clip)


def env_turn_rewards(rollout: Rollout) -> TokenValues:
    """Per-token rewards [B, R] of a multi-turn generate with ``env = ...``: each environment step's reward on the
    last token of the policy turn it answered, 0 elsewhere (their sum over a row is :func:`env_reward`'s)."""
    if not rollout.fields or any(ENV_TURN_REWARDS not in f for f in rollout.fields):
        raise ValueError("env_turn_rewards needs a rollout whose generate acts in an environment (env = ...)")
    mask = rollout.mask
    out = torch.zeros(mask.shape, dtype=torch.float32)
    for row, f in enumerate(rollout.fields):
        for col, reward in f[ENV_TURN_REWARDS]:
            out[row, min(int(col), mask.shape[1] - 1)] += float(reward)
    check_finite(out, "an environment's reward", prompts=rollout.prompts)
    return TokenValues(out.to(mask.device), mask)


def env_reward(rollout: Rollout) -> torch.Tensor:
    """Each trajectory's summed reward from its environment (a multi-turn generate with ``env = ...``)."""
    if not rollout.fields or any(ENV_REWARD not in f for f in rollout.fields):
        raise ValueError("env_reward needs a rollout whose generate acts in an environment (env = ...)")
    return check_finite(torch.tensor([float(f[ENV_REWARD]) for f in rollout.fields]), "an environment's reward",
                        prompts=rollout.prompts)
