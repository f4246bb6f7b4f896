"""Price one stage under many candidate layouts at once (for placement searches).

:func:`evaluate` runs the same formulas as :class:`~rlhfc.cost.model.CostModel`
on arrays holding every candidate: with NumPy always, or with JAX
(``backend="jax"``, jitted, in float64) when it is installed
(``pip install rlhfc[jax]``). Both give the same numbers as pricing each
candidate alone (tests check it). :func:`candidate_layouts` lists the layouts a
search would consider for a mesh.
"""

from __future__ import annotations

import numpy as np

from rlhfc.ir import Module

from rlhfc.ir import plan
from rlhfc.ir.plan import Layout
from .model import CostConfig, CostModel, price

KEYS = ("total", "compute", "memory", "comm", "overhead", "weights_bytes", "state_bytes", "transient_bytes")


def have_jax() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True


def candidate_layouts(first: int, count: int, *, per_node: int, heads: int, layers: int,
                      microbatches=(1,), recompute=("none",)) -> list[Layout]:
    """Every (dp, tp, pp) split of ``count`` devices with tp inside a node and dividing ``heads``, pp <= layers."""
    out = []
    for tp in range(1, count + 1):
        if count % tp or heads % tp or tp > max(per_node, 1):
            continue
        for pp in range(1, count // tp + 1):
            if (count // tp) % pp or pp > layers:
                continue
            dp = count // (tp * pp)
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
        return {k: np.broadcast_to(np.asarray(out[k], dtype=np.float64), (len(layouts),)).copy() for k in KEYS}
    if backend != "jax":
        raise ValueError(f"unknown backend {backend!r}: use numpy or jax")
    return _evaluate_jax(inp, cm.dispatch, len(layouts))


def _evaluate_jax(inp, dispatch: float, n: int) -> dict[str, np.ndarray]:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise RuntimeError("backend='jax' needs JAX: pip install 'rlhfc[jax]'") from None
    with jax.enable_x64(True):
        lay = {k: jnp.asarray(v, dtype=jnp.float64) for k, v in inp.lay.items()}
        work = {k: (jnp.asarray(v, dtype=jnp.float64) if isinstance(v, np.ndarray) else v)
                for k, v in inp.work.items()}
        static = inp

        def run(lay):
            p = type(static)(static.family, static.hw, static.arch, work, lay, static.fit, static.opt_fit,
                             static.flop_rc, static.grid)
            out = price(jnp, p, dispatch)
            return {k: jnp.broadcast_to(jnp.asarray(out[k], dtype=jnp.float64), (n,)) for k in KEYS}

        result = jax.jit(run)(lay)
        return {k: np.asarray(v, dtype=np.float64) for k, v in result.items()}
