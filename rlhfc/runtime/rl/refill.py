"""DAPO's dynamic sampling with refill: sample rounds until the batch holds enough informative groups.

``group_advantages(filter_groups = true, max_refill = K)`` marks the groups whose ``group`` samples all
score the same (their group-relative advantages are 0: no learning signal). With refill, the generated
driver wraps the step's sampling — drawing the next prompts, generating, scoring, the filter — in a
``sample_round`` function and calls :meth:`rlhfc.runtime.job.Job.refill`, which runs rounds until
``groups`` groups with unequal scores are in hand or ``1 + K`` rounds have run (Yu et al., 2025, "DAPO",
§3.2; verl's ``max_num_gen_batches``), then hands the later stages the first ``groups`` kept groups, in
the order they were sampled. Kept groups past ``groups`` in the last round are discarded; when the rounds
run out first, the step trains on the groups it has (fewer rows; the metrics say how many).

Every value of a round is cut to its kept rows by its length: a value with one row per sample (rollouts,
token values, ``[B]`` scores) keeps the kept groups' samples, one with a row per prompt (the prompts, a
per-prompt baseline) keeps the kept groups; anything else (statistics) is the last round's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rlhfc.runtime.data.values import Rollout, TokenValues, _pad_cols, select_rows


def kept_groups(adv: TokenValues, group: int) -> list[int]:
    """The groups a filtered advantage keeps (all of them when it filtered nothing)."""
    if adv.keep is None:
        return list(range(adv.values.shape[0] // group))
    return [g for g, k in enumerate(adv.keep.view(-1, group)[:, 0].tolist()) if k]


def select_groups(value: Any, groups: list[int], group: int, samples: int) -> Any:
    """The rows of ``value`` that belong to ``groups`` (see the module docstring); ``samples``: the round's
    sample count (``len(prompts) · group``)."""
    rows = torch.tensor([g * group + i for g in groups for i in range(group)], dtype=torch.long)
    per_prompt = torch.tensor(groups, dtype=torch.long)
    if isinstance(value, Rollout):
        return select_rows(value, rows)
    if isinstance(value, TokenValues):
        return TokenValues(value.values[rows.to(value.values.device)], value.mask[rows.to(value.mask.device)])
    if isinstance(value, torch.Tensor) and value.ndim >= 1:
        if value.shape[0] == samples:
            return value[rows.to(value.device)]
        if value.shape[0] * group == samples:
            return value[per_prompt.to(value.device)]
    if isinstance(value, list):
        if len(value) == samples:
            return [value[i] for i in rows.tolist()]
        if len(value) * group == samples:
            return [value[i] for i in groups]
    return value


def concat_rollouts(parts: list[Rollout], pad_id: int = 0) -> Rollout:
    """Rollouts of several rounds as one, in order: prompts left-padded and responses right-padded to the
    widest (positions come from the attention mask, so extra left padding changes no forward), rows
    numbered 0..B-1."""
    p = max(r.batch.prompt_len for r in parts)
    width = max(r.batch.response_width for r in parts)

    def left(x: torch.Tensor, n: int, value) -> torch.Tensor:
        return x if n == 0 else torch.cat([torch.full((x.shape[0], n), value, dtype=x.dtype, device=x.device), x], 1)

    def tokens(r: Rollout, name: str, value) -> torch.Tensor:
        x = getattr(r.batch, name)
        return _pad_cols(left(x, p - r.batch.prompt_len, value), p + width, value)

    b0 = parts[0].batch
    batch = type(b0)(
        input_ids=torch.cat([tokens(r, "input_ids", pad_id) for r in parts]),
        attention_mask=torch.cat([tokens(r, "attention_mask", 0) for r in parts]),
        response_mask=torch.cat([_pad_cols(r.batch.response_mask, width) for r in parts]),
        prompt_len=p,
        response_lengths=torch.cat([r.batch.response_lengths for r in parts]),
        prompt_lengths=torch.cat([r.batch.prompt_lengths for r in parts]),
        eos=torch.cat([r.batch.eos for r in parts]))
    flat = lambda attr: [x for r in parts for x in getattr(r, attr)]  # noqa: E731
    logprobs = (torch.cat([_pad_cols(r.logprobs, width) for r in parts])
                if all(r.logprobs is not None for r in parts) else None)
    return Rollout(batch, flat("prompts"), flat("responses"), parts[0].model, max(r.version for r in parts),
                   parts[0].tokenizer, list(range(batch.batch_size)), flat("born"),
                   max(r.decode_steps for r in parts), logprobs, all(r.unpad for r in parts),
                   sum(r.computed_tokens for r in parts),
                   flat("fields") if all(len(r.fields) == r.size for r in parts) else [])


def concat(parts: list[Any]) -> Any:
    """One value from its pieces of several rounds (same kind each)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Rollout):
        return concat_rollouts(parts)
    if isinstance(first, TokenValues):
        width = max(p.values.shape[1] for p in parts)
        return TokenValues(torch.cat([_pad_cols(p.values, width) for p in parts]),
                           torch.cat([_pad_cols(p.mask, width) for p in parts]))
    if isinstance(first, torch.Tensor) and first.ndim >= 1:
        return torch.cat(parts)
    if isinstance(first, list):
        return [x for p in parts for x in p]
    return parts[-1]


def refill(round_fn: Callable[[], dict[str, Any]], filter: str, *, groups: int, group: int,
           max_rounds: int) -> dict[str, Any]:
    """Run ``round_fn`` (one sampling round; its values by name, futures resolved) until ``groups`` groups
    that ``filter``'s advantages keep are in hand, or ``max_rounds`` rounds; the values cut to those groups
    (see the module docstring). The filter's advantages come back with ``keep`` all true and the
    statistics: ``dropped_groups`` (uniform groups over all rounds), ``sample_rounds``, ``sampled_groups``."""
    pieces: dict[str, list] = {}
    counts: list[int] = []   # groups kept of each round
    have = dropped = sampled = rounds = 0
    while have < groups and rounds < max_rounds:
        values = round_fn()
        rounds += 1
        adv = values[filter]
        samples = adv.values.shape[0]
        kept = kept_groups(adv, group)
        sampled += samples // group
        dropped += samples // group - len(kept)
        kept = kept[:groups - have]
        have += len(kept)
        counts.append(len(kept))
        for name, value in values.items():
            pieces.setdefault(name, []).append(select_groups(value, kept, group, samples))
    # rounds that kept nothing add no rows (nor their widths); with no rows at all, the first round's empty cut
    out = {name: concat([p for p, n in zip(parts, counts) if n] or parts[:1]) for name, parts in pieces.items()}
    adv = out[filter]
    out[filter] = TokenValues(adv.values, adv.mask, keep=torch.ones(adv.values.shape[0], dtype=torch.bool),
                              dropped_groups=dropped, sample_rounds=rounds, sampled_groups=sampled)
    return out


__all__ = ["concat", "concat_rollouts", "kept_groups", "refill", "select_groups"]
