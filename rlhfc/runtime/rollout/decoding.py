"""The decoding engine: ``generate_stream`` samples responses with a KV cache and yields each sample as it
finishes (see :mod:`rlhfc.runtime.rollout.generation` for the rollout layout and the plain ``generate``).

Finished rows leave the decode batch (with their KV cache) once a quarter of it has finished, and with
``slots = K`` at most K rows decode at once: waiting prompts join the batch as rows leave it (continuous batching),
their prompts prefilled on their own and their KV cache merged into the batch's, left-padded to a common
width. Rows resumed from a carried partial response (overcommit's) are prefilled apart from fresh prompts and
join the same way, so a long carried prefix pads no fresh prompt. Every row samples from its own random stream
keyed by its row and its token position, so neither compaction nor joining changes a row's tokens (up to the
float rounding of batched kernels over other shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from rlhfc.contract.rules import DECODE_COMPACT_FRACTION
from rlhfc.runtime.models.build import PolicyModel, position_ids_from_mask

from .sampling import sample_next_token


@dataclass(frozen=True)
class FinishedSample:
    """One finished sample from ``generate_stream``.

    ``index``: the row of its prompt in the input list; ``response_ids`` includes
    the final EOS when ``eos`` is True; ``step``: the decoding step (0-based) at
    which it finished.
    """

    index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    eos: bool
    step: int
    #: with ``logprob_temperature``: the log-prob of each response token under the generating weights
    #: (the resumed part's from the prefill, the rest as it was sampled); else empty
    logprobs: tuple[float, ...] = ()
    #: tokens the engine computed for it: the padded prompt, and its share of each decode step's batch
    #: (finished rows not yet dropped included) while it was decoding
    computed: float = 0.0


#: the least share of useful tokens in the prefill of a group of carried rows (padded to its longest): a row
#: that would take a group below it starts a group of its own (one more prefill call)
PREFILL_FILL = 0.8


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device



@dataclass(frozen=True)
class PartialSample:
    """A sample still being generated when ``generate_stream`` stopped early (``stop_after``).

    ``response_ids``: the tokens generated so far; ``index``: its row in the input.
    """

    index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    #: with ``carry_kv``: its decode state (:func:`row_state`), so another call continues it without a prefill
    state: dict | None = None


def row_state(cache, mask: torch.Tensor, slot: int, logprobs: Sequence[float]) -> dict:
    """A live row's decode state: its KV cache as one tensor ``[layers, 2 (keys, values), heads, L, head_dim]``
    over its L attended positions, on the CPU (one tensor a row: what crosses processes pickles fast), and the
    log-probs of its tokens so far. The cache holds every token but the last sampled one, which the continuing
    call feeds through the model first (:func:`_resume_rows`)."""
    cols = torch.nonzero(mask[slot]).flatten()
    kv = torch.stack([torch.stack([la.keys[slot][:, cols], la.values[slot][:, cols]]) for la in cache.layers])
    return {"kv": kv.cpu(), "logprobs": list(logprobs)}


def _resume_rows(model, states: list[dict], pending: list[int], device):
    """The decode batch of rows continued from their states (:func:`row_state`): their caches left-padded to the
    longest, then one decode step over each row's last sampled token; (next-token logits, cache, mask,
    last positions), as a prefill returns them."""
    lengths = [st["kv"].shape[3] for st in states]
    width = max(lengths)
    # [rows, layers, 2, heads, width, head_dim], each row's positions at the right (left padding)
    kv = torch.stack([torch.nn.functional.pad(st["kv"], (0, 0, width - n, 0)) for st, n in zip(states, lengths)])
    kv = kv.to(device)
    cache = DynamicCache()
    for layer in range(kv.shape[1]):
        cache.update(kv[:, layer, 0].contiguous(), kv[:, layer, 1].contiguous(), layer)
    mask = torch.zeros((len(states), width + 1), dtype=torch.long, device=device)
    for k, n in enumerate(lengths):
        mask[k, width - n:] = 1
    positions = torch.tensor([[n] for n in lengths], dtype=torch.long, device=device)
    token = torch.tensor([[t] for t in pending], dtype=torch.long, device=device)
    logits, cache = model.decode_step(token, mask, positions, cache)
    return logits[:, -1], cache, mask, positions[:, -1]


@torch.no_grad()
def generate_stream(
    model: PolicyModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    budgets: Sequence[int] | None = None,
    stop_after: int | None = None,
    logprob_temperature: float | None = None,
    resumed: Sequence[int] | None = None,
    row_keys: Sequence[int] | None = None,
    compact: bool = True,
    slots: int | None = None,
    carry_kv: bool = False,
    states: Sequence[dict | None] | None = None,
) -> Iterator[FinishedSample | PartialSample]:
    """Decode all prompts together with a KV cache; yield each sample when it finishes.

    ``prompts``: token-id lists (non-empty; left-padded here). A sample finishes
    when it emits ``eos_id`` (kept in its response) or after ``max_new_tokens``
    tokens (or after ``budgets[row]`` tokens when per-row budgets are given,
    each in 1..max_new_tokens). With ``stop_after = k``, decoding stops as soon as
    k samples have finished and every unfinished row is yielded as a
