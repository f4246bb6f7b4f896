"""PPO / GRPO / RLOO math on plain tensors: masked reductions, KL, advantages, losses and their aggregation.

The minibatch training loop that applies the losses is :mod:`rlhfc.runtime.train.loop`.

Conventions (every function):

* Token tensors are response-aligned ``[B, R]`` (see ``generation.RolloutBatch``);
  sequence tensors are ``[B]``.
* ``mask`` is ``[B, R]`` with 1 on real response tokens (any dtype: bool, long or
  float). Responses are right-padded, so each mask row is a prefix of 1s.
* Masked-out positions of every token-level output are exactly 0; inputs may hold
  anything there (even NaN/inf is ignored by the ``torch.where`` masking).
* Losses are token means over the mask of the whole (mini)batch ("token-mean" aggregation, as TRL's PPO
  trainer and verl's default; ``policy_loss(loss_agg=...)`` offers the others). The formulas follow the
  PPO-for-LLMs recipe (TRL's PPO trainer, verl, OpenRLHF); tests cross-check them against TRL 1.12.
"""

from __future__ import annotations

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "kl_penalty",
    "kl_penalized_rewards",
    "gae",
    "policy_loss",
    "value_loss",
    "group_advantages",
    "rloo_advantages",
    "broadcast_to_tokens",
    "aggregate",
    "loss_units",
    "sequence_log_ratio",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
#: policy-loss aggregations (rlhfc.ir.ops.LOSS_AGGS)
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


# ----------------------------------------------------------------------------- masked reductions


def _zero_where_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1 (over ``dim``, or everything)."""
    x = _zero_where_masked(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1.

    An all-zero mask gives 0 (not NaN), so an empty minibatch adds nothing.
    """
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the mask (a scalar). ``unbiased`` applies Bessel's
    correction n / (n - 1) (TRL and verl do); with n <= 1 the correction is skipped."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and var over the mask.

    ``shift_mean=False`` adds the mean back (scale only). Masked positions are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _zero_where_masked(out, mask)


# ----------------------------------------------------------------------------- KL and rewards


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token log-probs.

    k1 = logp - ref_logp; k2 = 0.5 (logp - ref_logp)^2;
    k3 = exp(ref_logp - logp) - 1 - (ref_logp - logp)  (non-negative, unbiased).
    All three are 0 where logp == ref_logp. Shapes are preserved.
    """
    diff = logp - ref_logp
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff**2
    if estimator == "k3":
        log_ratio = -diff
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {KL_ESTIMATORS}")


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[B] column of each row's last masked-in token (0 for a row with none): a multi-turn trajectory's mask
    has gaps (its tool tokens), so this is not the count of ones minus one."""
    cols = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    return ((mask.long() * cols).max(-1).values - 1).clamp(min=0)


