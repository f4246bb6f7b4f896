"""Price one stage under many candidate layouts at once (for placement searches).

:func:`evaluate` runs the same formulas as :class:`~rlhfc.cost.model.CostModel`
on arrays holding every candidate: with NumPy always, or with JAX
(``backend="jax"``, jitted, in float64) when it is installed
(``pip install rlhfc[jax]``). Both give the same numbers as pricing each
candidate alone (tests check it). JAX batches are padded to a power of two and
the jitted function kept per stage and size class, so a stage compiles once
however many batch sizes it is asked for. Results are memoised in the cost
model's cache (shared across a placement search's candidates). The placement
pass itself prices with NumPy on every machine: whether JAX is installed must
not change a plan. :func:`candidate_layouts` lists the layouts a search would
consider for a mesh.
"""

from __future__ import annotations

import numpy as np

from rlhfc.ir import Module

from rlhfc.ir import plan
from rlhfc.ir.plan import Layout, splits
from .model import CostConfig, CostModel, price

KEYS = ("total", "compute", "memory", "comm", "overhead", "weights_bytes", "state_bytes", "transient_bytes")


def have_jax() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True


def candidate_layouts(first: int, count: int, *, per_node: int, heads: int, layers: int, kv_heads: int | None = None,
                      microbatches=(1,), recompute=("none",)) -> list[Layout]:
    """Every (dp, tp, pp) split of ``count`` devices the hardware rules allow (:mod:`rlhfc.ir.plan.hardware`:
    tp dividing ``heads`` and ``kv_heads`` with its groups inside a node, pp dividing ``layers``)."""
    out = []
    for dp, tp, pp in splits(first, count, per_node=per_node, heads=heads, kv_heads=kv_heads or heads,
                             layers=layers):
        for mb in microbatches:
            for rc in recompute:
                out.append(Layout(first, count, dp, tp, pp, mb, rc))
    return out


def evaluate(module: Module, stage: str, layouts: list[Layout], *, config: CostConfig | None = None,
             backend: str = "numpy", cost_model: CostModel | None = None) -> dict[str, np.ndarray]:
    """Time (``total``, seconds) and its parts, and memory per device, of ``stage`` under each layout.

    Returns NumPy arrays, one entry per layout. ``backend``: ``numpy`` or ``jax``.
    """
    cm = cost_model or CostModel(module, config)
    st = module.graph.stage(stage)
    if st.op.split(".", 1)[0] not in ("generate", "forward", "train"):
        raise ValueError(f"stage %{stage} ({st.op}) runs on the driver; only model stages have layouts")
    if not layouts:
        return {k: np.zeros(0) for k in KEYS}
    if st.op == "generate" and len({l.microbatches for l in layouts}) > 1:
        # waves change the generation workload itself: price each microbatches value as its own batch
        out = {k: np.zeros(len(layouts)) for k in KEYS}
        for m in sorted({l.microbatches for l in layouts}):
            idx = [i for i, l in enumerate(layouts) if l.microbatches == m]
            part = evaluate(module, stage, [layouts[i] for i in idx], backend=backend, cost_model=cm)
            for k in KEYS:
                out[k][idx] = part[k]
        return out
    key = ("evaluate", stage, tuple(layouts), repr(plan.recompute_decision(st)), backend)
    if key in cm._cache:   # a placement search asks for the same stage and meshes again (shared_prices)
        return {k: v.copy() for k, v in cm._cache[key].items()}
    out = _evaluate(cm, st, layouts, backend)
    cm._cache[key] = out
    return {k: v.copy() for k, v in out.items()}


def _evaluate(cm: CostModel, st, layouts: list[Layout], backend: str) -> dict[str, np.ndarray]:
    inp = cm.price_inputs(st, list(layouts))
    if backend == "numpy":
        out = price(np, inp, cm.dispatch)
        out = {k: np.broadcast_to(np.asarray(out[k], dtype=np.float64), (len(layouts),)).copy() for k in KEYS}
    elif backend == "jax":
        out = _evaluate_jax(inp, cm.dispatch, len(layouts))
    else:
        raise ValueError(f"unknown backend {backend!r}: use numpy or jax")
    if inp.family == "generate" and cm.own_weights(st):   # the refit and engine memory, as stage_cost
        cm.add_refit_batched(st, cm.module.models[st.target], out, layouts)
    return out


#: jitted pricing functions, one per stage's fixed inputs and padded batch size (see :func:`_evaluate_jax`)
_JITTED: dict = {}
#: how many times :func:`_evaluate_jax` compiled (tests count them)
JAX_COMPILES = [0]


def _fingerprint(value):
    """A hashable stand-in for a price input: numbers as they are, arrays by content, other objects by id
    (length laws and profile fits are shared objects)."""
    if isinstance(value, dict):
        return tuple((k, _fingerprint(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):   # a multi-turn generate's turns
        return ("seq",) + tuple(_fingerprint(v) for v in value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return ("id", id(value))


def _evaluate_jax(inp, dispatch: float, n: int) -> dict[str, np.ndarray]:
    """The formulas jitted in float64. The candidate batch is padded to a power of two (at least 64) by
    repeating its last layout, and the jitted function is kept per stage inputs and padded size: a search
    asking for many batch sizes of one stage compiles once per size class, not once per size."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise RuntimeError("backend='jax' needs JAX: pip install 'rlhfc[jax]'") from None
    size = max(64, 1 << max(n - 1, 0).bit_length())
    lay_np = {k: np.pad(np.asarray(v, dtype=np.float64).reshape(-1), (0, size - n), mode="edge")
              for k, v in inp.lay.items()}
    key = (inp.family, _fingerprint(inp.hw), _fingerprint(inp.arch), _fingerprint(inp.work), id(inp.fit),
           id(inp.opt_fit), id(inp.grid), dispatch, size)
    with jax.enable_x64(True):
        fn = _JITTED.get(key)
        if fn is None:
            work = {k: (jnp.asarray(v, dtype=jnp.float64) if isinstance(v, np.ndarray) else v)
                    for k, v in inp.work.items()}
            static = inp

            def run(lay):
                p = type(static)(static.family, static.hw, static.arch, work, lay, static.fit, static.opt_fit,
                                 static.flop_rc, static.grid)
                out = price(jnp, p, dispatch)
                return {k: jnp.broadcast_to(jnp.asarray(out[k], dtype=jnp.float64), (size,)) for k in KEYS}

            if len(_JITTED) > 256:
                _JITTED.clear()
            fn = _JITTED[key] = jax.jit(run)
            JAX_COMPILES[0] += 1
        result = fn({k: jnp.asarray(v) for k, v in lay_np.items()})
        return {k: np.asarray(v, dtype=np.float64)[:n] for k, v in result.items()}
