"""Stage prices shared between cost models: :func:`shared_prices` (what a placement search prices with)."""

from __future__ import annotations

import contextlib
import contextvars

#: inside :func:`shared_prices`: stage prices shared by every cost model built there, per configuration
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("rlhfc_shared_prices", default=None)


@contextlib.contextmanager
def shared_prices():
    """Share stage prices between the cost models built inside (a placement search builds one per candidate
    plan). Only for modules that differ in their plan (meshes, layouts, recompute decisions, syncs): a price
    is keyed by the stage, its layout, its recompute annotation and the rows priced, not by anything else
    the upstream passes wrote. Pure memoisation: every number is the one an unshared cost model computes."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def shared_cache() -> dict | None:
    """The caches of the enclosing :func:`shared_prices` (one per cost configuration), or None outside one."""
    return _SHARED.get()
