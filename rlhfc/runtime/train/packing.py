"""Token-proportional forwards and training: rows grouped by length, each group cut to its own width.

A rollout is one rectangle — every row as wide as the longest prompt plus the longest response — so with
long-tailed response lengths most of a padded forward computes padding. Under the ``unpad`` pass the
runtime instead sorts the rows by length and cuts them into groups, each computed as its own rectangle,
cropped on both sides to its longest prompt and longest response (:func:`crop_rows`). The grouping
(:func:`length_groups`) minimises the computed tokens plus a fixed cost per group (a forward call's
overhead, in tokens), by dynamic programming over the sorted lengths.

Results are response-aligned, so a group's [b, r] result goes back into the rollout's [B, R] layout
(:func:`bucketed`). Losses are token means over a minibatch, so training weights each group's loss by its
share of the minibatch's response tokens and accumulates gradients: the same math as one padded
minibatch, rounded differently (matrix products over other shapes).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from rlhfc.contract import rules
from rlhfc.runtime.rollout.generation import RolloutBatch

#: the cost of one more group, in computed tokens (the contract's rule: the cost model prices the same figure)
GROUP_COST_TOKENS = rules.GROUP_COST_TOKENS


def length_groups(lengths: list[int], group_cost: int = GROUP_COST_TOKENS,
                  max_rows: int | None = None) -> list[list[int]]:
    """Rows (indices into ``lengths``) in groups of similar length, minimising Σ rows·width + cost per group,
    with at most ``max_rows`` rows a group (a training micro-batch) when given.

    Rows are sorted by length (ties by index); groups are contiguous runs of that order, so a group's width
    is its last row's length. Exact dynamic programming, O(B²)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = lengths[order[end - 1]]
        for start in range(max(0, end - max_rows) if max_rows else 0, end):
            cost = best[start] + (end - start) * width + group_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def computed_tokens(batch: RolloutBatch, grouped: bool) -> int:
    """Tokens a forward over ``batch`` computes: in length groups (:func:`length_groups`, each cut to its
    longest prompt and longest response) or as one rectangle (prompt width + response width, every row)."""
    if not grouped:
        return batch.batch_size * (batch.prompt_len + batch.response_width)
    p, r = batch.prompt_lengths.tolist(), batch.response_lengths.tolist()
    return sum(len(g) * (max(p[i] for i in g) + max(r[i] for i in g)) for g in length_groups(row_lengths(batch)))


def row_lengths(batch: RolloutBatch) -> list[int]:
    """Each row's real tokens: its prompt and its response."""
    return (batch.prompt_lengths + batch.response_lengths).tolist()


def crop_rows(batch: RolloutBatch, index: list[int]) -> RolloutBatch:
    """Rows ``index`` of ``batch``, cut to their longest prompt (columns on the left) and their longest
    response (columns on the right); every real token kept, at the same position relative to the prompt end."""
    sub = batch.select(index)
    p = max(1, int(sub.prompt_lengths.max()))
    r = max(1, int(sub.response_lengths.max()))
    start = sub.prompt_len - p
    end = sub.prompt_len + min(r, sub.response_width)
    return RolloutBatch(input_ids=sub.input_ids[:, start:end], attention_mask=sub.attention_mask[:, start:end],
                        response_mask=sub.response_mask[:, :end - sub.prompt_len], prompt_len=p,
                        response_lengths=sub.response_lengths, prompt_lengths=sub.prompt_lengths, eos=sub.eos)


def _rows_of(part: Mapping[str, Any], index: list[int]) -> dict[str, Any]:
    """Rows ``index`` of a training minibatch dict, at its full width."""
    rows = torch.as_tensor(index, dtype=torch.long)
    return {k: v[rows.to(v.device)] if isinstance(v, torch.Tensor) and v.ndim > 0 else v for k, v in part.items()}


def crop_part(part: Mapping[str, Any], index: list[int]) -> dict[str, Any]:
    """:func:`crop_rows` for a training minibatch dict: the RolloutBatch fields plus response-aligned
    [B, R] tensors (old log-probs, advantages, returns, ...), cut the same way."""
    batch = RolloutBatch.from_dict(part)
    cropped = crop_rows(batch, index)
    width_r = batch.response_width
    keep_r = cropped.response_width
    rows = torch.as_tensor(index, dtype=torch.long)
    out: dict[str, Any] = {}
    for k, v in part.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == width_r and k not in ("input_ids",
                                                                                               "attention_mask"):
            out[k] = v[rows.to(v.device), :keep_r]
        elif isinstance(v, torch.Tensor) and v.ndim > 0:
            out[k] = v[rows.to(v.device)]
        else:
            out[k] = v
    out.update(cropped.as_dict())
    return out


