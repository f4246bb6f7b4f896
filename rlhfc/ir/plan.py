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
| ``unpad``             | generate, train    | bool                          |
| ``logprobs``          | generate           | bool                          |
| ``strategy`` (module) | module             | one of :data:`STRATEGIES`     |

A ``sync`` stage's destination is an op attribute (``to_first``/``to_count``),
read as a :class:`Sync`. Absent annotations take the defaults the runtime uses
(see :func:`stage_mesh`, :func:`stage_layout`).

The single lists (-O levels, placement strategies, recompute policies, weight
transports) and the single rules (:func:`stage_mesh`, :func:`worker_key`,
:func:`workers`, :func:`stream_consumers`, :func:`sync_destination`,
:func:`device_shares`) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .core import Cluster, Graph, Module, Stage, Symbol
from .diagnostics import CompileError, Diagnostic, DiagnosticSink

# -- the single lists ---------------------------------------------------------------------------------

#: optimisation levels, in order (``rlhfc.passes.pipelines`` says which passes each runs)
OPT_LEVELS = ("O0", "O1", "O2", "O3")
#: placement strategies a plan can have (the module's ``strategy`` annotation)
STRATEGIES = ("flatten", "interleave", "separate", "search")
#: what a program's ``run { placement = ... }`` and ``--placement`` accept
PLACEMENTS = ("auto",) + STRATEGIES
#: activation recomputation policies of a training stage, cheapest in memory last
RECOMPUTE_POLICIES = ("none", "selective", "full")
#: how a ``sync`` stage moves weights
TRANSPORTS = ("object_store", "collective")
#: op families whose stages run on a model's worker
WORKER_FAMILIES = ("generate", "forward", "train", "sync")


def opt_level(text) -> str:
    """The canonical name of an -O level: ``"O2"``, ``"o2"``, ``"2"`` → ``"O2"``; a located-free
    :class:`CompileError` with the levels as a hint otherwise."""
    raw = str(text).strip()
    key = raw.upper() if raw[:1] in ("O", "o") else f"O{raw}"
    if key not in OPT_LEVELS:
        raise CompileError([Diagnostic("error", f"unknown optimisation level '{text}'", None,
                                       f"levels: {', '.join(OPT_LEVELS)} (-O0 … -O{len(OPT_LEVELS) - 1})")])
    return key


# -- typed attributes ---------------------------------------------------------------------------------


