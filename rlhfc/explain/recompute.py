"""What ``explain`` says about activation recomputation: per train stage with a decision of the ``recompute``
pass, what is kept and what is recomputed, the activation memory before -> after, the time it adds, and why
(what the stage would need on its devices without it)."""

from __future__ import annotations

from rlhfc.ir import Module, plan


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.1f} MiB" if x < 2 ** 30 else f"{x / 2 ** 30:.2f} GiB"


def _ops(keys) -> str:
    """``mm x7, rsqrt x2``: the kept aten calls by op."""
    counts: dict[str, int] = {}
    for k in keys:
        name = k.split("#")[0].split(".")[0].lstrip("_")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(counts.items(), key=lambda kv: -kv[1]))


def recompute_notes(module: Module, cm) -> list[str]:
    from rlhfc.cost import memory_issues

    notes = []
    for s in module.graph.stages:
        d = plan.recompute_decision(s)
        if d is None or d.kept is None or d.policy == "none":
            continue
        model = module.models[s.target]
        cost = cm.stage_cost(s)
        lay = cost.layout
        blocks = model.layers // max(1, lay.pp if lay else 1)
        micro = cost.work.get("epochs", 1) * cost.work.get("minibatches", 1) * (lay.microbatches if lay else 1)
        added = d.seconds * blocks * micro
        what = {"full": "recomputes every block from its input",
                "selective": "recomputes the core attention (Megatron's selective)",
                "ops": f"keeps the outputs of {len(d.save)} ops of each block ({_ops(d.save)}) and recomputes the "
                       "rest"}[d.policy]
        split = f", split over tp{lay.tp}" if lay and lay.tp > 1 and cm.gpu else ""
        line = (f"%{s.name} {what}: activations kept per block{split} {_mib(d.autograd or 0)} -> {_mib(d.kept)} "
                f"({blocks} blocks: {_mib((d.autograd or 0) * blocks)} -> {_mib(d.kept * blocks)} per micro-batch); "
                f"adds {added * 1e3:.1f} ms per step ({d.seconds * 1e3:.2f} ms per block and micro-batch)")
        trial = module.clone()
        plan.set_recompute(trial.graph.stage(s.name), plan.Recompute("none"))
        over = [i for i in memory_issues(trial) if i.stage == s.name] or memory_issues(trial)
        if over:
            i = over[0]
            line += (f"; why: without it {i.message.replace('stage ', '', 1)}")
        elif d.budget is not None:
            line += f"; why: its blocks had {_mib(d.budget)} each for kept activations (the budget)"
        notes.append(line)
    return notes
