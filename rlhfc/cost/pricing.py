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
    if f == "generate" and "turns" in work:   # multi-turn: a decode call per turn, then the turn's tool calls
        res, transient = _turns(xp, inp)
        state = 0.0 * lay["dp"]
    elif f == "generate":
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
        if work.get("offload"):   # optimizer state and step on the host (the offload pass)
            state = F.offloaded_state_bytes(xp, hw, arch, lay)
            host = F.offload_step_seconds(xp, hw, arch, work, lay)
            res = dict(res, total=res["total"] + host, memory=res["memory"] + host, offload=host + 0.0 * res["total"])
        else:
            state = F.train_state_bytes(xp, hw, arch, lay)
    out = {k: v for k, v in res.items() if k != "step"}
    out["total"] = out["total"] + dispatch
    out["overhead"] = out["overhead"] + dispatch
    out["weights_bytes"] = F.weights_bytes(xp, hw, arch, lay)
    out["state_bytes"] = state
    out["transient_bytes"] = transient + 0.0 * lay["dp"]
    return out


def _turns(xp, inp: PriceInputs) -> tuple[dict, object]:
    """A multi-turn generate (:meth:`rlhfc.cost.model.CostModel.turn_work`): its turns' decode calls one after
    another, plus the tool calls between them (``tools``; a group's ranks each call their share's); its
    transient memory the largest turn's."""
    hw, arch, lay = inp.hw, inp.arch, inp.lay
    parts = [F.generate_time(xp, hw, arch, w, lay, inp.fit) for w in inp.work["turns"]]
    res = {k: sum(p[k] for p in parts) for k in parts[0]}
    tools = inp.work["tool_s"] / lay["dp"]
    res["total"] = res["total"] + tools
    res["overhead"] = res["overhead"] + tools
    res["tools"] = tools + 0.0 * res["total"]
    transient = F.generate_cache_bytes(xp, hw, arch, inp.work["turns"][0], lay)
    for w in inp.work["turns"][1:]:
        transient = xp.maximum(transient, F.generate_cache_bytes(xp, hw, arch, w, lay))
    return res, transient


def _bound(parts: dict) -> str:
    keys = [k for k in ("compute", "memory", "comm", "overhead") if k in parts]
    if not keys:
        return ""
    return max(keys, key=lambda k: parts[k])
