"""``dce``: remove stages whose results nothing uses.

Exact: only *pure* stages (forward passes and computations, per their op spec)
are removed, and only when no other stage reads any of their results, so
training is unchanged. A data ``load`` whose batch nobody reads is removed too.
Repeats until nothing changes (removing a stage can orphan its producers).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.ir import Module, get_op

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class DeadStageElimination(Pass):
    name = "dce"
    description = "remove side-effect-free stages whose results are never used"
    exact = True

    def run(self, module: Module) -> Module:
        g = module.graph
        changed = True
        while changed:
            changed = False
            for stage in reversed(list(g.stages)):
                spec = get_op(stage.op)
                if spec is None or not spec.pure:
                    continue
                if any(g.users(v) for v in stage.outputs):
                    continue
                g.remove(stage)
                changed = True
        module.refresh_versions()
        return module
