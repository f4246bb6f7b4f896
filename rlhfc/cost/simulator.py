"""Discrete-event simulation of an annotated IR on its cluster.

Several steps are unrolled (``steps``, default 3). Each (step, stage) is a task
whose duration comes from :class:`~rlhfc.cost.model.CostModel`. A task starts
when all of these hold:

- **data**: the stages producing its operands (same step) have finished;
- **parameter versions**: a reader with edge ``[+d]`` waits for the writer of
  step k-d; a writer (``train``) waits for every reader of the weights it
  overwrites (readers ``[+1]`` of its step and ``[+0]`` of the step before);
- **asynchronous rollout** (a generate whose edge is ``[+1..+1+K]``): the driver submits step k's
  generation at the start of step k-K (steps 0..K at the start of step 0), before that step's other
  calls, so it waits only for the weights of step k-1-K and the barrier before step k-K; the steady-state
  step time then shows the overlap of generation with training;
- **launch order** (the driver's program order): a stage waits for every stage
  above it in the IR, except those of its own ``overlap`` group (launched
  together) and, for a consumer of a ``stream``-ed generate, that generate
  (it waits for chunks instead);
- **step barrier**: the driver runs one step after another (``step_barrier``,
  as the runtime's loop does); without it only the dependencies above order
  the steps (ReaL-style unrolled iterations);
- **devices** (GPU clusters): every device of its mesh is free. A device runs
  one task at a time, in submission order (a worker's call queue); driver-side
  stages share one ``driver`` resource;
- **workers** (CPU clusters, processor sharing): a worker — one process per
  (model, mesh), as the runtime starts them — runs its calls one at a time in
  submission order, but workers whose cores overlap run at the same time, the
  OS giving each its fair share of the cores; a call slows down by the share it
  gets (its serial part needs a whole core, the rest scales with the measured
  thread speed-up), and a worker that shares its cores runs one thread per
  whole core of its share (see :func:`_schedule_shared`).

Streaming: a consumer (``forward.*``, ``compute.rule``) of a generate annotated
``stream = {chunk = C}`` runs once per chunk of C finished samples, each chunk
starting when its samples have finished (expected order statistics of the
response lengths) and the previous chunk is done. Overcommitment prices the
generate as B+delta prompts stopping when B have finished.

Dynamic sampling with refill (``group_advantages(filter_groups = true, max_refill = K)``): the step is
priced with one sampling round, as if every group of the batch's prompts had unequal scores — the best
case. How many rounds a step needs depends on the rewards, which the compiler cannot know; ``rlhfc
explain`` notes the round's stages and what each further round (up to K) adds.

Parameter reallocation: when consecutive stages on a model (cyclically across
steps) use different placements, the weights move between the layouts
(:func:`rlhfc.cost.sync.sync_time`): a ``sync`` stage on the model
carries that time; without one it is added to the later stage and noted.

Memory: a device holds, for the whole run, the weights of every model with a
stage on it (the larger shard if the model has two layouts there) and the
gradients + optimizer state of models it trains, plus, while a task runs, that
task's activations / KV cache. The result has each device's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhfc.ir import Module, Stage, plan
from rlhfc.ir.plan import Layout
from rlhfc.ir.schedule import build_schedule

from .model import CostConfig, CostModel, StageCost
from .scheduling import Task, _Context, _runs, _schedule_exclusive, _schedule_shared
from .shared import shared_cache
from .sync import host_copy_time, reshard_time, sync_time


@dataclass
class DeviceStats:
    index: int
    node: int
    busy_s: float
    utilisation: float
    peak_memory_bytes: float
    capacity_bytes: float
    static: dict            # what stays resident: {"@actor weights": bytes, "@actor grads+optimizer": bytes}
    peak_stages: list       # the tasks running at the memory peak


@dataclass
class SimResult:
    step_time_s: float
    steps: int
    makespan_s: float
    step_spans: list
    tasks: list
    devices: list
    costs: dict
    critical_path: list
    notes: list
    sync_s: dict                 # seconds of weight syncing, by the stage that carries them

    def step_tasks(self, step: int | None = None) -> list[Task]:
        """The tasks of one step (default: the last, steady-state one)."""
        k = self.steps - 1 if step is None else step
        return [t for t in self.tasks if t.step == k]

    @property
    def bottleneck(self) -> dict:
        return bottleneck(self)


def _members(cost_model: CostModel, stage: Stage) -> tuple[int, int] | None:
    if plan.on_worker(cost_model.module, stage):
        lay = cost_model.layout(stage)
        return (lay.first, lay.count)
    return None


def _reallocations(cm: CostModel) -> tuple[dict, dict, list, dict]:
    """Weight-sync time: (charged to compute stages, carried by sync stages, notes, the
    extra devices a sync occupies).

    Two ways a plan can use a model under several layouts:

    - it keeps one copy per mesh, refreshed after training by ``sync`` stages (the ``realloc`` pass): a sync
      moves the trained weights from the train stage's layout to its destination mesh (``to_first``,
      ``to_count``; the layout of the model's stage there), in buckets of ``bucket_mb``; on GPUs the
      ``object_store`` transport also crosses host memory twice (``collective`` goes device to device);
    - a ``sync`` onto its own mesh reshards a worker group's training layout into full copies on every rank
      (:func:`rlhfc.cost.sync.reshard_time`);
    - it has no sync stage: the weights move between consecutive stages whose layouts differ (ReaL's
      reallocation; cyclically, the first stage of a step follows the last one of the step before), and the
      time is charged to the later stage.
    """
    g = cm.module.graph
    extra: dict[str, float] = {}
    carried: dict[str, float] = {}
    sync_devices: dict[str, list[int]] = {}
    notes: list[str] = []
    per_node = cm.cluster.per_node
    fam = lambda st: st.op.split(".", 1)[0]  # noqa: E731
    for name, model in cm.module.models.items():
        on = [s for s in g.stages if s.target == name and plan.on_worker(cm.module, s)]
        compute = [s for s in on if fam(s) in ("generate", "forward", "train")]
        syncs = [s for s in on if fam(s) == "sync"]
        nbytes = cm.spec.bytes_per_param * model.params
        if syncs:
            train = next((s for s in compute if s.op == "train"), None)
            src = cm.layout(train) if train is not None else cm.layout(syncs[0])
            covered = {(src.first, src.count)}
            for sy in syncs:
                mesh = plan.sync_destination(cm.module, sy)
                if mesh is None:
                    continue
                dest = mesh.pair()
                covered.add(dest)
                if plan.is_reshard(cm.module, sy):   # the group gathers its pieces into full copies
                    trainer, par = plan.worker_layout(cm.module, name, mesh)
                    held = plan.backend_traits(trainer).held_fraction(par.dp, par.tp, par.pp)
                    carried[sy.name] = carried.get(sy.name, 0.0) + reshard_time(
                        nbytes, held, float(sy.attrs.get("bucket_mb", 64)), src, cm.spec, per_node)
                    sync_devices[sy.name] = list(src.devices)
                    continue
                there = next((x for x in compute if (cm.layout(x).first, cm.layout(x).count) == dest), None)
                dst = cm.layout(there) if there is not None else Layout(dest[0], dest[1], dest[1], 1, 1)
                seconds = sync_time(nbytes, src, dst, cm.spec, per_node)
                bucket = float(sy.attrs.get("bucket_mb", 64)) * 2 ** 20
                seconds += math.ceil(nbytes / max(dst.tp * dst.pp, 1) / bucket) * cm.spec.latency
                if cm.gpu and sy.attrs.get("transport", "object_store") == "object_store":
                    # through host memory: device -> host at the sender, host -> device at the receiver
                    seconds += 2 * host_copy_time(nbytes / max(dst.tp * dst.pp, 1), cm.spec)
                carried[sy.name] = carried.get(sy.name, 0.0) + seconds
                sync_devices[sy.name] = sorted(set(src.devices) | set(range(dest[0], dest[0] + dest[1])))
            for x in compute:
                lay = cm.layout(x)
                if (lay.first, lay.count) not in covered:
                    notes.append(f"@{name} is used on devices {lay.describe(per_node)} by %{x.name}, which no sync "
                                 "stage refreshes after training: that copy serves stale weights")
        elif len(compute) > 1:
            for i, s in enumerate(compute):
                prev = compute[i - 1]
                src, dst = cm.layout(prev), cm.layout(s)
                if src.same_placement(dst):
                    continue
                seconds = sync_time(nbytes, src, dst, cm.spec, per_node)
                extra[s.name] = extra.get(s.name, 0.0) + seconds
                notes.append(f"@{name} changes layout between %{prev.name} ({src.parallel_text()} on "
                             f"{src.describe(per_node)}) and %{s.name} ({dst.parallel_text()} on "
                             f"{dst.describe(per_node)}) with no sync stage: {seconds:.3g} s of weight "
                             "transfer charged to %" + s.name)
    return extra, carried, notes, sync_devices


def simulate(module: Module, config: CostConfig | None = None, *, steps: int = 3, step_barrier: bool = True,
             cost_model: CostModel | None = None) -> SimResult:
    """Simulate ``steps`` steps of ``module`` (see the module docstring); at least :data:`STEADY_STEPS` when a
    generate runs ahead of training (asynchronous rollout): fewer would price its warm-up, not its steady
    state (``SimResult.steps`` says how many ran)."""
    cm = cost_model or CostModel(module, config)
    if steps < STEADY_STEPS and any(plan.async_rollout(module, s) is not None for s in module.graph.stages):
        steps = STEADY_STEPS
    if _shared_active():   # a placement search simulates the same plan more than once: memoised by its plan
        key = ("simulate", steps, step_barrier, tuple((s.name, s.op, str(s.annotations), str(s.attrs))
                                                      for s in module.graph.stages))
        if key not in cm._cache:
            cm._cache[key] = _simulate(module, cm, steps, step_barrier)
        return cm._cache[key]
    return _simulate(module, cm, steps, step_barrier)


def _shared_active() -> bool:
    return shared_cache() is not None


def _context(module: Module, cm: CostModel, steps: int, step_barrier: bool,
             timeline: bool = True) -> tuple[_Context, list]:
    """What the schedulers need to simulate ``steps`` steps of ``module`` (priced stages, dependencies, syncs,
    streams), and the reallocation notes. Without ``timeline``, what :func:`rlhfc.cost.scheduling.footprints`
    needs: no dependencies, the stages in graph order, the schedule only where something streams, and the
    weight moves' times only where they decide whether a stage takes any time."""
    g = module.graph
    # a footprint needs the schedule only for what streams (whose consumers hold a chunk's activations)
    schedule = build_schedule(module) if timeline or any(plan.streams(s) for s in g.stages) else None
    # tasks are submitted as the driver launches them
    stages = [e.stage for e in schedule.launch_order()] if timeline else list(g.stages)
    costs: dict[str, StageCost] = {s.name: cm.stage_cost(s) for s in stages}
    if timeline or any(c.time_s <= 0 for c in costs.values()) or any(s.op.split(".")[0] == "sync" for s in stages):
        extra, sync_time, notes, sync_devices = _reallocations(cm)
    else:   # no sync stage (whose devices these are) and every stage takes time already
        extra, sync_time, notes, sync_devices = {}, {}, [], {}
    members = {s.name: _members(cm, s) for s in stages}
    by_name = {s.name: s for s in stages}
    # chunk size of each streamed generate (an overcommitted one without chunks hands over one chunk)
    streams = {e.name: plan.stream_chunk(e.stage) or (e.stage.outputs[0].type.batch or 1)
               for e in (schedule.entries if schedule else ()) if e.kind == "stream"}

    def stream_source(s: Stage) -> Stage | None:
        src = schedule[s.name].source if schedule else None
        return by_name[src] if src is not None else None

    if not timeline:
        return _Context(cm, stages, costs, extra, sync_time, sync_devices, members, streams, stream_source,
                        {}, {}, {}, steps, step_barrier), notes
    # static dependencies (within a step): data, and the driver's launch order (the schedule)
    index = {s.name: i for i, s in enumerate(stages)}
    producers = {id(v): s for s in stages for v in s.outputs}
    data_deps = {s.name: sorted({producers[id(v)].name for v in s.inputs if id(v) in producers
                                 and producers[id(v)] is not stream_source(s)}, key=index.get)
                 for s in stages}
    order_deps = {s.name: [p for p in schedule.launch_deps(s.name) if p != schedule[s.name].source]
                  for s in stages}
    readers: dict[str, list] = {}
    for e in g.versions:
        readers.setdefault(e.writer, []).append(e)

    ahead = {s.name: a.staleness for s in stages if (a := plan.async_rollout(module, s)) is not None}
    return _Context(cm, stages, costs, extra, sync_time, sync_devices, members, streams, stream_source,
                    data_deps, order_deps, readers, steps, step_barrier, ahead), notes


