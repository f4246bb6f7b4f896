"""What recomputing a block really costs beyond its ops' arithmetic: fresh outputs and the checkpoint itself.

Measured on a CPU (``docs/benchmarks.md``, "Recompute selection"), an op replayed inside a checkpointed
backward costs what the same op costs in a forward (within 3 %, per kind); what a per-kind price of a
block's forward misses is:

- **fresh outputs**: an op whose output is a large new allocation (glibc maps blocks of 32 MiB and more from
  the OS afresh each time; their pages fault on first touch, about a microsecond per 4 KiB page) pays for it
  every time it runs — a recomputed s x s attention op pays it again in backward. The profile measures the
  cost per byte at 32 and 64 MiB (:func:`rlhfc.calibrate.recompute.measure_fresh_bytes`); an op pays ``bytes x`` the
  rate of the largest measured size not above its allocation (nothing below 32 MiB: the heap reuses those).
  A CPU worker keeps freed memory (:mod:`rlhfc.runtime.worker.allocator`) and the profile measures with the same
  settings, so there the rate comes out near zero; with ``RLHFC_RETAIN_MEMORY=0`` it is glibc's;
- **the checkpoint**: a checkpointed block costs ``ckpt_region_s`` beyond its replayed ops (a full
  checkpoint), and a selective one ``ckpt_op_s`` more per aten call its policy sees — every op of the forward
  and of the replay up to the last op that saves (:func:`rlhfc.calibrate.recompute.measure_checkpoint`, on a
  tiny block; the forward's calls, where a profile measured them on the model's own block at its training
  shape, :func:`measured_dispatch`, at that rate: it grows with the block).

:func:`with_replay_costs` puts both on a trace (op seconds and the trace's fixed costs, which
:func:`rlhfc.passes.recompute_choice.price` adds per policy). A per-kind rate fitted from a whole block forward
smears the fresh-output cost of its few large ops over every op of the kind (the s x s ops look 3x slower
per byte than the small ones, the scores' matmul 4x slower per FLOP than the others); priced apart, each
kind's rate is the probe's (:func:`rlhfc.calibrate.recompute.measure_kinds`, into a reused buffer).
"""

from __future__ import annotations

from dataclasses import replace

from .recompute_trace import BlockTrace


def fresh_seconds(nbytes: float, curve) -> float:
    """Seconds a fresh allocation of ``nbytes`` costs: ``nbytes x`` the s/byte of the largest measured size
    not above it (``curve``: ``((bytes, s/byte), ...)``; 0 below the smallest or without a curve)."""
    rate = 0.0
    for size, per_byte in sorted(curve):
        if size > nbytes:
            break
        rate = per_byte
    return nbytes * rate


#: priced traces by (the traced block, its costs): the traced block is itself cached, so a placement search
#: asking again for the same stage gets the same priced trace (and the knapsack's memo, keyed by it, hits)
_PRICED: dict[tuple, tuple] = {}


def with_replay_costs(trace: BlockTrace, fresh=(), ckpt_op_s: float = 0.0, ckpt_region_s: float = 0.0,
                      ckpt_forward_op_s: float | None = None) -> BlockTrace:
    """``trace`` with each allocating op's fresh-output cost added to its seconds, and the checkpoint's
    fixed costs recorded (see the module docstring); the same object for the same inputs."""
    key = (id(trace), tuple(map(tuple, fresh)), float(ckpt_op_s), float(ckpt_region_s), ckpt_forward_op_s)
    if key not in _PRICED:
        if len(_PRICED) > 1024:
            _PRICED.clear()
        # the input kept: its id stays its own
        _PRICED[key] = (trace, _priced(trace, fresh, ckpt_op_s, ckpt_region_s, ckpt_forward_op_s))
    return _PRICED[key][1]


def _priced(trace: BlockTrace, fresh, ckpt_op_s: float, ckpt_region_s: float, ckpt_forward_op_s) -> BlockTrace:
    nodes = tuple(replace(n, seconds=n.seconds + fresh_seconds(n.bytes, fresh)) if n.bytes else n
                  for n in trace.nodes)
    return replace(trace, nodes=nodes, forward_s=sum(n.seconds for n in nodes), ckpt_op_s=float(ckpt_op_s),
                   ckpt_region_s=float(ckpt_region_s),
                   ckpt_forward_op_s=None if ckpt_forward_op_s is None else float(ckpt_forward_op_s))


def spec_costs(spec) -> dict:
    """The replay costs a :class:`rlhfc.cost.hardware.DeviceSpec` carries, as :func:`with_replay_costs`
    keywords."""
    return {"fresh": tuple(spec.fresh_s_per_byte), "ckpt_op_s": spec.ckpt_op_s, "ckpt_region_s": spec.ckpt_region_s}


def measured_ops(spec, model: str | None):
    """``(rows, seq, ((op key, CPU s), ...))``: the forward op times a profile measured on ``model``'s own block
    at its training shape (``spec.block_ops``, by profile key), or None."""
    for key, rows, seq, ops, *_ in getattr(spec, "block_ops", ()):
        if key == model and ops:
            return rows, seq, ops
    return None


def measured_dispatch(spec, model: str | None) -> float | None:
    """Seconds a call a selective checkpoint adds to a forward, as a profile measured it on ``model``'s own
    block at its training shape (:func:`rlhfc.calibrate.recompute.measure_dispatch`), or None (then the host's
    tiny-block rate, ``spec.ckpt_op_s``, prices it). The replay's calls stay at the host's rate: in the
    benchmark's 6-block model the replays, timed directly, cost their ops plus about that rate a call, while its
    forwards paid the block's rate (docs/benchmarks.md, "Recompute selection")."""
    for key, _rows, _seq, _ops, *rest in getattr(spec, "block_ops", ()):
        if key == model and rest and rest[0] is not None:
            return float(rest[0])
    return None


_MEASURED: dict[tuple, tuple] = {}


def with_measured_ops(trace: BlockTrace, at: BlockTrace, ops) -> BlockTrace:
    """``trace`` with each op's price scaled by what the same op measured against its price on ``at`` (the
    same block priced alike at the shape the profile measured, ``ops``: ``((op key, CPU s), ...)``): at that
    shape each op costs exactly its measured forward time (a replay costs what a forward does); at another,
    its price moves with its work. Ops not measured, or priced free (views), keep their price; the same object
    for the same inputs."""
    key = (id(trace), id(at), id(ops))
    if key not in _MEASURED:
        if len(_MEASURED) > 1024:
            _MEASURED.clear()
        measured, base = dict(ops), {n.key: n.seconds for n in at.nodes}
        nodes = tuple(replace(n, seconds=n.seconds * measured[n.key] / base[n.key])
                      if n.key in measured and base.get(n.key, 0.0) > 0 else n for n in trace.nodes)
        _MEASURED[key] = (trace, at, ops, replace(trace, nodes=nodes, forward_s=sum(n.seconds for n in nodes)))
    return _MEASURED[key][3]
