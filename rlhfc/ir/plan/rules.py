"""Plan rules: reading and writing a stage's plan, where it runs, what streams to what, which workers run.

Why this file is long: it is the one place a stage's plan annotations are read and written (tests/test_layers.py
keeps every other module off them), so each new plan attribute adds its reader and setter here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfc.contract.engines import DEFAULT_TRAINER, TrainTraits, auto_backend, train_backends, train_traits

from ..core import Graph, Model, Module, Stage
from .attrs import (AUTO, STRATEGIES, WORKER_FAMILIES, AsyncRollout, Layout, Mesh, Overcommit, Parallel, PlanError,
                    Recompute, Stream, Sync, Tail, Fused, _is_int)

# -- reading a plan -------------------------------------------------------------------------------------


def _read(stage: Stage, cls, *args):
    value = stage.annotations.get(cls.key)
    if value is None:
        return None
    try:
        return cls.parse(value, *args)
    except PlanError:
        return None


def mesh(stage: Stage) -> Mesh | None:
    """The stage's own ``mesh`` annotation (None if absent or malformed)."""
    return _read(stage, Mesh)


def stream(stage: Stage) -> Stream | None:
    return _read(stage, Stream) if stage.op == "generate" else None


def fused(stage: Stage) -> Fused | None:
    """A train stage's fused pipeline schedule with another model's (the ``fuse_training`` pass), if any."""
    return _read(stage, Fused) if stage.op == "train" else None


def set_fused(stage: Stage, value: Fused | None) -> None:
    """Mark (or, None, unmark) a train stage's fused schedule."""
    if value is None:
        stage.annotations.pop(Fused.key, None)
    else:
        stage.annotations[Fused.key] = value.print()


def set_tail(stage: Stage, value: Tail | None) -> None:
    """Mark (or, None, unmark) a streamed generate's long-tail migration."""
    if value is None:
        stage.annotations.pop(Tail.key, None)
    else:
        stage.annotations[Tail.key] = value.print()


def tail(stage: Stage) -> Tail | None:
    """A streamed generate's long-tail migration (the ``tail_migrate`` pass), if any."""
    return _read(stage, Tail) if stage.op == "generate" else None


def stream_chunk(stage: Stage) -> int | None:
    s = stream(stage)
    return s.chunk if s else None


def overcommit(stage: Stage) -> Overcommit | None:
    return _read(stage, Overcommit) if stage.op == "generate" else None


def async_rollout(module: Module, stage: Stage) -> AsyncRollout | None:
    """How far the generate ``stage`` may run ahead of training: its ``async_rollout`` annotation (the pass's
    decision), else the program's ``run { staleness = K }`` with the default cap; None when synchronous
    (staleness 0, or a generate of a frozen model: no newer weights to wait for)."""
    k = module.staleness_of(stage)
    if not k:
        return None
    got = _read(stage, AsyncRollout)
    return AsyncRollout(k, got.behaviour_cap, got.proximal) if got else AsyncRollout(k)


def can_run_ahead(module: Module, gen: Stage) -> bool:
    """Whether a generate stage can run ahead of training (asynchronous rollout): a trained model's, drawing
    prompts no other stage reads (the driver draws them per generation it launches), in a pipeline that does
    not refill its sampling round (DAPO's dynamic sampling re-runs it)."""
    g = module.graph
    if gen.op != "generate" or gen.target not in module.trainable_models() or not gen.inputs:
        return False
    load = g.producer(gen.inputs[0])
    if load.op != "load" or len(g.users(load.outputs[0])) != 1:
        return False
    return not refills(g)


def multi_turn(stage: Stage) -> bool:
    """Whether a generate runs a multi-turn loop (tools between the policy's turns): its rows are
    trajectories the worker builds whole, so it is not streamed in chunks nor overcommitted."""
    return stage.op == "generate" and (bool(stage.attrs.get("tools")) or bool(stage.attrs.get("env"))
                                       or stage.attrs.get("max_turns", 1) != 1)


def refills(graph: Graph) -> bool:
    """Whether the pipeline refills its sampling round (DAPO's dynamic sampling, ``max_refill``)."""
    return any(s.op == "compute.group_advantages" and s.attrs.get("max_refill") for s in graph.stages)


