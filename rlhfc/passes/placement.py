"""``placement``: which devices each model uses, and its parallel layout (Ant's strategies, ReaL's search).

Strategies (``placement{strategy=...}``, the program's ``run { placement = ... }``
or ``--placement``):

- ``flatten`` — every model on every device, one layout (DeepSpeed-Chat style).
- ``interleave`` — models get exclusive device shares sized by their work (whole nodes for a model
  heavy enough, or too large in memory, for one; the others share nodes, each node split by work into
  shares dividing it) and run concurrently; with fewer devices than models, models are packed into
  shares by longest-processing-time (on 2 CPU cores: the actor alone on one
  core, critic + reference + reward on the other).
- ``separate`` — generation on its own devices (whole nodes on a multi-node cluster), apart from training and the
  other forwards (a shadow copy of the actor serves generation; ``realloc``
  inserts the weight transfer after each train step).
- ``search`` (the default on clusters of more than one device) — start from the
  best of the three, then a Metropolis (MCMC) walk over per-model meshes
  (aligned power-of-two device ranges) and generation meshes, each plan priced
  as the compile emits it (placed, then the passes after this one, then
  simulated as ``explain`` does: :mod:`rlhfc.passes.search`); plans that
  overflow memory cost ×3 (as ReaL); each baseline system's plan is a seed, and
  a layout search after the walk pins stages to other layouts than the greedy
  choice (and tries the plan without streaming). Returns the fastest plan that fits. The
  search is bounded by ``candidates`` (plans priced, seeded by ``seed``), never
  by wall-clock time: the same program compiles to the same plan on an idle and
  on a busy machine.

Every mesh is node-aligned (inside one node, or whole nodes) and every split obeys the hardware rules of
:mod:`rlhfc.ir.plan.hardware` (tp inside a node dividing heads and kv heads, pp dividing layers); memory is
counted once (:mod:`rlhfc.passes.layouts`). The strategies' plans: :mod:`rlhfc.passes.strategies`; placing a plan:
:func:`rlhfc.passes.layouts.place`.

Each model stage gets ``mesh = {first, count}`` and ``parallel = {dp, tp, pp}``:
the fastest split of its mesh (cost model) whose memory fits beside the other
models there, among the splits the run's trainer can run (``fsdp``: dp only;
``megatron``/``auto``: tp dividing heads, kv_heads, ffn and vocab, pp dividing
layers). A model whose layout the program fixes (``layout(...)``) keeps it:
every strategy gives all its stages one mesh of exactly dp·tp·pp devices (its
generation is not split off), and search only moves that mesh. A plan that cannot fit is a compile error naming the stage, the
device, bytes needed vs available, and what would make it fit.

Exact: placement decides where and how stages run, not what they compute (on
CPU every worker keeps one torch thread per core, so results are bitwise equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.cost import CostConfig, ProfileError, check_memory, load_profile, memory_issues, response_dist
from rlhfc.ir import CompileError, DiagnosticSink, Module, plan
from rlhfc.ir.diagnostics import error
from rlhfc.ir.plan import STRATEGIES

from .base import Pass, register_pass
from .baselines import build
from .layouts import place
from .search import search
from .strategies import flatten, interleave, respect_fixed, separate


@register_pass
@dataclass(frozen=True)
class Placement(Pass):
    name = "placement"
    description = "place models on devices: flatten | interleave | separate | search (cost-model MCMC)"
    exact = True
    strategy: str = field(default="auto", metadata={"doc": "flatten, interleave, separate, search, auto, or "
                                                            "baseline:dschat|openrlhf|verl|nemo"})
    candidates: int = field(default=400, metadata={"doc": "plans the search may price (its budget; no time limit)"})
    seed: int = field(default=0, metadata={"doc": "seed of the search's random walk"})
    profile: str = field(default="", metadata={
        "doc": "measured profile the search prices with (a path, as explain's --profile; empty: catalog rates)"})
    response_lengths: str = field(default="auto", metadata={
        "doc": "response-length law the search prices (as explain's --response-lengths: auto, max, "
               "geometric:P, lognormal:F:S)"})

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError("candidates must be >= 1 (the number of plans the search may price)")
        try:
            response_dist(self.response_lengths, 8, vocab=100, pretrained=False)
        except (ValueError, IndexError) as exc:
            raise ValueError(f"bad response_lengths {self.response_lengths!r}: {exc} (e.g. max or "
                             "lognormal:0.25:1.0)") from None
        if self.strategy not in plan.PLACEMENTS:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)} or auto")

    def run(self, module: Module) -> Module:
        return self.run_in_pipeline(module, [])

    def run_in_pipeline(self, module: Module, downstream: list, upstream: list = ()) -> Module:
        """Place ``module``; ``downstream``: the passes the pipeline runs after this one (the search prices
        every candidate plan as they will leave it: :mod:`rlhfc.passes.search`); ``upstream``: those that ran
        before it (a plan that takes ``reuse_logprobs``' decision back is regrouped by their ``parallelize``).

        On a GPU cluster with the ``offload`` pass downstream, a program no plan fits is placed again with every
        train stage's optimizer state on the host (the layouts then priced with it), and the offload pass
        keeps that only where the plan needs it."""
        if module.cluster.device == "cpu" or not any(p.name == "offload" for p in downstream):
            return self._place(module, downstream, upstream)
        original = module.clone()
        try:
            return self._place(module, downstream, upstream)
        except CompileError as first:
            trial = original
            for s in trial.graph.stages:
                if s.op == "train":
                    plan.set_offload(s, True)
            try:
                return self._place(trial, downstream, upstream)
            except CompileError:
                raise first from None

    def _place(self, module: Module, downstream: list, upstream: list = ()) -> Module:
        strategy = self.strategy if self.strategy != "auto" else module.run.placement
        if strategy.startswith("baseline:"):   # another system's plan, as it would run (passes/baselines.py)
            return build(module, strategy.split(":", 1)[1])
        if strategy == "auto":
            strategy = "search" if module.cluster.num_devices > 1 else "flatten"
        assign_fn = {"flatten": flatten, "interleave": interleave, "separate": separate}.get(strategy)
        if assign_fn is not None:
            assign = respect_fixed(module, assign_fn(module))
        else:
            try:
                prof = load_profile(self.profile) if self.profile else None
            except ProfileError as exc:
                raise error(f"placement: {exc}", None, "give a file `rlhfc profile` wrote, or no profile") from None
            regroup = next((p for p in upstream if p.name == "parallelize"), None)
            assign, report = search(module, self.candidates, self.seed, downstream,
                                    CostConfig(profile=prof, response_lengths=self.response_lengths), upstream)
            module.search_report = report   # not IR: what explain reports about the search
        place(module, assign, strategy, regroup if assign_fn is None else None)
        if memory_issues(module) and not memory_issues(with_full_recompute(module, offload=True)):
            return module   # it fits once the trained models recompute their activations (and, on GPUs, keep
            #                 their optimizer state on the host): the recompute and offload passes decide
        sink = DiagnosticSink()
        check_memory(module, sink)
        sink.raise_if_errors()
        return module


def with_full_recompute(module: Module, offload: bool = False) -> Module:
    """A copy of ``module`` whose train stages recompute everything (the least activation memory), and with
    ``offload`` keep their optimizer state on the host (on GPU clusters: the offload pass's last resort)."""
    trial = module.clone()
    for s in trial.graph.stages:
        if s.op == "train":
            plan.set_recompute(s, plan.Recompute("full"))
            if offload and trial.cluster.device != "cpu":
                plan.set_offload(s, True)
    return trial
