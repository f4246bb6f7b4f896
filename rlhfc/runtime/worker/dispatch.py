"""How a worker method runs on a group of several ranks, declared on the method itself.

The driver calls a :class:`~rlhfc.runtime.driver.group.WorkerGroup` as it would call one worker; the group
reads the mode a worker method is marked with (``@dispatch(mode)``) and calls its ranks accordingly:

* ``split`` — every rank gets the call and computes its share of the rollout's rows (a rank whose backend
  does not answer for its share gives None: megatron's other tensor-parallel ranks and stages); the group
  joins the answers in row order.
* ``all`` — every rank takes part (training, generation, gathering or loading weights are collectives of the
  group); the group answers with rank 0's result once every rank is done.
* ``stream`` — every rank takes part; rank 0 streams the chunks (it samples every row).

A method without a mark runs on one-rank groups only (the collective weight transfer: its process group
would span the sender's rank 0 and every receiving rank, which is not built yet).
"""

from __future__ import annotations

from typing import Callable

#: the modes a worker method may be marked with
MODES = ("split", "all", "stream")


def dispatch(mode: str) -> Callable:
    """Mark a worker method with how it runs on a group of ranks (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode {mode!r} (one of {', '.join(MODES)})")

    def mark(fn):
        fn.dispatch = mode
        return fn

    return mark


def dispatch_mode(cls: type, method: str) -> str | None:
    """The mode ``cls.method`` is marked with (None: no mark, or no such method)."""
    return getattr(getattr(cls, method, None), "dispatch", None)


def dispatched(cls: type) -> dict[str, str]:
    """Every marked method of ``cls`` and its mode."""
    return {name: mode for name in dir(cls) if not name.startswith("_")
            for mode in [dispatch_mode(cls, name)] if mode is not None}