def generates_ahead(module: Module, model: str) -> bool:
    """Whether a generate stage of ``model`` runs ahead of training (its weight syncs are then not awaited)."""
    return any(async_rollout(module, s) is not None for s in module.graph.stages_on(model))


def staleness(module: Module, stage: Stage) -> int:
    """The staleness bound of a generate stage (0: synchronous)."""
    return module.staleness_of(stage)


def overcommit_delta(stage: Stage) -> int:
    o = overcommit(stage)
    return o.delta if o else 0


def recompute(stage: Stage) -> str:
    """The stage's coarse recompute policy (none / selective / full; a traced decision: see
    :func:`recompute_decision`)."""
    r = _read(stage, Recompute)
    return r.coarse if r else "none"


def recompute_decision(stage: Stage) -> Recompute | None:
    """The stage's recompute annotation, when it is set (a coarse policy or a traced decision)."""
    return _read(stage, Recompute) if stage.op == "train" else None


def layout_signature(stage: Stage) -> tuple | None:
    """The raw values of the annotations a stage's layout is read from (``mesh``, ``parallel``,
    ``microbatches``, ``recompute``), for memoising what depends on them; None when the stage has no mesh of
    its own (its layout then depends on its model's other stages: :func:`home_mesh`)."""
    a = stage.annotations
    if Mesh.key not in a:
        return None
    return (str(a[Mesh.key]), str(a.get(Parallel.key)), a.get("microbatches"), str(a.get(Recompute.key)))


def set_recompute(stage: Stage, decision: Recompute) -> None:
    """Annotate a train stage with ``decision`` (``none`` without numbers: the annotation is removed)."""
    value = decision.print()
    if value == "none":
        stage.annotations.pop(Recompute.key, None)
    else:
        stage.annotations[Recompute.key] = value


def overlap_group(stage: Stage) -> int | None:
    g = stage.annotations.get("overlap")
    return g if _is_int(g) else None


def flag(stage: Stage, name: str) -> bool:
    """A boolean annotation (``unpad``, ``logprobs``), false when absent."""
    return stage.annotations.get(name) is True


def microbatches(stage: Stage) -> int:
    m = stage.annotations.get("microbatches")
    return m if _is_int(m) and m >= 1 else 1


def threads_cap(stage: Stage) -> int | None:
    """The ``threads`` pass's cap on the torch threads a CPU stage runs with (None: no cap, or malformed)."""
    n = stage.annotations.get("threads")
    return n if _is_int(n) and n >= 1 else None


def set_threads_cap(stage: Stage, n: int | None) -> None:
    if n is None:
        stage.annotations.pop("threads", None)
    else:
        stage.annotations["threads"] = int(n)


def offload(stage: Stage) -> bool:
    """Whether a train stage keeps its model's optimizer state, and runs the optimizer step, on the host
    (``offload = true``, the ``offload`` pass: where the plan does not fit otherwise)."""
    return stage.op == "train" and stage.annotations.get("offload") is True


def set_offload(stage: Stage, on: bool) -> None:
    if on:
        stage.annotations["offload"] = True
    else:
        stage.annotations.pop("offload", None)


def refit_mb(stage: Stage) -> int | None:
    """The refit bucket size (MiB) the ``realloc`` pass gave a generate stage whose engine holds its own weights
    (None: not marked, or malformed; the runtime's default is 64)."""
    n = stage.annotations.get("refit_mb")
    return n if _is_int(n) and n >= 1 else None


def set_refit_mb(stage: Stage, mb: int | None) -> None:
    if mb is None:
        stage.annotations.pop("refit_mb", None)
    else:
        stage.annotations["refit_mb"] = int(mb)


def gpu_memory(stage: Stage) -> float | None:
    """The share of its GPU a CUDA rollout engine starts with (``gpu_memory``; None: not marked, or malformed)."""
    f = stage.annotations.get("gpu_memory")
    ok = isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f <= 1
    return float(f) if ok else None


def set_gpu_memory(stage: Stage, share: float | None) -> None:
    if share is None:
        stage.annotations.pop("gpu_memory", None)
    else:
        stage.annotations["gpu_memory"] = float(share)


