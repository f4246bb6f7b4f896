"""The arithmetic of a worker's forwards (``run { precision = fp32 | bf16 }``).

Under ``bf16`` every forward — generation, log-probs, values, scores and the loss's forward in training —
runs under ``torch.autocast(device, dtype=torch.bfloat16)``: matrix products in bf16, reductions such as
softmax and log-softmax in float32 (autocast's own op lists). Weights, gradients and optimizer state stay
float32 (the master weights): autocast casts a bf16 copy of a weight for each product, and backward brings
its gradient back to the float32 parameter. Backward and the optimizer step run outside autocast.
"""

from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

import torch

__all__ = ["PRECISIONS", "autocast", "under_autocast"]

#: the precisions a run may choose
PRECISIONS = ("fp32", "bf16")

T = TypeVar("T")


def autocast(device: str, precision: str):
    """The autocast context of ``precision`` on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``): bf16
    autocast, or a disabled one (a no-op) for fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")


def under_autocast(items: Iterable[T], device: str, precision: str) -> Iterator[T]:
    """Iterate ``items`` (a generation stream), computing each item under :func:`autocast` — which is off
    again while the consumer holds it (a streamed chunk goes on to other code)."""
    it = iter(items)
    while True:
        with autocast(device, precision):
            item = next(it, _END)
        if item is _END:
            return
        yield item


_END = object()
