"""The schedule of one step: which stages the driver launches when, what it awaits, what streams to what.

It is built once from the annotated IR and has two readers: code generation
emits it as the driver's ``step`` function (``rlhfc.codegen``) and the
simulator prices it (``rlhfc.cost.simulator``) — as torch.fx's ``CodeGen`` and
``Interpreter`` walk the same graph — so the two cannot disagree about the order
stages run in.

The driver runs the stages in graph order, one line each:

- ``load`` — draws prompts on the driver;
- ``remote`` — a call on a model's worker group; the driver waits for it at once
  (``job.get``), unless the stage is in an ``overlap`` group: then it launches a
  future and goes on (``future``), and awaits it where a driver-side stage first
  needs it (``awaits``) or at the end of the step;
- ``compute`` — a driver-side ``compute.*`` op, after awaiting the futures it reads;
- ``stream`` — a streamed and/or overcommitted generate: one blocking call that also
  runs its ``consumers`` chunk by chunk (``in_stream``, their ``source`` is the
  generate) and, when overcommitted, draws its prompts itself (the ``load`` feeding
  it is ``in_stream`` too, with no ``source``);
- ``ahead`` — a generate under asynchronous rollout (``run { staleness = K }``, the ``async_rollout`` pass):
  the driver takes this step's rollout from the generations it launched up to K steps earlier and launches
  the next ones, drawing their prompts itself (the ``load`` feeding it is ``in_stream``, with no ``source``);
  blocking for this step's rollout only;
- ``sync`` — a blocking weight transfer to another mesh, after awaiting the train
  stage whose weights it sends (under asynchronous rollout the receiving side is not awaited: it takes the
  weights between generations).

``after`` is what the driver has already waited for when it launches a stage:
nothing launched later can start before those have finished. A worker runs its
calls in the order they were launched (Ray actor queues).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.contract.engines import rollout_traits

from . import plan
from .core import Module, Stage


@dataclass(frozen=True)
class Entry:
    """How the driver runs one stage (see the module docstring)."""

    stage: Stage
    kind: str
    future: bool = False
    awaits: tuple[str, ...] = ()        # value names awaited right before this line (futures it reads)
    after: frozenset = frozenset()      # stage names the driver has waited for when it launches this one
    group: int | None = None
    within: str | None = None           # in_stream: the streamed generate whose call runs this stage
    source: str | None = None           # in_stream consumers: the generate whose chunks they take
    consumers: tuple[str, ...] = ()     # stream: the stages computed chunk by chunk inside it

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass(frozen=True)
class Refill:
    """DAPO's dynamic sampling with refill (``group_advantages(filter_groups = true, max_refill = K)``).

    The driver runs the stages of one sampling ``round`` — from drawing prompts to the filtering stage
    ``filter`` — again, on the next prompts, until ``groups`` groups with unequal scores are in hand or
    ``1 + max_refill`` rounds have run; the step's later stages see the first ``groups`` kept groups
    (``group`` samples each). ``round`` is in schedule order: the stages that descend from the prompts and
    lead to ``filter``, and those a streamed generate of the round computes inside its call.
    """

    filter: str
    round: tuple[str, ...]
    groups: int
    group: int
    max_refill: int

    @property
    def max_rounds(self) -> int:
        return 1 + self.max_refill


@dataclass
class Schedule:
    """The step's entries in launch (graph) order, the futures resolved at the end of the step, and the
    sampling round that dynamic sampling repeats (``refill``, None when no stage refills)."""

    entries: list[Entry]
    at_end: tuple[str, ...] = ()
    by_name: dict = field(default_factory=dict)
    refill: Refill | None = None
    _order: list | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.by_name = {e.name: e for e in self.entries}

    def __getitem__(self, stage: str) -> Entry:
        return self.by_name[stage]

    def launch_order(self) -> list[Entry]:
        """The entries in the order the driver launches them: a stage inside a stream goes with it (the
        load it draws just before, its consumers just after), everything else in graph order."""
        if self._order is not None:   # the entries do not change once built; the simulator asks per stage
            return list(self._order)
        out = []
        for e in self.entries:
            if e.kind == "in_stream":
                continue
            out += [x for x in self.entries if x.within == e.name and x.source is None]
            out.append(e)
            out += [self.by_name[c] for c in e.consumers]
        self._order = out
        return list(out)

    def launch_deps(self, stage: str) -> list[str]:
        """Stages that must have finished before ``stage`` can start because of the driver's order, in
        launch order (data and weight-version dependencies come on top)."""
        e = self.by_name[stage]
        if self._order is None:
            self.launch_order()
        return [x.name for x in self._order if x.name in e.after]


def build_schedule(module: Module) -> Schedule:
    """The schedule of ``module``'s step (see the module docstring)."""
    g = module.graph
    done: set[str] = set()            # stages the driver has waited for
    pending: dict[str, str] = {}      # value name -> stage, for launched futures not yet awaited
    inside: dict[str, str] = {}       # stage -> the streamed generate that runs it
    for s in g.stages:
        if plan.streams(s):
            for c in plan.stream_consumers(g, s):
                inside[c.name] = s.name
            if plan.overcommit(s) is not None:
                load = g.producer(s.inputs[0])
                if load.op == "load" and all(plan.overcommit(u) is not None for u in g.users(load.outputs[0])):
                    inside[load.name] = s.name
        elif plan.async_rollout(module, s) is not None and s.inputs:
            load = g.producer(s.inputs[0])
            if load.op == "load" and len(g.users(load.outputs[0])) == 1:
                inside[load.name] = s.name
    entries: list[Entry] = []
    for s in g.stages:
        group = plan.overlap_group(s)
        if s.name in inside:
            src = inside[s.name] if s.op != "load" else None
            entries.append(Entry(s, "in_stream", group=group, within=inside[s.name], source=src))
            continue
        if s.op == "load":
            entries.append(Entry(s, "load", after=frozenset(done), group=group))
            done.add(s.name)
        elif plan.async_rollout(module, s) is not None:
            entries.append(Entry(s, "ahead", after=frozenset(done), group=group))
            done.update((s.name, *(n for n, src in inside.items() if src == s.name)))
        elif plan.streams(s):
            consumers = tuple(c.name for c in plan.stream_consumers(g, s))
            entries.append(Entry(s, "stream", after=frozenset(done), group=group, consumers=consumers))
            done.update((s.name, *consumers, *(n for n, src in inside.items() if src == s.name)))
        elif s.op == "sync":   # awaits the train stage whose weights it sends
            needed = tuple(v.name for v in s.inputs if v.name in pending)
            done.update(pending.pop(n) for n in needed)
            entries.append(Entry(s, "sync", awaits=needed, after=frozenset(done), group=group))
            if not plan.generates_ahead(module, s.target):
                done.add(s.name)   # under asynchronous rollout the copy's side is not awaited
        elif plan.on_worker(module, s):
            future = group is not None
            entries.append(Entry(s, "remote", future=future, after=frozenset(done), group=group))
            if future:
                pending.update((v.name, s.name) for v in s.outputs)
            else:
                done.add(s.name)
        else:
            needed = tuple(v.name for v in s.inputs if v.name in pending)
            for n in needed:
                done.add(pending.pop(n))
            entries.append(Entry(s, "compute", awaits=needed, after=frozenset(done), group=group))
            done.add(s.name)
    launched = {e.name: e.after for e in entries if e.kind in ("stream", "ahead")}
    entries = [Entry(e.stage, e.kind, group=e.group, within=e.within, source=e.source, after=launched[e.within])
               if e.kind == "in_stream" else e for e in entries]   # a stage inside a stream launches with it
    return Schedule(entries, tuple(pending), refill=_refill(module, entries))


