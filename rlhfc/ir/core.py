"""The IR: a Module holds a Cluster, Models, data sources, run settings and one Graph.

A Graph is a DAG of Stages connected by SSA Values, listed in a topological
order (every value is defined before it is used — the verifier checks it). A
stage's ``attrs`` are what the program asked for (semantics); its
``annotations`` are what passes decided (how it runs: placement, overlap,
streaming …). Passes add annotations, never hidden state: whatever a pass
decides is in the printed IR. For diagnostics only, every entity also remembers
where it was written (``loc`` in the ``.rlhf`` program, ``ir_loc`` in the
``.rlir`` text) and where each of its fields was (``field_locs``); none of these
is printed or compared.

Cross-step parameter versions are explicit :class:`VersionEdge`s: a stage that
reads a trained model's weights before that model's ``train`` stage in the step
reads the version written one step earlier (``distance = 1``); one after it
reads this step's (``distance = 0``). A generate stage whose samples may be stale (asynchronous rollout:
``run { staleness = K }``, or the ``async_rollout`` pass's annotation) reads weights 1 to 1 + K steps old:
its edge carries the bound (``[+1..+2]`` for K = 1; :meth:`Module.staleness_of`).

Stability: the classes and methods without a leading underscore are the public
IR API for custom passes (stable within a minor version).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from rlhfc.contract.engines import DEFAULT_ROLLOUT, DEFAULT_TRAINER

from .arch import ARCH_FIELDS, param_count
from .diagnostics import Loc
from .types import ValueType


@dataclass(frozen=True)
class Symbol:
    """A reference to a module-level entity (``@actor``) inside an attribute."""

    name: str

    def __str__(self) -> str:
        return f"@{self.name}"


@dataclass
class Cluster:
    """Devices: ``nodes`` × ``per_node`` devices of kind ``device`` (``cpu`` or a GPU kind)."""

    name: str
    device: str = "cpu"
    nodes: int = 1
    per_node: int = 1
    loc: Loc | None = None
    annotations: dict = field(default_factory=dict)
    #: where this entity stood in the ``.rlir`` text it was parsed from (diagnostics only; never printed)
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    #: where each field's value was written: in the ``.rlir`` text (the parser) or the ``.rlhf`` program
    #: (lowering); the verifier points at the field (diagnostics only; never printed, not compared)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)
    #: memory of each device in bytes when the program sets it (``memory = "2GB"``); None: the device kind's
    #: catalog capacity (:data:`rlhfc.ir.devices.DEVICE_MEMORY`)
    memory: int | None = None

    @property
    def num_devices(self) -> int:
        return self.nodes * self.per_node

    def attrs(self) -> dict:
        out = {"device": self.device, "nodes": self.nodes, "per_node": self.per_node}
        if self.memory is not None:   # printed only when the program sets it
            out["memory"] = self.memory
        return out


@dataclass
class Model:
    """A model: architecture config, head, whether it trains, and how it is initialised.

    ``init`` is ``"random"`` (seeded random weights), ``"pretrained"`` (from
    ``source``, a local Hugging Face folder) or a :class:`Symbol` naming the model
    whose weights it starts from (``copy(actor)``).

    ``layout`` is the program's fixed parallel layout of the model, ``{"dp": D, "tp": T, "pp": P}``
    (the ``layout(...)`` clause; every factor present), or None when the placement pass chooses it.
    It is not part of :meth:`config`: ``copy``/``like`` do not inherit it. Read it through
    :func:`rlhfc.ir.plan.fixed_layout`.
    """

    name: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_seq: int
    head: str = "lm"
    trainable: bool = False
    init: object = "random"
    source: str = ""
    layout: dict | None = None
    #: LoRA adapters of a policy, ``{"alpha": A, "rank": R, "targets": [module names]}`` (the ``lora(...)``
    #: clause; :mod:`rlhfc.ir.lora`), or None: every weight trains
    lora: dict | None = None
    #: keep the loaded folder's dropout in the RL stages (``hf("...", dropout = true)``); by default it is off,
    #: as in the peers (config-built models have none)
    dropout: bool = False
    loc: Loc | None = None
    annotations: dict = field(default_factory=dict)
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    def config(self) -> dict:
        """Architecture fields only (what ``copy``/``like`` share)."""
        return {k: getattr(self, k) for k in ("arch",) + ARCH_FIELDS}

    def attrs(self) -> dict:
        out = self.config()
        out.update(head=self.head, trainable=self.trainable, init=self.init, source=self.source)
        if self.layout is not None:   # printed only when the program fixes it
            out["layout"] = self.layout
        if self.lora is not None:     # printed only when the program asks for adapters
            out["lora"] = self.lora
        if self.dropout:              # printed only when the program keeps it
            out["dropout"] = True
        return out

    @property
    def params(self) -> int:
        """Parameter count derived from the architecture."""
        return param_count(self.arch, self.layers, self.hidden, self.heads, self.kv_heads,
                           self.ffn, self.vocab, self.max_seq, self.head)


#: Options of each data-source kind, in canonical order, with their Python type.
DATA_OPTIONS: dict[str, dict[str, type]] = {
    "synthetic": {"count": int, "min_len": int, "max_len": int, "seed": int},
    "jsonl": {"path": str, "field": str, "fields": list, "truncate": str},
    # tables read with the `datasets` library (an optional install) from a local file
    "parquet": {"path": str, "field": str, "fields": list, "truncate": str},
    "arrow": {"path": str, "field": str, "fields": list, "truncate": str},
}

#: what a jsonl source does with a prompt too long for a model that reads it (``truncate = ...``)
TRUNCATE_POLICIES = ("error", "left", "right")


@dataclass
class DataSource:
    """Where prompts come from: ``kind`` is ``synthetic`` or ``jsonl``; ``options`` its settings."""

    name: str
    kind: str
    options: dict = field(default_factory=dict)
    loc: Loc | None = None
    annotations: dict = field(default_factory=dict)
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    def attrs(self) -> dict:
        """``kind`` first, then the options in :data:`DATA_OPTIONS` order (others sorted after)."""
        known = DATA_OPTIONS.get(self.kind, ())
        order = [k for k in known if k in self.options] + sorted(k for k in self.options if k not in known)
        return {"kind": self.kind, **{k: self.options[k] for k in order}}


#: a tool's settings in IR text order, with their defaults (``fn`` has none)
TOOL_DEFAULTS = {"timeout": 2.0, "memory_mb": 256, "max_output": 1024}
#: an environment's limits when its declaration states none: each reset/step's seconds, its process's memory
ENV_DEFAULTS = {"timeout": 10.0, "memory_mb": 512}


@dataclass
class Tool:
    """A tool a multi-turn generate may call (``tool calc = python("tools:calculator", timeout = 2)``):
    ``fn`` is ``"module:function"`` (resolved like a rule's module: the program's folder or an installed
    module the run block allows), each call in a sandboxed process of its own with ``timeout`` seconds of
    wall clock, ``memory_mb`` of address space and its result cut to ``max_output`` characters.

    ``kind = "env"``: an environment (``env game = python("envs:Game", timeout = 10, memory = 512M)``): ``fn``
    names a class, one instance per trajectory, ``reset(record) -> observation`` and ``step(action) ->
    (observation, reward, done)``, the instances held by a sandboxed process of their own
    (:class:`rlhfc.runtime.rollout.sandbox.EnvSandbox`) with ``timeout`` seconds per call and ``memory_mb`` of
    memory (:data:`ENV_DEFAULTS` when not stated; ``max_output`` does not apply)."""

    name: str
    fn: str
    kind: str = "tool"
    timeout: float | None = None
    memory_mb: int | None = None
    max_output: int = 1024
    loc: Loc | None = None
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        defaults = ENV_DEFAULTS if self.kind == "env" else TOOL_DEFAULTS
        if self.timeout is None:
            self.timeout = defaults["timeout"]
        if self.memory_mb is None:
            self.memory_mb = defaults["memory_mb"]

    def attrs(self) -> dict:
        if self.kind == "env":   # its limits printed where not the defaults
            return {"fn": self.fn, **{k: getattr(self, k) for k, v in ENV_DEFAULTS.items() if getattr(self, k) != v}}
        return {"fn": self.fn, "timeout": self.timeout, "memory_mb": self.memory_mb, "max_output": self.max_output}


@dataclass
class RunConfig:
    """Run settings: steps, seed, checkpoint interval (0 = only at the end), default -O level, the
    placement strategy (``auto``: search on multi-device clusters, else flatten), and the installed
    modules that ``rule("module:function", ...)`` may name besides the program's folder and rlhfc's
    built-in rewards (``reward_modules``; printed only when not empty), and the trainer that runs the
    models' layouts (``trainer``: ``torch`` runs each model on one process per mesh, ``fsdp`` runs dp
    ranks sharded with FSDP2, ``megatron`` runs dp × tp × pp megatron-core ranks, ``auto`` picks one per
    model from its layout — :func:`rlhfc.ir.plan.resolve_trainer`; printed only when not ``torch``).

    ``precision`` (``fp32`` | ``bf16``): the arithmetic of forwards, generation and training; ``bf16``
    runs them under bf16 autocast while weights and optimizer state stay float32 (printed only when not
    ``fp32``). ``log_samples``: samples per step written to the run folder's ``samples.jsonl`` and
    TensorBoard text (0 = none; printed only when not the default 4). ``rollout`` (``torch`` | ``vllm``): the
    engine of the generate stages — rlhfc's own decode loop, or a vLLM engine owned by the generating model's
    worker and refitted after every train step (printed only when not ``torch``). ``staleness`` (an integer
    K >= 0, or None when the program states none): asynchronous rollout — each step trains on samples
    generated by weights at most K versions old, with the decoupled PPO loss (0: synchronous, as without it;
    -O3 takes K = 1 where the program states none; printed only when stated). ``processes`` (``shared`` |
    ``own``): whether colocated models that may share a worker process do (:func:`rlhfc.ir.schedule.shared_processes`:
    one start-up instead of one per model) or each keep a process of their own (printed only when ``own``)."""

    steps: int = 10
    seed: int = 0
    checkpoint_every: int = 0
    optimize: str = "O1"
    placement: str = "auto"
    reward_modules: list = field(default_factory=list)
    trainer: str = DEFAULT_TRAINER
    precision: str = "fp32"
    log_samples: int = 4
    rollout: str = DEFAULT_ROLLOUT
    staleness: int | None = None
    processes: str = "shared"
    loc: Loc | None = None
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    def attrs(self) -> dict:
        out = {"steps": self.steps, "seed": self.seed, "checkpoint_every": self.checkpoint_every,
               "optimize": self.optimize, "placement": self.placement}
        if self.reward_modules:
            out["reward_modules"] = self.reward_modules
        if self.trainer != DEFAULT_TRAINER:
            out["trainer"] = self.trainer
        if self.precision != "fp32":
            out["precision"] = self.precision
        if self.log_samples != 4:
            out["log_samples"] = self.log_samples
        if self.rollout != DEFAULT_ROLLOUT:
            out["rollout"] = self.rollout
        if self.staleness is not None:
            out["staleness"] = self.staleness
        if self.processes != "shared":
            out["processes"] = self.processes
        return out


#: The settings of a run block (every field of RunConfig but the locations).
RUN_KEYS = tuple(f.name for f in fields(RunConfig) if f.name not in ("loc", "ir_loc", "field_locs"))


@dataclass(eq=False)
class Value:
    """An SSA value: a unique ``name`` (printed ``%name``) and a :class:`ValueType`."""

    name: str
    type: ValueType

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Stage:
    """One node of the per-step dataflow.

    ``op`` names an :class:`~rlhfc.ir.ops.OpSpec`; ``target`` is the model or data
    source it works on (or None); ``inputs``/``outputs`` are Values; ``attrs`` are the
    program's settings; ``annotations`` the passes' decisions. A stage is named
    after its first output (every stage has at least one).
    """

    op: str
    target: str | None
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)
    loc: Loc | None = None
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.outputs[0].name

    def __repr__(self) -> str:
        return f"<Stage {self.name} = {self.op}>"


@dataclass(frozen=True)
class VersionEdge:
    """Stage ``reader`` reads the weights of ``model`` that stage ``writer`` wrote ``distance`` steps earlier —
    or, with a ``staleness`` bound K > 0 (asynchronous rollout), weights ``distance`` to ``distance + K`` steps old
    (printed ``[+1..+2]``; ``[+1]`` when synchronous)."""

    model: str
    writer: str
    reader: str
    distance: int
    staleness: int = 0

    @property
    def span(self) -> str:
        """``+D``, or ``+D..+E`` with a staleness bound."""
        return f"+{self.distance}" + (f"..+{self.distance + self.staleness}" if self.staleness else "")


@dataclass
class Graph:
    """The per-step dataflow.

    ``params``: pipeline parameters (``batch``); ``stages``: in a topological order;
    ``versions``: the cross-step parameter-version edges (exactly those
    :func:`derive_versions` gives — call :meth:`Module.refresh_versions` after
    reordering, adding or removing stages); ``annotations``: graph-wide pass decisions.
    """

    name: str
    params: dict = field(default_factory=dict)
    stages: list[Stage] = field(default_factory=list)
    versions: list[VersionEdge] = field(default_factory=list)
    loc: Loc | None = None
    annotations: dict = field(default_factory=dict)
    ir_loc: Loc | None = field(default=None, compare=False, repr=False)
    field_locs: dict[str, Loc] = field(default_factory=dict, compare=False, repr=False)

    # -- queries -------------------------------------------------------------------------------
    def values(self) -> dict[str, Value]:
        return {v.name: v for s in self.stages for v in s.outputs}

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def producer(self, value: Value) -> Stage:
        for s in self.stages:
            if any(o is value for o in s.outputs):
                return s
        raise KeyError(value.name)

    def users(self, value: Value) -> list[Stage]:
        return [s for s in self.stages if any(i is value for i in s.inputs)]

    def stages_on(self, model: str) -> list[Stage]:
        return [s for s in self.stages if s.target == model]

    def predecessors(self, stage: Stage) -> list[Stage]:
        seen: list[Stage] = []
        for v in stage.inputs:
            p = self.producer(v)
            if p not in seen:
                seen.append(p)
        return seen

    # -- edits (keep the topological order valid) ------------------------------------------------
    def insert(self, index: int, stage: Stage) -> Stage:
        self.stages.insert(index, stage)
        return stage

    def remove(self, stage: Stage) -> None:
        """Remove a stage whose outputs are unused (raises otherwise)."""
        for v in stage.outputs:
            if self.users(v):
                raise ValueError(f"cannot remove stage %{stage.name}: %{v.name} is still used")
        self.stages.remove(stage)
        self.versions = [e for e in self.versions if stage.name not in (e.reader, e.writer)]

    def replace_all_uses(self, old: Value, new: Value) -> None:
        for s in self.stages:
            s.inputs = [new if v is old else v for v in s.inputs]

    def fresh_name(self, base: str) -> str:
        """A value name not used yet: ``base``, else ``base_1``, ``base_2`` …"""
        taken = set(self.values())
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"


def derive_versions(graph: Graph, trainable: set[str], staleness=None) -> list[VersionEdge]:
    """The parameter-version edges the stage order implies (see module docstring).

    For each trained model: stages reading it before its ``train`` stage read the
    previous step's weights (distance 1); stages after it read this step's
    (distance 0). A graph may have at most one train stage per model. ``staleness(stage)``: a reader's
    staleness bound (:meth:`Module.staleness_of`; none: 0).
    """
    edges: list[VersionEdge] = []
    for model in sorted(trainable):
        on_model = graph.stages_on(model)
        writers = [s for s in on_model if s.op == "train"]
        if len(writers) != 1:
            continue
        writer = writers[0]
        w_index = graph.stages.index(writer)
        for s in on_model:
            if s is writer:
                continue
            distance = 1 if graph.stages.index(s) < w_index else 0
            edges.append(VersionEdge(model, writer.name, s.name, distance, staleness(s) if staleness else 0))
    return edges


@dataclass
class Module:
    """A whole compiled program."""

    name: str
    cluster: Cluster
    models: dict[str, Model] = field(default_factory=dict)
    data: dict[str, DataSource] = field(default_factory=dict)
    graph: Graph = field(default_factory=lambda: Graph("main"))
    #: the tools and environments the program declares (multi-turn generates use them); printed only when there are
    #: some
    tools: dict[str, Tool] = field(default_factory=dict)
    run: RunConfig = field(default_factory=RunConfig)
    annotations: dict = field(default_factory=dict)

    def clone(self) -> "Module":
        return copy.deepcopy(self)

    def trainable_models(self) -> set[str]:
        return {m.name for m in self.models.values() if m.trainable}

    def refresh_versions(self) -> None:
        """Recompute the version edges after a pass reordered or added stages (or changed a staleness)."""
        self.graph.versions = derive_versions(self.graph, self.trainable_models(), self.staleness_of)

    def staleness_of(self, stage: "Stage") -> int:
        """How many versions older than synchronous training's the weights a stage reads may be: a generate
        of a trained model under asynchronous rollout — its ``async_rollout = {staleness = K}`` annotation
        (the pass's choice), else the program's ``run { staleness = K }``; 0 for every other stage. The one
        rule of the bound (:func:`rlhfc.ir.plan.async_rollout` reads the rest of the annotation)."""
        if stage.op != "generate" or stage.target not in self.trainable_models():
            return 0
        ann = stage.annotations.get("async_rollout")
        k = ann.get("staleness") if isinstance(ann, dict) else self.run.staleness
        return k if isinstance(k, int) and not isinstance(k, bool) and k > 0 else 0
