"""The plan: how a program runs, as typed attributes on the IR, and the rules every reader shares.

Passes record their decisions as stage and module annotations (``annot {...}``
in the text form). This module is their single home: each plan attribute is a
typed class that parses itself from its annotation value, prints itself back
and verifies itself against the module, and every reader of a plan — passes,
the cost model and simulator, ``explain``, code generation — reads it through
the functions here, so no two of them can disagree about a default.

| annotation            | on                 | class / type                  |
| --------------------- | ------------------ | ----------------------------- |
| ``mesh``              | model stages       | :class:`Mesh`                 |
| ``parallel``          | model stages       | :class:`Parallel`             |
| ``microbatches``      | model stages       | int >= 1                      |
| ``recompute``         | train stages       | :class:`Recompute`            |
| ``overlap``           | any stage          | int group id                  |
| ``stream``            | generate           | :class:`Stream`               |
| ``stream_from``       | forward consumers  | name of the streamed rollout  |
| ``overcommit``        | generate           | :class:`Overcommit`           |
| ``tail``              | streamed generate  | :class:`Tail`                 |
| ``fused``             | train              | :class:`Fused`                |
| ``async_rollout``     | generate           | :class:`AsyncRollout`         |
| ``unpad``             | generate, train    | bool                          |
| ``logprobs``          | generate           | bool                          |
| ``engine``            | generate           | a registered engine with ``auto`` traits (``rollout = auto``'s choice; absent = the default) |
| ``refit_mb``          | generate           | int >= 1 (an own-weights engine's refit bucket, MiB) |
| ``gpu_memory``        | generate           | float in (0, 1] (a CUDA engine's share of its GPU) |
| ``threads``           | CPU worker stages  | int >= 1 (the ``threads`` pass's cap)          |
| ``offload``           | train              | bool (optimizer state and step on the host: the ``offload`` pass) |
| ``strategy`` (module) | module             | one of :data:`STRATEGIES`     |
| ``changes_training`` (module) | module     | list of notes (passes that change what trains) |

Each is read and written through the functions here (``threads_cap``, ``refit_mb``, ``gpu_memory``,
``changes_training`` and their setters); a malformed value is a located error of the verifier
(:func:`verify_plan`), and its reader gives the default.

A model's fixed layout (the program's ``layout(...)`` clause, ``Model.layout``) is read as a
:class:`Parallel` by :func:`fixed_layout`; the trainer and layout each worker runs come from
:func:`worker_layout` (``run { trainer = ... }`` resolved per model by :func:`resolve_trainer`).

A ``sync`` stage's destination is an op attribute (``to_first``/``to_count``),
read as a :class:`Sync`. Absent annotations take the defaults the runtime uses
(see :func:`stage_mesh`, :func:`stage_layout`).

The single lists (-O levels, placement strategies, recompute policies, weight
transports) and the single rules (:func:`stage_mesh`, :func:`worker_key`,
:func:`workers`, :func:`stream_consumers`, :func:`sync_destination`,
:func:`device_shares`) live here too, and the hardware rules of meshes and splits
(:mod:`rlhfc.ir.plan.hardware`: node-aligned meshes, tp inside a node dividing the heads, pp dividing the layers).
"""

from __future__ import annotations

from .attrs import BASELINES, placement_problem
from .attrs import (AUTO, LAYOUT_FACTORS, OPT_LEVELS, PLACEMENTS, PROXIMAL_METHODS, RECOMPUTE_POLICIES, STRATEGIES, TRANSPORTS,
                    rollouts, trainers, WORKER_FAMILIES, AsyncRollout, Layout, Mesh, Overcommit, Parallel, PlanError, Recompute,
                    Stream, Sync, Tail, Fused, describe, opt_level)
from .check import verify_plan
from .hardware import aligned_sizes, layout_problems, mesh_aligned, splits, tp_within_nodes
from .rollout import ENGINE_KEY, auto_engine, engine_problem, head_problem, installed, model_engine, stage_engine, verify_rollout
from .rules import (Worker, async_rollout, can_run_ahead, generates_ahead, multi_turn, refills, staleness, backend_traits, changes_training, device_shares, gpu_memory, note_changes_training, unnote_changes_training,
                    refit_mb, set_gpu_memory, set_refit_mb, set_threads_cap, threads_cap, offload, set_offload, fixed_layout, flag, home_mesh, is_reshard, layout_signature, mesh,
                    microbatches, on_worker, overcommit, overcommit_delta, overlap_group, policy_temperature,
                    recompute, recompute_decision, set_flag, set_layout, set_overlap, set_recompute, unset,
                    set_strategy, set_stream_from, stage_layout, stage_mesh, stage_worker, strategy, stream, tail, fused, set_tail, set_fused,
                    stream_chunk, stream_consumers, stream_source, streams, sync_destination, worker_key, worker_name,
                    worker_ranks, workers, planned_layout, resolve_trainer, worker_layout)

__all__ = [
    "BASELINES", "placement_problem", "unset",
    "aligned_sizes", "layout_problems", "mesh_aligned", "splits", "tp_within_nodes",
    "AUTO", "LAYOUT_FACTORS", "backend_traits", "fixed_layout", "changes_training", "gpu_memory",
    "note_changes_training", "unnote_changes_training", "layout_signature", "refit_mb", "set_gpu_memory", "set_refit_mb", "set_threads_cap", "threads_cap", "offload", "set_offload", "planned_layout", "resolve_trainer", "worker_layout",
    "OPT_LEVELS", "PLACEMENTS", "RECOMPUTE_POLICIES", "rollouts", "STRATEGIES", "trainers", "TRANSPORTS", "WORKER_FAMILIES",
    "verify_rollout", "auto_engine", "head_problem", "installed", "ENGINE_KEY", "model_engine", "stage_engine", "engine_problem",
    "AsyncRollout", "PROXIMAL_METHODS", "async_rollout", "can_run_ahead", "generates_ahead", "multi_turn", "refills", "staleness", "Layout", "Mesh", "Overcommit", "Parallel", "PlanError", "Recompute", "Stream", "Sync", "Tail", "tail", "Fused", "fused", "set_tail", "set_fused", "Worker", "describe",
    "opt_level", "verify_plan", "device_shares", "flag", "home_mesh", "mesh", "microbatches", "on_worker",
    "overcommit", "overcommit_delta", "overlap_group", "policy_temperature", "recompute", "recompute_decision",
    "set_recompute", "set_flag", "set_layout",
    "set_overlap", "set_strategy", "set_stream_from", "stage_layout", "stage_mesh", "stage_worker", "strategy",
    "is_reshard", "stream", "stream_chunk", "stream_consumers", "stream_source", "streams", "sync_destination",
    "worker_key", "worker_name", "worker_ranks", "workers",
]
