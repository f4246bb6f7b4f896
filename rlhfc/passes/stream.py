"""``stream`` (OPPO intra-step overlap): generation hands finished samples downstream in chunks.

For each ``generate`` stage, the forward stages of *other* models that read its
rollout (reference log-probs, critic values, reward scores) become streamed
consumers: the generating worker yields every ``chunk`` finished samples, and
each chunk goes to the consumers at once, so they compute while the long tail
of the batch is still being generated. (Forwards of the generating model wait:
its worker is busy generating, and a second thread there would only take CPU
from generation — measured slower on 2 cores.) Annotations: ``stream = {chunk = C}`` on
the generate stage, ``stream_from = "<rollout>"`` on each consumer.

Chunk size: a small chunk hides more of the consumers' work behind generation
but pays a fixed cost per chunk (a remote call and a forward launch per
consumer). With consumer work ``W`` for the whole batch and per-chunk cost
``o``, the exposed time is about ``W / k + k·o`` for ``k`` chunks, minimised at
``k = sqrt(W / o)``; ``W`` comes from the cost model's forward-time estimate.
``chunk = N`` overrides it. A cost-model failure (an exception, or a time that is not a finite number
of seconds) is a compile error at the generate stage, never a silent fallback to another chunk size.

Exact up to float rounding: a consumer computes each chunk's rows in a forward
over fewer rows than the whole batch, and batched kernels may round a row
differently when the row count differs (measured: the critic's and reward
model's ``Linear(hidden, 1)`` head, a matrix-vector product, moves a value by
one ulp between 2 and 4 rows). The same math; same tokens; metrics within the
rounding tolerance of docs/claims.md. With one chunk (``chunk`` ≥ batch) the
forwards are the unstreamed ones and the step is bitwise -O0's; with ``unpad``
each chunk is also cut to its own longest response (that pass's rounding).
Tested end to end with several chunks per step (tests/e2e/test_claims_runs.py).

Multi-turn generates (tools or an environment): trajectories end at turn boundaries, and the worker's turn
loop hands on those that ended after each turn (:meth:`rlhfc.runtime.rollout.agent.AgentLoop.iterate`), so a
chunk of trajectories that answered at the first turn reaches the forwards while the others call tools and
decode their next turns. The trajectories are the unstreamed ones (the same loop and random streams). They are
streamed only when ``stream{chunk = N}`` is given: the cost model prices every turn by default (an upper
bound on the turns, :meth:`rlhfc.cost.CostModel.turn_work`), at which every trajectory ends at the last turn
and no automatic chunk size pays; with ``explain --turns E`` the simulator prices the trajectories that end
early. Tested end to end in tests/e2e/test_agent_run.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhfc.cost import CostModel
from rlhfc.ir import CompileError, Module, where
from rlhfc.ir.diagnostics import error
from rlhfc.ir.plan import Stream as StreamAttr
from rlhfc.ir.plan import async_rollout, multi_turn, set_stream_from

from .base import Pass, register_pass

#: per chunk and consumer: one Ray call and one forward launch (≈ 2 ms on the 2-core CPU VM; chunks
#: of 4 of a 16-sample batch measured fastest there, chunks of 2 slower than no streaming)
CHUNK_OVERHEAD_S = 0.002


@register_pass
@dataclass(frozen=True)
class Stream(Pass):
    name = "stream"
    description = "stream finished samples from generation to downstream forwards in chunks"
    exact = True
    rounding = True     # a chunk's forward runs over fewer rows: batched kernels may round differently
    chunk: int = field(default=0, metadata={"doc": "samples per chunk (0 = chosen from the cost model)"})

    def __post_init__(self) -> None:
        if self.chunk < 0:
            raise ValueError("chunk must be >= 0 (0 = automatic)")

    def run(self, module: Module) -> Module:
        g = module.graph
        for gen in [s for s in g.stages if s.op == "generate"]:
            if async_rollout(module, gen) is not None:   # generated a step ahead: nothing to stream into
                continue
            if multi_turn(gen) and not self.chunk:
                # trajectories end at turn boundaries; priced at every turn (the default, an upper bound on the
                # turns) they all end at the last, so no chunk size pays: only a chunk given streams them
                continue
            roll = gen.outputs[0]
            consumers = [s for s in g.users(roll) if s.op.startswith("forward.") and s.target != gen.target
                         and len(s.inputs) == 1]
            if not consumers:
                continue
            batch = roll.type.batch or 1
            chunk = self.chunk or auto_chunk(module, gen, consumers)
            gen.annotations[StreamAttr.key] = StreamAttr(max(1, min(chunk, batch))).print()
            for c in consumers:
                set_stream_from(c, gen)
        return module


def auto_chunk(module: Module, gen, consumers) -> int:
    """Samples per chunk minimising ``W / k + k · o`` (see the module docstring)."""
    batch = gen.outputs[0].type.batch or 1
    work = sum(forward_seconds(module, c, gen) for c in consumers)
    k = max(1, min(batch, round(math.sqrt(work / (CHUNK_OVERHEAD_S * len(consumers))))))
    return math.ceil(batch / k)


def forward_seconds(module: Module, stage, gen) -> float:
    """Predicted time of one forward stage over the whole rollout (the cost model, catalog rates). A
    cost-model failure is a compile error located at ``gen`` (the stage whose chunk size it decides)."""
    try:   # catalog rates: the same build on every machine
        seconds = float(CostModel(module).stage_cost(stage).time_s)
    except CompileError:
        raise
    except Exception as exc:
        raise error(f"stream: the cost model failed to price %{stage.name}, which %{gen.name} streams to "
                    f"({type(exc).__name__}: {exc}); the chunk size cannot be chosen", where(gen),
                    "set the chunk yourself (stream{chunk=N}) or fix the cost model; RLHFC_DEBUG=1 shows "
                    "the traceback") from exc
    if not math.isfinite(seconds) or seconds < 0:
        raise error(f"stream: the cost model priced %{stage.name} at {seconds} s, not a time; the chunk size "
                    f"of %{gen.name} cannot be chosen", where(gen),
                    "set the chunk yourself (stream{chunk=N}) or fix the cost model (a profile with a broken "
                    "fit gives such numbers: re-run `rlhfc profile`)")
    return seconds
