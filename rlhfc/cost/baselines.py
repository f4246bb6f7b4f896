"""What makes other RLHF systems slow, priced: the cost terms of the baseline plans (``placement =
"baseline:NAME"``, :mod:`rlhfc.passes.baselines`).

A module whose plan is a baseline (its ``strategy`` annotation is ``baseline:NAME``) is priced by
:class:`BaselineCostModel` — :class:`~rlhfc.cost.CostModel` picks it itself, so the simulator, the memory
check and ``explain`` all price the same terms. Each system is a row of :data:`SYSTEMS` (rules as data);
the terms, all from the catalog's bandwidths and the model's shape (no constant fitted to a paper):

- **ZeRO-3 parameter gathers** (``zero3``: DeepSpeed-Chat, OpenRLHF's DeepSpeed trainers): parameters are
  sharded over the dp ranks and all-gathered before every use — once per micro-batch of a forward, twice
  (forward and backward) per micro-batch of a training pass. Each rank receives ``(dp-1)/dp`` of the
  model's bytes per gather, at the NVLink rate inside a node and the network rate across nodes. Memory:
  weights and gradients + optimizer state are sharded over dp too (``2N/dp`` and ``14N/dp``).
- **Resharding before generation** (``reshard``): ``hybrid_engine`` (DeepSpeed-Chat's Hybrid Engine)
  gathers the ZeRO-3 shards of the actor into the generation layout every step — each device receives the
  generation shard minus the ZeRO-3 shard it holds, over the mesh's links; ``3d`` (verl's 3D-HybridEngine)
  and ``refit`` (NeMo-Aligner's TRT-LLM refit) gather within the micro-dp group only: each device receives
  its generation shard minus its training shard of the actor (no redundant copies).
- **Static batching** (``static_generation``: HF ``generate`` in DeepSpeed-Chat's Hybrid Engine, TRT-LLM as
  NeMo-Aligner drives it): a wave decodes all its rows until its longest response ends (no continuous
  batching: finished rows stay in the batch, no new ones join). The plan's generation ``microbatches``
  is the number of waves the KV cache allows (:mod:`rlhfc.passes.baselines` sizes it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rlhfc.ir import Module, Stage, plan
from rlhfc.ir.plan import BASELINES

from .model import STRATEGY_PRICERS, CostModel, StageCost


@dataclass(frozen=True)
class System:
    """How one system runs a PPO step (see docs/benchmarks.md for the sources)."""

    name: str
    title: str
    colocate: bool                     # every model on every device (else exclusive meshes)
    zero3: tuple[str, ...]             # op families whose parameters are ZeRO-3 sharded and gathered per use
    reshard: str | None                # "hybrid_engine" | "3d" | "refit" | None (generation on its own devices)
    static_generation: bool            # no continuous batching
    overlap: bool                      # independent stages on disjoint devices run at the same time
    generation_apart: bool = False     # generation on its own devices (vLLM engines)


SYSTEMS: dict[str, System] = {
    "dschat": System("dschat", "DeepSpeed-Chat", colocate=True, zero3=("forward", "train"),
                     reshard="hybrid_engine", static_generation=True, overlap=False),
    "openrlhf": System("openrlhf", "OpenRLHF", colocate=False, zero3=("forward", "train"), reshard=None,
                       static_generation=False, overlap=True, generation_apart=True),
    "verl": System("verl", "verl (HybridFlow)", colocate=True, zero3=(), reshard="3d", static_generation=False,
                   overlap=False),
    "nemo": System("nemo", "NeMo-Aligner", colocate=False, zero3=(), reshard="refit", static_generation=True,
                   overlap=True),
}
assert tuple(SYSTEMS) == BASELINES, "every baseline of rlhfc.ir.plan.BASELINES has a row, in order"


def system_of(module: Module) -> System | None:
    """The baseline a module's plan is (None for rlhfc's own plans)."""
    s = plan.strategy(module) or ""
    return SYSTEMS.get(s.split(":", 1)[1]) if s.startswith("baseline:") else None


def _link_bw(cm: CostModel, lay) -> float:
    """Bytes/s one device moves in a collective over ``lay``'s mesh: NVLink inside a node, else the network."""
    bw = cm.spec.inter_bw if len(lay.nodes(cm.cluster.per_node)) > 1 else cm.spec.intra_bw
    return bw * cm.spec.net_eff


