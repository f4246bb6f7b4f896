"""``tail_migrate`` (RLHFuse's long-tail migration): a generating group's last rows move onto one rank.

A generate on a group of ranks (a data-parallel FSDP or megatron worker) splits its rows: each rank decodes its
share. The batch's responses have a long tail, so for most of a step's generation each rank decodes a handful of
rows — a decode step costs about what a full one does, and every rank's process stays busy for its own few
stragglers. RLHFuse (NSDI '25, arXiv 2409.13221) moves those stragglers onto fewer devices and gives the freed
ones the next stages of the finished samples. Here: each rank streams its finished rows to the forwards in chunks
(the generate must be streamed: the ``stream`` pass) and stops once fewer than ``below`` of its rows are still
decoding; the unfinished rows of every rank, with their tokens so far and their random-stream keys, continue
together on the first rank — with their KV caches, or re-prefilled from their tokens (``move``, below). The
other ranks' processes are free meanwhile (on a CPU cluster their
cores run the forwards of the finished chunks beside the tail), and the group's generation makes one tail, not
one per rank.

Threshold: ``threshold = auto`` moves a rank's rows once fewer than ``rows per rank / ranks`` of them decode
(at least 1): then the tails of all ranks together are at most one rank's starting share, so the rank that takes
them decodes no wider a batch than it started with — no decode step of the tail costs more than one of the
start. ``threshold = f`` (0 < f <= 1) moves them below ``f`` of a rank's rows.

Move: ``move = kv`` hands each row's KV cache (and its tokens' log-probs) to the rank that continues it, which runs
one decode step over the row's last token and decodes on (the engine's ``kv_moves`` trait: the torch engine);
``move = prefill`` re-prefills the row's prompt and tokens so far there. ``auto`` (the default) takes the cheaper
as the cost model prices them (:meth:`rlhfc.cost.model.CostModel.tail_move`: the caches' bytes through Ray's object
store twice, rank to driver to rank, against a forward of the rows' tokens). Measured on a 2-core CPU
(``benchmarks/rlhfuse.py --move``, docs/benchmarks.md): about even at 2 layers x 128, the KV move 1.7-3.5x
cheaper from 4 layers x 512 up.

Exact up to float rounding: the torch engine samples each row from its own random stream keyed by the row and the
token position (:func:`rlhfc.runtime.rollout.decoding.decode_stream`), so a moved row samples the tokens it would
have sampled on its own rank; its logits come from its own KV cache in another batch (``kv``) or from a prefill of
its tokens so far (``prefill``): the same math, other kernels — rounding, as the ``stream`` pass's forwards over
fewer rows. An engine whose
rows share a batch's random state (vLLM: one seed per call) would sample other tokens: the pass leaves its
generates alone (the engine's ``row_streams`` trait).

Where it does nothing (a documented no-op, not an error: -O2 runs it on every program): a generate on one rank,
one that is not streamed (no consumers to run beside the tail), a multi-turn, overcommitted or asynchronous
generate, or an engine without ``row_streams``. ``explain`` shows the annotation (``tail = {below = K, move =
M}``) and the runtime's trace shows each rank's generate ending at its tail and the first rank's continuation.

-O2 and -O3 run it as ``tail_migrate{when=faster}``: the marks stay only where the simulator predicts the step at
least 1 % faster with them (:data:`rlhfc.passes.predict.EXACT_GAIN`). Splitting a generate over its ranks pays
where a decode step's cost grows with its rows; on a small model on CPU a step of half the rows costs nearly
what a full one does (2 layers x 128: 2.8 against 3.4 ms), every rank's process pays the whole per-step overhead
on a core the forwards also want, and the job measured 12 % slower with the pass (docs/benchmarks.md). Named
alone (``tail_migrate``, as the tests do) it marks every generate it can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhfc.contract.engines import rollout_traits
from rlhfc.cost import CostModel
from rlhfc.ir import Module, plan
from rlhfc.ir.diagnostics import error

from .predict import EXACT_GAIN, Faster

from .base import Pass, register_pass


def tail_below(rows_per_rank: int, ranks: int, threshold: str) -> int:
    """A rank's rows left decoding below which they move (see the module docstring)."""
    if threshold == "auto":
        return max(1, rows_per_rank // ranks)
    return max(1, math.floor(float(threshold) * rows_per_rank))


@register_pass
@dataclass(frozen=True)
class TailMigrate(Pass):
    name = "tail_migrate"
    description = "move a generating group's last unfinished rows onto one rank, freeing the others"
    exact = True
    rounding = True     # a moved row decodes in another batch (or from a prefill instead of its KV cache)
    threshold: str = field(default="auto", metadata={"doc": "auto, or the fraction of a rank's rows below which "
                                                            "they move (0 < f <= 1)"})
    when: str = field(default="always", metadata={
        "doc": "always: every generate it can migrate; faster (-O2, -O3): only where the step is predicted at "
               "least 1 % faster than without"})
    move: str = field(default="auto", metadata={"doc": "how the tail moves: kv (its KV caches), prefill "
                                                       "(re-prefilled on the rank that takes it), or auto: the "
                                                       "cheaper as priced, kv only on an engine that moves KV"})

    def __post_init__(self) -> None:
        if self.threshold != "auto":
            try:
                f = float(self.threshold)
            except ValueError:
                f = -1.0
            if not 0 < f <= 1:
                raise error(f"pass tail_migrate: threshold must be auto or a fraction in (0, 1], got "
                            f"{self.threshold!r}", None, "write tail_migrate{threshold=auto} or "
                            "tail_migrate{threshold=0.25}")
        if self.when not in ("always", "faster"):
            raise error(f"pass tail_migrate: when must be always or faster, got {self.when!r}", None,
                        "write tail_migrate{when=faster}")
        if self.move not in ("auto", *plan.Tail.moves):
            raise error(f"pass tail_migrate: move must be auto, kv or prefill, got {self.move!r}", None,
                        "write tail_migrate{move=kv}")

    def _move(self, module: Module, gen, ranks: int, below: int) -> str:
        """``kv`` where the engine moves KV caches and the cost model prices the move below a re-prefill
        (:meth:`~rlhfc.cost.model.CostModel.tail_move`), else ``prefill``; ``move = kv|prefill`` forces one."""
        if not rollout_traits(plan.stage_engine(module, gen)).kv_moves:
            return "prefill"
        if self.move != "auto":
            return self.move
        price = CostModel(module).tail_move(gen, ranks, below)
        return "kv" if price["kv"] < price["prefill"] else "prefill"

    def run(self, module: Module) -> Module:
        if self.when == "always":
            return self._migrate(module)
        candidate = self._migrate(module.clone())
        if not any(plan.tail(s) for s in candidate.graph.stages):
            return candidate   # its own marks cleared
        base = module.clone()
        for s in base.graph.stages:
            plan.set_tail(s, None)
        return candidate if Faster(EXACT_GAIN)(candidate, base) else base

    def _migrate(self, module: Module) -> Module:
        for gen in [s for s in module.graph.stages if s.op == "generate"]:
            plan.set_tail(gen, None)   # idempotent: its own mark only
            if plan.stream_chunk(gen) is None or plan.overcommit(gen) is not None or plan.multi_turn(gen) \
                    or plan.async_rollout(module, gen) is not None:
                continue
            if not rollout_traits(plan.stage_engine(module, gen)).row_streams:
                continue
            ranks = plan.worker_ranks(module, gen.target, plan.stage_mesh(module, gen))
            rows = (gen.outputs[0].type.batch or 1)
            if ranks < 2 or rows < 2 * ranks:
                continue
            below = tail_below(-(-rows // ranks), ranks, self.threshold)
            plan.set_tail(gen, plan.Tail(below, self._move(module, gen, ranks, below)))
        return module
