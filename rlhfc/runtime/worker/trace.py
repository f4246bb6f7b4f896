"""The measured timeline of a run (``rlhfc run --trace``): ``OUT/trace.json``, Chrome trace events.

The file opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``. Its layout (``rlhfc explain
--format trace`` writes the predicted timeline in the same layout, so the two open side by side):

* ``pid 1`` **driver**: ``tid 1`` *steps* (one span per step), ``tid 2`` *driver stages* (the
  driver-side ``compute`` stages), ``tid 3`` *waits* (the driver blocked on a remote stage; category
  ``wait``, measured only);
* ``pid 2`` **syncs**: one ``tid`` per ``sync`` stage (the weight transfer, driver-timed, with bytes and
  buckets);
* ``pid 10 + i`` **worker** ``i`` of ``plan.json``'s ``placement.workers`` (its name): one ``tid`` per
  rank (``rank r · pid P``). A span is one stage call as the worker ran it: a streamed forward runs once
  per chunk, so it has one span per chunk.

Every span is a complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds from the start of the
first step); its ``name`` is the stage, ``cat`` the op family and ``args`` hold ``stage``, ``op``,
``step``, ``rows``, ``tokens`` (prompt + response tokens of the rows) and, for worker calls, ``method``,
``threads``, ``cpu_ms`` (the CPU time of the thread that ran the call), ``runq_ms`` (the time that thread
waited for a core, Linux only: a span's wall time is about ``cpu_ms + runq_ms``, plus ``yield_ms``, the
time a streamed call was suspended at its chunks' hand-over to Ray). A step's span also holds ``load1``,
the machine's 1-minute load average as it ended (other processes competing for the cores make every stage
slower than the profile measured).
``otherData`` holds ``module``, ``kind`` (``measured``), ``job`` (the job folder) and ``cores`` (the
driver machine's).

Workers time their own calls (:func:`recorded`, applied by :func:`rlhfc.runtime.worker.stages.stage_call`)
once the driver switched tracing on (:meth:`TracedWorker.trace_start`); the driver drains them after each
step (:meth:`Timeline.collect`) and names each call's stage by its Ray task id (the ``ObjectRef`` the
driver waited on); a call on a multi-rank group, whose ranks' task ids the driver never sees, is named by
its model and method when a single stage of the plan matches.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from rlhfc.contract.plan import Plan

#: the op family each worker method runs
METHOD_OPS = {"generate": "generate", "generate_chunks": "generate", "logprobs": "forward.logprobs",
              "values": "forward.values", "score": "forward.score", "train": "train"}
DRIVER_PID, SYNC_PID, WORKER_PID0 = 1, 2, 10
STEPS_TID, DRIVER_TID, WAIT_TID = 1, 2, 3


def work_of(value: Any) -> dict[str, int]:
    """``rows`` and ``tokens`` (prompt + response tokens) of what a stage consumed or produced."""
    roll = getattr(value, "rollout", None) or value
    batch = getattr(roll, "batch", None)
    if batch is not None and hasattr(batch, "response_lengths"):
        return {"rows": int(batch.response_lengths.numel()),
                "tokens": int(batch.prompt_lengths.sum()) + int(batch.response_lengths.sum())}
    mask = getattr(value, "mask", None)
    if mask is not None and hasattr(mask, "sum") and getattr(mask, "dim", lambda: 0)() == 2:
        return {"rows": int(mask.shape[0]), "tokens": int(mask.sum())}
    if isinstance(value, (list, tuple)) and value and all(isinstance(x, str) for x in value):
        return {"rows": len(value)}
    if isinstance(value, tuple) and value:   # several outputs (gae: advantages, returns): the first's rows
        return work_of(value[0])
    shape = getattr(value, "shape", None)
    return {"rows": int(shape[0])} if shape is not None and len(shape) >= 1 else {}


def _task_id() -> str | None:
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():   # a worker used in-process: asking would start Ray
        return None
    try:
        return ray.get_runtime_context().get_task_id()
    except Exception:   # not inside a Ray task
        return None


class TracedWorker:
    """What a worker adds for the timeline: the driver switches recording on and drains the spans."""

    _trace: list | None = None
    _trace_depth: int = 0

    def trace_start(self) -> dict:
        """Start recording this worker's stage calls; answers its process id."""
        self._trace = []
        return {"pid": os.getpid()}

    def trace_spans(self) -> list[dict]:
        """The calls recorded since the last drain (and forget them)."""
        spans, self._trace = list(self._trace or []), ([] if self._trace is not None else None)
        return spans


