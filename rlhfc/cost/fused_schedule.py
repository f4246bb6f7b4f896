"""One idea: two models' pipeline-parallel training fused into one schedule on the same devices (RLHFuse).

RLHFuse (NSDI '25, arXiv 2409.13221) trains the actor and the critic at the same time on the same devices:
the actor's pipeline stage ``s`` sits on device ``s`` and the critic's on device ``P − 1 − s``, so the two
pipelines run in opposite directions and each fills the other's bubbles — while the actor's first stage waits
for its micro-batches to come back for their backward passes, the critic's last stage (same device) is busy, and
the other way round. Which operation a device runs next is a schedule; RLHFuse searches it by simulated
annealing. This module is that search, independent of any engine:

* **Operations**: for model ``m`` (0: the one whose pipeline runs device 0 → P − 1, 1: the reversed one),
  micro-batch ``j`` and stage ``s``, a forward ``F`` and a backward ``B`` of the stage's layers, with the
  model's per-stage durations. ``F(m, j, s)`` follows ``F(m, j, s − 1)``; ``B(m, j, P − 1)`` follows
  ``F(m, j, P − 1)``; ``B(m, j, s)`` follows ``B(m, j, s + 1)``; an edge between devices costs ``hop`` seconds.
* **Memory**: a device holds, per model, the activations of the micro-batches whose forward ran there and whose
  backward did not yet: at most ``min(M, P − s)`` for the model's stage ``s`` — what 1F1B keeps. The fused
  schedule therefore needs no more activation memory than the two 1F1B schedules it replaces, each model's
  pipeline alone can always progress, and no schedule deadlocks.
* **Decoding**: a schedule is a priority per operation; a list scheduler runs, on each device as soon as it is
  free, the ready operation (dependencies done, room in memory) of highest priority (:func:`decode`).
* **Search**: priorities start from each model's own 1F1B order; simulated annealing moves one operation's
  priority at a time and keeps the shortest makespan seen (:func:`search`). Seeded: the same inputs give the
  same schedule.
* **Bounds**: the lower bound is max(the longest dependency chain, the busiest device's work) — RLHFuse's
  max(critical path, total work / devices), the busiest device standing for the average since every device
  holds one stage of each model. The unfused reference is the two models' 1F1B schedules one after the other.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass

#: operation kinds
FWD, BWD = "F", "B"


@dataclass(frozen=True)
class Pipeline:
    """One model's training pipeline: ``micro`` micro-batches through ``stages`` stages, ``forward_s`` and
    ``backward_s`` seconds per micro-batch and stage (a stage holds 1/stages of the layers)."""

    name: str
    micro: int
    forward_s: float
    backward_s: float

    def __post_init__(self) -> None:
        if self.micro < 1 or self.forward_s < 0 or self.backward_s < 0:
            raise ValueError(f"pipeline {self.name}: micro >= 1 and non-negative durations, got {self}")


@dataclass(frozen=True)
class Op:
    model: int     # 0: stages on devices 0..P-1; 1: the reversed direction
    kind: str      # F or B
    micro: int
    stage: int


@dataclass
class Schedule:
    """A decoded schedule: per device, (start, end, op) in run order; its makespan and bounds."""

    devices: int
    pipelines: tuple[Pipeline, ...]
    runs: list[list[tuple[float, float, Op]]]
    makespan: float
    critical_path: float
    busiest_device: float
    unfused: float = 0.0
    iterations: int = 0
    seconds: float = 0.0

    @property
    def lower_bound(self) -> float:
        """No schedule is shorter: the longer of the critical path and the busiest device's bound."""
        return max(self.critical_path, self.busiest_device)

    @property
    def gap(self) -> float:
        """How far the makespan is above the lower bound (0.05: 5 % above)."""
        return self.makespan / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    @property
    def gain(self) -> float:
        """The unfused schedule's time over this one's."""
        return self.unfused / self.makespan if self.makespan > 0 else 1.0


def device_of(op: Op, devices: int) -> int:
    return op.stage if op.model == 0 else devices - 1 - op.stage


def _duration(op: Op, pipes: tuple[Pipeline, ...]) -> float:
    p = pipes[op.model]
    return p.forward_s if op.kind == FWD else p.backward_s


def _ops(devices: int, pipes: tuple[Pipeline, ...]) -> list[Op]:
    return [Op(m, k, j, s) for m, p in enumerate(pipes) for j in range(p.micro) for s in range(devices)
            for k in (FWD, BWD)]