def _simulate(module: Module, cm: CostModel, steps: int, step_barrier: bool) -> SimResult:
    ctx, notes = _context(module, cm, steps, step_barrier)
    costs, extra, sync_time = ctx.costs, ctx.extra, ctx.sync_time
    if cm.spec.is_cpu:
        tasks, core_busy = _schedule_shared(ctx)
    else:
        tasks, core_busy = _schedule_exclusive(ctx), None
    spans, makespan, step_time = step_spans(tasks, steps)
    window = (spans[0][1], spans[-1][1]) if steps > 1 else (0.0, makespan)
    devices = _device_stats(cm, module, tasks, costs, window, core_busy)
    result = SimResult(step_time, steps, makespan, spans, tasks, devices, costs, [], notes,
                       {**extra, **sync_time})
    result.critical_path = critical_path(result)
    return result


#: steps to simulate for a steady state when steps run ahead of each other (asynchronous rollout): its warm-up
#: over, the later half of them prices the step
STEADY_STEPS = 8


def step_spans(tasks: list[Task], steps: int) -> tuple[list, float, float]:
    """Each step's (first start, last end), the makespan, and the steady-state seconds per step: between the
    ends of the later half of the steps (two steps: their ends; one step: the makespan). A pipeline of steps
    (asynchronous rollout) warms up — its first generations start at once — so averaging from the first step
    would price it low; a synchronous job's steps are alike and any window gives the same figure."""
    spans = []
    for k in range(steps):
        ts = [t for t in tasks if t.step == k]
        spans.append((min(t.start for t in ts), max(t.end for t in ts)))
    makespan = max(t.end for t in tasks) if tasks else 0.0
    first = min(steps // 2, steps - 2)
    step_time = (spans[-1][1] - spans[first][1]) / (steps - 1 - first) if steps > 1 else makespan
    return spans, makespan, step_time


def _intervals(t: Task) -> list[tuple[float, float]]:
    """The intervals ``t`` runs in: its chunks', else its own."""
    return [(a, b) for a, b, _ in t.chunks] if t.chunks else [(t.start, t.end)]


def _device_stats(cm: CostModel, module: Module, tasks: list[Task], costs: dict, window,
                  core_busy: list | None = None) -> list[DeviceStats]:
    c = module.cluster
    n = c.nodes * c.per_node
    static = resident_bytes(module, costs, n, cm)
    lo, hi = window
    span = max(hi - lo, 1e-12)
    out = []
    runs = [(t, a, b) for t in tasks for a, b in _runs(t.resources, n)]   # contiguous device ranges per task
    cuts = sorted({0, n} | {x for _, a, b in runs for x in (a, b)})
    per_dev_tasks: list[list[Task]] = [None] * n   # every device lies between two cuts: all set below
    for x, y in zip(cuts, cuts[1:]):   # devices between two cuts run the same tasks, in task order
        if x < y:
            shared = [t for t, a, b in runs if a <= x and y <= b]
            for d in range(x, y):
                per_dev_tasks[d] = shared
    capacity = cm.spec.memory
    every = _events(tasks)   # sorted once; each group of devices takes its tasks' subsequence
    by_core: dict[int, float] = {}
    for a, b, core, share in core_busy or ():   # processor sharing: the core-seconds each task got of a core
        by_core[core] = by_core.get(core, 0.0) + share * max(0.0, min(b, hi) - max(a, lo))
    seen: dict[int, tuple] = {}   # devices running the same tasks have the same busy time and peak
    bases: dict[int, float] = {}
    for d in range(n):
        mine = per_dev_tasks[d]
        sig = id(mine)
        if sig not in seen:
            busy = 0.0
            if core_busy is None:
                for t in mine:
                    for a, b in _intervals(t):
                        busy += max(0.0, min(b, hi) - max(a, lo))
            seen[sig] = (busy, _peak_overlap(mine, every))
        busy, (peak_extra, at_peak) = seen[sig]
        if core_busy is not None:
            busy = by_core.get(d, 0.0)
        held = static[d]
        if id(held) not in bases:   # devices of a run share their resident dict
            bases[id(held)] = sum(held.values())
        base = bases[id(held)]
        out.append(DeviceStats(d, d // c.per_node, busy, min(1.0, busy / span), base + peak_extra, capacity,
                               static[d], at_peak))
    return out


def resident_bytes(module: Module, costs: dict, n: int, cm: CostModel | None = None) -> list[dict]:
    """What stays on each of ``n`` devices for the whole run: ``{"@actor weights": bytes, "@actor
    grads+optimizer": bytes}`` (the larger shard when a model has two layouts there), and with ``cm``, a
    vLLM engine's resident bytes on its generate stages' devices (``"@actor vllm engine"``:
    :meth:`rlhfc.cost.model.CostModel.engine_bytes`). Devices covered by the same stages share one dict (computed once
    per run of such devices; read it, do not change it)."""
    spans = [(costs[s.name].layout, s.target, costs[s.name]) for s in module.graph.stages
             if costs[s.name].layout is not None and s.target in module.models]
    engines = {}
    if cm is not None:
        for s in module.graph.stages:
            if s.op == "generate" and s.target in module.models and costs[s.name].layout is not None \
                    and cm.own_weights(s):
                held = cm.engine_bytes(module.models[s.target])["resident"]
                if held:
                    engines[s.name] = (costs[s.name].layout, f"@{s.target} vllm engine", held)
    cuts = sorted({0, n} | {min(max(x, 0), n) for lay, _, _ in spans for x in (lay.first, lay.first + lay.count)})
    out: list[dict] = [{}] * n
    for lo, hi in zip(cuts, cuts[1:]):
        if lo >= hi:
            continue
        held: dict = {}
        for lay, target, cost in spans:
            if lay.first <= lo and hi <= lay.first + lay.count:
                key = f"@{target} weights"
                held[key] = max(held.get(key, 0.0), cost.weights_bytes)
                if cost.state_bytes:
                    skey = f"@{target} grads+optimizer"
                    held[skey] = max(held.get(skey, 0.0), cost.state_bytes)
        for lay, key, nbytes in engines.values():
            if lay.first <= lo and hi <= lay.first + lay.count:
                held[key] = max(held.get(key, 0.0), nbytes)
        out[lo:hi] = [held] * (hi - lo)
    return out


def _events(tasks: list[Task]) -> list[tuple]:
    """Every task's (start, 1, task) and (end, 0, task) per interval it runs, in time order (ends first). An
    interval that takes no time holds nothing (its end would sort before its start)."""
    events = []
    for t in tasks:
        for a, b in _intervals(t):
            if b <= a:
                continue
            events.append((a, 1, t))
            events.append((b, 0, t))
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def _peak_overlap(tasks: list[Task], events: list | None = None) -> tuple[float, list[str]]:
    """Largest sum of transient bytes of tasks running at the same time on a device, and which ones.
    ``events``: :func:`_events` of a superset of ``tasks`` (the subsequence of a stable sort is the same)."""
    if events is None:
        events = _events(tasks)
    else:
        mine = {id(t) for t in tasks}
        events = [e for e in events if id(e[2]) in mine]
    running: dict[int, Task] = {}
    best, names, approx = 0.0, [], 0.0
    for _, kind, t in events:
        if kind:
            if id(t) not in running:
                approx += t.transient_bytes
            running[id(t)] = t
            if approx >= best * (1 - 1e-9):   # a running sum to skip; the peak itself summed afresh (exact)
                total = sum(x.transient_bytes for x in running.values())
                if total > best:
                    best, names = total, [f"%{x.stage}@{x.step}" for x in running.values()]
        elif running.pop(id(t), None) is not None:
            approx -= t.transient_bytes
    return best, names


def critical_path(result: SimResult) -> list[Task]:
    """Tasks from the first to the last finishing one, following what made each start when it did."""
    by_key = {(t.stage, t.step): t for t in result.tasks}
    if not result.tasks:
        return []
    cur = max(result.tasks, key=lambda t: (t.end, t.step))
    path = [cur]
    seen = {id(cur)}
    while cur.waits_for:
        nxt = None
        if cur.waits_for.startswith("%"):
            name, _, step = cur.waits_for[1:].partition("@")
            nxt = by_key.get((name, int(step)))
        elif cur.waits_for == "devices":
            cands = [t for t in result.tasks if t is not cur and t.end <= cur.start + 1e-12 and t.devices and
                     cur.devices and _overlaps(t.devices, cur.devices)]
            nxt = max(cands, key=lambda t: t.end, default=None)
        elif cur.waits_for == "barrier":
            prev = [t for t in result.tasks if t.step == cur.step - 1]
            nxt = max(prev, key=lambda t: t.end, default=None)
        if nxt is None or id(nxt) in seen:
            break
        path.append(nxt)
        seen.add(id(nxt))
        cur = nxt
    return path[::-1]


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def bottleneck(result: SimResult) -> dict:
    """The stage that costs the steady-state step the most time, why, and what could help."""
    last = result.steps - 1
    on_path = [t for t in result.critical_path if t.step == last] or result.step_tasks()
    if not on_path:
        return {}
    worst = max(on_path, key=lambda t: t.duration)
    cost = result.costs[worst.stage]
    share = worst.duration / result.step_time_s if result.step_time_s > 0 else 0.0
    advice = {
        "generate": {"memory": "decoding is memory-bandwidth bound: a larger batch per replica, fewer tp ranks or "
                               "streaming chunks to the forwards (stream) overlap it",
                     "overhead": "decoding pays per-token overhead: larger batches amortise it; streaming "
                                 "(stream) and overcommitment (overcommit) cut the long tail",
                     "compute": "generation is compute bound: give it more devices (mesh/parallel)",
                     "comm": "tensor-parallel all-reduces dominate decoding: use a smaller tp and more dp"},
        "forward": {"compute": "overlap the forwards on disjoint devices (overlap) or give them more devices",
                    "memory": "the forward re-reads the weights per micro-batch: use fewer, larger micro-batches",
                    "overhead": "fixed per-call overhead dominates: batch the forwards together (overlap)",
                    "comm": "communication dominates: use a smaller tp"},
        "train": {"compute": "training is compute bound: more devices (data parallel) or train actor and critic "
                             "concurrently on disjoint meshes",
                  "memory": "optimizer/weight traffic dominates: larger minibatches",
                  "overhead": "fixed per-step cost dominates: fewer, larger minibatches",
                  "comm": "gradient/tensor-parallel traffic dominates: keep tp inside a node, fewer dp ranks"},
    }
    family = worst.op.split(".", 1)[0]
    hint = advice.get(family, {}).get(cost.bound, "")
    if not hint and family in ("compute", "load"):
        hint = "a driver-side stage: it is cheap unless the batch is huge"
    if worst.sync_s and worst.sync_s > 0.25 * worst.duration:
        hint = "weight reallocation before it dominates: insert a bucketed sync stage or keep the layouts equal"
    return {"stage": worst.stage, "op": worst.op, "model": worst.model, "seconds": worst.duration,
            "share": share, "bound": cost.bound, "hint": hint}