def bucketed(fn: Callable[[RolloutBatch], torch.Tensor], batch: RolloutBatch,
             group_cost: int = GROUP_COST_TOKENS) -> torch.Tensor:
    """``fn`` (a response-aligned forward: [b, r] per token, or [b] per row) run group by group and put back
    in the rollout's layout ([B, R] zero past each group's width, or [B])."""
    groups = length_groups(row_lengths(batch), group_cost)
    if len(groups) == 1 and len(groups[0]) == batch.batch_size and _full_width(batch):
        return fn(batch)
    out = None
    for index in groups:
        part = fn(crop_rows(batch, index))
        if out is None:
            shape = (batch.batch_size, batch.response_width) if part.ndim == 2 else (batch.batch_size,)
            out = torch.zeros(shape, dtype=part.dtype, device=part.device)
        rows = torch.as_tensor(index, dtype=torch.long, device=part.device)
        if part.ndim == 2:
            out[rows, :part.shape[1]] = part
        else:
            out[rows] = part
    return out


def _full_width(batch: RolloutBatch) -> bool:
    """Whether the batch is already as narrow as its rows allow (nothing to crop)."""
    return (int(batch.prompt_lengths.max()) == batch.prompt_len
            and int(batch.response_lengths.max()) >= batch.response_width)


def crop_padding(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Drop the trailing response columns that are padding in every row of a rollout-shaped batch.

    ``batch`` holds ``prompt_len`` (P) and ``response_mask`` [B, R]; tensors R wide are cut to
    the longest response r, tensors P + R wide to P + r. In real arithmetic nothing a loss reads
    changes (the cut columns are masked out everywhere); in floating point the matrix products
    are over fewer rows, so results can differ in the last bits.
    """
    mask = batch.get("response_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or "prompt_len" not in batch:
        return dict(batch)
    width = mask.shape[1]
    p = int(batch["prompt_len"])
    used = mask.any(0).nonzero()
    r = int(used.max()) + 1 if used.numel() else 1
    if r >= width:
        return dict(batch)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == p + width:
            out[k] = v[:, : p + r]
        elif isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == width:
            out[k] = v[:, :r]
        else:
            out[k] = v
    return out


def accumulate(model: torch.nn.Module, part: Mapping[str, Any], loss_fn: Callable, scale: float = 1.0, *,
               packed: bool = False, micro_batch: int = 0, pieces: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of one training minibatch (its gradients accumulate in the parameters).

    ``packed``: in length groups each cut to its own width (:func:`packed_backward`), at most ``micro_batch``
    rows a group when given; otherwise, with ``micro_batch`` smaller than the minibatch, in ``pieces``
    consecutive micro-batches of about that many rows (gradient accumulation: every rank of a data-parallel
    group must run the same number, so the caller says how many; default ⌈rows / micro_batch⌉). Otherwise
    the whole minibatch at once: ``loss_fn``, then backward of the loss times ``scale``."""
    rows = next((int(v.shape[0]) for v in part.values() if isinstance(v, torch.Tensor) and v.ndim > 0), 0)
    if packed:
        groups = length_groups(row_lengths(RolloutBatch.from_dict(part)), max_rows=micro_batch or None)
        return packed_backward(model, part, loss_fn, scale, groups)
    if micro_batch and micro_batch < rows:
        n = max(1, min(rows, pieces or -(-rows // micro_batch)))
        groups = [c.tolist() for c in torch.tensor_split(torch.arange(rows), n)]
        return packed_backward(model, part, loss_fn, scale, groups, crop=False)
    loss, metrics = loss_fn(model, part)
    (loss * scale if scale != 1.0 else loss).backward()
    return loss, metrics


def packed_backward(model: torch.nn.Module, part: Mapping[str, Any], loss_fn: Callable, scale: float = 1.0,
                    groups: list[list[int]] | None = None, crop: bool = True
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward and backward of one minibatch as groups of rows (default: of similar length,
    :func:`length_groups`), each cut to its own width unless ``crop`` is False. Each group's loss is weighted
    by its share of the minibatch's loss units (response tokens under a token mean, rows under a sequence
    mean) and the gradients accumulate: the gradient, loss and metrics of the whole minibatch (up to
    rounding)."""
    from rlhfc.runtime.rl.algorithms import loss_units

    groups = groups if groups is not None else length_groups(row_lengths(RolloutBatch.from_dict(part)))
    how = part.get("loss_agg", "token_mean")   # a seq-mean loss weighs each group by its share of rows
    tokens = loss_units(part["response_mask"], how).clamp(min=1)
    totals: dict[str, float] = {}
    loss_sum = 0.0
    for index in groups:
        piece = crop_part(part, index) if crop else _rows_of(part, index)
        share = float(loss_units(piece["response_mask"], how) / tokens) if len(groups) > 1 else 1.0
        loss, metrics = loss_fn(model, piece)
        (loss * (share * scale) if (share, scale) != (1.0, 1.0) else loss).backward()
        loss_sum += share * float(loss.detach())
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + share * float(v)
    return torch.tensor(loss_sum, dtype=torch.float64), totals