def _deps(op: Op, devices: int) -> list[Op]:
    if op.kind == FWD:
        return [Op(op.model, FWD, op.micro, op.stage - 1)] if op.stage > 0 else []
    if op.stage == devices - 1:
        return [Op(op.model, FWD, op.micro, op.stage)]
    return [Op(op.model, BWD, op.micro, op.stage + 1)]


class _Problem:
    """The operations of two pipelines on the devices, numbered, with their dependencies, users, devices,
    durations and memory caps (built once per search; :meth:`decode` runs many times)."""

    def __init__(self, devices: int, pipes: tuple[Pipeline, ...], hop: float):
        self.devices, self.pipes, self.hop = devices, pipes, hop
        self.ops = _ops(devices, pipes)
        index = {op: i for i, op in enumerate(self.ops)}
        self.index = index
        self.device = [device_of(op, devices) for op in self.ops]
        self.duration = [_duration(op, pipes) for op in self.ops]
        self.model = [op.model for op in self.ops]
        self.forward = [op.kind == FWD for op in self.ops]
        self.ndeps = [len(_deps(op, devices)) for op in self.ops]
        self.users: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for d in _deps(op, devices):
                self.users[index[d]].append(i)
        self.cap = [[min(p.micro, devices - (d if m == 0 else devices - 1 - d)) for m, p in enumerate(pipes)]
                    for d in range(devices)]

    def decode(self, priority: list[float]) -> tuple[float, list[list[tuple[float, float, int]]]]:
        """List-schedule every operation by ``priority`` (higher first) under the dependencies and the memory
        caps: a device takes its best ready operation whenever it is free. (makespan, per device runs)."""
        devices, hop = self.devices, self.hop
        waiting = list(self.ndeps)
        held = [[0] * len(self.pipes) for _ in range(devices)]
        queues: list[list] = [[] for _ in range(devices)]    # ready: (-priority, id)
        pending = [(0.0, i) for i, n in enumerate(waiting) if n == 0]   # (ready time, id)
        heapq.heapify(pending)
        events: list = []                                    # (end time, id) of running operations
        free = [0.0] * devices
        runs: list[list[tuple[float, float, int]]] = [[] for _ in range(devices)]
        now, left, makespan = 0.0, len(self.ops), 0.0
        eps = 1e-12
        while left:
            while pending and pending[0][0] <= now + eps:
                i = heapq.heappop(pending)[1]
                heapq.heappush(queues[self.device[i]], (-priority[i], i))
            for d in range(devices):
                if free[d] > now + eps or not queues[d]:
                    continue
                skipped, chosen = [], -1
                while queues[d]:
                    item = heapq.heappop(queues[d])
                    i = item[1]
                    if self.forward[i] and held[d][self.model[i]] >= self.cap[d][self.model[i]]:
                        skipped.append(item)
                        continue
                    chosen = i
                    break
                for item in skipped:
                    heapq.heappush(queues[d], item)
                if chosen < 0:
                    continue
                end = now + self.duration[chosen]
                runs[d].append((now, end, chosen))
                free[d] = end
                if self.forward[chosen]:
                    held[d][self.model[chosen]] += 1
                heapq.heappush(events, (end, chosen))
            # advance to the next event: an operation finishing or becoming ready
            times = [q[0][0] for q in (events, pending) if q]
            if not times:
                raise RuntimeError("fused schedule: no operation can run (the memory caps deadlocked)")
            nxt = min(times)
            if nxt > now:
                now = nxt
            while events and events[0][0] <= now + eps:
                i = heapq.heappop(events)[1]
                left -= 1
                makespan = max(makespan, now)
                d = self.device[i]
                if not self.forward[i]:
                    held[d][self.model[i]] -= 1
                for u in self.users[i]:
                    waiting[u] -= 1
                    if waiting[u] == 0:
                        heapq.heappush(pending, (now + (hop if self.device[u] != d else 0.0), u))
        return makespan, runs

    def schedule(self, priority: list[float]) -> Schedule:
        makespan, runs = self.decode(priority)
        cp, busiest = _bounds(self.devices, self.pipes, self.hop)
        return Schedule(self.devices, self.pipes, [[(s, e, self.ops[i]) for s, e, i in rs] for rs in runs],
                        makespan, cp, busiest)


def decode(devices: int, pipes: tuple[Pipeline, ...], priority: dict[Op, float], *, hop: float = 0.0) -> Schedule:
    """List-schedule every operation by ``priority`` (higher first) under the dependencies and the 1F1B memory
    caps; returns the schedule (event-driven: a device takes its best ready operation whenever it is free)."""
    problem = _Problem(devices, pipes, hop)
    return problem.schedule([priority[op] for op in problem.ops])


