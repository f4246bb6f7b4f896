"""PPO / GRPO / RLOO math on plain tensors, plus a minibatch training loop.

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

import math
from typing import Any, Callable, Mapping

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
    "make_optimizer",
    "train_epochs",
    "actor_loss_fn",
    "critic_loss_fn",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


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
    lengths = mask.long().sum(-1)
    has_token = lengths > 0
    last = (lengths - 1).clamp(min=0)
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
    """
    rewards = _zero_where_masked(rewards, mask)
    values = _zero_where_masked(values, mask)
    r = rewards.shape[1]
    next_adv = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(r)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        advantages[:, t] = next_adv
        next_value = values[:, t]
    returns = advantages + values
    return _zero_where_masked(advantages, mask), _zero_where_masked(returns, mask)


# ----------------------------------------------------------------------------- losses


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate, token-mean over the mask (``loss_agg``: another average of every term,
    ``ratio_level = "sequence"``: GSPO's sequence ratio; :mod:`rlhfc.runtime.algorithms`).

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
    from .algorithms import aggregate, sequence_log_ratio

    high = clip if clip_high is None else clip_high
    log_ratio = _zero_where_masked(logp - old_logp, mask)
    ratio = torch.exp(log_ratio if ratio_level == "token" else sequence_log_ratio(logp, old_logp, mask))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    pg_loss = aggregate(torch.maximum(unclipped, clipped), mask, loss_agg)
    loss = pg_loss
    metrics: dict[str, float] = {}
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


# ----------------------------------------------------------------------------- training loop


def make_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the parameters of ``model`` that require grad (fixed, reproducible
    settings: no fused kernel)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)


def _batch_size(batch: Mapping[str, Any]) -> int:
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim > 0}
    if len(sizes) != 1:
        raise ValueError(f"train_epochs: every tensor in the batch needs the same leading size, got {sorted(sizes)}")
    return sizes.pop()