class BaselineCostModel(CostModel):
    """:class:`CostModel` plus the terms of :data:`SYSTEMS` for a module whose plan is a baseline."""

    def __init__(self, module: Module, config=None):
        super().__init__(module, config)
        self.system = system_of(module)
        if self.system is not None and self.system.static_generation:
            self.continuous = False

    def generation_work(self, gen: Stage, micro: int = 1, continuous: bool | None = None) -> dict:
        """The base work; a static-batching baseline keeps every row of a wave in the batch to its end, except
        where the stage is priced with continuous batching (``continuous=True``: a vLLM engine batches
        continuously whichever system's plan it runs in)."""
        work = super().generation_work(gen, micro, continuous)
        if self.system is None or not self.system.static_generation or work.get("static") or continuous:
            return work
        # static batching: every row of a wave stays in the batch until the wave's longest response ends
        dist, wave = work["dist"], work["rows"]
        steps_w = dist.p_running(int(wave))
        active = np.full_like(steps_w, wave)
        row_steps = float(np.sum(steps_w * active))
        work = dict(work, steps_w=steps_w, active=active, decode_rows=wave, static=True,
                    expected_steps=float(steps_w.sum()), prompt=float(work["prompt_max"]),
                    kv_tokens=float(wave * (work["prompt_max"] + steps_w.sum())),
                    computed_tokens=float(wave * work["prompt_max"] + row_steps))
        self._cache[("gen", gen.name, max(1, int(micro)), continuous if continuous is not None else self.continuous)] = work
        return work

    def stage_cost(self, stage: Stage, layout=None, rows=None) -> StageCost:
        cost = super().stage_cost(stage, layout, rows)
        if self.system is None or cost.layout is None or cost.model is None or stage.op.startswith("sync"):
            return cost
        key = ("baseline", stage.name, layout, rows)
        if key in self._cache:
            return self._cache[key]
        extra, weights, state = self.terms(stage, cost)
        parts = dict(cost.parts)
        parts["comm"] = parts.get("comm", 0.0) + extra
        out = replace(cost, time_s=cost.time_s + extra, parts=parts, weights_bytes=weights, state_bytes=state,
                      work={**cost.work, "baseline_s": extra})
        self._cache[key] = out
        return out

    def terms(self, stage: Stage, cost: StageCost) -> tuple[float, float, float]:
        """Seconds the system adds to ``stage`` and its weights / state bytes per device."""
        sysm, lay, family = self.system, cost.layout, stage.op.split(".", 1)[0]
        model = self.module.models[stage.target]
        nbytes = float(self.spec.bytes_per_param) * model.params
        extra, weights, state = 0.0, cost.weights_bytes, cost.state_bytes
        if family in sysm.zero3 and lay.dp > 1:
            shard = nbytes / (lay.tp * lay.pp)
            passes = 1 if family == "forward" else \
                2 * int(stage.attrs.get("epochs", 1)) * int(stage.attrs.get("minibatches", 1))   # fwd + bwd
            gathers = lay.microbatches * passes
            extra += gathers * (shard * (lay.dp - 1) / lay.dp / _link_bw(self, lay) + self.spec.latency)
            weights = shard / lay.dp + shard / max(model.layers, 1)    # the shard, plus one gathered layer
            if family == "train":   # gradients and optimizer state sharded too (the latter on the host: offload)
                per = (float(self.spec.bytes_per_param) if plan.offload(stage) else 14.0)
                state = per * model.params / (lay.tp * lay.pp * lay.dp)
        if family == "generate" and sysm.reshard is not None:
            train = next((s for s in self.module.graph.stages_on(stage.target) if s.op == "train"), None)
            if train is not None:
                tl = self.layout(train)
                held = nbytes / (tl.tp * tl.pp) / (tl.dp if "train" in sysm.zero3 else 1)
                need = nbytes / (lay.tp * lay.pp)
                extra += max(0.0, need - held) / _link_bw(self, lay if sysm.reshard == "hybrid_engine" else tl) \
                    + self.spec.latency
        return extra, weights, state


STRATEGY_PRICERS["baseline:"] = BaselineCostModel