def _usage() -> tuple[float, float | None]:
    """(this thread's CPU seconds, the seconds it waited runnable for a core: Linux's schedstat, else None)."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as fh:
            waited = int(fh.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        waited = None
    return time.thread_time(), waited


def _span(method: str, t0: float, t1: float, threads, work: dict, task: str | None, chunks=None,
          u0=None, yielded: float = 0.0) -> dict:
    out = {"method": method, "t0": t0, "t1": t1, "threads": threads, "task": task, **work}
    if chunks:
        out["chunks"] = chunks
    if u0 is not None:
        u1 = _usage()
        out["cpu_ms"] = round((u1[0] - u0[0]) * 1e3, 3)
        if u0[1] is not None and u1[1] is not None:
            out["runq_ms"] = round((u1[1] - u0[1]) * 1e3, 3)
    if yielded:
        out["yield_ms"] = round(yielded * 1e3, 3)
    return out


def recorded(fn, method: str, generator: bool):
    """Wrap a worker's stage method so that, while tracing, each outermost call is recorded as a span
    (a subclass's stage method calling its parent's counts once)."""
    if generator:
        def wrapper(self, *args, threads=None, **kwargs):
            if getattr(self, "_trace", None) is None or getattr(self, "_trace_depth", 0):
                yield from fn(self, *args, threads=threads, **kwargs)
                return
            self._trace_depth = getattr(self, "_trace_depth", 0) + 1
            t0, task, rows, tokens, chunks, u0, yielded = time.time(), _task_id(), 0, 0, [], _usage(), 0.0
            try:
                for item in fn(self, *args, threads=threads, **kwargs):
                    w = work_of(item)
                    rows, tokens = rows + w.get("rows", 0), tokens + w.get("tokens", 0)
                    if w:
                        chunks.append([time.time(), w.get("rows", 0)])
                    y0 = time.perf_counter()
                    yield item
                    yielded += time.perf_counter() - y0
            finally:
                self._trace_depth -= 1
            if self._trace is not None:
                self._trace.append(_span(method, t0, time.time(), threads or getattr(self, "threads", None),
                                         {"rows": rows, "tokens": tokens}, task, chunks, u0, yielded))
        return wrapper

    def wrapper(self, *args, threads=None, **kwargs):
        if getattr(self, "_trace", None) is None or getattr(self, "_trace_depth", 0):
            return fn(self, *args, threads=threads, **kwargs)
        self._trace_depth = getattr(self, "_trace_depth", 0) + 1
        t0, u0 = time.time(), _usage()
        try:
            out = fn(self, *args, threads=threads, **kwargs)
        finally:
            self._trace_depth -= 1
        t1 = time.time()
        work = work_of(out) if method.startswith("generate") else work_of(args[0] if args else None)
        ops = self.__dict__.pop("_span_ops", None)   # a fused training's operations (rlhfc.runtime.train.fused)
        if self._trace is not None:
            self._trace.append(_span(method, t0, t1, threads or getattr(self, "threads", None), work, _task_id(),
                                     u0=u0))
            if ops:
                self._trace[-1]["ops"] = ops
        return out
    return wrapper


class Timeline:
    """The driver side of ``--trace``: driver and sync spans, the workers' spans, written as trace.json."""

    def __init__(self, out: str, plan: Plan, job_dir: str):
        self.path = os.path.join(out, "trace.json")
        self.plan = plan
        self.job_dir = job_dir
        self.origin = time.time()
        self.clock = time.time() - time.perf_counter()   # perf_counter -> wall clock
        self.events: list[dict] = []
        self.tasks: dict[str, str] = {}   # Ray task id -> stage
        self.step = 0
        names = list(plan.placement.workers)
        self.pid = {name: WORKER_PID0 + i for i, name in enumerate(names)}
        stages = plan.graph.stages
        self.syncs = [s.name for s in stages if s.op == "sync"]
        self.ops = {s.name: s.op for s in stages}
        self.by_method: dict[tuple[str, str], list[str]] = {}
        for s in stages:
            for method, op in METHOD_OPS.items():
                if s.op == op and s.target:
                    self.by_method.setdefault((s.target, method), []).append(s.name)
        self.ranks_named: set = set()
        self.collect_s = 0.0   # driver seconds spent draining the workers' spans between steps (not a step's)

    # -- the driver's events ----------------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 1)

    def span(self, pid: int, tid: int, name: str, cat: str, t0: float, t1: float, args: dict) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": self._us(t0),
                            "dur": round(max(t1 - t0, 0.0) * 1e6, 1), "args": {"step": self.step, **args}})

    def driver(self, stage: str, t0_perf: float, kind: str, ref=None, value=None, extra: dict | None = None) -> None:
        """A driver-timed stage: ``kind`` ``wait`` (on a remote stage; ``ref`` names its task), ``compute``
        or ``sync``; ``t0_perf`` is the ``time.perf_counter()`` it started at."""
        t0, t1 = t0_perf + self.clock, time.time()
        if ref is not None:
            try:
                self.tasks[ref.task_id().hex()] = stage
            except Exception:   # not an ObjectRef
                pass
        op = self.ops.get(stage, "")
        if kind == "sync":
            tid = self.syncs.index(stage) + 1 if stage in self.syncs else len(self.syncs) + 1
            self.span(SYNC_PID, tid, stage, "sync", t0, t1, {"stage": stage, "op": op, **(extra or {})})
        elif kind == "compute":
            self.span(DRIVER_PID, DRIVER_TID, stage, op.split(".", 1)[0] or "compute", t0, t1,
                      {"stage": stage, "op": op, **work_of(value)})
        else:
            self.span(DRIVER_PID, WAIT_TID, f"wait {stage}", "wait", t0, t1, {"stage": stage, "op": op})

    def begin_step(self, step: int) -> float:
        self.step = step
        return time.time()

    def end_step(self, step: int, t0: float, workers: dict, end: float | None = None) -> None:
        """The step's span (from ``t0`` to ``end``, wall clock; default now), and the spans the workers
        recorded during it."""
        try:   # the machine's load: what else competed for its cores (other jobs' processes too)
            load = {"load1": round(os.getloadavg()[0], 2)}
        except (OSError, AttributeError):
            load = {}
        self.span(DRIVER_PID, STEPS_TID, f"step {step}", "step", t0, time.time() if end is None else end, load)
        t = time.perf_counter()
        self.collect(workers)
        self.collect_s += time.perf_counter() - t

    # -- the workers' spans -----------------------------------------------------------------------
    def start(self, workers: dict, resumed_at: int | None = None) -> None:
        """Switch recording on in every rank of every worker group; on resume (``resumed_at``: the
        checkpoint's step) keep the earlier session's spans of the steps before it."""
        import ray

        self.origin = time.time()   # times count from the first step of the run
        if resumed_at is not None:
            self.resume(resumed_at)

        for name, group in workers.items():
            answers = ray.get([rank.trace_start.remote() for rank in group.ranks])
            for r, a in enumerate(answers):
                self._name_thread(self.pid.get(name, WORKER_PID0 + len(self.pid)), r, f"rank {r} · pid {a['pid']}")

    def collect(self, workers: dict) -> None:
        import ray

        for name, group in workers.items():
            model = getattr(group, "model", name)
            for r, spans in enumerate(ray.get([rank.trace_spans.remote() for rank in group.ranks])):
                for sp in spans:
                    stage = self.tasks.get(sp.get("task") or "") or self._guess(model, sp["method"])
                    args = {"stage": stage, "op": self.ops.get(stage, METHOD_OPS.get(sp["method"], "")),
                            "method": sp["method"], "threads": sp.get("threads"),
                            **{k: sp[k] for k in ("rows", "tokens", "cpu_ms", "runq_ms", "yield_ms")
                               if k in sp}}
                    if sp.get("chunks"):
                        args["chunks"] = [[round((t - sp["t0"]) * 1e3, 3), n] for t, n in sp["chunks"]]
                    self.span(self.pid.get(name, WORKER_PID0), r, stage, args["op"].split(".", 1)[0] or "call",
                              sp["t0"], sp["t1"], args)
                    for kind, micro, call, t0, t1 in sp.get("ops") or ():   # a fused training's steps, nested
                        self.span(self.pid.get(name, WORKER_PID0), r, f"{stage} {kind}{micro}", "fused", t0, t1,
                                  {"stage": stage, "fused": kind, "micro": micro, "schedule": call})

    def _guess(self, model: str, method: str) -> str:
        found = self.by_method.get((model, method), [])
        return found[0] if len(found) == 1 else f"?{method}"

    # -- the file ---------------------------------------------------------------------------------
    def _name_thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self.ranks_named:
            self.ranks_named.add((pid, tid))
            self.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})

    def resume(self, upto: int) -> None:
        """On resume: keep the spans of steps before ``upto`` from the earlier session's trace.json, and its
        origin (this session's spans come after them on the same clock)."""
        try:
            with open(self.path, encoding="utf-8") as fh:
                old = json.load(fh)
            origin = float(old["otherData"]["origin"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        self.origin = origin
        self.events[:0] = [e for e in old.get("traceEvents", [])
                           if e.get("ph") == "X" and e.get("args", {}).get("step", upto) < upto]

    def write(self) -> None:
        meta = [*process_names({pid: name for name, pid in self.pid.items()}, bool(self.syncs)),
                {"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": WAIT_TID, "args": {"name": "waits"}},
                *[{"name": "thread_name", "ph": "M", "pid": SYNC_PID, "tid": i + 1, "args": {"name": s}}
                  for i, s in enumerate(self.syncs)]]
        doc = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
               "otherData": {"module": self.plan.module, "kind": "measured", "job": self.job_dir,
                             "origin": self.origin, "cores": os.cpu_count(),
                             "collect_s": round(self.collect_s, 6)}}
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
        os.replace(tmp, self.path)


def process_names(workers: dict[int, str], syncs: bool) -> list[dict]:
    """The metadata events naming the driver's, the syncs' and the workers' tracks (both timelines)."""
    out = [{"name": "process_name", "ph": "M", "pid": DRIVER_PID, "args": {"name": "driver"}},
           {"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": STEPS_TID, "args": {"name": "steps"}},
           {"name": "thread_name", "ph": "M", "pid": DRIVER_PID, "tid": DRIVER_TID, "args": {"name": "driver stages"}}]
    if syncs:
        out.append({"name": "process_name", "ph": "M", "pid": SYNC_PID, "args": {"name": "syncs"}})
    for pid, name in sorted(workers.items()):
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"worker {name}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
    return out