def _take(batch: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            out[k] = v[index.to(v.device)]
        else:
            out[k] = v
    return out


def train_epochs(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Any],
    loss_fn: Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, Mapping[str, float]]],
    epochs: int = 1,
    minibatches: int = 1,
    max_grad_norm: float | None = 1.0,
    generator: torch.Generator | None = None,
    unpad: bool = False,
    shard: tuple[int, int] | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    backward: Callable[..., tuple[torch.Tensor, Mapping[str, float]]] | None = None,
    clip: Callable[[list[torch.Tensor], float], torch.Tensor] | None = None,
    pack: bool = True,
    micro_batch: int = 0,
) -> dict[str, float]:
    """Run ``epochs`` passes over ``batch`` in ``minibatches`` optimizer steps each.

    ``batch``: a dict whose tensors share the leading size B (other values, e.g.
    ``prompt_len``, are passed through to every minibatch unchanged). Each epoch
    draws a permutation from ``generator`` (CPU) and splits it into
    ``minibatches`` nearly equal parts; for each part:
    ``zero_grad -> loss_fn(model, part) -> backward -> clip_grad_norm_ -> step``.
    Returns the mean of each metric over all steps, plus ``grad_norm`` (before
    clipping) and ``loss``. The model is put in train mode and left in eval mode.
    ``unpad``: each minibatch runs as groups of rows of similar length, each cut to its own width
    (:func:`rlhfc.runtime.packing.packed_backward`); with a ``backward`` hook or ``pack = False`` (FSDP ranks must all run the
    same number of forwards), the minibatch is cut to its longest response instead. ``micro_batch = K``:
    gradient accumulation over pieces of at most about K rows (length groups of at most K rows under unpad).

    Data parallel (``shard = (rank, world)``, every rank calling with the same batch and generator
    state): each rank takes its contiguous share of every minibatch and weights its loss by its share
    of the minibatch's response tokens, times ``world``. The losses are token means, so once the
    gradients are averaged over the ranks (FSDP does it in backward) they are the gradient of the
    whole minibatch's loss; ``reduce`` (a sum over the ranks) makes the metrics the whole
    minibatch's too. A minibatch needs at least ``world`` rows.
    """
    b = _batch_size(batch)
    if minibatches < 1 or minibatches > b:
        raise ValueError(f"minibatches must be in 1..{b} (batch size), got {minibatches}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals: dict[str, float] = {}
    steps = 0
    model.train()
    try:
        for _ in range(epochs):
            order = torch.randperm(b, generator=generator)
            for index in torch.tensor_split(order, minibatches):
                optimizer.zero_grad(set_to_none=True)
                weight = 1.0
                if shard is not None:
                    rank, world = shard
                    if len(index) < world:
                        raise ValueError(f"a minibatch of {len(index)} rows cannot be split over {world} "
                                         "data-parallel ranks: use fewer minibatches or fewer ranks")
                    from .algorithms import loss_units

                    how = batch.get("loss_agg", "token_mean")
                    tokens = loss_units(batch["response_mask"][index], how)
                    full, index = len(index), torch.tensor_split(index, world)[rank]
                    weight = float(loss_units(batch["response_mask"][index], how) / tokens.clamp(min=1))
                part = _take(batch, index)
                scale = weight * shard[1] if shard is not None else 1.0
                if backward is not None:
                    from .packing import crop_padding

                    part = crop_padding(part) if unpad else part
                    loss, metrics = backward(model, part, loss_fn, scale)
                else:   # one forward, length groups (unpad) or micro-batches (the same count on every rank)
                    from .packing import accumulate

                    pieces = -(-(full // shard[1]) // micro_batch) if shard is not None and micro_batch else 0
                    loss, metrics = accumulate(model, part, loss_fn, scale, packed=unpad and pack,
                                               micro_batch=micro_batch, pieces=pieces)
                limit = max_grad_norm if max_grad_norm is not None else math.inf
                if clip is not None:
                    grad_norm = clip(params, limit)
                else:
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, limit)
                if hasattr(grad_norm, "full_tensor"):   # a DTensor (sharded parameters): the global norm
                    grad_norm = grad_norm.full_tensor()
                if not math.isfinite(float(grad_norm)):
                    # every entry may be finite while their norm overflows: clipping would then zero the
                    # gradient and the step would go on silently (Adam still moving on its momentum)
                    from .guards import NonFiniteError

                    raise NonFiniteError(f"the gradient norm is {float(grad_norm)} on a minibatch; the run stops "
                                         "before the optimizer step (nothing of this step is checkpointed)")
                optimizer.step()
                step_metrics = {k: float(v) * weight for k, v in metrics.items()}
                step_metrics["loss"] = float(loss.detach()) * weight
                if reduce is not None:
                    keys = sorted(step_metrics)
                    summed = reduce(torch.tensor([step_metrics[k] for k in keys], dtype=torch.float64))
                    step_metrics = dict(zip(keys, summed.tolist()))
                step_metrics["grad_norm"] = float(grad_norm)
                for k, v in step_metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
                steps += 1
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    return {k: v / steps for k, v in totals.items()}


# ----------------------------------------------------------------------------- ready-made loss functions


def actor_loss_fn(
    clip: float = 0.2,
    clip_high: float | None = None,
    temperature: float = 1.0,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token_mean",
    ratio_level: str = "token",
) -> Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """A ``loss_fn`` for ``train_epochs`` on a policy.

    The minibatch dict holds the ``RolloutBatch`` fields (``RolloutBatch.as_dict()``)
    plus ``old_logp`` and ``advantages`` [B, R], and ``ref_logp`` [B, R] when
    ``kl_coef`` is set (GRPO).
    """
    from .generation import RolloutBatch, response_logprobs_and_entropy

    def loss_fn(model: torch.nn.Module, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        rollout = RolloutBatch.from_dict(mb)
        logp, entropy = response_logprobs_and_entropy(model, rollout, temperature)
        return policy_loss(
            logp,
            mb["old_logp"],
            mb["advantages"],
            rollout.response_mask,
            clip=clip,
            clip_high=clip_high,
            entropy=entropy.detach() if not entropy_coef else entropy,
            entropy_coef=entropy_coef,
            ref_logp=mb.get("ref_logp") if kl_coef else None,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            loss_agg=loss_agg,
            ratio_level=ratio_level,
        )

    return loss_fn


def critic_loss_fn(
    clip: float | None = 0.2,
) -> Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """A ``loss_fn`` for ``train_epochs`` on a value model; the minibatch dict holds
    the ``RolloutBatch`` fields plus ``old_values`` and ``returns`` [B, R]."""
    from .generation import RolloutBatch, response_values

    def loss_fn(model: torch.nn.Module, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        rollout = RolloutBatch.from_dict(mb)
        values = response_values(model, rollout)
        return value_loss(values, mb["old_values"], mb["returns"], rollout.response_mask, clip=clip)

    return loss_fn
