"""The minibatch training loop of every train backend, and the loss functions it runs on a model.

:func:`train_epochs` runs PPO's epochs over shuffled minibatches of a batch (gradient clipping, an optional
data-parallel share and reduction, length-grouped pieces of an unpadded minibatch: :mod:`.packing`);
:func:`actor_loss_fn` and :func:`critic_loss_fn` bind the losses of :mod:`rlhfc.runtime.rl.ppo` to a model's
forwards.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from rlhfc.runtime.rl.guards import NonFiniteError
from rlhfc.runtime.rl.ppo import loss_units, policy_loss, value_loss
from rlhfc.runtime.rollout.generation import RolloutBatch, response_logprobs_and_entropy, response_values

from .packing import accumulate, crop_padding

__all__ = ["make_optimizer", "train_epochs", "actor_loss_fn", "critic_loss_fn"]


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


def take_rows(batch: Mapping[str, Any], index: torch.Tensor) -> dict[str, Any]:
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
    (:func:`rlhfc.runtime.train.packing.packed_backward`); with a ``backward`` hook or ``pack = False`` (FSDP ranks must all run the
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
    # the parameters whose gradients backward fills (an offloaded optimizer steps host copies of them)
    params = getattr(optimizer, "device_params", None) or [p for group in optimizer.param_groups for p in group["params"]]
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

                    how = batch.get("loss_agg", "token_mean")
                    tokens = loss_units(batch["response_mask"][index], how)
                    full, index = len(index), torch.tensor_split(index, world)[rank]
                    weight = float(loss_units(batch["response_mask"][index], how) / tokens.clamp(min=1))
                part = take_rows(batch, index)
                scale = weight * shard[1] if shard is not None else 1.0
                if backward is not None:

                    part = crop_padding(part) if unpad else part
                    loss, metrics = backward(model, part, loss_fn, scale)
                else:   # one forward, length groups (unpad) or micro-batches (the same count on every rank)

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
    behaviour_cap: float | None = None,
) -> Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """A ``loss_fn`` for ``train_epochs`` on a policy.

    The minibatch dict holds the ``RolloutBatch`` fields (``RolloutBatch.as_dict()``)
    plus ``old_logp`` and ``advantages`` [B, R], and ``ref_logp`` [B, R] when
    ``kl_coef`` is set (GRPO), and ``behaviour_logp`` [B, R] under asynchronous rollout (decoupled PPO,
    capped at ``behaviour_cap``), with ``proximal_alpha`` [B, 1] under A-3PO's interpolated proximal policy.
    """

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
            behaviour_logp=mb.get("behaviour_logp"),
            behaviour_cap=behaviour_cap,
            proximal_alpha=mb.get("proximal_alpha"),
        )

    return loss_fn


def critic_loss_fn(
    clip: float | None = 0.2,
) -> Callable[[torch.nn.Module, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]:
    """A ``loss_fn`` for ``train_epochs`` on a value model; the minibatch dict holds
    the ``RolloutBatch`` fields plus ``old_values`` and ``returns`` [B, R]."""

    def loss_fn(model: torch.nn.Module, mb: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        rollout = RolloutBatch.from_dict(mb)
        values = response_values(model, rollout)
        return value_loss(values, mb["old_values"], mb["returns"], rollout.response_mask, clip=clip)

    return loss_fn