def _bounds(devices: int, pipes: tuple[Pipeline, ...], hop: float) -> tuple[float, float]:
    """(longest dependency chain, the busiest device's bound): one micro-batch's forward and backward through
    every stage with the hops between devices; and per device, its share of both models' work (RLHFuse's total
    work / devices: every device holds one stage of each model) plus what no schedule can avoid around it —
    nothing is ready there before the earlier stages' forwards of the first micro-batch (the shorter of the two
    models' chains), and after its last operation that model's backward still runs through its earlier stages."""
    chain = max(devices * (p.forward_s + p.backward_s) + 2 * (devices - 1) * hop for p in pipes)
    work = sum(p.micro * (p.forward_s + p.backward_s) for p in pipes)
    busiest = 0.0
    for d in range(devices):
        stage = [d if m == 0 else devices - 1 - d for m in range(len(pipes))]
        head = min(stage[m] * (p.forward_s + hop) for m, p in enumerate(pipes))
        tail = min(stage[m] * (p.backward_s + hop) for m, p in enumerate(pipes))
        busiest = max(busiest, head + work + tail)
    return chain, busiest


def one_f_one_b(devices: int, pipe: Pipeline, *, hop: float = 0.0) -> Schedule:
    """``pipe`` alone on the devices, backward first among ready operations (1F1B's order under its caps)."""
    return decode(devices, (pipe,), {op: _one_f_one_b_priority(op) for op in _ops(devices, (pipe,))}, hop=hop)


def _one_f_one_b_priority(op: Op) -> float:
    # backward before forward; earlier micro-batches first
    return (1e6 if op.kind == BWD else 0.0) - op.micro


