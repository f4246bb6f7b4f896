"""``rlhfc explain --compare``: rlhfc's plan beside the plans other systems would run, predicted.

:func:`compare_rows` prices each compiled module (rlhfc's, then each ``baseline:NAME``) with the same
simulator and cost model (a baseline's module carries its system's terms, :mod:`rlhfc.cost.baselines`);
:func:`render_compare` prints one block per plan: its predicted step time, the ratio to rlhfc's, and where
each model stage runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.cost import CostConfig, simulate
from rlhfc.ir import Module, plan

from .report import fmt_seconds


@dataclass
class CompareRow:
    """One plan: its name, the system it stands for, predicted seconds per step, and its stages' layouts
    (``(stage, op, model, layout text)``)."""

    name: str
    title: str
    step_s: float
    stages: list


def compare_rows(modules: list[tuple[str, str, Module]], *, steps: int = 3,
                 config: CostConfig | None = None) -> list[CompareRow]:
    rows = []
    for name, title, module in modules:
        sim = simulate(module, config, steps=steps)
        per, cpu = module.cluster.per_node, module.cluster.device == "cpu"
        stages = []
        for s in module.graph.stages:
            if s.target not in module.models or not plan.on_worker(module, s) or s.op == "sync":
                continue
            lay = plan.stage_layout(module, s)
            stages.append((s.name, s.op, s.target, f"devices {lay.describe(per)} {lay.parallel_text(cpu)}"))
        rows.append(CompareRow(name, title, sim.step_time_s, stages))
    return rows


def render_compare_json(rows: list[CompareRow]) -> str:
    """The comparison as JSON: ``{"plans": [{"name", "system", "step_s", "ratio", "stages": [...]}]}``."""
    import json

    base = rows[0].step_s
    return json.dumps({"plans": [
        {"name": r.name, "system": r.title, "step_s": r.step_s, "ratio": r.step_s / max(base, 1e-12),
         "stages": [{"stage": st, "op": op, "model": m, "where": w} for st, op, m, w in r.stages]}
        for r in rows]}, indent=2) + "\n"


def render_compare(rows: list[CompareRow]) -> str:
    base = rows[0].step_s
    out = ["plan comparison (predicted by the same cost model; ratio = plan's step time / rlhfc's)", ""]
    out.append(f"{'plan':<18} {'system':<20} {'step':>10} {'ratio':>7}")
    for r in rows:
        out.append(f"{r.name:<18} {r.title:<20} {fmt_seconds(r.step_s):>10} {r.step_s / max(base, 1e-12):>6.2f}x")
    for r in rows:
        out += ["", f"{r.name} ({r.title}): {fmt_seconds(r.step_s)} per step"]
        out += [f"  %{stage:<14} {op:<18} @{model:<8} {where}" for stage, op, model, where in r.stages]
    return "\n".join(out) + "\n"
