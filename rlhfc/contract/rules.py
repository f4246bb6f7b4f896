"""Rules the compiler prices and the runtime follows: one home each, imported by both sides.

* :data:`GROUP_COST_TOKENS` — what one more length group of a packed forward or training call costs, in
  computed tokens (a call's fixed overhead: kernel launches, Python). Measured on a 2-core CPU for 1-25M
  parameter models: a call costs about as much as 64-256 tokens; fewer, wider groups past that gain little.
  The runtime groups rows by it (:func:`rlhfc.runtime.train.packing.length_groups`); the cost model prices the
  groups it makes (:func:`rlhfc.cost.lengths.packed_tokens`).
* :data:`DECODE_COMPACT_FRACTION` — the torch decoder drops finished rows (and their KV cache) from the
  decode batch once this fraction of the batch has finished; the cost model prices the live rows by it.
* :func:`op_key` — the name a block's k-th call of an aten op has in a recompute decision
  (``mm.default#3``): the recompute pass writes these names, the runtime's selective checkpoint counts them.
"""

from __future__ import annotations

GROUP_COST_TOKENS = 128

DECODE_COMPACT_FRACTION = 0.25


def op_key(op_name: str, k: int) -> str:
    """``mm.default#3``: the k-th call (from 0) of aten op ``op_name`` (``aten.mm.default`` or ``mm.default``)."""
    return f"{op_name[5:] if op_name.startswith('aten.') else op_name}#{k}"
