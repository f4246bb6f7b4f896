"""What ``explain`` says about the rollout engines (``run { rollout = vllm | auto }``): per generate stage the
engine it runs on (and on how many ranks, each with an engine of its own), its price per step and where the price comes from (the profile's vLLM measurements or the
catalog assumption, :mod:`rlhfc.cost.engine`); under ``auto``, per generating model the engine the ``engine``
pass chose and why: both engines' prices at the compiled plan and, when the pass ran in this process, the
prices it compared (before placement, torch credited with a reused log-prob forward), or what keeps the model
off vLLM."""

from __future__ import annotations

from rlhfc.contract.engines import DEFAULT_ROLLOUT, rollout_traits
from rlhfc.ir import Module, plan


def engine_notes(module: Module, cm) -> list[str]:
    """Notes for ``explain`` (none under ``rollout = torch``)."""
    if module.run.rollout == DEFAULT_ROLLOUT:
        return []
    from rlhfc.cost.engine import unsupported

    notes = []
    gens = [s for s in module.graph.stages if s.op == "generate" and s.target in module.models]
    for s in gens:
        c = cm.stage_cost(s)
        engine = plan.stage_engine(module, s)
        traits = rollout_traits(engine)
        if traits.own_weights:
            refit = c.parts.get("refit")
            rates = "measured by the profile" if c.work.get("engine_source") == "profile" else \
                (f"the catalog assumption (no {traits.title} measurement in the profile: run `rlhfc profile` with "
                 f"{traits.title} installed)")
            extra = f", of which refit {refit * 1e3:.1f} ms ({c.work.get('refit_source')})" if refit else ""
            dp = c.layout.dp if c.layout is not None else 1
            ranks = f" on {dp} ranks, an engine each decoding its share of the {c.work['rows']:g} rows" \
                if dp > 1 else ""
            share = c.work.get("gpu_memory_utilization")
            share = f"; its engine starts with gpu_memory_utilization = {share:g} of each GPU" if share else ""
            notes.append(f"%{s.name} generates on {engine}{ranks}: {c.time_s * 1e3:.1f} ms a step{extra}; "
                         f"{traits.title}'s rates: {rates}{share}")
        else:
            notes.append(f"%{s.name} generates on {engine} (rlhfc's decode loop): {c.time_s * 1e3:.1f} ms a step"
                         if engine == DEFAULT_ROLLOUT else f"%{s.name} generates on {engine}: {c.time_s * 1e3:.1f} "
                         "ms a step (priced at the trainer's decoding rates)")
    if module.run.rollout != "auto":
        return notes
    from rlhfc.cost.model import engine_prices

    chosen = {c.model: c for c in getattr(module, "engine_choices", [])}   # the engine pass's own prices, if run
    for name in dict.fromkeys(s.target for s in gens):
        mine = [s for s in gens if s.target == name]
        engine = plan.model_engine(module, name)
        other = plan.auto_engine()
        problem = plan.engine_problem(module, name, other) or unsupported(cm.profile, module.models[name])
        if problem is not None and engine == DEFAULT_ROLLOUT:
            notes.append(f"rollout = auto keeps @{name} on {DEFAULT_ROLLOUT}: {problem}")
            continue
        prices = engine_prices(module, mine, cm.config)
        why = f" (the engine pass chose it before placement: {chosen[name].why})" if name in chosen else ""
        notes.append(f"rollout = auto runs @{name} on {engine}: at this plan its generate stages cost "
                     f"{prices[other] * 1e3:.1f} ms a step on {other} (refit included) vs "
                     f"{prices[DEFAULT_ROLLOUT] * 1e3:.1f} ms on {DEFAULT_ROLLOUT}{why}")
    return notes
