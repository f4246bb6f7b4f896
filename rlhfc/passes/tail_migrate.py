"""``tail_migrate`` (RLHFuse's long-tail migration): a generating group's last rows move onto one rank.

A generate on a group of ranks (a data-parallel FSDP or megatron worker) splits its rows: each rank decodes its
share. The batch's responses have a long tail, so for most of a step's generation each rank decodes a handful of
rows — a decode step costs about what a full one does, and every rank's process stays busy for its own few
stragglers. RLHFuse (NSDI '25, arXiv 2409.13221) moves those stragglers onto fewer devices and gives the freed
ones the next stages of the finished samples. Here: each rank streams its finished rows to the forwards in chunks
(the generate must be streamed: the ``stream`` pass) and stops once fewer than ``below`` of its rows are still
decoding; the unfinished rows of every rank, with their tokens so far and their random-stream keys, continue
together on the first rank, re-prefilled. The other ranks' processes are free meanwhile (on a CPU cluster their
cores run the forwards of the finished chunks beside the tail), and the group's generation makes one tail, not
one per rank.

Threshold: ``threshold = auto`` moves a rank's rows once fewer than ``rows per rank / ranks`` of them decode
(at least 1): then the tails of all ranks together are at most one rank's starting share, so the rank that takes
them decodes no wider a batch than it started with — no decode step of the tail costs more than one of the
start. ``threshold = f`` (0 < f <= 1) moves them below ``f`` of a rank's rows.

Exact up to float rounding: the torch engine samples each row from its own random stream keyed by the row and the
token position (:func:`rlhfc.runtime.rollout.decoding.decode_stream`), so a moved row samples the tokens it would
have sampled on its own rank; its logits come from a prefill of its tokens so far instead of the KV cache it had
(the same math, other kernels: rounding, as the ``stream`` pass's forwards over fewer rows). An engine whose
rows share a batch's random state (vLLM: one seed per call) would sample other tokens: the pass leaves its
generates alone (the engine's ``row_streams`` trait).

Where it does nothing (a documented no-op, not an error: -O2 runs it on every program): a generate on one rank,
one that is not streamed (no consumers to run beside the tail), a multi-turn, overcommitted or asynchronous
generate, or an engine without ``row_streams``. ``explain`` shows the annotation (``tail = {below = K}``) and
the runtime's trace shows each rank's generate ending at its tail and the first rank's continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhfc.contract.engines import rollout_traits
from rlhfc.ir import Module, plan
from rlhfc.ir.diagnostics import error

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
    rounding = True     # a moved row's logits come from a prefill instead of its KV cache
    threshold: str = field(default="auto", metadata={"doc": "auto, or the fraction of a rank's rows below which "
                                                            "they move (0 < f <= 1)"})

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

    def run(self, module: Module) -> Module:
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
            plan.set_tail(gen, plan.Tail(below))
        return module
