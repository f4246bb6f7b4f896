"""Run a compiled job: start Ray, place workers, loop over steps, log, checkpoint, resume.

A job folder holds ``main.py`` (the generated driver: a ``step(job, w)`` function)
and ``plan.json`` (everything the compiler decided). ``python job/main.py``
calls :func:`main`, which needs only this package — no compiler code.

Run folder layout (``--out``, default ``runs/<module>``)::

    metrics.jsonl          one JSON object per step
    events.out.tfevents.*  TensorBoard scalars
    checkpoints/step_K/    per model: weights.safetensors, state.safetensors, state.json; job.json
    checkpoints/latest     name of the newest complete checkpoint

Checkpoints are written to a temporary folder and renamed when complete, and
never deleted, so a crash never leaves a half checkpoint or loses an old one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Callable

from .data import PromptSource, prompt_source_from_spec
from .values import Rollout, TokenValues


class JobError(Exception):
    """A failure the user can act on; printed as ``error: ...`` + ``hint: ...`` without a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


def _ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # idle OpenMP threads must sleep, not spin: workers share cores (10-100x slower otherwise on 2 cores)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import ray

    return ray


class Job:
    """The driver-side state of a running job; the generated ``step`` function calls its methods."""

    def __init__(self, job_dir: str, out: str | None = None, steps: int | None = None, resume: bool = False,
                 ray_address: str | None = None, progress: bool = True):
        self.job_dir = os.path.abspath(job_dir)
        with open(os.path.join(self.job_dir, "plan.json"), encoding="utf-8") as fh:
            self.plan = json.load(fh)
        run = self.plan["run"]
        self.steps = int(steps if steps is not None else run["steps"])
        self.checkpoint_every = int(run["checkpoint_every"])
        self.seed = int(run["seed"])
        self.out = os.path.abspath(out or os.path.join("runs", self.plan["module"]))
        self.resume = resume
        self.ray_address = ray_address
        self.show_progress = progress
        self.data: dict[str, PromptSource] = {name: prompt_source_from_spec(spec)
                                              for name, spec in self.plan["data"].items()}
        self.workers: dict[str, Any] = {}
        self.groups: dict[str, str] = {}     # sync stage -> collective backend of its two-rank group
        self.handles = SimpleNamespace()
        self.current_stage = ""
        self.last_checkpoint: str | None = None
        self._started_ray = False
        self._tb = None
        #: seconds the driver waited on each stage in the current step (reported as wait_s in metrics)
        self.stage_seconds: dict[str, float] = {}
        #: per overcommitted stage: {"delta": current Δ, "carry": unfinished samples (plain JSON)}
        self.overcommit: dict[str, dict] = {}

    # -- called by the generated step function -------------------------------------------------
    def next_prompts(self, data: str, batch: int) -> list[str]:
        return self.data[data].next_batch(batch)

    def get(self, stage: str, ref):
        """Wait for one remote stage result, naming the stage if its worker fails."""
        self.current_stage = stage
        ray = _ray()
        t0 = time.perf_counter()
        try:
            out = ray.get(ref)
            self._timed(stage, t0)
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

    def _stage_of(self, value: str) -> str:
        return self.plan["graph"]["value_to_stage"].get(value, value)

    def stream(self, stage: str, launch: Callable, *, prompts: list[str] | None = None,
               data: str | None = None, batch: int | None = None, consumers: dict[str, Callable] | None = None,
               overcommit: dict | None = None) -> list[Any]:
        """Run a streamed (and maybe overcommitted) generate stage; returns [rollout, *consumer results].

        ``launch(prompts, carry)`` starts the worker's ``generate_chunks``; each chunk it yields is handed
        at once to every consumer (``{value: lambda chunk: worker.method.remote(chunk)}``), so downstream
        forwards run while generation goes on. Chunks and consumer results are merged back in batch order.
        With ``overcommit = {"delta": D, ...}`` the stage draws ``batch + D - carried`` new prompts from
        ``data``, trains on the first ``batch`` samples to finish and carries the rest to the next step.
        """
        ray = _ray()
        from .values import CarryOver, merge_parts, merge_rollouts

        consumers = consumers or {}
        carry: list[dict] = []
        if overcommit is not None:
            state = self.overcommit.setdefault(stage, {"delta": int(overcommit["delta"]), "carry": []})
            carry = state["carry"]
            prompts = self.next_prompts(data, max(0, batch + state["delta"] - len(carry)))
        chunks, parts = [], {name: [] for name in consumers}
        self.current_stage = stage
        t_start = time.perf_counter()
        try:
            for ref in launch(prompts, carry):
                item = ray.get(ref)
                if isinstance(item, CarryOver):
                    carry = item.samples
                    continue
                chunks.append(item)
                for name, start in consumers.items():
                    parts[name].append(start(ref))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        self._timed(stage, t_start)
        roll = merge_rollouts(chunks)
        results = [merge_parts([self.get(self._stage_of(n), r) for r in refs], chunks) for n, refs in parts.items()]
        if overcommit is not None:
            self._adapt_overcommit(stage, overcommit, roll, carry)
        return [roll, *results]

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

    def sync(self, stage: str, src, dst, *, bucket_mb: int, after=None, transport: str = "object_store") \
            -> dict[str, float]:
        """Copy ``src``'s weights to ``dst`` (another mesh) in buckets: through Ray's object store, or
        (``transport="collective"``) as broadcasts in a two-rank process group of the pair — NCCL when
        the workers are on GPUs, gloo on CPU — set up on the first sync and kept."""
        ray = _ray()
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            if transport == "collective":
                if stage not in self.groups:
                    backend = "gloo" if self.plan["cluster"]["device"] == "cpu" else "nccl"
                    host, port = ray.get(src.open_group.remote(stage))
                    ray.get([src.join_group.remote(stage, 0, host, port, backend),
                             dst.join_group.remote(stage, 1, host, port, backend)])
                    self.groups[stage] = backend
                sent, received = src.send_weights.remote(stage, bucket_mb), dst.recv_weights.remote(stage, bucket_mb)
                (version, nbytes, buckets), _ = ray.get([sent, received])
            elif transport == "object_store":
                refs, version, nbytes = ray.get(src.export_buckets.remote(bucket_mb))
                ray.get([dst.import_bucket.remote(r) for r in refs])
                buckets = len(refs)
            else:
                raise JobError(f"stage '{stage}': unknown weight transport {transport!r}",
                               "use object_store or collective (realloc{transport=...})")
            ray.get(dst.set_version.remote(version))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise self._ray_failure(stage, exc) from None
        self._timed(stage, t0)
        return {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - t0}

    def compute(self, stage: str, op: Callable, /, *args, **kwargs):
        """Run a driver-side compute stage, naming it if it fails."""
        self.current_stage = stage
        t0 = time.perf_counter()
        try:
            out = op(*args, **kwargs)
            self._timed(stage, t0)
            return out
        except Exception as exc:
            raise self._stage_failed(stage, f"{type(exc).__name__}: {exc}") from None

    def _timed(self, stage: str, t0: float) -> None:
        """Seconds the driver waited for a stage (its run time when nothing else was in flight)."""
        self.stage_seconds[stage] = self.stage_seconds.get(stage, 0.0) + time.perf_counter() - t0

    def _ray_failure(self, stage: str, exc: Exception) -> JobError:
        """A JobError for a remote failure: a dead worker, or the exception a stage raised."""
        ray = _ray()
        if isinstance(exc, ray.exceptions.RayActorError):
            return self._stage_failed(stage, f"its worker died ({type(exc).__name__})")
        cause = getattr(exc, "cause", None) or exc
        log = self._log_error(stage, exc)
        return self._stage_failed(stage, f"{type(cause).__name__}: {cause}" + (f" (traceback in {log})" if log else ""))

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
        info = self.plan["graph"]["stages_by_name"].get(stage, {})
        where = f"stage %{stage}" + (f" ({info.get('op')} on model '{info['target']}')" if info.get("target") else "")
        last = self.last_checkpoint
        hint = (f"last good checkpoint: {last}; continue with --resume --out {self.out}" if last else
                f"no checkpoint was written yet; metrics so far are in {self.out}/metrics.jsonl")
        return JobError(f"{where} failed: {why}", hint)

    # -- set-up --------------------------------------------------------------------------------
    def start(self) -> None:
        ray = _ray()
        os.makedirs(self.out, exist_ok=True)
        placement = self.plan["placement"]
        if not ray.is_initialized():
            if self.ray_address:
                ray.init(address=self.ray_address, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR")
            else:
                need_cpu = sum(b.get("CPU", 0) for b in placement["bundles"])
                tmp = os.path.join(self.out, "ray")
                if len(tmp) > 40:  # Ray adds ~62 bytes to it for its sockets; unix socket paths hold 107
                    tmp = tempfile.mkdtemp(prefix="rlhfc-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
                ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need_cpu)), include_dashboard=False,
                         log_to_driver=False, logging_level="ERROR", _temp_dir=tmp)
            self._started_ray = True
        self._check_resources(ray)
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .worker import ModelWorker

        strategy = placement.get("strategy", "PACK")
        if len(ray.nodes()) < len(placement["bundles"]):
            strategy = "PACK"   # a local (one-node) Ray runs a multi-node plan on this machine
        pg = placement_group(placement["bundles"], strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=60)
        except Exception:
            raise JobError("the Ray cluster cannot reserve the plan's devices "
                           f"({placement['bundles']})", "check `ray status`, or compile for a smaller cluster")
        self.pg = pg
        use_gpu = self.plan["cluster"]["device"] != "cpu"
        refs = {}
        for name, w in placement["workers"].items():
            model = self.plan["models"][w.get("model", name)]
            actor_cls = ray.remote(num_cpus=w["num_cpus"], num_gpus=w.get("num_gpus", 0),
                                   max_restarts=0)(ModelWorker)
            handle = actor_cls.options(
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=w["bundle"]),
            ).remote(w.get("model", name), model["spec"], model["init"], self.seed, w.get("threads", 1),
                     "cuda" if use_gpu else "cpu", w.get("cores"))
            self.workers[name] = handle
            refs[name] = handle.ready.remote()
            setattr(self.handles, name, handle)
        self.worker_info: dict[str, dict] = {}
        for name, ref in refs.items():
            self.current_stage = f"start {name}"
            try:
                self.worker_info[name] = ray.get(ref)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                raise JobError(f"worker for model '{name}' failed to start: {type(cause).__name__}: {cause}",
                               "check the model's config (and for hf(...) models, the local folder)") from None

    def _check_resources(self, ray) -> None:
        have = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in self.plan["placement"]["bundles"]:
            for k, v in b.items():
                need[k] = need.get(k, 0) + v
        for k, v in need.items():
            if have.get(k, 0) + 1e-9 < v:
                kind = self.plan["cluster"]["device"]
                raise JobError(f"the plan needs {v:g} {k} ({kind}) but the Ray cluster has {have.get(k, 0):g}",
                               "run it on a matching cluster with --ray-address, or compile a program whose "
                               "cluster is `devices = cpu:N` to run locally")

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_root(self) -> str:
        return os.path.join(self.out, "checkpoints")

    def latest_checkpoint(self) -> str | None:
        latest = os.path.join(self.checkpoint_root(), "latest")
        if not os.path.isfile(latest):
            return None
        with open(latest) as fh:
            name = fh.read().strip()
        path = os.path.join(self.checkpoint_root(), name)
        return path if os.path.isfile(os.path.join(path, "job.json")) else None

    def save_checkpoint(self, step: int) -> str:
        ray = _ray()
        root = self.checkpoint_root()
        final = os.path.join(root, f"step_{step}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self.current_stage = "checkpoint"
        ray.get([h.save.remote(os.path.join(tmp, name)) for name, h in self.workers.items()])
        with open(os.path.join(tmp, "job.json"), "w") as fh:
            json.dump({"step": step, "data": {k: v.state() for k, v in self.data.items()},
                       "overcommit": self.overcommit,
                       "module": self.plan["module"], "seed": self.seed}, fh)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(root, "latest.tmp"), "w") as fh:
            fh.write(f"step_{step}\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        self.last_checkpoint = final
        return final

    def load_checkpoint(self, path: str) -> int:
        ray = _ray()
        with open(os.path.join(path, "job.json")) as fh:
            meta = json.load(fh)
        ray.get([h.load.remote(os.path.join(path, name)) for name, h in self.workers.items()])
        for k, state in meta["data"].items():
            self.data[k].load_state(state)
        self.overcommit = meta.get("overcommit", {})
        self.last_checkpoint = path
        return int(meta["step"])

    # -- metrics ---------------------------------------------------------------------------------
    def step_metrics(self, step: int, values: dict[str, Any], seconds: float) -> dict[str, float]:
        roles = self.plan["metrics"]
        m: dict[str, float] = {"step": step}
        roll: Rollout | None = values.get(roles.get("rollout")) if roles.get("rollout") else None
        scores = values.get(roles.get("reward")) if roles.get("reward") else None
        if scores is not None:
            m["reward_mean"] = float(scores.float().mean())
            m["reward_std"] = float(scores.float().std()) if scores.numel() > 1 else 0.0
        if roles.get("kl"):
            logp, ref = (values.get(n) for n in roles["kl"])
            if isinstance(logp, TokenValues) and isinstance(ref, TokenValues):
                diff = TokenValues(logp.values - ref.values, logp.mask)
                m["kl"] = diff.mean()
        for key, name in (("policy", roles.get("policy_train")), ("value", roles.get("value_train"))):
            stats = values.get(name) if name else None
            if not stats:
                continue
            if key == "policy":
                m["policy_loss"] = stats.get("pg_loss", stats.get("loss", float("nan")))
                for k in ("entropy", "clipfrac", "approx_kl", "grad_norm"):
                    if k in stats:
                        m[f"policy_{k}" if k == "grad_norm" else k] = stats[k]
            else:
                m["value_loss"] = stats.get("vf_loss", stats.get("loss", float("nan")))
                if "vf_clipfrac" in stats:
                    m["value_clipfrac"] = stats["vf_clipfrac"]
        m.setdefault("kl", float("nan"))
        m.setdefault("policy_loss", float("nan"))
        m.setdefault("value_loss", float("nan"))
        m.setdefault("reward_mean", float("nan"))
        if roll is not None:
            lengths = roll.batch.response_lengths.float()
            m["response_len_mean"] = float(lengths.mean())
            m["response_len_max"] = float(lengths.max())
            m["decode_steps"] = roll.decode_steps
            m["gen_version"] = roll.version
            m["samples"] = roll.size
            if roll.born:
                stale = [roll.version - b for b in roll.born]
                m["carried"] = sum(1 for x in stale if x > 0)
                m["staleness_max"] = max(stale)
                m["staleness_mean"] = sum(stale) / len(stale)
            for stage, state in self.overcommit.items():
                m["overcommit_delta"] = state["delta"]
                m["carry_next"] = len(state["carry"])
        m["step_time_s"] = seconds
        m["samples_per_s"] = (m.get("samples", 0) / seconds) if seconds > 0 else 0.0
        return m

    def _write_metrics(self, m: dict[str, float]) -> None:
        with open(os.path.join(self.out, "metrics.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                 for k, v in m.items()}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self._tb is not None:
            for k, v in m.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                    self._tb.add_scalar(k, v, m["step"])
            self._tb.flush()

    def _trim_metrics(self, upto: int) -> None:
        """On resume: keep the metric lines of steps before ``upto`` (later ones will be recomputed)."""
        path = os.path.join(self.out, "metrics.jsonl")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as fh:
            lines = [ln for ln in fh if ln.strip() and json.loads(ln)["step"] < upto]
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(lines)

    # -- the loop --------------------------------------------------------------------------------
    def run(self, step_fn: Callable[["Job", Any], dict[str, Any]]) -> list[dict[str, float]]:
        start_step = 0
        existing = self.latest_checkpoint() if os.path.isdir(self.out) else None
        if existing and not self.resume:
            raise JobError(f"{self.out} already holds checkpoints (latest: {os.path.basename(existing)})",
                           "continue it with --resume, or choose another folder with --out; "
                           "nothing was overwritten")
        if self.resume and existing is None:
            raise JobError(f"--resume: no checkpoint in {self.checkpoint_root()}",
                           "run without --resume to start fresh")
        metrics_path = os.path.join(self.out, "metrics.jsonl")
        if not self.resume and os.path.isfile(metrics_path) and os.path.getsize(metrics_path) > 0:
            raise JobError(f"{metrics_path} already exists", "choose another folder with --out")
        self.start()
        if self.resume:
            start_step = self.load_checkpoint(existing)
            self._trim_metrics(start_step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self.out)
        except Exception:  # tensorboard missing: metrics.jsonl still has everything
            self._tb = None
        history: list[dict[str, float]] = []
        with _Progress(self.show_progress, self.steps, start_step, self.plan) as bar:
            for step in range(start_step, self.steps):
                t0 = time.perf_counter()
                self.stage_seconds = {}
                values = self.resolve(step_fn(self, self.handles))
                m = self.step_metrics(step, values, time.perf_counter() - t0)
                m["wait_s"] = {k: round(v, 6) for k, v in self.stage_seconds.items()}
                self._write_metrics(m)
                history.append(m)
                bar.update(m)
                done = step + 1
                if (self.checkpoint_every and done % self.checkpoint_every == 0) or done == self.steps:
                    self.save_checkpoint(done)
        if self._tb is not None:
            self._tb.close()
        return history

    def shutdown(self) -> None:
        if self._started_ray:
            _ray().shutdown()


class _Progress:
    """A rich progress bar showing reward, KL, losses and throughput per step."""

    def __init__(self, enabled: bool, total: int, start: int, plan: dict):
        self.enabled = enabled
        self.total, self.start = total, start
        self.plan = plan

    def __enter__(self):
        if not self.enabled:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from rich.console import Console

        # piped output (logs, CI) has no width: give the line room instead of squeezing it to 80 columns
        console = None if sys.stdout.isatty() else Console(width=150)
        self.progress = Progress(TextColumn("[bold]{task.fields[name]}"), BarColumn(bar_width=24),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[stats]}"),
                                 transient=False, console=console)
        self.progress.__enter__()
        self.task = self.progress.add_task("train", total=self.total, completed=self.start,
                                           name=self.plan["module"], stats="starting workers…")
        return self

    def update(self, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        stats = (f"reward {_fmt(m.get('reward_mean'))}  kl {_fmt(m.get('kl'))}  "
                 f"pg {_fmt(m.get('policy_loss'))}  vf {_fmt(m.get('value_loss'))}  "
                 f"{m.get('samples_per_s', 0):.1f} samples/s")
        self.progress.update(self.task, advance=1, stats=stats)

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)
        return False


def _fmt(v) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.3f}"


def summarize(history: list[dict[str, float]], out: str) -> str:
    """A short end-of-run summary: first vs last reward, KL, throughput."""
    if not history:
        return f"nothing to do; run folder: {out}"
    k = min(5, len(history))
    first = [h["reward_mean"] for h in history[:k] if h.get("reward_mean") is not None]
    last = [h["reward_mean"] for h in history[-k:] if h.get("reward_mean") is not None]
    sps = sum(h["samples_per_s"] for h in history) / len(history)
    lines = [f"trained steps {history[0]['step']}..{history[-1]['step']} — run folder: {out}"]
    if first and last:
        lines.append(f"mean reward: first {k} steps {sum(first) / len(first):+.4f} -> last {k} steps "
                     f"{sum(last) / len(last):+.4f}")
    lines.append(f"mean throughput: {sps:.1f} samples/s; metrics: {out}/metrics.jsonl")
    return "\n".join(lines)


def run_job(job_dir: str, step_fn: Callable | None = None, *, steps: int | None = None, out: str | None = None,
            resume: bool = False, ray_address: str | None = None, progress: bool = True) -> list[dict[str, float]]:
    """Run the job in ``job_dir`` (its ``main.py`` supplies ``step_fn`` when not given)."""
    if step_fn is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("rlhfc_job_main", os.path.join(job_dir, "main.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        step_fn = mod.step
    job = Job(job_dir, out=out, steps=steps, resume=resume, ray_address=ray_address, progress=progress)
    try:
        history = job.run(step_fn)
    finally:
        job.shutdown()
    if progress:
        print(summarize(history, job.out), file=sys.stderr)
    return history


def main(job_file: str, argv: list[str] | None = None) -> int:
    """Command line of a generated ``main.py``: ``python job/main.py [--steps N] [--out DIR] [--resume] ...``."""
    ap = argparse.ArgumentParser(description="Run this compiled rlhfc job.")
    ap.add_argument("--steps", type=int, default=None, help="train this many steps in total (default: plan)")
    ap.add_argument("--out", default=None, help="run folder (metrics, checkpoints)")
    ap.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    ap.add_argument("--ray-address", default=None, help="connect to an existing Ray cluster")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    module = sys.modules.get("__main__")
    try:
        run_job(os.path.dirname(os.path.abspath(job_file)), getattr(module, "step", None), steps=args.steps,
                out=args.out, resume=args.resume, ray_address=args.ray_address, progress=not args.no_progress)
    except JobError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; checkpoints written so far are kept", file=sys.stderr)
        return 130
    return 0