class PlanError(ValueError):
    """A malformed or inconsistent plan attribute: ``message`` and a ``hint`` saying how to fix it."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def describe(value) -> str:
    """A value as a diagnostic names it (``string 'a'``, ``int 3``, ``bool true``)."""
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, Symbol):
        return f"symbol {value}"
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class Mesh:
    """Devices ``first .. first+count-1`` of the cluster (node-major)."""

    first: int
    count: int
    key: ClassVar[str] = "mesh"

    @property
    def devices(self) -> range:
        return range(self.first, self.first + self.count)

    def pair(self) -> tuple[int, int]:
        return self.first, self.count

    @classmethod
    def parse(cls, value, cluster: Cluster | None = None) -> "Mesh":
        total = cluster.num_devices if cluster is not None and _is_int(cluster.num_devices) else None
        span = f"devices 0..{total - 1}" if total else "no devices"
        where = f" (the cluster @{cluster.name} has {span})" if cluster is not None else ""
        if not isinstance(value, dict) or set(value) != {"first", "count"} \
                or not all(_is_int(value[k]) for k in ("first", "count")):
            raise PlanError(f"mesh must be {{first = I, count = N}} with integers, got {describe(value)}",
                            f"e.g. mesh = {{first = 0, count = {total or 1}}}{where}")
        mesh = cls(value["first"], value["count"])
        if mesh.first < 0 or mesh.count < 1:
            raise PlanError(f"mesh needs first >= 0 and count >= 1, got first = {mesh.first}, count = {mesh.count}",
                            f"e.g. mesh = {{first = 0, count = {total or 1}}}")
        if total is not None and mesh.first + mesh.count > total:
            fit = max(total - mesh.first, 0)
            raise PlanError(f"mesh {{first = {mesh.first}, count = {mesh.count}}} covers devices "
                            f"{mesh.first}..{mesh.first + mesh.count - 1} but cluster @{cluster.name} has {span} "
                            f"({cluster.nodes} x {cluster.per_node})",
                            f"use count = {fit} from first = {mesh.first}" if fit else
                            f"start the mesh at a device below {total}, e.g. mesh = {{first = 0, count = "
                            f"{min(mesh.count, total)}}}")
        return mesh

    def print(self) -> dict:
        return {"first": self.first, "count": self.count}


@dataclass(frozen=True)
class Parallel:
    """A mesh's split: ``dp`` data-parallel replicas × ``tp`` tensor × ``pp`` pipeline ranks.

    In the text form missing ``tp``/``pp`` are 1 and a missing ``dp`` fills the mesh; :meth:`parse`
    resolves them against the mesh size, so a parsed value is complete."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    key: ClassVar[str] = "parallel"

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, value, mesh_count: int | None = None) -> "Parallel":
        """Read the annotation; a missing ``dp`` fills ``mesh_count`` (see :meth:`verify` for consistency)."""
        if not isinstance(value, dict) or not value or set(value) - {"dp", "tp", "pp"} \
                or not all(_is_int(v) and v >= 1 for v in value.values()):
            raise PlanError(f"parallel must be {{dp = D, tp = T, pp = P}} with integers >= 1, got {describe(value)}",
                            "e.g. parallel = {dp = 2, tp = 4, pp = 1} (missing tp/pp default to 1)")
        tp, pp = value.get("tp", 1), value.get("pp", 1)
        return cls(value.get("dp", max(1, mesh_count // (tp * pp)) if mesh_count else 1), tp, pp)

    def verify(self, mesh_count: int | None, model=None) -> list[PlanError]:
        """What is wrong with this split on a mesh of ``mesh_count`` devices for ``model``."""
        dp, tp, pp = self.dp, self.tp, self.pp
        errors = []
        if mesh_count is not None and self.size != mesh_count:
            hint = f"dp * tp * pp must equal the mesh size {mesh_count}"
            if mesh_count % (tp * pp) == 0:
                hint += f": with tp = {tp}, pp = {pp} use dp = {mesh_count // (tp * pp)}"
            else:
                hint += f"; tp * pp = {tp * pp} does not divide {mesh_count}: choose tp and pp whose product divides it"
            errors.append(PlanError(f"parallel dp = {dp}, tp = {tp}, pp = {pp} uses {self.size} devices but the "
                                    f"mesh has {mesh_count}", hint))
        if model is not None and _is_int(model.heads) and model.heads >= 1 and model.heads % tp:
            ok = [t for t in range(1, model.heads + 1) if model.heads % t == 0]
            errors.append(PlanError(f"tp = {tp} does not divide the {model.heads} attention heads of @{model.name}",
                                    f"tensor parallelism splits the heads: tp must be one of {', '.join(map(str, ok))}"))
        if model is not None and _is_int(model.layers) and model.layers >= 1 and pp > model.layers:
            errors.append(PlanError(f"pp = {pp} is more pipeline stages than the {model.layers} layers of "
                                    f"@{model.name}", f"use pp <= {model.layers}"))
        return errors

    def print(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}


@dataclass(frozen=True)
class Stream:
    """``stream = {chunk = C}`` on a generate stage: finished samples go downstream C at a time."""

    chunk: int
    key: ClassVar[str] = "stream"

    @classmethod
    def parse(cls, value) -> "Stream":
        inner = value.get("chunk") if isinstance(value, dict) else value
        extra = sorted(set(value) - {"chunk"}) if isinstance(value, dict) else []
        if not _is_int(inner) or inner < 1 or extra:
            raise PlanError(f"stream must be {{chunk = N}} with an integer N >= 1, got {describe(value)}",
                            "write stream = {chunk = 4}")
        return cls(inner)

    def print(self) -> dict:
        return {"chunk": self.chunk}


@dataclass(frozen=True)
class Overcommit:
    """``overcommit = {delta = D, ...}`` on a generate stage: B+D prompts in flight, the first B to finish
    train, the rest carry over (``rlhfc.passes.overcommit`` documents the knobs)."""

    delta: int
    adaptive: bool | None = None
    min_delta: int | None = None
    max_delta: int | None = None
    max_staleness: int | None = None
    key: ClassVar[str] = "overcommit"
    KNOBS: ClassVar[tuple[str, ...]] = ("adaptive", "min_delta", "max_delta", "max_staleness")

    @classmethod
    def parse(cls, value) -> "Overcommit":
        inner = value.get("delta") if isinstance(value, dict) else value
        extra = sorted(set(value) - {"delta", *cls.KNOBS}) if isinstance(value, dict) else []
        if not _is_int(inner) or inner < 0 or extra:
            raise PlanError(f"overcommit must be {{delta = N}} with an integer N >= 0, got {describe(value)}",
                            "write overcommit = {delta = 4}")
        knobs = {k: value[k] for k in cls.KNOBS if isinstance(value, dict) and k in value}
        return cls(inner, **knobs)

    def print(self) -> dict:
        return {"delta": self.delta, **{k: getattr(self, k) for k in self.KNOBS if getattr(self, k) is not None}}


@dataclass(frozen=True)
class Recompute:
    """``recompute = "none" | "selective" | "full"`` on a training stage."""

    policy: str = "none"
    key: ClassVar[str] = "recompute"

    @classmethod
    def parse(cls, value) -> "Recompute":
        if value not in RECOMPUTE_POLICIES:
            raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, got {describe(value)}",
                            'write recompute = "selective"')
        return cls(value)

    def print(self) -> str:
        return self.policy


@dataclass(frozen=True)
class Sync:
    """A ``sync`` stage's transfer: its model's trained weights go to ``dest`` in buckets."""

    dest: Mesh
    bucket_mb: int = 64
    transport: str = "object_store"

    @classmethod
    def of(cls, stage: Stage) -> "Sync | None":
        """The stage's sync (None unless it is a ``sync`` stage with a valid destination)."""
        if stage.op != "sync":
            return None
        first, count = stage.attrs.get("to_first"), stage.attrs.get("to_count")
        if not (_is_int(first) and _is_int(count) and first >= 0 and count >= 1):
            return None
        return cls(Mesh(first, count), int(stage.attrs.get("bucket_mb", 64)),
                   str(stage.attrs.get("transport", "object_store")))

    def attrs(self) -> dict:
        return {"bucket_mb": self.bucket_mb, "to_first": self.dest.first, "to_count": self.dest.count,
                "transport": self.transport}


#: the stage annotations that hold a typed attribute
TYPED = {c.key: c for c in (Mesh, Parallel, Stream, Overcommit, Recompute)}


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


def stream_chunk(stage: Stage) -> int | None:
    s = stream(stage)
    return s.chunk if s else None


def overcommit(stage: Stage) -> Overcommit | None:
    return _read(stage, Overcommit) if stage.op == "generate" else None


def overcommit_delta(stage: Stage) -> int:
    o = overcommit(stage)
    return o.delta if o else 0


def recompute(stage: Stage) -> str:
    r = _read(stage, Recompute)
    return r.policy if r else "none"


def overlap_group(stage: Stage) -> int | None:
    g = stage.annotations.get("overlap")
    return g if _is_int(g) else None


def flag(stage: Stage, name: str) -> bool:
    """A boolean annotation (``unpad``, ``logprobs``), false when absent."""
    return stage.annotations.get(name) is True


def microbatches(stage: Stage) -> int:
    m = stage.annotations.get("microbatches")
    return m if _is_int(m) and m >= 1 else 1


def strategy(module: Module) -> str | None:
    s = module.annotations.get("strategy")
    return s if s in STRATEGIES else None


def on_worker(module: Module, stage: Stage) -> bool:
    """Whether the stage runs on a model's worker (not on the driver)."""
    return stage.target in module.models and stage.op.split(".", 1)[0] in WORKER_FAMILIES


def home_mesh(module: Module, model: str) -> Mesh:
    """Where a model's weights are authoritative: its train stage's mesh, else its first stage's with a
    mesh, else the whole cluster (the flattened default)."""
    stages = module.graph.stages_on(model)
    for s in [s for s in stages if s.op == "train"] + [s for s in stages if s.op != "train"]:
        m = mesh(s)
        if m is not None:
            return m
    return Mesh(0, module.cluster.num_devices)


def stage_mesh(module: Module, stage: Stage) -> Mesh:
    """The devices a stage runs on: its ``mesh``, else its model's :func:`home_mesh` (the whole cluster for
    a stage on no model)."""
    m = mesh(stage)
    if m is not None:
        return m
    if stage.target in module.models:
        return home_mesh(module, stage.target)
    return Mesh(0, module.cluster.num_devices)


@dataclass(frozen=True)
class Layout:
    """A stage's placement: devices ``first .. first+count-1`` (node-major) and its parallel split."""

    first: int
    count: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    recompute: str = "none"

    @property
    def devices(self) -> range:
        return range(self.first, self.first + self.count)

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.first, self.count)

    def nodes(self, per_node: int) -> list[int]:
        """The nodes the mesh touches."""
        return sorted({d // per_node for d in self.devices})

    def tp_inter_node(self, per_node: int) -> bool:
        """Whether one tensor-parallel group crosses a node boundary (groups are consecutive devices)."""
        return self.tp > 1 and (self.tp > per_node or self.first % per_node + self.tp > per_node)

    def dp_inter_node(self, per_node: int) -> bool:
        """Whether the data-parallel replicas (or pipeline stages) sit on more than one node."""
        return len(self.nodes(per_node)) > 1

    def same_placement(self, other: "Layout") -> bool:
        return (self.first, self.count, self.dp, self.tp, self.pp) == \
            (other.first, other.count, other.dp, other.tp, other.pp)

    def describe(self, per_node: int) -> str:
        last = self.first + self.count - 1
        nodes = self.nodes(per_node)
        where = f"{self.first}" if self.count == 1 else f"{self.first}-{last}"
        where += f" (node {nodes[0]})" if len(nodes) == 1 else f" (nodes {nodes[0]}-{nodes[-1]})"
        return where

    def parallel_text(self, cpu: bool = False) -> str:
        """``dp2 tp4 pp1`` (+ micro-batches, recompute); on CPU clusters the mesh's cores are one process's
        threads, so ``2 threads``."""
        text = f"{self.count} thread{'s' if self.count > 1 else ''}" if cpu else f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.microbatches > 1:
            text += f" mb{self.microbatches}"
        if self.recompute != "none":
            text += f" rc:{self.recompute}"
        return text


def stage_layout(module: Module, stage: Stage) -> Layout:
    """The layout a stage runs with: :func:`stage_mesh`, its ``parallel`` split (pure data parallelism when
    absent), ``microbatches`` and ``recompute``."""
    m = stage_mesh(module, stage)
    par = _read(stage, Parallel, m.count) or Parallel(max(1, m.count), 1, 1)
    return Layout(m.first, m.count, par.dp, par.tp, par.pp, microbatches(stage), recompute(stage))


def set_layout(stage: Stage, layout: Layout, *, parallel: bool = True) -> None:
    """Write a layout's annotations on a stage (``mesh``, and ``parallel``/``microbatches``/``recompute``
    unless ``parallel`` is false); defaults are left out of the text."""
    stage.annotations[Mesh.key] = layout.mesh.print()
    if not parallel:
        return
    stage.annotations[Parallel.key] = Parallel(layout.dp, layout.tp, layout.pp).print()
    for key, value, default in (("microbatches", layout.microbatches, 1), ("recompute", layout.recompute, "none")):
        if value != default:
            stage.annotations[key] = value
        else:
            stage.annotations.pop(key, None)


def sync_destination(module: Module, stage: Stage) -> Mesh | None:
    """The mesh a ``sync`` stage writes to, clipped to the cluster (None for other stages)."""
    sy = Sync.of(stage)
    if sy is None:
        return None
    total = module.cluster.num_devices
    return Mesh(sy.dest.first, max(1, min(sy.dest.count, total - sy.dest.first)))


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
    """A worker process the runtime starts: ``model`` on ``mesh``, pinned to ``cores`` of ``node`` (the
    mesh's devices on its first node; ``devices`` are their global indices), with its ``share`` of them
    and its torch ``threads``."""

    name: str
    model: str
    mesh: Mesh
    node: int
    cores: tuple[int, ...]
    devices: tuple[int, ...]
    share: float
    threads: int


def workers(module: Module) -> dict[tuple[str, Mesh], Worker]:
    """Every worker the runtime starts, keyed by (model, mesh): one per mesh a model's stages run on, plus
    the destination of each ``sync``. A worker occupies its mesh's devices on the mesh's first node (one
    Ray bundle per node); a device used by k workers gives each 1/k (:func:`device_shares`)."""
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
        out[(model, m)] = Worker(worker_name(module, model, m), model, m, node, cores,
                                 tuple(node * c.per_node + core for core in cores), sh["share"], sh["threads"])
    return out


def device_shares(devices_by_worker: dict) -> dict:
    """Each worker's ``share`` of its devices (a device used by k workers gives each 1/k) and the torch
    ``threads`` it runs on CPU (one per whole core of its share). Devices are any hashable ids."""
    load: dict = {}
    for devices in devices_by_worker.values():
        for d in devices:
            load[d] = load.get(d, 0) + 1
    out = {}
    for key, devices in devices_by_worker.items():
        share = sum(1.0 / load[d] for d in devices)
        out[key] = {"share": share, "threads": max(1, int(share + 1e-9))}
    return out


# -- verifying a plan ------------------------------------------------------------------------------------


def _loc(entity):
    return getattr(entity, "ir_loc", None) or getattr(entity, "loc", None)


def verify_plan(module: Module, sink: DiagnosticSink) -> None:
    """Check every plan annotation where present (absent ones take defaults); the verifier calls this."""
    s = module.annotations.get("strategy")
    if s is not None and s not in STRATEGIES:
        sink.error(f"module annotation strategy must be one of {', '.join(STRATEGIES)}, got {describe(s)}",
                   None, f'write strategy = "{STRATEGIES[0]}" (or remove it)')
    total = module.cluster.num_devices if _is_int(module.cluster.num_devices) else None
    for stage in module.graph.stages:
        if stage.outputs and stage.annotations:
            _verify_stage(module, stage, total, sink)


def _verify_stage(module: Module, stage: Stage, total, sink: DiagnosticSink) -> None:
    ann = stage.annotations
    at = _loc(stage)
    label = f"stage %{stage.name}"

    def report(exc: PlanError) -> None:
        sink.error(f"{label}: {exc.message}", at, exc.hint)

    count = total
    if Mesh.key in ann:
        try:
            count = Mesh.parse(ann[Mesh.key], module.cluster).count
        except PlanError as exc:
            report(exc)
            count = None
    if Parallel.key in ann:
        try:
            for exc in Parallel.parse(ann[Parallel.key], count).verify(count, module.models.get(stage.target or "")):
                report(exc)
        except PlanError as exc:
            report(exc)
    if "microbatches" in ann and not (_is_int(ann["microbatches"]) and ann["microbatches"] >= 1):
        sink.error(f"{label}: microbatches must be an integer >= 1, got {describe(ann['microbatches'])}", at,
                   "write microbatches = 4 (micro-batches per forward / per optimizer step)")
    if Recompute.key in ann:
        try:
            Recompute.parse(ann[Recompute.key])
        except PlanError as exc:
            report(exc)
    for name, ops, hint in (("unpad", ("generate", "train"), "forwards follow their rollout: mark the generate "
                                                              "stage unpad = true"),
                            ("logprobs", ("generate",), "mark the generate stage whose sampling log-probs are "
                                                        "kept: logprobs = true")):
        if name not in ann:
            continue
        if stage.op not in ops:
            sink.error(f"{label}: '{name}' applies to {' and '.join(ops)} stages only, not {stage.op}", at, hint)
        elif not isinstance(ann[name], bool):
            sink.error(f"{label}: {name} must be true or false, got {describe(ann[name])}", at, f"write {name} = true")
    if "overlap" in ann and not _is_int(ann["overlap"]):
        sink.error(f"{label}: overlap must be an integer group id, got {describe(ann['overlap'])}", at,
                   "stages with the same overlap = K are launched together, e.g. overlap = 1")
    for cls in (Stream, Overcommit):
        if cls.key not in ann:
            continue
        if stage.op != "generate":
            sink.error(f"{label}: '{cls.key}' applies to generate stages only, not {stage.op}", at,
                       f"move {cls.key} = {{...}} to the generate stage whose samples it concerns")
            continue
        try:
            cls.parse(ann[cls.key])
        except PlanError as exc:
            report(exc)
    if "stream_from" in ann:
        _verify_stream_from(module, stage, label, at, sink)


def _verify_stream_from(module: Module, stage: Stage, label: str, at, sink: DiagnosticSink) -> None:
    name = stage.annotations["stream_from"]
    src = stream_source(module.graph, stage)
    if src is None:
        sink.error(f"{label}: stream_from must name the rollout of a generate stage, got {describe(name)}", at,
                   "write stream_from = \"<rollout>\" with the result of the streamed generate stage")
    elif not streams(src):
        sink.error(f"{label}: stream_from = {name!r} but %{src.name} is not streamed", at,
                   f"annotate %{src.name} with stream = {{chunk = N}}, or remove stream_from")
    elif not (stage.op.startswith("forward.") and len(stage.inputs) == 1 and stage.inputs[0] is src.outputs[0]):
        sink.error(f"{label}: only a forward stage whose one operand is %{name} can run inside its stream, "
                   f"not {stage.op}", at, "remove stream_from: the stage runs after the stream instead")
