"""A stage's price from its inputs: the formulas (:mod:`rlhfc.cost.formulas`) applied to one stage under one
or more layouts, as arrays (NumPy, or JAX in :mod:`rlhfc.cost.batched`). :class:`~rlhfc.cost.model.CostModel`
works out the inputs; everything that prices (the per-stage cost, the batched search, the thread-scaling
speedups) calls :func:`price`."""

from __future__ import annotations

from dataclasses import dataclass

from . import formulas as F


@dataclass
class PriceInputs:
    """Everything the formulas need to price one stage under one or more layouts."""

    family: str
    hw: dict
    arch: dict
    work: dict
    lay: dict
    fit: object
    opt_fit: object
    flop_rc: list
    grid: object = None


def price(xp, inp: PriceInputs, dispatch: float = 0.0) -> dict:
    """Time parts and memory per device of a stage for every layout in ``inp.lay`` (arrays)."""
    f, hw, arch, work, lay = inp.family, inp.hw, inp.arch, inp.work, inp.lay
    if f == "generate":
        res = F.generate_time(xp, hw, arch, work, lay, inp.fit)
        transient = F.generate_cache_bytes(xp, hw, arch, work, lay)
        state = 0.0 * lay["dp"]
    elif f == "forward":
        res = F.forward_time(xp, hw, arch, work, lay, inp.fit, inp.grid)
        transient = F.forward_activation_bytes(xp, hw, arch, work, lay)
        state = 0.0 * lay["dp"]
    else:
        res = F.train_time(xp, hw, arch, work, lay, inp.fit, inp.opt_fit, inp.grid)
        if "rc_kept" in work:   # a traced recompute decision: its own bytes and seconds (lay["rc"] is 0)
            transient = F.traced_train_activation_bytes(xp, hw, arch, work, lay)
            extra = F.traced_recompute_seconds(xp, arch, work, lay)
            res = dict(res, total=res["total"] + extra, compute=res["compute"] + extra)
        else:
            transient = F.train_activation_bytes(xp, hw, arch, work, lay)
        state = F.train_state_bytes(xp, hw, arch, lay)
    out = {k: v for k, v in res.items() if k != "step"}
    out["total"] = out["total"] + dispatch
    out["overhead"] = out["overhead"] + dispatch
    out["weights_bytes"] = F.weights_bytes(xp, hw, arch, lay)
    out["state_bytes"] = state
    out["transient_bytes"] = transient + 0.0 * lay["dp"]
    return out


def _bound(parts: dict) -> str:
    keys = [k for k in ("compute", "memory", "comm", "overhead") if k in parts]
    if not keys:
        return ""
    return max(keys, key=lambda k: parts[k])