def changes_training(module: Module) -> list[str]:
    """The notes of the passes that change what the job trains on (module annotation ``changes_training``)."""
    notes = module.annotations.get("changes_training")
    return [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else []


def note_changes_training(module: Module, note: str) -> None:
    notes = changes_training(module)
    if note not in notes:
        module.annotations["changes_training"] = notes + [note]


def unnote_changes_training(module: Module, note: str) -> None:
    """Take back a pass's note (a later pass undid all it changed)."""
    notes = [n for n in changes_training(module) if n != note]
    if notes:
        module.annotations["changes_training"] = notes
    else:
        module.annotations.pop("changes_training", None)


def strategy(module: Module) -> str | None:
    s = module.annotations.get("strategy")
    return s if s in STRATEGIES else None


def on_worker(module: Module, stage: Stage) -> bool:
    """Whether the stage runs on a model's worker (not on the driver)."""
    return stage.target in module.models and stage.op.split(".", 1)[0] in WORKER_FAMILIES


def fixed_layout(model: Model | None) -> Parallel | None:
    """The layout a model's ``layout(...)`` clause fixes (None when it has none, or a malformed one: the
    verifier reports that)."""
    value = getattr(model, "layout", None)
    if value is None:
        return None
    try:
        return Parallel.parse_fixed(value)
    except PlanError:
        return None


def home_mesh(module: Module, model: str) -> Mesh:
    """Where a model's weights are authoritative: its train stage's mesh, else its first stage's with a
    mesh, else the first dp·tp·pp devices for a model with a fixed layout that fits the cluster, else the
    whole cluster (the flattened default)."""
    stages = module.graph.stages_on(model)
    for s in [s for s in stages if s.op == "train"] + [s for s in stages if s.op != "train"]:
        m = mesh(s)
        if m is not None:
            return m
    total = module.cluster.num_devices
    fixed = fixed_layout(module.models.get(model))
    if fixed is not None and _is_int(total) and fixed.size <= total:
        return Mesh(0, fixed.size)
    return Mesh(0, total)


def stage_mesh(module: Module, stage: Stage) -> Mesh:
    """The devices a stage runs on: its ``mesh``, else its model's :func:`home_mesh` (the whole cluster for
    a stage on no model)."""
    m = mesh(stage)
    if m is not None:
        return m
    if stage.target in module.models:
        return home_mesh(module, stage.target)
    return Mesh(0, module.cluster.num_devices)

def stage_layout(module: Module, stage: Stage) -> Layout:
    """The layout a stage runs with: :func:`stage_mesh`, its ``parallel`` split (when absent: its model's
    fixed layout if that fills the mesh, else pure data parallelism), ``microbatches`` and ``recompute``."""
    m = stage_mesh(module, stage)
    fixed = fixed_layout(module.models.get(stage.target or ""))
    if fixed is not None and fixed.size != m.count:
        fixed = None
    par = _read(stage, Parallel, m.count) or fixed or Parallel(max(1, m.count), 1, 1)
    return Layout(m.first, m.count, par.dp, par.tp, par.pp, microbatches(stage), recompute(stage))


def set_layout(stage: Stage, layout: Layout, *, parallel: bool = True) -> None:
    """Write a layout's annotations on a stage (``mesh``, and ``parallel``/``microbatches``/``recompute``
    unless ``parallel`` is false); defaults are left out of the text."""
    stage.annotations[Mesh.key] = layout.mesh.print()
    if not parallel:
        return
    stage.annotations[Parallel.key] = Parallel(layout.dp, layout.tp, layout.pp).print()
    decided = _read(stage, Recompute)
    for key, value, default in (("microbatches", layout.microbatches, 1), ("recompute", layout.recompute, "none")):
        if key == "recompute" and decided is not None and decided.coarse == value and decided.print() != value:
            continue   # a traced decision (the recompute pass) that agrees with the layout stays
        if value != default:
            stage.annotations[key] = value
        else:
            stage.annotations.pop(key, None)


def unset(stage: Stage, *keys: str) -> None:
    """Remove the annotations ``keys`` of ``stage`` (a decision a later pass takes back)."""
    for key in keys:
        stage.annotations.pop(key, None)


def set_flag(stage: Stage, name: str) -> None:
    """Set a boolean annotation (``unpad``, ``logprobs``)."""
    stage.annotations[name] = True


def set_overlap(stage: Stage, group: int | None) -> None:
    """Put the stage in overlap group ``group`` (None: in none)."""
    if group is None:
        stage.annotations.pop("overlap", None)
    else:
        stage.annotations["overlap"] = group


def set_stream_from(consumer: Stage, generate: Stage) -> None:
    """Make ``consumer`` run chunk by chunk inside ``generate``'s stream."""
    consumer.annotations["stream_from"] = generate.outputs[0].name


def set_strategy(module: Module, name: str) -> None:
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    module.annotations["strategy"] = name


def sync_destination(module: Module, stage: Stage) -> Mesh | None:
    """The mesh a ``sync`` stage writes to, clipped to the cluster (None for other stages)."""
    sy = Sync.of(stage)
    if sy is None:
        return None
    total = module.cluster.num_devices
    return Mesh(sy.dest.first, max(1, min(sy.dest.count, total - sy.dest.first)))


def is_reshard(module: Module, stage: Stage) -> bool:
    """Whether ``stage`` is a ``sync`` onto its own mesh: the worker group reshards its training layout (tp/pp
    pieces, FSDP shards) into its generation layout, a full copy of the weights on every rank."""
    dest = sync_destination(module, stage)
    return dest is not None and dest == stage_mesh(module, stage)


def stream_source(graph: Graph, stage: Stage) -> Stage | None:
    """The streamed generate a consumer takes its chunks from (its ``stream_from`` annotation)."""
    name = stage.annotations.get("stream_from")
    if not isinstance(name, str):
        return None
    for s in graph.stages:
        if s.op == "generate" and s.outputs and s.outputs[0].name == name:
            return s
    return None


def stream_consumers(graph: Graph, generate: Stage) -> list[Stage]:
    """The stages that run chunk by chunk inside ``generate``'s stream, in graph order."""
    roll = generate.outputs[0].name
    return [s for s in graph.stages if s.annotations.get("stream_from") == roll]


def streams(stage: Stage) -> bool:
    """Whether a generate stage runs as a stream (chunked and/or overcommitted)."""
    return stage.op == "generate" and (stream(stage) is not None or overcommit(stage) is not None)


def policy_temperature(graph: Graph, loss: Stage) -> float:
    """The temperature a ``compute.ppo_clip`` recomputes log-probs at: the one its old log-probs were
    computed at (a ``forward.logprobs`` or ``compute.sample_logprobs`` operand), else 1."""
    producer = graph.producer(loss.inputs[1])
    if producer.op in ("forward.logprobs", "compute.sample_logprobs"):
        return float(producer.attrs.get("temperature", 1.0))
    return 1.0


# -- workers ---------------------------------------------------------------------------------------------


def worker_key(module: Module, stage: Stage) -> tuple[str, Mesh]:
    """The worker that runs a model stage: one per (model, mesh), as the runtime starts them."""
    return stage.target, stage_mesh(module, stage)


def worker_name(module: Module, model: str, where: Mesh) -> str:
    """The worker hosting ``model`` on ``where``: the model's name at home, ``model_at_F_N`` for a copy."""
    return model if where == home_mesh(module, model) else f"{model}_at_{where.first}_{where.count}"


def stage_worker(module: Module, stage: Stage) -> str:
    return worker_name(module, *worker_key(module, stage))


@dataclass(frozen=True)
class Worker:
    """A worker the runtime starts: ``model`` on ``mesh``, pinned to ``cores`` of ``node`` (the mesh's
    devices on its first node; ``devices`` are their global indices), with its ``share`` of them and its
    torch ``threads``: one per core of its mesh on that node, what a stage that runs alone uses (a stage that
    may overlap stages of other workers on the same cores gets fewer: :func:`rlhfc.ir.schedule.stage_threads`);
    a multi-rank group's ranks run one thread each, pinned to one core each. It runs as ``ranks`` = dp·tp·pp processes of ``trainer`` (``torch``: one process,
    dp = tp = pp = 1; see :func:`worker_layout`)."""

    name: str
    model: str
    mesh: Mesh
    node: int
    cores: tuple[int, ...]
    devices: tuple[int, ...]
    share: float
    threads: int
    ranks: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    trainer: str = "torch"


def workers(module: Module) -> dict[tuple[str, Mesh], Worker]:
    """Every worker the runtime starts, keyed by (model, mesh): one per mesh a model's stages run on, plus
    the destination of each ``sync``. A worker occupies its mesh's devices on the mesh's first node (one
    Ray bundle per node); a device used by k workers gives each 1/k (:func:`device_shares`). It runs the
    trainer and layout :func:`worker_layout` says, as dp·tp·pp processes."""
    c = module.cluster
    found: dict[tuple[str, Mesh], tuple[int, tuple[int, ...]]] = {}
    for s in module.graph.stages:
        if not on_worker(module, s):
            continue
        meshes = [stage_mesh(module, s)]
        dest = sync_destination(module, s)
        if dest is not None:
            meshes.append(dest)
        for m in meshes:
            node, start = m.first // c.per_node, m.first % c.per_node
            found.setdefault((s.target, m), (node, tuple(range(start, min(c.per_node, start + m.count)))))
    shares = device_shares({key: [(node, core) for core in cores] for key, (node, cores) in found.items()})
    out = {}
    for (model, m), (node, cores) in found.items():
        sh = shares[(model, m)]
        trainer, par = worker_layout(module, model, m)
        out[(model, m)] = Worker(worker_name(module, model, m), model, m, node, cores,
                                 tuple(node * c.per_node + core for core in cores), sh["share"],
                                 len(cores) if par.size == 1 else 1,   # a group's ranks: one pinned core each
                                 par.size, par.dp, par.tp, par.pp, trainer)
    return out


def resolve_trainer(trainer: str, layout: Parallel) -> str:
    """The train backend that runs a model of ``layout`` under ``run { trainer = ... }``: ``auto`` — the
    registered backend of lowest ``auto_rank`` that runs the layout (megatron when tp or pp > 1, fsdp when
    dp > 1, torch otherwise); a named backend as named, or on one rank its ``solo`` backend (fsdp: torch, one
    rank needs no sharding)."""
    if trainer == AUTO:
        return auto_backend(layout.dp, layout.tp, layout.pp)
    traits = backend_traits(trainer)
    if traits.solo and layout.size == 1:
        return traits.solo
    return trainer


def backend_traits(trainer: str) -> TrainTraits:
    """The traits of train backend ``trainer`` (the default backend's for a name no backend registered: the
    verifier reports the name)."""
    return train_traits(trainer if trainer in train_backends() else DEFAULT_TRAINER)


def planned_layout(module: Module, model: str, where: Mesh) -> Parallel:
    """The layout the plan gives ``model`` on ``where``: its fixed layout (``layout(...)``), else its train
    stage's split there, else the largest split of its stages there (1 x 1 x 1 with none)."""
    fixed = fixed_layout(module.models.get(model))
    if fixed is not None:
        return fixed
    on = [s for s in module.graph.stages_on(model) if on_worker(module, s) and s.op != "sync"
          and stage_mesh(module, s) == where]
    train = [s for s in on if s.op == "train"]
    splits = [Parallel(lay.dp, lay.tp, lay.pp) for lay in (stage_layout(module, s) for s in (train or on))]
    return max(splits, key=lambda p: (p.size, p.dp), default=Parallel(1, 1, 1))


def worker_layout(module: Module, model: str, where: Mesh) -> tuple[str, Parallel]:
    """(trainer, layout) that runs ``model`` on ``where``: :func:`resolve_trainer` of the run's trainer and
    :func:`planned_layout`; on a one-process backend (``torch``) the layout that runs is 1 x 1 x 1."""
    par = planned_layout(module, model, where)
    trainer = resolve_trainer(module.run.trainer, par)
    return trainer, (par if backend_traits(trainer).dims else Parallel(1, 1, 1))


def worker_ranks(module: Module, model: str, where: Mesh) -> int:
    """How many processes run ``model`` on ``where``: dp·tp·pp of :func:`worker_layout` (1 under torch)."""
    return worker_layout(module, model, where)[1].size


def device_shares(devices_by_worker: dict) -> dict:
    """Each worker's ``share`` of its devices (a device used by k workers gives each 1/k; Ray's resource
    accounting) and the whole cores of that share (``threads``). Devices are any hashable ids."""
    load: dict = {}
    for devices in devices_by_worker.values():
        for d in devices:
            load[d] = load.get(d, 0) + 1
    out = {}
    for key, devices in devices_by_worker.items():
        share = sum(1.0 / load[d] for d in devices)
        out[key] = {"share": share, "threads": max(1, int(share + 1e-9))}
    return out
