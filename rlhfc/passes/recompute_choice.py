"""Which activations of a block to keep: prices of the recompute policies, and the knapsack that picks one.

The runtime recomputes through a selective checkpoint (:mod:`rlhfc.runtime.models.recompute`): the outputs of the
ops in a *save set* S are kept; in backward the block's forward is replayed from its inputs — ops in S return
their kept outputs, every other op runs again — until the last op whose backward keeps a tensor (the
checkpoint's early stop). So, per block and micro-batch, with the ops ``o_1 .. o_n`` of a
:class:`~rlhfc.passes.recompute_trace.BlockTrace` and ``c`` the last op that saves anything:

- memory kept for backward: ``sum(bytes(o) for o in S)`` (plain autograd, policy ``none``: what autograd
  saves, ``autograd_bytes``);
- time added: ``sum(seconds(o_i) for i <= c if o_i not in S)`` plus the checkpoint's own cost (measured:
  :mod:`rlhfc.passes.recompute_prices`): ``ckpt_region_s`` for any checkpointed block, and for a selective one
  (S not empty) ``ckpt_op_s`` per aten call its policy sees (the ``n`` of the forward — at
  ``ckpt_forward_op_s`` where a profile measured that on the model's own block — and the ``c + 1`` of the
  replay) — a cost ``full`` does not pay, so keeping a few small outputs can cost more than keeping none.

Policies:

- ``none`` — no checkpoint; ``full`` — S empty (only the block's input is kept);
- ``selective`` — Megatron's: recompute the core attention only (S = every other op before ``c`` that
  allocates);
- ``budget`` — the least recompute time whose memory fits ``budget`` bytes per block: a 0/1 knapsack
  (value: an op's seconds, weight: its bytes) over the ops up to ``c``; ``none`` when autograd's own saving
  fits. Where torch's activation-memory-budget partitioner ranks ops by runtime per byte and Megatron fixes
  the set, the knapsack is optimal for this cost model (up to the byte quantisation), so it is never worse
  than either at the same budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from .recompute_trace import BlockTrace

#: knapsack resolution: the budget is cut into this many units (weights rounded up, so a pick always fits)
UNITS = 512


@dataclass(frozen=True)
class Choice:
    """A decision for one block: ``policy`` (``none``/``full``/``ops``), ``save`` (the op keys kept, for
    ``ops``), ``saved_bytes`` (kept for backward per block, its input excluded), ``recompute_s`` (time
    added per block and micro-batch), ``recomputed`` (the allocating ops run again, for ``explain``)."""

    policy: str
    save: tuple[str, ...]
    saved_bytes: int
    recompute_s: float
    recomputed: tuple[str, ...]


def _cut(trace: BlockTrace) -> int:
    return max((i for i, n in enumerate(trace.nodes) if n.saves), default=-1)


def price(trace: BlockTrace, save: set[str] | None) -> Choice:
    """The memory and time of keeping ``save`` (None: no checkpoint at all)."""
    if save is None:
        return Choice("none", (), trace.autograd_bytes, 0.0, ())
    cut = _cut(trace)
    kept = tuple(n.key for n in trace.nodes if n.key in save)
    rerun = [n for i, n in enumerate(trace.nodes) if i <= cut and n.key not in save]
    forward_op_s = trace.ckpt_op_s if trace.ckpt_forward_op_s is None else trace.ckpt_forward_op_s
    fixed = trace.ckpt_region_s + (forward_op_s * len(trace.nodes) + trace.ckpt_op_s * (cut + 1) if kept else 0.0)
    return Choice("ops" if kept else "full", kept, sum(n.bytes for n in trace.nodes if n.key in save),
                  sum(n.seconds for n in rerun) + fixed, tuple(n.key for n in rerun if n.bytes))


def full(trace: BlockTrace) -> Choice:
    return price(trace, set())


def selective(trace: BlockTrace) -> Choice:
    """Megatron's selective recomputation: everything but the core attention is kept."""
    cut = _cut(trace)
    return price(trace, {n.key for i, n in enumerate(trace.nodes)
                         if i <= cut and n.bytes and not n.core_attention})


def within(trace: BlockTrace, budget: float) -> Choice:
    """The least recompute time whose kept bytes fit ``budget`` (per block); ``full`` when nothing else fits
    (it keeps only the input, which every policy keeps)."""
    if trace.autograd_bytes <= budget:
        return price(trace, None)
    cut = _cut(trace)
    items = [n for i, n in enumerate(trace.nodes) if i <= cut and n.bytes and n.bytes <= budget]
    if budget <= 0 or not items:
        return full(trace)
    save = _knapsack(items, budget)
    # the knapsack rounds weights up; the fixed policies and the greedy ranking are exact: take the best that fits
    options = [price(trace, save), selective(trace), greedy(trace, budget), full(trace)]
    return min((c for c in options if c.saved_bytes <= budget), key=lambda c: (c.recompute_s, c.saved_bytes))


def _knapsack(items: list, budget: float) -> set[str]:
    """The keys of ``items`` (ops, each ``budget`` or smaller) whose seconds sum highest with their bytes, each
    rounded up to a unit of ``budget / UNITS``, within ``budget``: a 0/1 knapsack, one NumPy row per item."""
    import numpy as np

    unit = budget / UNITS
    best = np.zeros(UNITS + 1)            # best[w]: most seconds saved with weight <= w units
    keep = []
    for n in items:
        w = int(-(-n.bytes // unit)) if unit > 0 else UNITS + 1
        row = np.zeros(UNITS + 1, dtype=bool)
        if w <= UNITS:   # every capacity at once: each reads the row before this item
            gain = best[:UNITS + 1 - w] + n.seconds
            row[w:] = gain > best[w:]
            best[w:] = np.where(row[w:], gain, best[w:])
        keep.append(row)
    save, cap = set(), UNITS
    for n, row in zip(reversed(items), reversed(keep)):
        if row[cap]:
            save.add(n.key)
            cap -= int(-(-n.bytes // unit))
    return save


def greedy(trace: BlockTrace, budget: float) -> Choice:
    """The ranking idea of torch's activation-memory-budget partitioner: keep ops in order of recompute
    seconds saved per byte kept while they fit (a baseline; :func:`within` is never worse)."""
    cut, used, save = _cut(trace), 0, set()
    ranked = sorted((n for i, n in enumerate(trace.nodes) if i <= cut and n.bytes),
                    key=lambda n: n.seconds / n.bytes, reverse=True)
    for n in ranked:
        if used + n.bytes <= budget:
            save.add(n.key)
            used += n.bytes
    return price(trace, save)


def choose(trace: BlockTrace, policy: str, budget: float | None = None) -> Choice:
    """The choice of ``policy`` (``budget`` needs ``budget`` bytes per block)."""
    if policy == "none":
        return price(trace, None)
    if policy == "full":
        return full(trace)
    if policy == "selective":
        return selective(trace)
    if policy == "budget":
        if budget is None:
            raise ValueError("policy budget needs a budget (bytes per block)")
        return within(trace, budget)
    raise ValueError(f"unknown recompute policy {policy!r}")