:class:`PartialSample` holding its tokens so far (OPPO's overcommitment). Decoding stops early
    once every sample is finished.

    Random draws: every row samples from its own stream (:func:`row_uniforms`), keyed by
    ``row_keys[row]`` and its token position (a resumed row continues at position ``resumed[row]``); by
    default the keys are one draw from ``generator`` plus the row number. A row's tokens therefore do not
    depend on the other rows of the batch.

    ``compact``: finished rows leave the decode batch (with their KV cache) once a quarter of the batch
    has finished, so a decode step costs what the live rows need. Otherwise they keep their slot, fed
    ``pad_id`` with attention mask 0. Either way the live rows are unaffected (up to the float rounding
    of batched products over a different number of rows).

    ``slots = K``: at most K rows decode at once (continuous batching). Rows start in prompt order; once a
    quarter of the slots are free (or none are live) the next waiting prompts are prefilled and join the
    batch. A row's tokens are the same as without the limit (its own random stream; its own token count
    for budgets and positions). ``FinishedSample.step`` counts the engine's decoding steps, so finish
    order stays meaningful; with ``stop_after``, prompts that never started are yielded as
    :class:`PartialSample` with no tokens.

    With ``logprob_temperature = T`` each finished sample also carries the log-prob of its response
    tokens under these weights at temperature T — what ``response_logprobs`` computes, here taken from
    the logits decoding produces anyway (equal up to float rounding: the same math with a KV cache). A
    row resumed from a carried partial response (its last ``resumed[row]`` prompt tokens are that
    partial response) gets those tokens' log-probs from the prefill, i.e. under the current weights.

    ``carry_kv``: the :class:`PartialSample` of a row stopped by ``stop_after`` carries its decode state
    (:func:`row_state`); ``states[row]``: a resumed row's state from such a call under the same weights — the
    row continues from its KV cache (one decode step over its last token) instead of a prefill of its tokens,
    and its carried tokens' log-probs are those it was sampled with (long-tail migration moves rows so).
    """
    if not prompts:
        return
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (encode with add_bos=True)")
    device = _model_device(model)
    b = len(prompts)
    max_positions = getattr(model.hf.config, "max_position_embeddings", None)
    rows_need = [len(x) + (int(budgets[i]) if budgets is not None else max(max_new_tokens, 0))
                 for i, x in enumerate(prompts)]
    if max_positions is not None and max(rows_need) > max_positions:
        raise ValueError(
            f"prompt length + max_new_tokens ({max(rows_need)}) exceeds the model's max_seq {max_positions}; "
            "raise max_seq in the model spec or shorten prompts/responses"
        )
    prompt_tuples = [tuple(int(t) for t in x) for x in prompts]
    if max_new_tokens <= 0:
        for row in range(b):
            yield FinishedSample(row, prompt_tuples[row], (), False, -1)
        return

    T = logprob_temperature
    want_lp = T is not None and T > 0
    token_lps: list[list[float]] = [[] for _ in range(b)]
    budget = [max_new_tokens] * b
    if budgets is not None:
        if len(budgets) != b or any(not 1 <= int(x) <= max_new_tokens for x in budgets):
            raise ValueError(f"budgets must give each of the {b} rows 1..{max_new_tokens} tokens")
        budget = [int(x) for x in budgets]
    if row_keys is None:
        base = int(torch.randint(0, 2**62, (1,), generator=generator))
        row_keys = [base + row for row in range(b)]
    if len(row_keys) != b:
        raise ValueError(f"row_keys must give each of the {b} rows a key")
    start = [int(r) for r in resumed] if resumed is not None else [0] * b
    if states is not None and (len(states) != b or any(st is not None and not start[i] for i, st in enumerate(states))):
        raise ValueError(f"states must give each of the {b} rows a decode state or None, and only resumed rows one")
    kept = list(states) if states is not None else [None] * b
    charged = [0.0] * b                     # computed tokens per row (FinishedSample.computed)

    def prefill(index: list[int]):
        """The rows ``index`` through the model, left-padded to their longest prompt: their next-token logits,
        KV cache, attention mask and last positions (and the log-probs of resumed rows' carried tokens)."""
        width = max(len(prompts[i]) for i in index)
        ids = torch.full((len(index), width), pad_id, dtype=torch.long)
        m = torch.zeros((len(index), width), dtype=torch.long)
        for k, i in enumerate(index):
            ids[k, width - len(prompts[i]):] = torch.tensor(list(prompts[i]), dtype=torch.long)
            m[k, width - len(prompts[i]):] = 1
            charged[i] += width
        ids, m = ids.to(device), m.to(device)
        positions = position_ids_from_mask(m)
        logits, kv = model.decode_step(ids, m, positions, None)
        if want_lp and any(start[i] for i in index):
            scaled = logits if T == 1.0 else logits / T
            pre = (scaled[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                   - torch.logsumexp(scaled[:, :-1], dim=-1)).tolist()       # column c predicts token c + 1
            for k, i in enumerate(index):
                if start[i]:
                    token_lps[i] = pre[k][width - 1 - start[i]:width - 1]
        return logits[:, -1], kv, m, positions[:, -1]

    def state(index: list[int]):
        t = lambda xs: torch.tensor([xs[i] for i in index], dtype=torch.long, device=device)  # noqa: E731
        return (torch.tensor(index, dtype=torch.long, device=device), t(row_keys), t(start), t(budget),
                torch.zeros(len(index), dtype=torch.long, device=device),
                torch.zeros(len(index), dtype=torch.bool, device=device))

    def start_rows(index: list[int]):
        """Prefill rows ``index`` and make them a decode batch: fresh prompts together, rows resumed from a
        carried partial response apart from them, in groups of similar width (a prefix carried over several
        steps is long: padding every fresh prompt, or a once-carried row, to it would compute mostly padding),
        the caches then joined as waiting prompts join."""
        fresh = [i for i in index if not start[i]]
        moved = [i for i in index if kept[i] is not None]
        groups = [fresh] if fresh else []
        group: list[int] = []
        for i in sorted((i for i in index if start[i] and kept[i] is None), key=lambda i: len(prompts[i])):
            # a row joins the group while the group's prefill stays >= PREFILL_FILL useful tokens
            if group and len(prompts[i]) * (len(group) + 1) > (sum(len(prompts[j]) for j in group)
                                                              + len(prompts[i])) / PREFILL_FILL:
                groups.append(group)
                group = []
            group.append(i)
        if group:
            groups.append(group)
        if moved:
            groups.append(moved)

        def start_group(g):
            if g is not moved:
                return prefill(g)
            for i in g:
                token_lps[i] = list(kept[i]["logprobs"])
                charged[i] += 1
            return _resume_rows(model, [kept[i] for i in g], [prompts[i][-1] for i in g], device)

        logits, kv, m, pos = start_group(groups[0])
        for g in groups[1:]:
            more_logits, more_kv, more_m, more_pos = start_group(g)
            kv, m = _join_caches(kv, m, more_kv, more_m)
            logits, pos = torch.cat([logits, more_logits]), torch.cat([pos, more_pos])
        return state([i for g in groups for i in g]), (logits, kv, m, pos)

    slots = b if slots is None else max(1, min(int(slots), b))
    waiting = list(range(slots, b))
    # per batch slot: its row, random-stream key, resumed offset, token budget, tokens so far, finished
    (rows, keys, offset, limit, count, finished), (next_logits, cache, mask, last_pos) = \
        start_rows(list(range(slots)))
    responses = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = [0] * b
    n_finished = 0
    step = 0
    while True:
        token = sample_next_token(next_logits, temperature, top_p, top_k, generator, keys=keys, steps=offset + count)
        active = ~finished
        token = torch.where(active, token, torch.full_like(token, pad_id))
        responses[rows[active], count[active]] = token[active]
        if want_lp:
            scaled = next_logits if T == 1.0 else next_logits / T
            lp = (scaled.gather(-1, token.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)).tolist()
        count = count + active.long()
        done_now = active & ((token == eos_id) | (limit == count))
        finished = finished | done_now

        slot_rows = rows.tolist()
        for slot, on in enumerate(active.tolist()):
            if on:
                lengths[slot_rows[slot]] += 1
                if want_lp:
                    token_lps[slot_rows[slot]].append(lp[slot])
        for slot in torch.nonzero(done_now).flatten().tolist():
            row = slot_rows[slot]
            ids = responses[row, : lengths[row]].tolist()
            yield FinishedSample(row, prompt_tuples[row], tuple(ids), ids[-1] == eos_id, step, tuple(token_lps[row]),
                                 charged[row])
            n_finished += 1

        if stop_after is not None and n_finished >= stop_after and (waiting or not bool(finished.all())):
            for slot in torch.nonzero(~finished).flatten().tolist():
                row = slot_rows[slot]
                yield PartialSample(row, prompt_tuples[row], tuple(responses[row, : lengths[row]].tolist()),
                                    row_state(cache, mask, slot, token_lps[row]) if carry_kv else None)
            for row in waiting:      # never started: carried with no tokens
                yield PartialSample(row, prompt_tuples[row], ())
            return
        if bool(finished.all()) and not waiting:
            return
        live = int((~finished).sum())
        join = waiting[: slots - live] if waiting and (slots - live >= max(1, slots // 4) or live == 0) else []
        if (compact and int(finished.sum()) >= max(1, int(len(slot_rows) * DECODE_COMPACT_FRACTION))) or \
                (join and bool(finished.any())):
            keep = torch.nonzero(~finished).flatten()
            cache.batch_select_indices(keep)
            rows, keys, offset, limit, count, mask, last_pos, token, active, finished = (
                x[keep] for x in (rows, keys, offset, limit, count, mask, last_pos, token, active, finished))
        if len(rows):
            mask = torch.cat([mask, active.long().unsqueeze(1)], dim=1)
            # finished rows stay put: a row that resumed from a long prefix with a small budget would
            # otherwise walk past the model's max positions while the others still decode
            last_pos = last_pos + active.long()
            going = [r for r, f in zip(rows.tolist(), finished.tolist()) if not f]
            for r in going:   # this step computes one token per batch slot, for the rows still decoding
                charged[r] += len(rows) / len(going)
            logits, cache = model.decode_step(token.unsqueeze(1), mask, last_pos.unsqueeze(1), cache)
            next_logits = logits[:, -1]
        if join:   # continuous batching: waiting prompts take the free slots
            waiting = waiting[len(join):]
            more, (new_logits, new_cache, new_mask, new_pos) = start_rows(join)
            if len(rows):
                cache, mask = _join_caches(cache, mask, new_cache, new_mask)
                next_logits, last_pos = torch.cat([next_logits, new_logits]), torch.cat([last_pos, new_pos])
                rows, keys, offset, limit, count, finished = (torch.cat([a, c]) for a, c in zip(
                    (rows, keys, offset, limit, count, finished), more))
            else:
                cache, mask, next_logits, last_pos = new_cache, new_mask, new_logits, new_pos
                rows, keys, offset, limit, count, finished = more
        step += 1


def _join_caches(cache, mask: torch.Tensor, other, other_mask: torch.Tensor):
    """One KV cache (and attention mask) for the rows of two: both left-padded to the wider, stacked."""
    width = max(mask.shape[1], other_mask.shape[1])
    pad = lambda x, n: torch.nn.functional.pad(x, (0, 0, n, 0)) if n else x  # noqa: E731 - [B, H, S, D] on S
    da, db = width - mask.shape[1], width - other_mask.shape[1]
    for la, lb in zip(cache.layers, other.layers):
        la.keys = torch.cat([pad(la.keys, da), pad(lb.keys, db)])
        la.values = torch.cat([pad(la.values, da), pad(lb.values, db)])
    mask = torch.cat([torch.nn.functional.pad(mask, (da, 0)), torch.nn.functional.pad(other_mask, (db, 0))])
    return cache, mask
