"""Checkpoints of a run folder: save, resume, find the latest — atomically.

Layout (under ``OUT/checkpoints``)::

    step_K/<worker>/       weights.safetensors, state.safetensors, state.json (written by the worker)
    step_K/job.json        driver state: step, data cursors, overcommit carry, module, seed
    latest                 name of the newest complete checkpoint

A checkpoint is written to ``step_K.tmp`` and renamed when complete, and ``latest`` is replaced
atomically after it, so a crash never leaves a half checkpoint or loses an old one; none is deleted.
"""

from __future__ import annotations

import json
import os
import shutil

from .cluster import import_ray
from .group import WorkerGroup


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
    return path if os.path.isfile(os.path.join(path, "job.json")) else None


def save_checkpoint(root: str, step: int, workers: dict[str, WorkerGroup], meta: dict) -> str:
    """Write ``step_{step}``: every worker group saves its model, ``meta`` goes to job.json; returns its path."""
    ray = import_ray()
    final = os.path.join(root, f"step_{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ray.get([group.save.remote(os.path.join(tmp, name)) for name, group in workers.items()])
    with open(os.path.join(tmp, "job.json"), "w") as fh:
        json.dump(meta, fh)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_atomic(os.path.join(root, "latest"), f"step_{step}\n")
    return final


def load_checkpoint(path: str, workers: dict[str, WorkerGroup]) -> dict:
    """Load every worker group's model from checkpoint ``path``; returns its job.json."""
    ray = import_ray()
    with open(os.path.join(path, "job.json")) as fh:
        meta = json.load(fh)
    ray.get([group.load.remote(os.path.join(path, name)) for name, group in workers.items()])
    return meta


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` by ``text`` in one step (write ``path.tmp``, then rename)."""
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.replace(path + ".tmp", path)