def _refill(module: Module, entries: list[Entry]) -> Refill | None:
    """The sampling round of a refilling ``group_advantages`` (see :class:`Refill`); None when none refills."""
    g = module.graph
    stage = next((s for s in g.stages if s.op == "compute.group_advantages" and s.attrs.get("max_refill")), None)
    if stage is None:
        return None
    ancestors, todo = set(), [stage]
    while todo:
        s = todo.pop()
        if s.name not in ancestors:
            ancestors.add(s.name)
            todo += [g.producer(v) for v in s.inputs]
    loads = [g.stage(n) for n in ancestors if g.stage(n).op == "load"]
    below, todo = set(), list(loads)
    while todo:
        s = todo.pop()
        if s.name not in below:
            below.add(s.name)
            todo += [u for v in s.outputs for u in g.users(v)]
    members = ancestors & below
    members |= {e.name for e in entries if e.kind == "in_stream" and e.within in members}
    groups = sum(int(s.attrs["batch"]) for s in loads)
    return Refill(stage.name, tuple(e.name for e in entries if e.name in members), groups,
                  int(stage.attrs.get("group", 1)), int(stage.attrs["max_refill"]))


def stage_threads(module: Module, schedule: Schedule | None = None) -> dict[str, int]:
    """Torch threads each worker stage runs with on a CPU cluster — cores follow the work.

    A stage gets its worker's threads (one per core of its mesh) divided among the workers that may run on
    some of the same cores at the same time: those of the stages neither side of the schedule has awaited
    before launching the other (an overlap group's members, a stream's generate and its consumers, a
    future still in flight), and a generate running ahead (asynchronous rollout) with every stage of another
    worker. A stage the driver runs alone — every stage at -O0 — gets all its cores,
    unless the ``threads`` pass marked it ``threads = N`` (fewer measured faster): then at most N.
    Multi-rank groups keep one thread per rank. The runtime applies it per call (``threads=`` on the
    call, when fewer than the worker's own) and the simulator prices the same numbers. Empty on GPUs."""
    if module.cluster.device != "cpu":
        return {}
    out = {}
    for e, w, beside in _concurrent(module, schedule or build_schedule(module)):
        mine = set(w.devices)
        beside = {v.name for v in beside if mine & set(v.devices)}
        out[e.name] = w.threads if w.ranks > 1 else max(1, w.threads // (1 + len(beside)))
        cap = plan.threads_cap(e.stage)   # the threads pass: fewer measured faster
        if cap is not None and w.ranks == 1:
            out[e.name] = min(out[e.name], cap)
    return out


def _concurrent(module: Module, schedule: Schedule) -> list[tuple[Entry, "plan.Worker", list]]:
    """Each worker stage of the schedule, its worker, and the other workers whose stages may run at the same
    time as it: those of the stages neither side of the schedule has awaited before launching the other (an
    overlap group's members, a stream's generate and its consumers, a future still in flight), and for a
    generate running ahead (asynchronous rollout) every stage of another worker."""
    ws = plan.workers(module)
    on = [(e, ws[plan.worker_key(module, e.stage)]) for e in schedule.launch_order()
          if e.kind in ("remote", "stream", "in_stream", "ahead") and plan.on_worker(module, e.stage)]
    return [(e, w, [v for f, v in on if v.name != w.name
                    and ((f.name not in e.after and e.name not in f.after) or "ahead" in (e.kind, f.kind))])
            for e, w in on]


def concurrent_workers(module: Module, schedule: Schedule | None = None) -> set[frozenset[str]]:
    """The pairs of workers (by name) some of whose stages may run at the same time in a step (see
    :func:`_concurrent`): at -O0, where the driver awaits every stage before the next, none."""
    return {frozenset((w.name, v.name)) for _, w, beside in _concurrent(module, schedule or build_schedule(module))
            for v in beside}


def shared_processes(module: Module, placed: dict) -> dict:
    """Which workers share a process (:mod:`rlhfc.runtime.worker.host`): on a CPU cluster, the one-process
    workers on the same cores with the same threads, whose train backend and rollout engine both may share one
    (their traits' ``shares_process``), with no dropout (it draws from the process's random generator) and
    no collective weight sync (its two ranks would be one process) — and whose stages never run at the same
    time (:func:`concurrent_workers`: at -O0 none do; -O2's streamed and parallel
    forwards, training launched together, a generate running ahead do). Each worker process costs a start-up
    (importing torch and transformers: ~8 CPU-seconds on the 2-core VM of docs/benchmarks.md), a shared
    process pays it once; but stages running at the same time in one process share its Python interpreter:
    measured at -O2 on the wide point of benchmarks/throughput.py, its steps took 5.38 s shared against
    4.67 s on a process each (15 % slower), so such workers keep their own.
    Answers ``{(model, mesh): process name}`` for the workers that share one (at least two per process); the
    name is the hosted workers' names joined by ``+``. ``run { processes = own }`` keeps a process per worker;
    so do GPU clusters (untested on CUDA here; docs/runtime.md)."""
    if module.cluster.device != "cpu" or module.run.processes == "own":
        return {}
    collective = {s.target for s in module.graph.stages
                  if (sy := plan.Sync.of(s)) is not None and sy.transport == "collective"}
    groups: dict[tuple, list] = {}
    for key, w in placed.items():
        m = module.models[w.model]
        if (w.ranks == 1 and not m.dropout and w.model not in collective
                and plan.backend_traits(w.trainer).shares_process
                and rollout_traits(plan.model_engine(module, w.model)).shares_process):
            groups.setdefault((w.node, tuple(w.cores), w.threads), []).append(key)
    together = concurrent_workers(module)
    out = {}
    for keys in groups.values():
        processes: list[list] = []   # greedily: each worker joins the first process where none runs beside it
        for k in keys:
            home = next((p for p in processes if all(frozenset((placed[k].name, placed[o].name)) not in together
                                                     for o in p)), None)
            (home.append(k) if home is not None else processes.append([k]))
        for p in processes:
            if len(p) > 1:
                name = "+".join(placed[k].name for k in p)
                out.update({k: name for k in p})
    return out


__all__ = ["Entry", "Refill", "Schedule", "build_schedule", "concurrent_workers", "shared_processes",
           "stage_threads"]
