"""The simulator's two list schedulers: exclusive devices (GPU clusters) and processor sharing (CPU).

Why this file is long: it is one idea, turning a priced step into a timeline; the two schedulers share the
dependencies, the submission order (asynchronous rollout submits a generation steps ahead) and the task record.

Both take a :class:`_Context` — the priced stages of one step and their
dependencies (data, the driver's launch order from the step's
:class:`~rlhfc.ir.schedule.Schedule`, parameter versions) — and return the
:class:`Task` of every (stage, step); :mod:`rlhfc.cost.simulator` documents the
rules they follow.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from rlhfc.ir import Stage, plan
from rlhfc.ir.schedule import stage_threads

from .hardware import table_speedup
from .model import CostModel, StageCost

DRIVER = -1


@dataclass
class Task:
    """One stage of one simulated step. ``devices``: (first, count), or None for a driver-side stage."""

    stage: str
    step: int
    op: str
    model: str | None
    start: float
    end: float
    devices: tuple[int, int] | None
    busy: float
    transient_bytes: float
    chunks: list = field(default_factory=list)
    sync_s: float = 0.0
    waits_for: str = ""          # what decided the start: "stage@step", "devices", "barrier" or ""
    resources: list = field(default_factory=list)   # every device it occupies (a sync: senders and receivers)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class _Context:
    """What both schedulers need: the priced stages and their dependencies."""

    cm: CostModel
    stages: list
    costs: dict
    extra: dict
    sync_time: dict
    sync_devices: dict
    members: dict
    streams: dict
    stream_source: object
    data_deps: dict
    order_deps: dict
    readers: dict
    steps: int
    step_barrier: bool
    #: generate stage -> its staleness bound K, for generates that run ahead (asynchronous rollout)
    ahead: dict = field(default_factory=dict)


def submission_blocks(ctx: _Context) -> list[list[tuple[Stage, int]]]:
    """The (stage, step) tasks in the order the driver submits them, one block per step it runs: a generate
    running K steps ahead submits steps 0..K in block 0 and step b + K in block b, before the block's other
    stages (``job.ahead`` is the step's first call); every other stage submits its own step's task."""
    blocks = []
    for b in range(ctx.steps):
        block = []
        for s in ctx.stages:
            k_ahead = ctx.ahead.get(s.name, 0)
            if not k_ahead:
                block.append((s, b))
            elif b == 0:
                block += [(s, k) for k in range(min(k_ahead, ctx.steps - 1) + 1)]
            elif b + k_ahead < ctx.steps:
                block.append((s, b + k_ahead))
        blocks.append(block)
    return blocks


def _dependencies(ctx: _Context, s: Stage, k: int) -> list[tuple[str, int]]:
    """The (stage, step) tasks that must end before ``s`` of step ``k`` starts (data, launch order,
    parameter versions; not the step barrier). A generate running ahead draws its own prompts and is the
    first call of the step that launches it: it waits only for the weights it may read, those written
    ``distance + staleness`` steps before; a train stage does not wait for such readers (a generating copy
    holds its own weights; on the trainer's worker the queue already runs the generation first)."""
    ahead = s.name in ctx.ahead
    keys = [] if ahead else [(p, k) for p in ctx.data_deps[s.name] + ctx.order_deps[s.name]]
    for e in ctx.cm.module.graph.versions:
        if e.reader == s.name and k - e.distance - e.staleness >= 0:
            keys.append((e.writer, k - e.distance - e.staleness))
    for e in ctx.readers.get(s.name, []):
        if e.staleness:
            continue
        kk = k if e.distance == 1 else k - 1
        if kk >= 0:
            keys.append((e.reader, kk))
    return keys


def _resources(ctx: _Context, s: Stage) -> list[int]:
    """Every device ``s`` occupies (a sync: its senders and receivers), or ``[DRIVER]``."""
    mem = ctx.members[s.name]
    return ctx.sync_devices.get(s.name) or (list(range(mem[0], mem[0] + mem[1])) if mem else [DRIVER])


def _stream_batch(gen_cost) -> int:
    """Rows a streamed generate hands over (in chunks)."""
    return len(gen_cost.finish_offsets) or int(gen_cost.work.get("batch", 1))


def footprints(ctx: _Context) -> list[tuple[list[int], float]]:
    """Each stage's devices (:func:`_resources`) and the activations it holds there while it runs, as
    :func:`_schedule_exclusive` schedules it (a streamed consumer: one chunk's), for the stages that take
    time (one taking none holds nothing: see ``simulator._events``). Steps repeat these."""
    out = []
    for s in ctx.stages:
        cost = ctx.costs[s.name]
        src = ctx.stream_source(s)
        if src is not None:
            chunk, batch = ctx.streams[src.name], _stream_batch(ctx.costs[src.name])
            sizes = {min(chunk, batch - j * chunk) for j in range(max(1, math.ceil(batch / chunk)))}
            if any(ctx.cm.stage_cost(s, rows=float(r)).time_s > 0 for r in sizes):
                out.append((_resources(ctx, s), ctx.cm.stage_cost(s, rows=float(min(chunk, batch))).transient_bytes))
        elif cost.time_s + ctx.extra.get(s.name, 0.0) + ctx.sync_time.get(s.name, 0.0) > 0:
            out.append((_resources(ctx, s), cost.transient_bytes))
    return out


def _slot_runs(devices: list[int], driver: int) -> list[tuple[int, int]]:
    """``devices`` (:data:`DRIVER` as slot ``driver``) as [a, b) runs of consecutive slots."""
    return _runs(sorted({driver if d == DRIVER else d for d in devices}), driver + 1)


def _runs(devices, n: int) -> list[tuple[int, int]]:
    """``devices`` (sorted indices) as [a, b) ranges of consecutive ones, within 0..n-1."""
    if devices and 0 <= devices[0] and devices[-1] < n \
            and list(devices) == list(range(devices[0], devices[-1] + 1)):   # one range (a stage's mesh)
        return [(devices[0], devices[-1] + 1)]
    out: list = []
    for d in devices:
        if not 0 <= d < n:
            continue
        if out and out[-1][1] == d:
            out[-1][1] = d + 1
        else:
            out.append([d, d + 1])
    return [(a, b) for a, b in out]


def _ready(done: dict, keys: list, barrier: float | None) -> tuple[float, str]:
    """When the last of the tasks ``keys`` that are ``done`` (and the step ``barrier``, if any) ends, and which
    one that is: ``"%stage@step"`` or ``"barrier"`` (ties: the greatest label; nothing: ``(0.0, "")``)."""
    ends = [(done[key].end, key) for key in keys if key in done]
    if barrier is not None:
        ends.append((barrier, None))
    if not ends:
        return 0.0, ""
    ready = max(e for e, _ in ends)
    return ready, max("barrier" if key is None else f"%{key[0]}@{key[1]}" for e, key in ends if e == ready)


def _schedule_exclusive(ctx: "_Context") -> list[Task]:
    """List scheduling with exclusive devices: a device runs one task at a time, in submission order."""
    cm, stages, costs, extra, sync_time = ctx.cm, ctx.stages, ctx.costs, ctx.extra, ctx.sync_time
    members, streams, stream_source = ctx.members, ctx.streams, ctx.stream_source
    steps, step_barrier = ctx.steps, ctx.step_barrier
    done: dict[tuple[str, int], Task] = {}
    resources = {s.name: _resources(ctx, s) for s in stages}
    # when each device (the driver: the last slot) is free; a stage's devices as runs of consecutive slots
    top = max((d for res in resources.values() for d in res), default=-1) + 1
    runs = {name: _slot_runs(res, top) for name, res in resources.items()}
    free = [0.0] * (top + 1)
    chunk_cost: dict[tuple[str, int], object] = {}   # a consumer's price per chunk size (asked every step)

    def priced(s: Stage, rows: int):
        if (s.name, rows) not in chunk_cost:
            chunk_cost[(s.name, rows)] = cm.stage_cost(s, rows=float(rows))
        return chunk_cost[(s.name, rows)]

    tasks: list[Task] = []
    step_end = [0.0] * steps
    for blk, block in enumerate(submission_blocks(ctx)):
        for s, k in block:
            ready, why = _ready(done, _dependencies(ctx, s, k),
                                step_end[blk - 1] if step_barrier and blk > 0 else None)
            mem = members[s.name]
            res, mine = resources[s.name], runs[s.name]
            dev_free = max((max(free[a:b]) for a, b in mine), default=0.0)
            cost = costs[s.name]
            duration = cost.time_s + extra.get(s.name, 0.0) + sync_time.get(s.name, 0.0)
            src = stream_source(s)
            chunks: list = []
            if src is not None:
                gen_task = done[(src.name, k)]
                gen_cost = costs[src.name]
                chunk = streams[src.name]
                batch = _stream_batch(gen_cost)
                t_prev = max(ready, 0.0)
                first_start = None
                busy = 0.0
                n_chunks = max(1, math.ceil(batch / chunk))
                seconds: dict[int, float] = {}   # a chunk's price by its rows (all chunks but the last are alike)
                for j in range(n_chunks):
                    rows = min(chunk, batch - j * chunk)
                    last = min((j + 1) * chunk, batch) - 1
                    avail = gen_task.end if j == n_chunks - 1 else \
                        gen_task.start + gen_cost.finish_offsets[last] if gen_cost.finish_offsets else gen_task.end
                    if rows not in seconds:
                        seconds[rows] = priced(s, rows).time_s
                    c_cost = seconds[rows]
                    start = max(avail, t_prev, dev_free if j == 0 else t_prev)
                    if j == 0:
                        first_start = start
                        start += extra.get(s.name, 0.0)
                    end = start + c_cost
                    chunks.append((start, end, rows))
                    busy += c_cost
                    t_prev = end
                start, end = first_start, t_prev
                why = f"%{src.name}@{k}"   # its last chunk waits for the end of generation
                busy += extra.get(s.name, 0.0)
                transient = priced(s, min(chunk, batch)).transient_bytes
            else:
                start = max(ready, dev_free)
                if dev_free > ready:
                    why = "devices"
                end = start + duration
                busy = duration
                transient = cost.transient_bytes
            for a, b in mine:
                free[a:b] = [end] * (b - a)
            task = Task(s.name, k, s.op, s.target if mem else None, start, end, mem, busy, transient, chunks,
                        extra.get(s.name, 0.0), why, res if res != [DRIVER] else [])
            done[(s.name, k)] = task
            tasks.append(task)
        step_end[blk] = max(t.end for t in tasks if t.step == blk)
    return tasks


@dataclass
class _Job:
    """One task of the processor-sharing schedule: its units (chunks) run one after another."""

    stage: Stage
    step: int
    workers: list
    cores: frozenset
    threads: int
    units: list                     # [priced seconds, serial fraction, rows, release]; release: None (at once),
    prereqs: list                   # (gen job, fraction of it done) or (gen job, None) = when it has ended
    state: str = "wait"             # wait -> held (worker taken) -> run -> held ... -> done
    unit: int = 0
    rem: float = 0.0
    done_s: float = 0.0             # priced seconds completed (generate: what releases its chunks)
    total_s: float = 0.0
    start: float | None = None
    end: float = 0.0
    why: str = ""
    spans: list = field(default_factory=list)
    unit_start: float = 0.0
    #: per unit, the (cores, threads) it runs on where they change (a migrated tail: one rank); None: the job's
    phases: list | None = None


def _speed(speedup, x: float) -> float:
    """Throughput of ``x`` cores' worth of CPU time relative to one core (fractions: time-sliced);
    ``speedup(n)``: n threads' throughput relative to one."""
    if x <= 1.0:
        return max(x, 1e-9)
    lo = int(math.floor(x))
    a, b = speedup(lo), speedup(lo + 1)
    return a + (b - a) * (x - lo)


def _fair_shares(running: list[_Job]) -> dict[int, float]:
    """Max-min fair CPU allocation (cores' worth) of the running jobs: the OS shares each core equally among
    the runnable processes pinned to it, and a process uses at most one core per thread. Progressive filling
    over the jobs' core sets (the placement's meshes: aligned ranges, nested or disjoint)."""
    alloc = {id(j): 0.0 for j in running}
    sets = {j.cores for j in running}
    active = [j for j in running]
    while active:
        inc = min(j.threads - alloc[id(j)] for j in active)
        slack = {}
        for cs in sets:
            inside = [j for j in active if j.cores <= cs]
            slack[cs] = len(cs) - sum(alloc[id(j)] for j in running if j.cores <= cs)
            if inside:
                inc = min(inc, slack[cs] / len(inside))
        for j in active:
            alloc[id(j)] += inc
        full = [cs for cs in sets if slack[cs] - inc * sum(1 for j in active if j.cores <= cs) <= 1e-12]
        keep = [j for j in active if alloc[id(j)] < j.threads - 1e-12 and not any(j.cores <= cs for cs in full)]
        if len(keep) == len(active):
            break
        active = keep
    return alloc


def _schedule_shared(ctx: _Context) -> tuple[list[Task], list]:
    """Processor sharing (CPU clusters): workers are processes; each runs its calls one at a time in
    submission order, while workers whose cores overlap run *at the same time*, each getting its fair
    share of the cores (:func:`_fair_shares`). A call priced at ``T`` seconds on its whole mesh (the cost
    model: one thread per core) runs on ``a`` cores' worth of CPU in
    ``d + (T - d) * (sigma / min(a, 1) + (1 - sigma) * s(cores) / s(a))``, ``d`` the dispatch the price
    holds (the driver's round trip, not the worker's CPU): the serial part (per-call and per-layer
    overhead, fraction ``sigma``) needs one core, the rest scales with the host's measured thread speed-up
    ``s``. When the profile timed the stage's model at fewer threads too, the stage's own speed-up
    (:meth:`rlhfc.cost.model.CostModel.stage_speedup`, serial part included) replaces that estimate:
    ``T * s_m(cores) / s_m(a)``.
    A call runs with the torch threads the runtime gives it (:func:`rlhfc.ir.schedule.stage_threads`: its
    mesh's cores, divided among the workers that may share them at the same time)."""
    cm = ctx.cm
    module, spec = cm.module, cm.spec
    workers = plan.workers(module)
    threads = stage_threads(module)
    jobs: list[_Job] = []
    pos: dict[tuple[str, int], int] = {}
    block_of: list[int] = []
    for b, block in enumerate(submission_blocks(ctx)):
        for s, k in block:
            pos[(s.name, k)] = len(jobs)
            jobs.append(_cpu_job(ctx, s, k, workers, threads, jobs, pos))
            block_of.append(b)
    for n, j in enumerate(jobs):
        deps = [pos[key] for key in _dependencies(ctx, j.stage, j.step) if key in pos and pos[key] < n]
        if ctx.step_barrier and block_of[n] > 0:   # the tasks of the step before the one that submits it
            deps += [m for m in range(n) if jobs[m].step == block_of[n] - 1]
        j.prereqs = sorted(set(deps))
    queues: dict = {}
    for n, j in enumerate(jobs):
        for w in j.workers:
            queues.setdefault(w, []).append(n)
    head = {w: 0 for w in queues}
    core_busy: list[tuple[float, float, int, float]] = []   # (from, to, core, share of it)
    t, eps = 0.0, 1e-12
    waiting = list(range(len(jobs)))
    left = len(jobs)

    def released(j: _Job) -> bool:
        rel = j.units[j.unit][3]
        if rel is None:
            return True
        gen, frac = rel
        if gen.state == "done":
            return True
        return frac is not None and gen.state in ("run", "held") and gen.done_s >= frac * gen.total_s - eps

    while left:
        moved = True
        while moved:
            moved = False
            for n in list(waiting):
                j = jobs[n]
                if any(jobs[m].state != "done" for m in j.prereqs) or \
                        any(queues[w][head[w]] != n for w in j.workers):
                    continue
                waiting.remove(n)
                j.state = "held"
                ready = max(((jobs[m].end, m) for m in j.prereqs), default=(0.0, -1))
                if ready[1] < 0:
                    j.why = ""
                elif ready[0] < t - eps:
                    j.why = "devices"
                elif ctx.step_barrier and jobs[ready[1]].step < j.step:
                    j.why = "barrier"
                else:
                    j.why = f"%{jobs[ready[1]].stage.name}@{jobs[ready[1]].step}"
                moved = True
            for j in jobs:
                if j.state == "held" and released(j):
                    j.state, j.rem, j.unit_start = "run", j.units[j.unit][0], t
                    if j.phases is not None:
                        j.cores, j.threads = j.phases[j.unit]
                    if j.start is None:
                        j.start = t
                    moved = True
                if j.state == "run" and j.rem <= eps:
                    _finish_unit(j, t, jobs, queues, head)
                    if j.state == "done":
                        left -= 1
                    moved = True
        running = [j for j in jobs if j.state == "run"]
        if not running:
            if left:
                raise RuntimeError("simulator: no task can run (a dependency cycle in the schedule)")
            break
        computing = [j for j in running if j.cores]
        alloc = _fair_shares(computing)
        rate = {}
        for j in running:
            if not j.cores:
                rate[id(j)] = 1.0
                continue
            a = max(alloc[id(j)], 1e-9)
            count = len(j.cores)
            priced, sigma, _, _, table, d = j.units[j.unit]
            if table:   # the stage's own times at the measured thread counts: its serial part is inside
                sp = functools.partial(table_speedup, table)
                slow = _speed(sp, count) / _speed(sp, a)
            else:
                slow = sigma / min(a, 1.0) + (1.0 - sigma) * _speed(spec.speedup, count) / _speed(spec.speedup, a)
            d = min(d, priced)   # the dispatch at full speed, the rest slowed (a constant rate over the unit)
            rate[id(j)] = priced / (d + (priced - d) * slow) if priced > 0 else 1.0 / slow
        dt = min(j.rem / rate[id(j)] for j in running)
        for j in jobs:   # a held chunk waiting for its generate to get far enough
            if j.state == "held":
                gen, frac = j.units[j.unit][3] or (None, None)
                if gen is not None and frac is not None and gen.state == "run":
                    dt = min(dt, max(frac * gen.total_s - gen.done_s, 0.0) / rate[id(gen)])
        dt = max(dt, 0.0)
        for j in running:
            step = rate[id(j)] * dt
            j.rem -= step
            j.done_s += step
            if j.cores and dt > 0:
                share = alloc[id(j)] / len(j.cores)
                for c in j.cores:
                    core_busy.append((t, t + dt, c, share))
        t += dt
        for j in running:
            if j.rem <= eps * max(1.0, j.units[j.unit][0]):
                j.rem = 0.0
    tasks = []
    for j in jobs:
        s, k = j.stage, j.step
        mem = ctx.members[s.name]
        src = ctx.stream_source(s)
        chunked = src is not None
        res = ctx.sync_devices.get(s.name) or (list(range(mem[0], mem[0] + mem[1])) if mem else [])
        chunk_rows = j.units[0][2] if chunked else None
        transient = cm.stage_cost(s, rows=float(chunk_rows)).transient_bytes if chunked else \
            ctx.costs[s.name].transient_bytes
        tasks.append(Task(s.name, k, s.op, s.target if mem else None, j.start if j.start is not None else j.end,
                          j.end, mem, sum(b - a for a, b, _ in j.spans), transient,
                          list(j.spans) if chunked else [], ctx.extra.get(s.name, 0.0),
                          f"%{src.name}@{k}" if chunked else j.why, res))
    return tasks, core_busy


def _finish_unit(j: _Job, t: float, jobs: list, queues: dict, head: dict) -> None:
    j.spans.append((j.unit_start, t, j.units[j.unit][2]))
    j.unit += 1
    if j.unit < len(j.units):
        j.state = "held"
        return
    j.state, j.end = "done", t
    for w in j.workers:
        head[w] += 1
        if head[w] >= len(queues[w]):
            queues[w].append(-1)   # the worker's queue is done: a sentinel no job index matches


def _cpu_job(ctx: _Context, s: Stage, k: int, workers: dict, threads_of: dict, jobs: list, pos: dict) -> _Job:
    cm = ctx.cm
    cost = ctx.costs[s.name]
    extra = ctx.extra.get(s.name, 0.0)
    mem = ctx.members[s.name]
    if mem is None:
        wkeys, cores, threads = ["driver"], frozenset(), 1
    else:
        key = plan.worker_key(cm.module, s)
        wkeys = [key]
        dest = plan.sync_destination(cm.module, s)
        if dest is not None:
            wkeys.append((s.target, dest))
        cores, threads = frozenset(workers[key].devices), threads_of.get(s.name, workers[key].threads)
        if s.op == "sync":
            cores = frozenset()   # a weight transfer waits on memory copies and the object store, not a core

    # a worker call's price holds the driver's dispatch (the Ray round trip): latency, not the worker's CPU,
    # so sharing the cores does not stretch it (and the worker's measured span does not contain it)
    d = cm.dispatch if cores and s.op.split(".")[0] in ("generate", "forward", "train") else 0.0

    def sigma(c: StageCost) -> float:
        busy = c.time_s - d
        return min(1.0, max(0.0, (c.parts.get("overhead", 0.0) - d) / busy)) if busy > 0 else 0.0

    src = ctx.stream_source(s)
    phases = None
    split = tail_split(cm.module, s, cost) if cores else None
    if src is None and split is not None:
        # a migrated tail (the tail_migrate pass): every rank decodes its share in a process of its own until its
        # tail starts (a core each: independent processes, linear in the cores they get), then one rank decodes
        # the rows left, the other ranks' cores free for the forwards of the finished chunks
        ranks = split[1]
        head, rest = cm.tail_phases(s, ranks, plan.tail(s).below)
        rest += extra + ctx.sync_time.get(s.name, 0.0)
        units = [[head + d, 0.0, None, None, tuple(float(n) for n in range(1, len(cores) + 1)), d],
                 [rest, sigma(cost), None, None, None, 0.0]]
        phases = [(cores, min(ranks, len(cores))), (frozenset({min(cores)}), 1)]
    elif src is None:
        duration = cost.time_s + extra + ctx.sync_time.get(s.name, 0.0)
        units = [[duration, sigma(cost), None, None, cm.stage_speedup(s) if cores else None, d]]
    else:
        gen = jobs[pos[(src.name, k)]]
        gen_cost = ctx.costs[src.name]
        chunk = ctx.streams[src.name]
        batch = len(gen_cost.finish_offsets) or int(gen_cost.work.get("batch", 1))
        n_chunks = max(1, math.ceil(batch / chunk))
        units = []
        for i in range(n_chunks):
            rows = min(chunk, batch - i * chunk)
            last = min((i + 1) * chunk, batch) - 1
            frac = None if (i == n_chunks - 1 or not gen_cost.finish_offsets) else \
                gen_cost.finish_offsets[last] / max(gen.total_s, 1e-12)
            c = cm.stage_cost(s, rows=float(rows))
            units.append([c.time_s + (extra if i == 0 else 0.0), sigma(c), rows, (gen, frac),
                          cm.stage_speedup(s, float(rows)) if cores else None, d])
    job = _Job(s, k, wkeys, cores, max(1, int(threads)), units, [], phases=phases)
    job.total_s = sum(u[0] for u in units)
    return job


def tail_split(module, s: Stage, cost) -> tuple[float, int] | None:
    """(seconds into the generate at which its ranks' tails start, ranks) of a generate the ``tail_migrate`` pass
    marked: the finish offset of a rank's ``rows − below + 1``-th row (as a fraction of the batch, by the length
    law); None for any other stage or without finish offsets."""
    t = plan.tail(s)
    if t is None or not cost.finish_offsets:
        return None
    ranks = plan.worker_ranks(module, s.target, plan.stage_mesh(module, s))
    per = -(-(s.outputs[0].type.batch or 1) // ranks)
    offsets = cost.finish_offsets
    start = offsets[min(len(offsets) - 1, max(0, -(-(per - t.below + 1) * len(offsets) // per) - 1))]
    return float(start), ranks