def search(devices: int, actor: Pipeline, critic: Pipeline, *, hop: float = 0.0, iterations: int = 3000,
           seed: int = 0, time_limit_s: float = 10.0) -> Schedule:
    """The fused schedule of ``actor`` (stages on devices 0 → P − 1) and ``critic`` (P − 1 → 0) on ``devices``
    devices, by simulated annealing over operation priorities (module docstring). Stops after ``iterations``
    moves or ``time_limit_s`` seconds; ``unfused`` is the two 1F1B schedules one after the other."""
    if devices < 1:
        raise ValueError("devices must be >= 1")
    t0 = time.perf_counter()
    pipes = (actor, critic)
    rng = random.Random(seed)
    # start: the best of three orders (each model's 1F1B order interleaved by when each operation would start
    # alone; the longest path left first; both 1F1B, the actor first)
    alone = [one_f_one_b(devices, p, hop=hop) for p in pipes]
    start_alone = {}
    for m, sched in enumerate(alone):
        for rs in sched.runs:
            for s, _, op in rs:
                start_alone[Op(m, op.kind, op.micro, op.stage)] = s
    level = _bottom_levels(devices, pipes, hop)
    problem = _Problem(devices, pipes, hop)
    starts = [[-start_alone[op] for op in problem.ops], [level[op] for op in problem.ops],
              [_one_f_one_b_priority(op) - 0.5 * op.model for op in problem.ops]]
    decoded = [problem.decode(p) for p in starts]
    pick = min(range(len(starts)), key=lambda i: decoded[i][0])
    bound = max(_bounds(devices, pipes, hop))   # stop at it: nothing shorter exists
    best_span, best_prio = decoded[pick][0], list(starts[pick])
    chains = 4   # restarts from the best start, each with its own random moves
    per_chain = max(1, iterations // chains)
    done = 0
    for _ in range(chains):
        prio = list(starts[pick])
        cur_span, cur_runs = decoded[pick]
        temp0 = 0.02 * cur_span
        for it in range(per_chain):
            if time.perf_counter() - t0 > time_limit_s or best_span <= bound * (1 + 1e-9):
                break
            # move: two operations close in a device's current order trade priorities (the device then runs
            # them the other way round where both are ready)
            runs = cur_runs[rng.randrange(devices)]
            if len(runs) < 2:
                break
            k = rng.randrange(len(runs) - 1)
            k2 = min(len(runs) - 1, k + rng.randint(1, 4))
            a, b = runs[k][2], runs[k2][2]
            prio[a], prio[b] = prio[b], prio[a]
            span, new_runs = problem.decode(prio)
            temp = temp0 * (1.0 - it / per_chain) + 1e-12
            if span <= cur_span or rng.random() < math.exp(-(span - cur_span) / temp):
                cur_span, cur_runs = span, new_runs
                if span < best_span - 1e-12:
                    best_span, best_prio = span, list(prio)
            else:
                prio[a], prio[b] = prio[b], prio[a]
            done += 1
    best = problem.schedule(best_prio)
    best.unfused = sum(s.makespan for s in alone)
    best.iterations = done
    best.seconds = time.perf_counter() - t0
    return best


def stage_sequence(stage: int, devices: int, micro: int) -> list[tuple[str, int]]:
    """The operations megatron-core's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) runs on
    pipeline stage ``stage`` of ``devices``, in order: ``min(devices - stage - 1, micro)`` warm-up forwards, then a
    forward and a backward in turn, then the remaining backwards; (kind, micro-batch)."""
    w = min(devices - stage - 1, micro)
    seq = [(FWD, j) for j in range(w)]
    for i in range(micro - w):
        seq += [(FWD, w + i), (BWD, i)]
    return seq + [(BWD, j) for j in range(micro - w, micro)]


def device_orders(schedule: Schedule, *, hop: float = 0.0) -> tuple[list[list[tuple[int, str, int]]], float]:
    """What each device runs under ``schedule``, as an executor that keeps each model's own pipeline schedule can
    run it (the megatron backend's fused training, :mod:`rlhfc.runtime.train.fused`): per device, (model, kind,
    micro-batch) in order — the schedule's interleaving of the two models (which model's operation comes next),
    each model's operations in its rank's 1F1B order (:func:`stage_sequence`). Returns the orders and their
    makespan (:func:`order_span`). An interleaving that cannot complete in that form falls back to each device
    running its first model's operations, then its second's (the unfused schedule, which always completes)."""
    P = schedule.devices
    pipes = schedule.pipelines
    orders = []
    for d, runs in enumerate(schedule.runs):
        seqs = {m: iter(stage_sequence(d if m == 0 else P - 1 - d, P, pipes[m].micro)) for m in range(len(pipes))}
        orders.append([(op.model, *next(seqs[op.model])) for _, _, op in runs])
    span = order_span(P, pipes, orders, hop=hop)
    if span is None:
        orders = [[(m, *op) for m in range(len(pipes)) for op in stage_sequence(d if m == 0 else P - 1 - d, P,
                                                                                 pipes[m].micro)]
                  for d in range(P)]
        span = order_span(P, pipes, orders, hop=hop)
    return orders, float(span)


def order_span(devices: int, pipes: tuple[Pipeline, ...], orders: list[list[tuple[int, str, int]]], *,
               hop: float = 0.0) -> float | None:
    """The makespan of running ``orders`` (per device, (model, kind, micro-batch)) strictly in order, each
    operation after its dependencies (and the hop between devices); None when they cannot complete (a device's
    next operation waits for one that waits behind it: the executor would deadlock)."""
    pos = [0] * devices
    free = [0.0] * devices
    done: dict[Op, float] = {}
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for d in range(devices):
            if pos[d] >= len(orders[d]):
                continue
            m, kind, j = orders[d][pos[d]]
            op = Op(m, kind, j, d if m == 0 else devices - 1 - d)
            deps = _deps(op, devices)
            if any(x not in done for x in deps):
                continue
            ready = max([free[d]] + [done[x] + (hop if device_of(x, devices) != d else 0.0) for x in deps])
            done[op] = free[d] = ready + _duration(op, pipes)
            pos[d] += 1
            left -= 1
            moved = True
        if not moved:
            return None
    return max(free)


def _bottom_levels(devices: int, pipes: tuple[Pipeline, ...], hop: float) -> dict[Op, float]:
    """Each operation's longest path to the end of its micro-batch (its own duration included)."""
    out: dict[Op, float] = {}
    for m, p in enumerate(pipes):
        for j in range(p.micro):
            for s in range(devices):     # backward of stage s: stages s..0 still to run
                out[Op(m, BWD, j, s)] = (s + 1) * p.backward_s + s * hop
            for s in range(devices):     # forward of stage s: the rest of the forwards, then every backward
                out[Op(m, FWD, j, s)] = (devices - s) * p.forward_s + devices * p.backward_s \
                    + (2 * devices - s - 2) * hop
    return out


def render(schedule: Schedule, width: int = 72, names: tuple[str, str] = ("a", "c")) -> list[str]:
    """The schedule as text, a line per device: each cell the operation running then (``a``/``A``: the first
    model's forward/backward, ``c``/``C`` the second's; ``.`` idle)."""
    span = schedule.makespan or 1.0
    lines = []
    for d, runs in enumerate(schedule.runs):
        cells = ["."] * width
        for start, end, op in runs:
            lo, hi = int(start / span * width), max(int(start / span * width) + 1, int(round(end / span * width)))
            ch = names[op.model]
            for i in range(lo, min(hi, width)):
                cells[i] = ch.upper() if op.kind == BWD else ch
        lines.append(f"device {d:>2} |{''.join(cells)}|")
    return lines
