"""``offload``: a trained model's optimizer state, and its optimizer step, on the host where the plan does not
fit otherwise (ZeRO-Offload; FSDP2's ``CPUOffloadPolicy``).

After placement and recompute have done what they can, the pass simulates the plan's memory
(:func:`rlhfc.cost.memory_issues`); while a device overflows, it marks the train stage on it whose gradients
and optimizer state weigh most ``annot {offload = true}`` (one at a time: offload costs every step host
transfers and a host-side Adam, :func:`rlhfc.cost.formulas.offload_step_seconds`), until the plan fits or no
train stage on an overflowing device is left. The device then holds the gradients only; the float32 master
weights and Adam moments live in host memory. The runtime's training worker of that model keeps its
optimizer there (:class:`rlhfc.runtime.train.offload.HostAdamW` on the torch and megatron trainers,
``CPUOffloadPolicy`` under fsdp). Exact: the same AdamW arithmetic in float32, on another device.

On CPU clusters the host is the device: the pass changes nothing (a program may still mark a train stage
``offload = true`` by hand; it then runs the host copy, which is how the runtime path is tested on CPU).
Idempotent: it first drops its own marks.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.cost import CostModel, memory_issues
from rlhfc.ir import Module, plan

from .base import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class Offload(Pass):
    name = "offload"
    description = "keep a train stage's optimizer state and step on the host where the plan does not fit otherwise"
    exact = True

    def run(self, module: Module) -> Module:
        trains = [s for s in module.graph.stages if s.op == "train"]
        if module.cluster.device == "cpu" or not trains:
            return module
        for s in trains:
            plan.set_offload(s, False)
        issues = memory_issues(module)
        cm = CostModel(module)   # an unmarked stage's state bytes do not depend on the other stages' marks
        while issues:
            over = {d for issue in issues for d in issue.devices}
            left = [s for s in trains if not plan.offload(s) and over & set(plan.stage_layout(module, s).devices)]
            if not left:
                break   # what is left over is the memory check's to report
            plan.set_offload(max(left, key=lambda s: cm.stage_cost(s).state_bytes), True)
            issues = memory_issues(module)
        return module
