"""Fused pipeline training (RLHFuse): two models' pipeline schedules interleaved on shared devices, in a given order.

RLHFuse trains the actor and the critic at the same time on the same devices, the critic's pipeline stages in
the reverse order of the actor's, so that each fills the other's pipeline bubbles; which operation a device runs
next is a schedule (:func:`rlhfc.cost.fused_schedule.search`, made executable by
:func:`rlhfc.cost.fused_schedule.device_orders`). Each model's ranks still run megatron-core's own 1F1B schedule,
unchanged (the same operations in the same order: the same arithmetic, bit for bit); a :class:`FusedGate` only
decides *when* each of a rank's forward and backward steps starts: after every operation that comes before it
in its device's order — the other model's included — has finished. The ranks of the two models that share a
device meet in a ``torch.distributed.TCPStore`` (one key per finished operation).

Why it cannot deadlock when the order is executable (:func:`rlhfc.cost.fused_schedule.order_span` completes): a
rank holds no turn while it waits for a peer (megatron receives a micro-batch's input or gradient before the
step's compute starts, and sends after it ends), and every operation's turn comes after operations that an
execution of the order finishes before it. A rank that waits past ``timeout_s`` (its peer died, or the order was
not executable) raises :class:`FusedScheduleError` naming the device and the operation, instead of hanging.

The gate wraps megatron's ``schedules.forward_step`` and ``schedules.backward_step`` while a fused training
schedule runs (:func:`gated`): the k-th forward (backward) call of a schedule is micro-batch k's.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Sequence

#: how long a rank waits for the operation before its own in the device's order (a dead peer's never comes)
GATE_TIMEOUT_S = 300.0


def parse_orders(orders) -> list[list[tuple[int, str, int]]]:
    """Per device, (model, kind, micro-batch) from the plan's ``"0F0 1F0 0B0 ..."`` strings (or tuples as they are)."""
    return [[(int(x[0]), x[1], int(x[2:])) for x in o.split()] if isinstance(o, str) else [tuple(x) for x in o]
            for o in orders]


class FusedScheduleError(RuntimeError):
    """A rank waited too long for its turn in the fused schedule (the other model's rank on the device died or
    stalled, or the order cannot be executed)."""


class FusedGate:
    """One rank's turns in a fused schedule: ``order`` is its device's (model, kind, micro-batch) sequence,
    ``model`` this rank's model (0 or 1), ``store`` the (host, port) of the pair's TCPStore, ``key`` a name for the
    training call (a step's), unique within the store's life."""

    def __init__(self, store: tuple[str, int], order: Sequence[Sequence], model: int, device: int, key: str,
                 timeout_s: float = GATE_TIMEOUT_S):
        import torch.distributed as dist

        self.order = [(int(m), str(k), int(j)) for m, k, j in order]
        self.model, self.device, self.key, self.timeout_s = int(model), int(device), str(key), float(timeout_s)
        self.position = {op: i for i, op in enumerate(self.order)}
        self.store = dist.TCPStore(store[0], int(store[1]), is_master=False,
                                   timeout=timedelta(seconds=self.timeout_s))
        self.calls = 0          # training schedules run through this gate (a train stage runs one per minibatch)
        self.log: list[tuple[str, int, int, float, float]] = []   # (kind, micro, schedule, start, end): the trace

    def _name(self, call: int, index: int) -> str:
        return f"{self.key}/{call}/{self.device}/{index}"

    def wait(self, call: int, kind: str, micro: int) -> int:
        """Block until the operation before (model, kind, micro) in the device's order has finished; its index."""
        index = self.position.get((self.model, kind, micro))
        if index is None:
            raise FusedScheduleError(f"fused schedule: device {self.device} has no turn for model {self.model}'s "
                                     f"{kind}{micro}: the two models' micro-batch counts differ from the order's")
        if index > 0:
            try:
                self.store.wait([self._name(call, index - 1)], timedelta(seconds=self.timeout_s))
            except Exception as exc:   # noqa: BLE001 - the store's timeout (its type varies by torch version)
                m, k, j = self.order[index - 1]
                raise FusedScheduleError(
                    f"fused schedule: on device {self.device}, model {self.model}'s {kind}{micro} waited "
                    f"{self.timeout_s:g} s for model {m}'s {k}{j} before it ({type(exc).__name__}): the other "
                    "model's rank on this device died or stalled") from None
        return index

    def finished(self, call: int, index: int) -> None:
        self.store.set(self._name(call, index), b"1")


@contextlib.contextmanager
def gated(gate: FusedGate):
    """Run one megatron training schedule with ``gate`` deciding when each forward and backward step starts."""
    from megatron.core.pipeline_parallel import schedules

    forward, backward = schedules.forward_step, schedules.backward_step
    call, counts = gate.calls, {"F": 0, "B": 0}
    gate.calls += 1

    def turn(kind: str, fn):
        def run(*args, **kwargs):
            micro = counts[kind]
            counts[kind] += 1
            index = gate.wait(call, kind, micro)
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                gate.log.append((kind, micro, call, t0, time.time()))
                gate.finished(call, index)
        return run

    schedules.forward_step, schedules.backward_step = turn("F", forward), turn("B", backward)
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward
