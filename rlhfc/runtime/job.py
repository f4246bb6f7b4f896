"""Run a compiled job: the driver the generated ``main.py`` calls, and its command line.

Why this file is long: it is one idea, the driver's side of a running job (every call the generated ``step``
makes, the step loop, the command line).

A job folder holds ``main.py`` (the generated driver: a ``step(job, w)`` function)
and ``plan.json`` (everything the compiler decided). ``python job/main.py``
calls :func:`main`, which needs only this package — no compiler code.

The runtime around one job, by concern:

* ``job``         (here) :class:`Job`: what ``step`` calls (``get``/``wait``/``resolve``/``stream``/
                  ``sync``/``reshard``/``compute``/``next_prompts``), naming the stage when one fails; the
                  step loop; :func:`run_job` and :func:`main`.
* ``cluster``     start or connect to Ray, reserve the placement group, create the workers.
* ``group``       :class:`~rlhfc.runtime.driver.group.WorkerGroup`, the handle ``w.<worker>`` (its ranks called as one worker).
* ``checkpoint``  save / resume / latest, written atomically.
* ``metrics``     ``metrics.jsonl``, TensorBoard, the progress line and the end-of-run summary.

Run folder layout (``--out``, default ``runs/<module>``)::

    metrics.jsonl          one JSON object per step
    samples.jsonl          run { log_samples = N } samples per step: prompt, response, reward (samples.py)
    trace.json             with --trace: the measured timeline, Chrome trace events (trace.py)
    events.out.tfevents.*  TensorBoard scalars
    errors.log             remote tracebacks of failed stages
    checkpoints/step_K/    per model: weights.safetensors, state.safetensors, state.json; job.json
    checkpoints/latest     name of the newest complete checkpoint

Checkpoints are written to a temporary folder and renamed when complete, and
never deleted, so a crash never leaves a half checkpoint or loses an old one.
A new run refuses a folder holding an earlier run; ``--resume`` checks the
checkpoint's manifest against the job first. Ctrl-C stops the run (the last
complete checkpoint stays ``latest``), shuts Ray down, prints the command that
resumes it and exits with status 130.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

from rlhfc.contract.plan import Plan, PlanFormatError, load_plan
from rlhfc.contract.plugins import PluginError, import_plugin
from rlhfc.runtime.data.prompts import PromptSource, prompt_source_from_spec
from rlhfc.runtime.data.values import oldest_version
from rlhfc.runtime.driver import checkpoint
from rlhfc.runtime.driver.cluster import Cluster, check_local_gpus
from rlhfc.runtime.driver.cluster import import_ray as _ray
from rlhfc.runtime.driver.group import WorkerGroup
from rlhfc.runtime.driver.metrics import MetricsLog, Progress, model_ranks, step_metrics, summarize
from rlhfc.runtime.driver.samples import SampleLog
from rlhfc.runtime.worker.trace import Timeline

from . import rewards
from .errors import JobError
from .errors import out_of_memory as _out_of_memory

__all__ = ["Interrupted", "Job", "JobError", "WorkerGroup", "main", "run_job", "summarize"]


def import_plugins(plugins) -> None:
    """Import the plan's plugins in this process (a missing one is a :class:`JobError`)."""
    for spec in plugins:
        try:
            import_plugin(spec)
        except PluginError as exc:
            raise JobError(f"the job's plugin {spec}: {exc.message}", exc.hint) from None


class Interrupted(JobError):
    """The run was stopped by Ctrl-C (SIGINT); exit status 130."""

    exit_code = 130
    label = "interrupted"


