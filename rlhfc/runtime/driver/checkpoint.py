"""Checkpoints of a run folder: save, resume, find the latest — atomically — and the checks around them.

Layout (under ``OUT/checkpoints``)::

    step_K/<worker>/       weights.safetensors, state.safetensors, state.json (written by the worker)
    step_K/job.json        driver state: step, data cursors, overcommit carry, module, seed, manifest
    latest                 name of the newest complete checkpoint

A checkpoint is written to ``step_K.tmp`` and renamed when complete, and ``latest`` is replaced
atomically after it, so a crash never leaves a half checkpoint or loses an old one; none is deleted.
A worker that dies (or a write that fails) while a checkpoint is written leaves the previous one as
``latest``: :func:`save_checkpoint` removes the half-written folder and raises :class:`CheckpointWriteError`.

``job.json``'s ``manifest`` (:func:`manifest`) says what the checkpoint belongs to: the models' shapes,
the algorithm (what each trained model's loss is, how advantages are estimated), a hash of the program,
the step, the rlhfc version and the workers saved. :func:`check_resume` compares it with the job that
resumes it and refuses a mismatch (:class:`CheckpointMismatch`). :func:`check_fresh_run_folder` keeps
a new run from writing over an earlier run's folder (:class:`RunFolderError`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from typing import Iterable

from safetensors.torch import load_file, save_file

from rlhfc import __version__
from rlhfc.contract.plan import Plan
from rlhfc.runtime.errors import JobError

from .cluster import import_ray
from .group import WorkerGroup

#: the model settings that fix its tensors' shapes
SHAPE_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "max_seq", "head")


class RunFolderError(JobError):
    """A run folder that cannot be used so: a new run (no ``--resume``) pointed at a folder holding an earlier
    run, or ``--resume`` of a folder without a checkpoint; exit status 2."""

    exit_code = 2


class CheckpointMismatch(JobError):
    """``--resume`` of a checkpoint that another program (other models or algorithm) wrote; exit status 2."""

    exit_code = 2


class CheckpointWriteError(Exception):
    """Writing a checkpoint failed: ``worker`` (None: the driver's own files) and the underlying ``cause``."""

    def __init__(self, step: int, worker: str | None, cause: BaseException):
        super().__init__(f"step_{step}: {worker or 'driver'}: {cause}")
        self.step, self.worker, self.cause = step, worker, cause


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root``, or None."""
    latest = os.path.join(root, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        name = fh.read().strip()
    path = os.path.join(root, name)
    return path if name and os.path.isfile(os.path.join(path, "job.json")) else None


#: the driver's tensors in a checkpoint: rollouts generated ahead of its step (asynchronous rollout)
IN_FLIGHT = "in_flight.safetensors"


def save_checkpoint(root: str, step: int, workers: dict[str, WorkerGroup], meta: dict,
                    tensors: dict | None = None) -> str:
    """Write ``step_{step}``: every worker group saves its model, ``meta`` goes to job.json and ``tensors``
    (when any) to in_flight.safetensors; returns its path.

    On failure (a worker dies or raises, a write fails) the half-written ``step_{step}.tmp`` is removed,
    ``latest`` is left as it was, and :class:`CheckpointWriteError` names the worker."""
    ray = import_ray()
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        refs = {name: group.save.remote(os.path.join(tmp, name)) for name, group in workers.items()}
        failed: tuple[str, BaseException] | None = None
        for name, ref in refs.items():   # wait for every save, then name the first that failed
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                failed = failed or (name, exc)
        if failed is not None:
            raise CheckpointWriteError(step, failed[0], failed[1])
        if tensors:
            save_file(tensors, os.path.join(tmp, IN_FLIGHT))
        write_atomic(os.path.join(tmp, "job.json"), json.dumps(meta))   # one writer for the driver's files
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(os.path.join(root, "latest"), f"step_{step}\n")
    except CheckpointWriteError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(step, None, exc) from None
    return final


def load_checkpoint(path: str, workers: dict[str, WorkerGroup]) -> dict:
    """Load every worker group's model from checkpoint ``path``; returns its job.json."""
    ray = import_ray()
    meta = read_meta(path)
    ray.get([group.load.remote(os.path.join(path, name)) for name, group in workers.items()])
    return meta


def read_tensors(path: str) -> dict:
    """The driver's tensors of checkpoint ``path`` ({} when it has none)."""
    file = os.path.join(path, IN_FLIGHT)
    if not os.path.exists(file):
        return {}
    return load_file(file)


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "job.json"), encoding="utf-8") as fh:
        return json.load(fh)


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` by ``text`` in one step (write ``path.tmp``, then rename)."""
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


# -- the run folder ------------------------------------------------------------------------------
def run_folder_contents(out: str, job_dir: str | None = None) -> list[str]:
    """What an earlier run left in ``out`` that a new run would write over (``job/`` counts unless it is
    ``job_dir``, the job about to run): ``job/``, ``metrics.jsonl``, ``samples.jsonl``, ``checkpoints/``,
    TensorBoard events."""
    if not os.path.isdir(out):
        return []
    found = []
    job = os.path.join(out, "job")
    if os.path.isdir(job) and os.listdir(job) and (
            job_dir is None or os.path.abspath(job) != os.path.abspath(job_dir)):
        found.append("job/")
    for log in ("metrics.jsonl", "samples.jsonl"):
        path = os.path.join(out, log)
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            found.append(log)
    ckpts = checkpoint_root(out)
    if os.path.isdir(ckpts) and os.listdir(ckpts):
        latest = latest_checkpoint(ckpts)
        found.append(f"checkpoints/{os.path.basename(latest)}" if latest else "checkpoints/")
    if glob.glob(os.path.join(out, "events.out.tfevents.*")):
        found.append("TensorBoard events")
    return found


def check_fresh_run_folder(out: str, job_dir: str | None, resume_hint: str) -> None:
    """Refuse (:class:`RunFolderError`) to start a new run in a folder holding an earlier run;
    ``resume_hint`` is how to continue that run instead (a command)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunFolderError(f"run folder {out} is a file, not a folder; nothing was overwritten",
                             "choose a folder with --out (a new one, or an earlier run's with --resume)")
    found = run_folder_contents(out, job_dir)
    if not found:
        return
    latest = latest_checkpoint(checkpoint_root(out))
    what = (f"already holds checkpoints (latest: {os.path.basename(latest)})" if latest else
            "already holds a run")
    if latest:
        hint = f"continue it with: {resume_hint}; or start a new run in another folder (--out)"
    else:
        hint = "it has no checkpoint to resume: choose another folder with --out, or remove it"
    raise RunFolderError(f"run folder {out} {what}: {', '.join(found)}; nothing was overwritten", hint)


# -- the manifest --------------------------------------------------------------------------------
def manifest(plan: Plan, step: int) -> dict:
    """What a checkpoint of ``plan`` at ``step`` belongs to (recorded in job.json, checked on resume)."""
    return {"format": 1, "step": step, "rlhfc_version": __version__, "module": plan.module,
            "program": program_hash(plan), "models": model_shapes(plan), "algorithm": algorithm(plan),
            "workers": sorted(plan.placement.workers)}


def model_shapes(plan: Plan) -> dict[str, dict]:
    """Per model: the settings that fix its shapes (with its LoRA adapters, when it has them), and its
    parameter count."""
    return {name: {**{k: getattr(m.spec, k) for k in SHAPE_KEYS}, "params": m.params,
                   **({"lora": m.spec.lora} if m.spec.lora else {})}
            for name, m in sorted(plan.models.items())}


def algorithm(plan: Plan) -> dict:
    """What is trained and how: per trained model the op(s) of its loss, and the compute ops between the
    reward and the losses (the advantage estimator: ``compute.gae``, ``compute.group_advantages``, …).
    Optimisations (-O levels, placements) do not change it."""
    stages = plan.graph.stages
    by_name = plan.graph.stages_by_name
    producer = {out: s for s in stages for out in s.outputs}
    train: dict[str, list[str]] = {}
    losses = set()
    for s in stages:
        if s.op == "train":
            ops = [producer[i].op for i in s.inputs if i in producer]
            train.setdefault(s.target, []).extend(ops)
            losses.update(producer[i].name for i in s.inputs if i in producer)
    reward = plan.metrics.reward
    after_reward: set[str] = set()
    frontier = [producer[reward].name] if reward in producer else []
    while frontier:
        outs = set(by_name[frontier.pop()].outputs)
        for s in stages:
            if s.name not in after_reward and outs & set(s.inputs):
                after_reward.add(s.name)
                frontier.append(s.name)
    before_loss: set[str] = set()
    frontier = list(losses)
    while frontier:
        for i in by_name[frontier.pop()].inputs:
            if i in producer and producer[i].name not in before_loss:
                before_loss.add(producer[i].name)
                frontier.append(producer[i].name)
    advantages = sorted({s.op for s in stages if s.name in after_reward & before_loss - losses
                         and s.op.startswith("compute.")})
    return {"train": {k: sorted(v) for k, v in sorted(train.items())}, "advantages": advantages}


def program_hash(plan: Plan) -> str:
    """sha256 of the program's IR without source locations and comments."""
    ir = re.sub(r'\s*loc\("[^"]*":\d+:\d+\)', "", plan.ir)
    ir = re.sub(r"\s*//[^\n]*", "", ir)
    return "sha256:" + hashlib.sha256(ir.encode()).hexdigest()


def check_resume(path: str, plan: Plan, workers: Iterable[str] | None = None) -> list[str]:
    """Check checkpoint ``path`` against the job of ``plan`` that resumes it: raise
    :class:`CheckpointMismatch` naming what differs, or return notes (program edits, another rlhfc
    version, a checkpoint written before manifests) to print."""
    name = os.path.basename(path)
    meta = read_meta(path)
    got = meta.get("manifest")
    want = manifest(plan, int(meta.get("step", 0)))
    # a worker with no saved state (another placement or -O level) would fail late, in its load
    missing = [w for w in (workers or want["workers"]) if not os.path.isdir(os.path.join(path, w))]
    if got is None:
        if missing:
            raise CheckpointMismatch(f"--resume: checkpoint {path} holds no state for worker(s) "
                                     f"{', '.join(missing)} of this job", "resume it with the program (or job) "
                                     "that wrote it, or start a new run in another folder (--out)")
        return [f"checkpoint {name} has no manifest (written by an older rlhfc): "
                "it is not checked against this program"]
    diffs: list[str] = []
    ck_models, models = got.get("models", {}), want["models"]
    for m in sorted(set(ck_models) - set(models)):
        diffs.append(f"model '{m}' is in the checkpoint but not in the program")
    for m in sorted(set(models) - set(ck_models)):
        diffs.append(f"model '{m}' is in the program but not in the checkpoint")
    for m in sorted(set(models) & set(ck_models)):
        changed = [f"{k} {ck_models[m].get(k)} -> {models[m].get(k)}" for k in (*SHAPE_KEYS, "params")
                   if ck_models[m].get(k) != models[m].get(k)]
        if changed:
            diffs.append(f"model '{m}' has other shapes ({', '.join(changed)})")
    ck_alg, alg = got.get("algorithm", {}), want["algorithm"]
    ck_train, train = ck_alg.get("train", {}), alg["train"]
    if sorted(ck_train) != sorted(train):
        diffs.append(f"trained models: {', '.join(sorted(ck_train)) or 'none'} in the checkpoint, "
                     f"{', '.join(sorted(train)) or 'none'} in the program")
    for m in sorted(set(ck_train) & set(train)):
        if ck_train[m] != train[m]:
            diffs.append(f"model '{m}' trains on {', '.join(ck_train[m])} in the checkpoint, "
                         f"{', '.join(train[m])} in the program")
    if ck_alg.get("advantages", []) != alg["advantages"]:
        diffs.append(f"advantages: {', '.join(ck_alg.get('advantages', [])) or 'none'} in the checkpoint, "
                     f"{', '.join(alg['advantages']) or 'none'} in the program")
    if missing and not diffs:
        diffs.append(f"no saved state for worker(s) {', '.join(missing)} (another placement or -O level "
                     f"wrote it: {', '.join(got.get('workers', []))})")
    if got.get("step") != meta.get("step") or not name.endswith(f"_{meta.get('step')}"):
        diffs.append(f"its job.json says step {meta.get('step')} and its manifest step {got.get('step')}")
    if diffs:
        who = f"'{got.get('module')}'" + (f" (the program is '{plan.module}')"
                                          if got.get("module") != plan.module else "")
        raise CheckpointMismatch(f"--resume: checkpoint {path} was written by {who} and does not match "
                                 f"this program: " + "; ".join(diffs),
                                 "resume it with the program (or job) that wrote it, or start a new run "
                                 "in another folder (--out) without --resume")
    notes = []
    if got.get("rlhfc_version") != __version__:
        notes.append(f"checkpoint {name} was written by rlhfc {got.get('rlhfc_version')}, "
                     f"this is rlhfc {__version__}")
    if got.get("program") != want["program"]:
        notes.append(f"the program changed since checkpoint {name} (same models and algorithm); "
                     "resuming with this job")
    return notes