def kl_penalized_rewards(
    scores: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-token rewards [B, R]: ``-kl_coef * kl`` on every response token, plus
    ``scores`` [B] on each row's last response token. A row with an empty
    response gets nothing (its score has no token to land on)."""
    kl = kl_penalty(logp, ref_logp, estimator)
    rewards = _zero_where_masked(-kl_coef * kl, mask)
    has_token = mask.bool().any(-1)
    last = last_token(mask)
    scores = scores.to(device=rewards.device, dtype=rewards.dtype)  # rule scores arrive on CPU
    bonus = torch.where(has_token, scores, torch.zeros_like(scores)).unsqueeze(1)
    return rewards + torch.zeros_like(rewards).scatter(1, last.unsqueeze(1), bonus)


# ----------------------------------------------------------------------------- GAE


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses.

    ``rewards``, ``values``: [B, R]; the value after the last response token is 0
    (the episode ends there). Returns ``(advantages, returns)`` [B, R] with
    ``returns = advantages + values``; both 0 where masked.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}

    A mask with gaps (a multi-turn trajectory: the tool's and the environment's tokens are 0 between the
    policy's turns) runs the recurrence over the policy's tokens only: t + 1 is the next policy token, so
    gamma and lam discount per policy token and a turn boundary costs nothing extra.
    """
    rewards = _zero_where_masked(rewards, mask)
    values = _zero_where_masked(values, mask)
    r = rewards.shape[1]
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(rewards)
    on = mask.bool()
    gaps = bool((on[:, 1:] & ~on[:, :-1]).any()) if r > 1 else False   # a masked run inside a response
    for t in reversed(range(r)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv
        if gaps:   # tool / environment tokens: the recurrence steps over them (the next policy token's value)
            next_adv = torch.where(on[:, t], adv, next_adv)
            next_value = torch.where(on[:, t], values[:, t], next_value)
        else:
            next_adv, next_value = adv, values[:, t]
    returns = advantages + values
    return _zero_where_masked(advantages, mask), _zero_where_masked(returns, mask)


# ----------------------------------------------------------------------------- losses


def proximal_alpha(born, version: int) -> torch.Tensor:
    """A-3PO's interpolation weight per sample, [B, 1]: ``s / (s + 1)`` with ``s = version − born`` the versions
    its generating weights lag the step's (AReaL's ``(v_prox − v_behave) / (v_θ − v_behave)`` with the step's
    weights the proximal version and the update it makes the next)."""
    lag = torch.tensor([max(0, int(version) - int(b)) for b in born], dtype=torch.float32)
    return (lag / (lag + 1.0)).unsqueeze(1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    clip_high: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token_mean",
    ratio_level: str = "token",
    behaviour_logp: torch.Tensor | None = None,
    behaviour_cap: float | None = None,
    proximal_alpha: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate, token-mean over the mask (``loss_agg``: another average of every term,
    ``ratio_level = "sequence"``: GSPO's sequence ratio; :mod:`rlhfc.runtime.rl.algorithms`).

    **Decoupled PPO** (rollouts generated by older weights than the step's: asynchronous rollout with bounded
    staleness, as AReaL's loss): with ``behaviour_logp`` [B, R] (the log-probs of the weights that generated
    each token), ``old_logp`` is the *proximal* policy (the weights at the start of the training step) — the
    ratio is clipped against it — and each token's surrogate is weighted by the behaviour importance weight
    ``exp(old_logp - behaviour_logp)``; a token whose weight exceeds ``behaviour_cap`` is dropped from the
    surrogate (weight 0; the average still counts it, as AReaL's). Metrics ``behaviour_weight_mean`` /
    ``_max`` (over the tokens kept) and ``behaviour_masked_frac``.

    **A-3PO** (``proximal_alpha`` [B, 1] or [B, R], with ``behaviour_logp``): no proximal forward; the proximal
    log-probs are interpolated, ``old = behaviour + alpha * (logp - behaviour)`` with ``logp`` detached
    (:func:`proximal_alpha`), and ``old_logp`` is not read.

    ``logp`` [B, R] (with grad), ``old_logp`` / ``advantages`` [B, R] (no grad).
    ratio = exp(logp - old_logp); per token
    ``max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip_high))``
    (``clip_high`` defaults to ``clip``). Optional terms:
    ``- entropy_coef * mean(entropy)`` (an entropy bonus; ``entropy`` [B, R]) and
    ``+ kl_coef * mean(kl_penalty(logp, ref_logp, kl_estimator))`` (GRPO's KL in the loss).

    Returns ``(loss, metrics)``; metrics (floats): ``pg_loss``, ``clipfrac``
    (share of tokens where the clipped term is the active one), ``approx_kl``
    (0.5 * mean((logp - old_logp)^2), as TRL), ``ratio``, and ``entropy`` / ``kl``
    when given.
    """
    high = clip if clip_high is None else clip_high
    if proximal_alpha is not None:
        if behaviour_logp is None:
            raise ValueError("an interpolated proximal policy (A-3PO) needs the behaviour log-probs")
        alpha = proximal_alpha.to(logp.dtype)
        old_logp = behaviour_logp + alpha * (logp.detach() - behaviour_logp)
        metrics_alpha = float(alpha.mean())
    log_ratio = _zero_where_masked(logp - old_logp, mask)
    ratio = torch.exp(log_ratio if ratio_level == "token" else sequence_log_ratio(logp, old_logp, mask))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    surrogate = torch.maximum(unclipped, clipped)
    metrics: dict[str, float] = {}
    if behaviour_logp is not None:
        with torch.no_grad():
            weight = torch.exp(_zero_where_masked(old_logp - behaviour_logp, mask))
            kept = mask.bool() if behaviour_cap is None else mask.bool() & (weight <= behaviour_cap)
            weight = torch.where(kept, weight, torch.zeros_like(weight))
            n_kept = int(kept.sum())
            metrics["behaviour_weight_mean"] = float(weight[kept].mean()) if n_kept else 0.0
            metrics["behaviour_weight_max"] = float(weight[kept].max()) if n_kept else 0.0
            metrics["behaviour_masked_frac"] = 1.0 - n_kept / max(1, int(mask.bool().sum()))
            if proximal_alpha is not None:
                metrics["proximal_alpha_mean"] = metrics_alpha
        surrogate = surrogate * weight
    pg_loss = aggregate(surrogate, mask, loss_agg)
    loss = pg_loss
    with torch.no_grad():
        metrics["pg_loss"] = float(pg_loss)
        per_row = "token_mean" if loss_agg == "token_mean" else "seq_mean_token_mean"   # means, weighed as the loss
        metrics["clipfrac"] = float(aggregate((clipped > unclipped).to(logp.dtype), mask, per_row))
        metrics["approx_kl"] = float(0.5 * aggregate(log_ratio**2, mask, per_row))
        metrics["ratio"] = float(aggregate(ratio, mask, per_row))
    if entropy is not None:
        ent = aggregate(entropy, mask, loss_agg)
        metrics["entropy"] = float(ent.detach())
        if entropy_coef:
            loss = loss - entropy_coef * ent
    if ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp, kl_estimator), mask, loss_agg)
        metrics["kl"] = float(kl.detach())
        if kl_coef:
            loss = loss + kl_coef * kl
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))`` over the mask,
    ``V_clip = clamp(V, old_values - clip, old_values + clip)``; ``clip=None``
    gives the plain ``0.5 * mean((V - R)^2)``. ``V_clip`` is ``V`` itself (the same bits) wherever
    ``V`` is within the clip range, so ``vf_clipfrac`` counts only tokens really clipped (written as
    ``old + clamp(V - old, ±clip)`` it would also count tokens where that sum rounds away from ``V``).

    Returns ``(loss, metrics)`` with ``vf_loss``, ``vf_clipfrac`` (share of tokens
    where the clipped error is the larger one), ``value_mean``.
    """
    err = (values - returns) ** 2
    if clip is None:
        per_token = err
        clipfrac = torch.zeros(())
    else:
        clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
        err_clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).to(values.dtype), mask)
    loss = 0.5 * masked_mean(per_token, mask)
    metrics = {
        "vf_loss": float(loss.detach()),
        "vf_clipfrac": float(clipfrac),
        "value_mean": float(masked_mean(values.detach(), mask)),
    }
    return loss, metrics


# ----------------------------------------------------------------------------- group baselines


def _groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    if scores.ndim != 1 or n < 1 or scores.shape[0] % n:
        raise ValueError(f"scores must be [B] with B a multiple of n={n}, got shape {tuple(scores.shape)}")
    return scores.view(-1, n)


def group_advantages(scores: torch.Tensor, n: int, eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages [B]: (score - group mean) / (group std + eps).

    ``scores`` [B] hold ``n`` samples per prompt laid out contiguously
    (``[p0s0, p0s1, ..., p1s0, ...]``). The std is the unbiased one (0 for n = 1);
    ``normalize_std=False`` (Dr. GRPO) skips the division.
    """
    g = _groups(scores, n)
    centered = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        std = g.std(dim=1, keepdim=True) if n > 1 else torch.zeros_like(g[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1)


def rloo_advantages(scores: torch.Tensor, n: int) -> torch.Tensor:
    """RLOO advantages [B]: score minus the mean of the other n - 1 samples of its
    prompt (same contiguous layout as ``group_advantages``); needs n >= 2."""
    if n < 2:
        raise ValueError("RLOO needs n >= 2 samples per prompt")
    g = _groups(scores, n)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (n - 1)
    return (g - baseline).reshape(-1)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, R]: each row's value on every response token, 0 where masked."""
    if not seq_values.is_floating_point():
        seq_values = seq_values.float()
    seq_values = seq_values.to(mask.device)
    return _zero_where_masked(seq_values.unsqueeze(1).expand(mask.shape), mask)


# ----------------------------------------------------------------------------- loss aggregation (GRPO/DAPO/GSPO forms)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str = "token_mean") -> torch.Tensor:
    """Average a per-token loss [B, R] over a minibatch.

    ``token_mean``: Σ loss / Σ tokens (every token of the minibatch weighs the same; DAPO's token-level
    loss, and rlhfc's default); ``seq_mean_token_mean``: the mean over sequences of each sequence's token
    mean (GRPO's paper form); ``seq_mean_token_sum``: the mean over sequences of each sequence's token sum
    (Dr. GRPO-style, no length normalisation). A sequence without tokens counts 0 in the seq means.
    """
    if how == "token_mean":
        return masked_mean(per_token, mask)
    if how == "seq_mean_token_mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if how == "seq_mean_token_sum":
        return masked_sum(per_token, mask, dim=1).mean()
    raise ValueError(f"unknown loss aggregation {how!r}; use one of {LOSS_AGGS}")


def loss_units(mask: torch.Tensor, how: str = "token_mean") -> torch.Tensor:
    """What a minibatch's loss averages over — its tokens (``token_mean``) or its rows (the seq means) — so a
    piece of a minibatch (a packed group, a data-parallel rank's share) weighs its loss by its share of
    these. ``mask``: the piece's response mask [b, R]."""
    if how == "token_mean":
        return mask.sum()
    return torch.tensor(float(mask.shape[0]))


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence log-ratio (Zheng et al., 2025, "Group Sequence Policy Optimization"):
    ``log s_i = mean over the response tokens of (logp − old_logp)`` on every token of row ``i`` [B, R] (0
    where masked); ``exp`` of it is the length-normalised sequence importance ratio, clipped as one."""
    seq = masked_mean(logp - old_logp, mask, dim=1)
    return torch.where(mask.bool(), seq.unsqueeze(1).expand(mask.shape), torch.zeros_like(logp))