class Job:
    """The driver-side state of a running job; the generated ``step`` function calls its methods."""

    def __init__(self, job_dir: str, out: str | None = None, steps: int | None = None, resume: bool = False,
                 ray_address: str | None = None, progress: bool = True, resume_command: list[str] | None = None,
                 trace: bool = False):
        self.job_dir = os.path.abspath(job_dir)
        try:
            self.plan: Plan = load_plan(os.path.join(self.job_dir, "plan.json"))
        except PlanFormatError as exc:
            raise JobError(exc.message, exc.hint) from None
        import_plugins(self.plan.plugins)
        check_local_gpus(self.plan, ray_address)
        run = self.plan.run
        if steps is not None and int(steps) < 1:
            raise JobError(f"steps must be at least 1, not {steps}",
                           "steps is the total number of steps to train (with --resume: including those "
                           "the checkpoint already trained)")
        self.steps = int(steps if steps is not None else run.steps)
        self.checkpoint_every = run.checkpoint_every
        self.seed = run.seed
        self.out = os.path.abspath(out or os.path.join("runs", self.plan.module))
        self.resume = resume
        self.ray_address = ray_address
        #: the command that resumes this run (printed on Ctrl-C and failures)
        self.resume_command = resume_command or [
            sys.executable, os.path.join(self.job_dir, "main.py"), "--resume", "--out", self.out,
            *(["--steps", str(self.steps)] if steps is not None else []),
            *(["--ray-address", ray_address] if ray_address else [])]
        self.step = 0   # the step running (or about to run)
        self.show_progress = progress
        self.data: dict[str, PromptSource] = {name: prompt_source_from_spec(d.as_spec())
                                              for name, d in self.plan.data.items()}
        for name, source in self.data.items():
            if source.truncated:
                print(f"note: data @{name}: {source.truncated} of {len(source)} prompts truncated "
                      f"({getattr(source, 'truncate', '?')}) to fit max_seq less max_new_tokens", file=sys.stderr)
        rewards.configure(self.plan.program_dir, self.plan.run.reward_modules)
        self.cluster: Cluster | None = None
        #: worker name -> its WorkerGroup (also ``self.handles.<name>``, the step function's ``w``)
        self.workers: dict[str, WorkerGroup] = {}
        self.worker_info: dict[str, dict] = {}
        self.pg = None
        self.collectives: dict[str, str] = {}   # sync stage -> collective backend of its two-rank group
        self.handles = SimpleNamespace()
        self.current_stage = ""
        self.last_checkpoint: str | None = None
        #: seconds the driver waited on each stage in the current step (reported as wait_s in metrics)
        self.stage_seconds: dict[str, float] = {}
        #: per overcommitted stage: {"delta": current Δ, "carry": unfinished samples (plain JSON)}
        self.overcommit: dict[str, dict] = {}
        #: per generate stage running ahead (asynchronous rollout): the generations launched for later steps,
        #: oldest first — {"step": the step that trains on it, "ref": its future, or "rollout": its result}
        self.in_flight: dict[str, list[dict]] = {}
        #: weight imports launched on a generating copy and not awaited (asynchronous rollout)
        self.pending_syncs: list[tuple[str, Any]] = []
        self.timeline = Timeline(self.out, self.plan, self.job_dir) if trace else None   # --trace
        self.value_to_stage = self.plan.graph.value_to_stage

    # -- called by the generated step function ---------------------------------------------------
    def next_prompts(self, data: str, batch: int) -> list[str]:
        return self.data[data].next_batch(batch)

    def tools(self, names: str) -> list[dict]:
        """The specs of the plan's tools ``names`` ("calc,search") for a multi-turn generate, each with its
        file's absolute path for the worker's sandbox (:meth:`_tool_file`)."""
        specs = []
        for name in [n for n in names.split(",") if n]:
            tool, path, fn = self._tool_file(name, "tool")
            specs.append({"name": name, "path": path, "function": fn, "timeout": tool.timeout,
                          "memory_mb": tool.memory_mb, "max_output": tool.max_output})
        return specs

    def env(self, name: str) -> dict:
        """The spec of the plan's environment ``name`` for a multi-turn generate (:meth:`_tool_file`)."""
        tool, path, cls = self._tool_file(name, "env")
        return {"name": name, "path": path, "cls": cls, "timeout": tool.timeout, "memory_mb": tool.memory_mb}

    def _tool_file(self, name: str, kind: str):
        """(the plan's tool or environment ``name``, its module's file, the function or class): the module found
        as a rule's is (a ``.py`` file in the program's folder, or an installed module ``reward_modules`` lists)."""
        from rlhfc.runtime.rewards import module_file

        what = "environment" if kind == "env" else "tool"
        tool = self.plan.tools.get(name)
        if tool is None or tool.kind != kind:
            raise JobError(f"the plan declares no {what} '{name}'", "recompile the program: rlhfc compile ...")
        mod, _, fn = tool.fn.partition(":")
        path = module_file(mod, self.plan.program_dir, self.plan.run.reward_modules)
        if path is None:
            raise JobError(f"{what} '{name}': module '{mod}' not found beside the program "
                           f"({self.plan.program_dir}) nor installed among reward_modules",
                           f"keep the {what}'s .py file beside the program the job was compiled from")
        return tool, path, fn

    def get(self, stage: str, ref):
        """Wait for one remote stage result, naming the stage if its worker fails."""
        self.current_stage = stage
        ray = _ray()
        t0 = time.perf_counter()
        try:
            out = ray.get(ref)
            self._timed(stage, t0, ref=ref)
            return out
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None

    def wait(self, futures: dict[str, Any]) -> list[Any]:
        """Await several launched stages (``{value name: future}``); values in the same order."""
        return [self.get(self._stage_of(name), ref) for name, ref in futures.items()]

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Replace any futures left in a step's results by their values."""
        ray = _ray()
        return {k: (self.get(self._stage_of(k), v) if isinstance(v, ray.ObjectRef) else v) for k, v in values.items()}

    def refill(self, stage: str, round_fn: Callable, w, *, groups: int, group: int, max_rounds: int) -> list[Any]:
        """Dynamic sampling: run ``round_fn(job, w)`` until ``groups`` groups of unequal scores (rlhfc.runtime.rl.refill)."""
        from rlhfc.runtime.rl.refill import refill

        out = refill(lambda: self.resolve(round_fn(self, w)), stage, groups=groups, group=group, max_rounds=max_rounds)
        return list(out.values())

    def _stage_of(self, value: str) -> str:
        return self.value_to_stage.get(value, value)

    def stream(self, stage: str, launch: Callable, *, prompts: list[str] | None = None,
               data: str | None = None, batch: int | None = None, consumers: dict[str, Callable] | None = None,
               overcommit: dict | None = None, tail: dict | None = None) -> list[Any]:
        """Run a streamed (and maybe overcommitted) generate stage; returns [rollout, *consumer results].

        ``launch(prompts, carry)`` starts the worker's ``generate_chunks``; each chunk it yields is handed
        at once to every consumer (``{value: lambda chunk: worker.method.remote(chunk)}``), so downstream
        forwards run while generation goes on. Chunks and consumer results are merged back in batch order.
        With ``overcommit = {"delta": D, ...}`` the stage draws ``batch + D - carried`` new prompts from
        ``data``, trains on the first ``batch`` samples to finish and carries the rest to the next step.
        With ``tail = {"ranks": [...], "below": k, "move": m}`` (the ``tail_migrate`` pass) each rank of the
        generating group decodes its own share and streams its chunks, stopping once fewer than ``k`` of its rows
        decode; then every rank's unfinished rows continue on the first rank, from their KV caches (``m = "kv"``)
        or re-prefilled (:meth:`_stream_tail`).
        """
        ray = _ray()
        from rlhfc.runtime.data.values import CarryOver

        consumers = consumers or {}
        if tail is not None:
            return self._stream_tail(stage, launch, prompts, consumers, list(tail["ranks"]), int(tail["below"]),
                                     tail.get("move") == "kv")
        carry: list[dict] = []
        if overcommit is not None:
            state = self.overcommit.setdefault(stage, {"delta": int(overcommit["delta"]), "carry": []})
            carry = state["carry"]
            prompts = self.next_prompts(data, max(0, batch + state["delta"] - len(carry)))
        chunks, parts, ref = [], {name: [] for name in consumers}, None
        self.current_stage = stage
        t_start = time.perf_counter()
        try:
            for ref in launch(prompts, carry):
                if overcommit is None:   # every item is a chunk: hand it on before fetching it here (the
                    for name, start in consumers.items():   # driver's fetch would delay the consumers' start)
                        parts[name].append(start(ref))
                item = ray.get(ref)
                if isinstance(item, CarryOver):
                    carry = item.samples
                    continue
                chunks.append(item)
                if overcommit is not None:
                    for name, start in consumers.items():
                        parts[name].append(start(ref))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        roll, results = self._merged(stage, t_start, ref, chunks, parts)
        if overcommit is not None:
            self._adapt_overcommit(stage, overcommit, roll, carry)
        return [roll, *results]

    def _merged(self, stage: str, t_start: float, ref, chunks: list, parts: dict) -> tuple[Any, list]:
        """A streamed generate's end: its time recorded (up to ``ref``, its last item), its chunks merged into one
        rollout in batch order, and each consumer's per-chunk results fetched and joined the same way."""
        from rlhfc.runtime.data.values import merge_parts, merge_rollouts

        self._timed(stage, t_start, ref=ref)
        roll = merge_rollouts(chunks)
        return roll, [merge_parts([self.get(self._stage_of(n), r) for r in refs], chunks) for n, refs in parts.items()]

    def _stream_tail(self, stage: str, launch: Callable, prompts: list[str], consumers: dict[str, Callable],
                     ranks: list, below: int, kv: bool = False) -> list[Any]:
        """Long-tail migration (RLHFuse): ``launch(prompts, carry, on=rank, **options)`` on every rank with its
        own share of the rows (``split``), each stopping once fewer than ``below`` of its rows decode and
        handing back those rows (a ``CarryOver``: tokens so far, row, random-stream key; ``kv``: the rows' KV
        caches too, so the first rank continues them without a prefill); chunks go to the
        consumers as any rank yields them. The rows carried back continue together on the first rank, where
        each samples on from its own key — the other ranks' processes are free meanwhile, and the consumers'
        forwards of the finished rows run beside the tail. Merged in batch order, as :meth:`stream`."""
        import queue
        import threading

        ray = _ray()
        from rlhfc.runtime.data.values import CarryOver

        self.current_stage = stage
        t_start = time.perf_counter()
        chunks, parts, carried, ref = [], {name: [] for name in consumers}, [], None
        got: queue.Queue = queue.Queue()

        def pump(gen) -> None:   # one rank's stream, fetched in its own thread
            try:
                for r in gen:
                    got.put((r, ray.get(r), None))
            except BaseException as exc:   # noqa: BLE001 - handed to the driver's thread, which raises it
                got.put((None, None, exc))
            got.put((None, None, StopIteration()))

        def take(r, item) -> None:
            if isinstance(item, CarryOver):
                carried.extend(item.samples)
                return
            chunks.append(item)
            for name, start in consumers.items():
                parts[name].append(start(r))

        try:
            threads = [threading.Thread(
                target=pump, args=(launch(prompts, [], on=rank, split=True, tail_below=below, tail_kv=kv),),
                daemon=True) for rank in ranks]
            for t in threads:
                t.start()
            running = len(threads)
            while running:
                r, item, exc = got.get()
                if isinstance(exc, StopIteration):
                    running -= 1
                elif exc is not None:
                    raise exc
                else:
                    ref = r
                    take(r, item)
            if carried:   # the tails of every rank, on the first: no rank of the group waits for another
                carried.sort(key=lambda c: c["row"])   # in batch order, whichever rank handed its tail back first
                for r in launch([], carried, on=ranks[0]):
                    ref = r
                    take(r, ray.get(r))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        roll, results = self._merged(stage, t_start, ref, chunks, parts)
        return [roll, *results]

    def fused(self, role: int, orders: list[str]) -> dict:
        """A fused train stage's ``fused`` argument (the ``fuse_training`` pass): the pair's meeting point, a
        ``TCPStore`` the driver hosts for the job's life (started at the first fused stage), its role and the
        orders, keyed by the step (:mod:`rlhfc.runtime.train.fused`)."""
        if getattr(self, "_fused_store", None) is None:
            import torch.distributed as dist

            from rlhfc.runtime.train.backend import open_store

            ray = _ray()
            host, port = open_store(ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1")
            self._fused_store = (dist.TCPStore(host, port, is_master=True, wait_for_workers=False), (host, port))
        return {"store": self._fused_store[1], "orders": orders, "model": int(role), "key": f"s{self.step}"}

    def ahead(self, stage: str, launch: Callable, *, data: str, batch: int, staleness: int):
        """Asynchronous rollout: this step's rollout, from generations launched up to ``staleness`` steps ago.

        ``launch(prompts)`` starts the generating worker's ``generate`` (a Ray future): the worker runs it
        with the weights it holds when it gets there — calls run in launch order, so a generation launched
        after a weight sync uses those weights. Admission control as AReaL's: new generations start while
        ``(staleness + version + 1) · batch − in flight − accepted`` leaves room for a batch (``version``: the
        train steps done, this step's number; ``accepted``: the samples earlier steps trained on). The
        prompts are drawn in launch order, so every step trains on the prompts a synchronous run would.
        Each sample records the weights version it was generated with (``born``, per token: no sample is
        carried here); one older than ``staleness`` versions stops the run (the bound is checked from the
        rollout, not assumed)."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        queue = self.in_flight.setdefault(stage, [])
        self._check_syncs(block=False)
        version, accepted = self.step, self.step * batch
        try:
            while (staleness + version + 1) * batch - len(queue) * batch - accepted >= batch:
                queue.append({"step": self.step + len(queue), "ref": launch(self.next_prompts(data, batch))})
            item = queue.pop(0)
            roll = item["rollout"] if "rollout" in item else ray.get(item["ref"])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        self._timed(stage, t0, ref=item.get("ref"))
        oldest = oldest_version(roll)   # from the versions recorded per token
        if self.step - oldest > staleness:
            raise self._stage_failed(stage, f"step {self.step} got samples generated by weights version {oldest}, "
                                     f"{self.step - oldest} versions old, past the staleness bound {staleness} "
                                     "(a weight sync reached the generating worker late)")
        return roll

    def _check_syncs(self, block: bool) -> None:
        """Surface a failed weight import launched without waiting (``block``: wait for all of them)."""
        if not self.pending_syncs:
            return
        ray = _ray()
        refs = [r for _, r in self.pending_syncs]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=None if block else 0)
        finished = set(done)
        for stage, ref in self.pending_syncs:
            if ref in finished:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    raise self._ray_failure(stage, exc) from None
        self.pending_syncs = [(s, r) for s, r in self.pending_syncs if r not in finished]

    def drain_in_flight(self) -> None:
        """Wait for every generation launched ahead and every weight import (kept as results: a checkpoint
        stores them; nothing is computed differently for having waited)."""
        ray = _ray()
        for stage, queue in self.in_flight.items():
            for item in queue:
                if "ref" in item:
                    try:
                        item["rollout"] = ray.get(item.pop("ref"))
                    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                        raise self._ray_failure(stage, exc) from None
        self._check_syncs(block=True)

    def _adapt_overcommit(self, stage: str, cfg: dict, roll, carry: list[dict]) -> None:
        """Δ online (OPPO): grow it while the batch still waits on a long tail, shrink it when carried
        samples grow stale. Tail = the B-th finisher's length against the median finished length."""
        state = self.overcommit[stage]
        state["carry"] = carry
        lengths = sorted(roll.batch.response_lengths.tolist())
        median = lengths[len(lengths) // 2]
        longest = lengths[-1]
        oldest = max((roll.version - b for b in roll.born), default=0)
        delta = state["delta"]
        if cfg.get("adaptive", True):
            if oldest >= int(cfg.get("max_staleness", 2)):
                delta -= 1
            elif longest > 1.5 * max(median, 1):
                delta += 1
            delta = max(int(cfg.get("min_delta", 0)), min(int(cfg.get("max_delta", delta)), delta))
        state["delta"] = delta

    def compute(self, stage: str, op: Callable, /, *args, **kwargs):
        """Run a driver-side compute stage, naming it if it fails."""
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            out = op(*args, **kwargs)
            self._timed(stage, t0, kind="compute", value=out)
            return out
        except Exception as exc:
            raise self._stage_failed(stage, f"{type(exc).__name__}: {exc}") from None

    # -- weight transfers: a sync stage copies a model's weights to its copy on another mesh; a reshard stage
    # has a group gather its training layout into full copies for generation
    def sync(self, stage: str, src, dst, *, bucket_mb: int, after=None, transport: str = "object_store",
             wait: bool = True) -> dict[str, float]:
        """Copy ``src``'s weights to ``dst`` (worker groups on two meshes) in buckets: through Ray's object
        store, or (``transport="collective"``) as broadcasts in a two-rank process group of the pair — NCCL
        when the workers are on GPUs, gloo on CPU — set up on the first sync and kept.

        ``wait=False`` (asynchronous rollout: ``dst`` may be generating ahead): the import is queued on
        ``dst`` behind the generation it is running, and not awaited — ``dst`` takes the new weights between
        generations (a failure surfaces at the next step). A collective transport still waits for ``dst``
        to join the broadcast."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            if transport == "collective":
                if stage not in self.collectives:
                    backend = "nccl" if self.plan.cluster.gpu else "gloo"
                    host, port = ray.get(src.sync_open.remote(stage))
                    ray.get([src.sync_join.remote(stage, 0, host, port, backend),
                             dst.sync_join.remote(stage, 1, host, port, backend)])
                    self.collectives[stage] = backend
                sent, received = src.sync_send.remote(stage, bucket_mb), dst.sync_recv.remote(stage, bucket_mb)
                (version, nbytes, buckets), _ = ray.get([sent, received])
            elif transport == "object_store":
                refs, version, nbytes = ray.get(src.sync_export.remote(bucket_mb))
                imports = [dst.sync_import.remote(r) for r in refs]
                if wait:
                    ray.get(imports)
                else:
                    self.pending_syncs += [(stage, r) for r in imports]
                buckets = len(refs)
            else:
                raise JobError(f"stage '{stage}': unknown weight transport {transport!r}",
                               "use object_store or collective (realloc{transport=...})")
            if wait:
                ray.get(dst.set_version.remote(version))
            else:
                self.pending_syncs.append((stage, dst.set_version.remote(version)))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        out = {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - t0}
        self._timed(stage, t0, kind="sync",
                    value={"bytes": int(nbytes), "buckets": int(buckets), "transport": transport})
        return out

    def reshard(self, stage: str, group, *, bucket_mb: int, after=None) -> dict[str, float]:
        """Reshard a worker group's training layout into its generation layout (every rank all-gathers a
        full copy of the weights, in buckets of ``bucket_mb``) right after training, so generation finds it."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            nbytes, buckets = ray.get(group.reshard.remote(bucket_mb))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        out = {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - t0}
        self._timed(stage, t0, kind="sync", value={"bytes": int(nbytes), "buckets": int(buckets), "transport": "reshard"})
        return out

    def _timed(self, stage: str, t0: float, *, ref=None, kind: str = "wait", value=None) -> None:
        """Seconds the driver waited for a stage (its run time when nothing else was in flight); with
        --trace, also a span of the timeline (``kind``: wait, compute or sync)."""
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + time.perf_counter() - t0
        if self.timeline is not None:
            self.timeline.driver(stage, t0, kind, ref=ref, value=value if kind == "compute" else None,
                                 extra=value if kind == "sync" else None)

    def _ray_failure(self, stage: str, exc: Exception) -> JobError:
        """A JobError for a remote failure: a dead worker, or the exception a stage raised."""
        ray = _ray()
        cause = getattr(exc, "cause", None) or exc
        if _out_of_memory(exc) or _out_of_memory(cause):   # the compiler's memory check said it would fit
            return self._stage_failed(stage, f"its worker ran out of memory ({type(cause).__name__}); the compiler's "
                                      "memory check expected it to fit, so its cost model underestimated this stage: "
                                      "recompile with a smaller cluster memory = \"...\" (then recompute keeps less)")
        if isinstance(exc, ray.exceptions.RayActorError):
            return self._stage_failed(stage, f"its worker died ({type(exc).__name__}{self._shared_by(stage)})")
        log = self._log_error(stage, exc)
        return self._stage_failed(stage, f"{type(cause).__name__}: {cause}" + (f" (traceback in {log})" if log else ""))

    def _shared_by(self, stage: str | None = None, worker: str | None = None) -> str:
        """For a stage (or a worker) whose worker shares its process with others (rlhfc.runtime.worker.host):
        which workers that process hosted, all gone with it."""
        info = self.plan.graph.stages_by_name.get(stage) if stage else None
        model = info.target if info is not None else None
        shared = sorted({w.process for name, w in self.plan.placement.workers.items()
                         if w.process and (name == worker or (model is not None and w.model == model))})
        return "".join(f"; its process hosted {', '.join(p.split('+'))}" for p in shared)

    def _log_error(self, stage: str, exc: Exception) -> str | None:
        """Append the remote traceback of a failed stage to ``OUT/errors.log`` (the console gets one line)."""
        path = os.path.join(self.out, "errors.log")
        try:
            with open(path, "a") as fh:
                fh.write(f"--- stage %{stage}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n{exc}\n")
        except OSError:
            return None
        return path

    def _stage_failed(self, stage: str, why: str) -> JobError:
        info = self.plan.graph.stages_by_name.get(stage)
        where = f"stage %{stage}" + (f" ({info.op} on model '{info.target}')" if info and info.target else "")
        last = self.last_checkpoint
        hint = (f"last good checkpoint: {last}; continue with: {shlex.join(self.resume_command)}" if last else
                f"no checkpoint was written yet; metrics so far are in {self.out}/metrics.jsonl")
        return JobError(f"{where} failed: {why}", hint)

    def interrupted(self) -> Interrupted:
        """The error a Ctrl-C becomes: where the run stopped and how to resume it."""
        where = f"stopped at step {self.step}" + (f" (stage %{self.current_stage})" if self.current_stage else "")
        last = (self.latest_checkpoint() if os.path.isdir(self.out) else None) or self.last_checkpoint
        if last:
            hint = (f"the last complete checkpoint, {last}, is kept as latest; resume with:\n"
                    f"    {shlex.join(self.resume_command)}")
        else:
            hint = (f"no checkpoint was written yet (metrics so far are in {self.out}/metrics.jsonl); "
                    "start again in another folder (--out)")
        return Interrupted(f"{where}; Ray is shut down", hint)

    # -- set-up (cluster.py) ---------------------------------------------------------------------
    def start(self) -> None:
        """Start or connect to Ray and create one worker group per placed worker (``w.<name>``)."""
        self.current_stage = "start"
        self.cluster = Cluster(self.plan, self.out, self.seed, self.ray_address)
        try:
            self.cluster.start()
        finally:
            self.workers, self.pg, self.worker_info = self.cluster.workers, self.cluster.pg, self.cluster.worker_info
        for name, group in self.workers.items():
            setattr(self.handles, name, group)

    def shutdown(self) -> None:
        """Stop Ray (if this job started it); a second Ctrl-C does not cut the shutdown short."""
        if self.cluster is None:
            return
        try:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:   # not the main thread
            previous = None
        try:
            self.cluster.shutdown()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    # -- checkpoints (checkpoint.py) -------------------------------------------------------------
    def checkpoint_root(self) -> str:
        return checkpoint.checkpoint_root(self.out)

    def latest_checkpoint(self) -> str | None:
        return checkpoint.latest_checkpoint(self.checkpoint_root())

    def save_checkpoint(self, step: int) -> str:
        """Write ``step_{step}``; a worker dying (or a write failing) meanwhile is a JobError naming the stage
        ``checkpoint``, and the previous checkpoint stays ``latest``."""
        from rlhfc.runtime.data.values import rollout_state

        self.drain_in_flight()   # before "checkpoint" is the stage: a generation failing here is its own stage's
        self.current_stage = "checkpoint"
        in_flight, tensors = {}, {}
        for stage, queue in self.in_flight.items():
            in_flight[stage] = []
            for i, item in enumerate(queue):
                state, named = rollout_state(item["rollout"], f"{stage}.{i}")
                in_flight[stage].append({"step": item["step"], "rollout": state})
                tensors.update(named)
        meta = {"step": step, "data": {k: v.state() for k, v in self.data.items()},
                "overcommit": self.overcommit, "in_flight": in_flight, "module": self.plan.module, "seed": self.seed,
                "manifest": checkpoint.manifest(self.plan, step)}
        try:
            self.last_checkpoint = checkpoint.save_checkpoint(self.checkpoint_root(), step, self.workers, meta,
                                                              tensors=tensors)
        except checkpoint.CheckpointWriteError as exc:
            ray = _ray()
            cause = exc.cause
            if isinstance(cause, ray.exceptions.RayActorError):
                why = f"its worker died ({type(cause).__name__}{self._shared_by(worker=exc.worker)})"
            else:
                inner = getattr(cause, "cause", None) or cause
                log = self._log_error("checkpoint", cause) if isinstance(cause, ray.exceptions.RayTaskError) else None
                why = f"{type(inner).__name__}: {inner}" + (f" (traceback in {log})" if log else "")
            who = f"worker '{exc.worker}'" if exc.worker else "the driver"
            err = self._stage_failed("checkpoint", why)
            raise JobError(f"stage %checkpoint (writing checkpoints/step_{step}: {who}) failed: {why}",
                           err.hint) from None
        return self.last_checkpoint

    def load_checkpoint(self, path: str) -> int:
        self.current_stage = "resume"
        ray = _ray()
        try:
            meta = checkpoint.load_checkpoint(path, self.workers)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            cause = getattr(exc, "cause", None) or exc
            raise JobError(f"--resume: loading checkpoint {path} failed: {type(cause).__name__}: {cause}",
                           "the checkpoint is damaged or was written by another job; start a new run in "
                           "another folder (--out)") from None
        for k, state in meta["data"].items():
            self.data[k].load_state(state)
        self.overcommit = meta.get("overcommit", {})
        if meta.get("in_flight"):   # generations launched ahead of the checkpoint's step, as they finished
            from rlhfc.runtime.data.values import rollout_from_state

            tensors = checkpoint.read_tensors(path)
            self.in_flight = {stage: [{"step": item["step"],
                                       "rollout": rollout_from_state(item["rollout"], tensors, f"{stage}.{i}")}
                                      for i, item in enumerate(queue)]
                              for stage, queue in meta["in_flight"].items()}
        self.last_checkpoint = path
        return int(meta["step"])

    # -- metrics (metrics.py) --------------------------------------------------------------------
    def step_metrics(self, step: int, values: dict[str, Any], seconds: float) -> dict[str, float]:
        roles = self.plan.metrics
        return step_metrics(roles, self.overcommit, step, values, seconds,
                            ahead=bool(roles.rollout) and self.value_to_stage.get(roles.rollout) in self.in_flight)

    # -- the loop --------------------------------------------------------------------------------
    def run(self, step_fn: Callable[["Job", Any], dict[str, Any]]) -> list[dict[str, float]]:
        start_step = 0
        existing = self.latest_checkpoint() if os.path.isdir(self.out) else None
        if not self.resume:
            checkpoint.check_fresh_run_folder(self.out, self.job_dir, shlex.join(self.resume_command))
        elif existing is None:
            raise checkpoint.RunFolderError(f"--resume: no checkpoint in {self.checkpoint_root()}",
                                            "run without --resume to start fresh")
        else:   # before any worker starts: a checkpoint of another program is refused at once
            for note in checkpoint.check_resume(existing, self.plan, self.plan.placement.workers):
                print(f"note: {note}", file=sys.stderr)
        log = MetricsLog(self.out)
        samples = SampleLog(self.out, self.plan.run.log_samples)
        self.start()
        kept = kept_samples = None
        if self.resume:
            start_step = self.load_checkpoint(existing)
            kept, notes = log.trim(start_step)
            kept_samples, more = samples.trim(start_step)
            for note in notes + more:
                print(f"note: {note}", file=sys.stderr)
        log.open_tensorboard(replay=kept)
        samples.open(log.tb, replay=kept_samples)
        if (tl := self.timeline) is not None:
            tl.start(self.workers, start_step if self.resume else None)
        history: list[dict[str, float]] = []
        try:
            with Progress(self.show_progress, self.steps, start_step, self.plan) as bar:
                for step in range(start_step, self.steps):
                    self.step = step
                    t0 = time.perf_counter()
                    self.stage_seconds = {}
                    t_trace = tl.begin_step(step) if tl is not None else 0.0
                    values = self.resolve(step_fn(self, self.handles))
                    m = self.step_metrics(step, values, time.perf_counter() - t0)
                    if tl is not None:   # after the step's time is taken: collecting spans is not the step's
                        tl.end_step(step, t_trace, self.workers, end=t0 + m["step_time_s"] + tl.clock)
                    m["wait_s"] = {k: round(v, 6) for k, v in self.stage_seconds.items()}
                    m["ranks"] = model_ranks(self.plan.placement.workers)   # processes per model
                    log.write(m)
                    roles = self.plan.metrics
                    roll = values.get(roles.rollout) if roles.rollout else None
                    samples.write(step, roll, values, roles.reward,      # with its prompt's data fields
                                  fields=roll.fields if roll is not None and any(roll.fields) else None)
                    history.append(m)
                    bar.update(m)
                    done = step + 1
                    if (self.checkpoint_every and done % self.checkpoint_every == 0) or done == self.steps:
                        self.save_checkpoint(done)
        finally:
            log.close()
            if tl is not None:
                tl.write()
        return history


def run_job(job_dir: str, step_fn: Callable | None = None, *, steps: int | None = None, out: str | None = None,
            resume: bool = False, ray_address: str | None = None, progress: bool = True,
            resume_command: list[str] | None = None, trace: bool = False) -> list[dict[str, float]]:
    """Run the job in ``job_dir`` (its ``main.py`` supplies ``step_fn`` when not given).

    Ctrl-C raises :class:`Interrupted` (after Ray is shut down) saying how to resume:
    ``resume_command``, by default ``python JOB/main.py --resume --out OUT``. ``trace``: write the measured
    timeline, ``OUT/trace.json`` (:mod:`rlhfc.runtime.worker.trace`)."""
    if step_fn is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("rlhfc_job_main", os.path.join(job_dir, "main.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        step_fn = mod.step
    job = Job(job_dir, out=out, steps=steps, resume=resume, ray_address=ray_address, progress=progress,
              resume_command=resume_command, trace=trace)
    try:
        history = job.run(step_fn)
    except KeyboardInterrupt:
        raise job.interrupted() from None
    finally:
        job.shutdown()
    if progress:
        print(summarize(history, job.out), file=sys.stderr)
    return history


def main(job_file: str, argv: list[str] | None = None) -> int:
    """Command line of a generated ``main.py``: ``python job/main.py [--steps N] [--out DIR] [--resume] ...``."""
    ap = argparse.ArgumentParser(description="Run this compiled rlhfc job.")
    ap.add_argument("--steps", type=_positive_steps, default=None,
                    help="train this many steps in total (default: plan)")
    ap.add_argument("--out", default=None, help="run folder (metrics, checkpoints)")
    ap.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    ap.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--trace", action="store_true", help="write the measured timeline, OUT/trace.json")
    args = ap.parse_args(argv)
    module = sys.modules.get("__main__")
    try:
        run_job(os.path.dirname(os.path.abspath(job_file)), getattr(module, "step", None), steps=args.steps,
                out=args.out, resume=args.resume, ray_address=args.ray_address, progress=not args.no_progress,
                trace=args.trace)
    except JobError as exc:
        print(f"{getattr(exc, 'label', 'error')}: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except KeyboardInterrupt:   # before the run started (e.g. while importing)
        print("interrupted; checkpoints written so far are kept", file=sys.stderr)
        return 130
    return 0


def _positive_steps(text: str) -> int:
    """``--steps``: a whole number of at least 1 (argparse turns the ValueError into a usage error, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of steps: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a number of steps: give the total number of steps to "
                                         "train, at least 1 (with --resume: including the checkpoint's)")
    return n

