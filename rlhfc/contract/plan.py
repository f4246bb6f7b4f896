"""``plan.json``: the compiled job's decisions, as typed, versioned dataclasses.

Codegen (:mod:`rlhfc.codegen.plan`) builds a :class:`Plan` and writes :meth:`Plan.to_json`; the runtime reads
it back with :func:`load_plan` / :meth:`Plan.from_json`, which checks every field's type and names the path
of a malformed one (``plan.json: placement.workers.actor.ranks: expected int, got 'two'``). Neither side reads
the JSON as a raw dict.

Format history (``format``):

* 1 — sessions 1-16: ``graph`` also held the derived maps ``stages_by_name`` and ``value_to_stage``; a
  worker's ``engine`` was absent for torch.
* 2 — the derived maps are properties of :class:`GraphPlan`; every worker names its ``engine``; ``plugins``.

A plan of another format is refused with a hint to recompile (:class:`PlanFormatError`).

Opaque parts: a stage's ``attrs`` and ``annotations`` are the IR's (the runtime reads none of them), a data
source's ``options`` are the options of its kind (:mod:`rlhfc.runtime.data.prompts` checks them).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

#: the format this rlhfc writes and reads
PLAN_FORMAT = 2


class PlanFormatError(ValueError):
    """A ``plan.json`` the runtime cannot read: ``path`` is where in the file, ``hint`` what to do."""

    def __init__(self, message: str, hint: str = "recompile the program: rlhfc compile PROGRAM.rlhf -o JOB/"):
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class ClusterPlan:
    """The devices the job runs on: ``nodes`` x ``per_node`` devices of kind ``device`` (``cpu`` or a GPU
    kind); ``memory``: bytes per device when the program set it."""

    name: str
    device: str = "cpu"
    nodes: int = 1
    per_node: int = 1
    memory: int | None = None

    @property
    def gpu(self) -> bool:
        return self.device != "cpu"


@dataclass(frozen=True)
class ModelSpec:
    """What a worker builds a model from (:func:`rlhfc.runtime.models.build.build_model` takes :meth:`as_dict`).
    ``source``: a local Hugging Face folder (absolute) or None for seeded random weights; ``lora``: adapter
    settings; ``recompute``: the training's activation recomputation (:mod:`rlhfc.runtime.models.recompute`);
    ``dropout``: keep a loaded folder's dropout in the RL stages (off by default, as the peers run)."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    max_seq: int
    head: str = "lm"
    source: str | None = None
    lora: dict | None = None
    recompute: dict | None = None
    dropout: bool = False

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("lora", "recompute"):
            if out[key] is None:
                del out[key]
        if not out["dropout"]:
            del out["dropout"]
        return out


@dataclass(frozen=True)
class ModelInit:
    """How a model's weights start: ``kind`` ``random`` | ``pretrained`` | ``copy`` (the initial weights of
    model ``source_model``, built from ``source_spec`` with that model's seed)."""

    kind: str
    source_model: str | None = None
    source_spec: ModelSpec | None = None

    def as_dict(self) -> dict:
        if self.kind != "copy":
            return {"kind": self.kind}
        return {"kind": "copy", "from": self.source_model, "spec": self.source_spec.as_dict()}


@dataclass(frozen=True)
class ModelPlan:
    spec: ModelSpec
    init: ModelInit
    trainable: bool
    params: int


@dataclass(frozen=True)
class PromptFit:
    """A model that reads a data source's prompts: the job checks at start that every prompt fits its
    ``max_seq`` with ``max_new_tokens`` (``chat``: counted in the chat template)."""

    model: str
    tokenizer_source: str | None
    vocab: int
    max_seq: int
    max_new_tokens: int
    chat: bool = False


@dataclass(frozen=True)
class ToolPlan:
    """A tool multi-turn generates call: ``fn`` ("module:function", found as a rule's module is) and the
    limits of each call's sandboxed process."""

    fn: str
    timeout: float = 2.0
    memory_mb: int = 256
    max_output: int = 1024
    #: "tool" (a sandboxed function of the call's text) or "env" (a class, an instance per trajectory)
    kind: str = "tool"


@dataclass(frozen=True)
class DataPlan:
    """A prompt source: ``kind`` and its options (paths absolute), and the models that read it."""

    kind: str
    options: dict = field(default_factory=dict)
    fit: tuple[PromptFit, ...] = ()

    def as_spec(self) -> dict:
        """The dict :func:`rlhfc.runtime.data.prompts.prompt_source_from_spec` takes."""
        spec = {"kind": self.kind, **self.options}
        if self.fit:
            spec["fit"] = [{"model": f.model, "tokenizer": {"source": f.tokenizer_source, "vocab": f.vocab},
                            "max_seq": f.max_seq, "max_new_tokens": f.max_new_tokens,
                            **({"chat": True} if f.chat else {})} for f in self.fit]
        return spec


@dataclass(frozen=True)
class RunPlan:
    """The program's ``run { ... }`` settings (``rollout``: the engine of generate stages, or ``auto``)."""

    steps: int = 10
    seed: int = 0
    checkpoint_every: int = 0
    optimize: str = "O1"
    placement: str = "auto"
    reward_modules: tuple[str, ...] = ()
    trainer: str = "torch"
    precision: str = "fp32"
    log_samples: int = 4
    rollout: str = "torch"
    staleness: int | None = None
    processes: str = "shared"


@dataclass(frozen=True)
class StagePlan:
    """A stage in schedule order: its op, target model (None for driver-side stages), value names, output
    types, and the IR's ``attrs`` and ``annotations`` (opaque here); ``loc`` is its source location."""

    name: str
    op: str
    target: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: tuple[str, ...] = ()
    attrs: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)
    loc: str | None = None


@dataclass(frozen=True)
class VersionEdge:
    """Model ``model``'s weights written by stage ``writer`` and read ``distance`` (to ``distance + staleness``,
    under asynchronous rollout) steps later by ``reader``."""

    model: str
    writer: str
    reader: str
    distance: int
    staleness: int = 0


@dataclass(frozen=True)
class GraphPlan:
    name: str
    params: dict
    stages: tuple[StagePlan, ...]
    versions: tuple[VersionEdge, ...] = ()

    @property
    def stages_by_name(self) -> dict[str, StagePlan]:
        return {s.name: s for s in self.stages}

    @property
    def value_to_stage(self) -> dict[str, str]:
        """Each value's producing stage."""
        return {v: s.name for s in self.stages for v in s.outputs}


@dataclass(frozen=True)
class WorkerPlan:
    """One worker group: model ``model`` on mesh ``mesh`` (first, count) of node ``bundle``; its Ray resource
    share; its torch ``threads`` and pinned ``cores``; its layout (``ranks`` = dp·tp·pp processes) and the
    registered ``trainer`` backend and rollout ``engine`` that run it (:mod:`rlhfc.contract.engines`);
    ``gpu_memory_utilization``: a CUDA rollout engine's share of its GPU, as the compiler priced it;
    ``offload``: it trains with its optimizer state and step on the host (the ``offload`` pass);
    ``process``: the name of the process it shares with the other workers of the same ``process``
    (:mod:`rlhfc.runtime.worker.host`), None for a process (or ``ranks`` processes) of its own;
    ``reversed_stages``: its pipeline stages sit on its mesh's cores in reverse (the second model of a fused
    training pair, the ``fuse_training`` pass: its stage ``s`` beside the first model's stage ``pp − 1 − s``)."""

    model: str
    mesh: tuple[int, int]
    bundle: int
    num_cpus: float
    num_gpus: float
    threads: int
    cores: tuple[int, ...]
    ranks: int
    dp: int
    tp: int
    pp: int
    trainer: str
    engine: str
    gpu_memory_utilization: float | None = None
    offload: bool = False
    process: str | None = None
    reversed_stages: bool = False


@dataclass(frozen=True)
class PlacementPlan:
    """Ray placement: one bundle per node (resource -> amount) and the workers by name, in plan order."""

    strategy: str
    bundles: tuple[dict[str, float], ...]
    workers: dict[str, WorkerPlan]


@dataclass(frozen=True)
class MetricRoles:
    """Which values the runtime reports: the rollout, the reward, the KL pair (log-probs, reference
    log-probs) and the policy / value train stages."""

    rollout: str | None = None
    reward: str | None = None
    kl: tuple[str, str] | None = None
    policy_train: str | None = None
    value_train: str | None = None


@dataclass(frozen=True)
class Plan:
    """Everything the runtime needs to run a compiled job (``plan.json`` beside the generated ``main.py``)."""

    module: str
    source: str | None
    program_dir: str | None
    opt_level: str | None
    passes: tuple[str, ...]
    cluster: ClusterPlan
    models: dict[str, ModelPlan]
    data: dict[str, DataPlan]
    run: RunPlan
    graph: GraphPlan
    placement: PlacementPlan
    metrics: MetricRoles
    ir: str
    #: modules (or absolute ``.py`` paths) the compiler imported with ``--plugin``: they register passes, ops
    #: or engines; the job imports them in its driver and in every worker (:mod:`rlhfc.contract.plugins`)
    plugins: tuple[str, ...] = ()
    #: the tools the program declares (multi-turn generates name them)
    tools: dict[str, ToolPlan] = field(default_factory=dict)
    format: int = PLAN_FORMAT

    def to_json(self) -> dict:
        """The JSON object written to ``plan.json`` (``format`` first)."""
        out = _encode(self)
        return {"format": out.pop("format"), **out}

    @classmethod
    def from_json(cls, obj: Any, where: str = "plan.json") -> "Plan":
        """Read a plan object, checking the format and every field's type (:class:`PlanFormatError`)."""
        if not isinstance(obj, dict):
            raise PlanFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        fmt = obj.get("format")
        if fmt != PLAN_FORMAT:
            raise PlanFormatError(f"{where}: plan format {fmt!r}, but this rlhfc reads format {PLAN_FORMAT}",
                                  "recompile the program with this rlhfc: rlhfc compile PROGRAM.rlhf -o JOB/")
        try:
            return _decode(cls, obj, "")
        except _FieldError as exc:
            raise PlanFormatError(f"{where}: {exc.path.lstrip('.') or 'the plan'}: {exc.problem}") from None

    def model_of(self, worker: str) -> str:
        return self.placement.workers[worker].model

    def trained_models(self) -> set[str]:
        return {name for name, m in self.models.items() if m.trainable}


def load_plan(path: str) -> Plan:
    """Read and check ``plan.json`` at ``path`` (:class:`PlanFormatError` when missing or malformed)."""
    try:
        with open(path, encoding="utf-8") as fh:
            obj = json.load(fh)
    except FileNotFoundError:
        raise PlanFormatError(f"{path}: no such file", "give the job folder `rlhfc compile -o` wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFormatError(f"{path}: not a readable JSON file ({exc})") from None
    return Plan.from_json(obj, path)


# -- the typed JSON codec ----------------------------------------------------------------------------------
def _encode(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


class _FieldError(Exception):
    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _decode(tp, value, where: str):
    """``value`` read as type ``tp`` (a dataclass, a builtin, ``X | None``, ``tuple[X, ...]``, ``tuple[X, Y]``,
    ``dict[str, X]``); a mismatch raises :class:`_FieldError` naming ``where``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _FieldError(where, f"expected an object, got {_shown(value)}")
        hints, fields = _hints(tp), {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise _FieldError(where, f"unknown field(s) {', '.join(unknown)}")
        kwargs = {}
        for name, f in fields.items():
            if name not in value:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise _FieldError(where, f"missing field '{name}'")
                continue
            kwargs[name] = _decode(hints[name], value[name], f"{where}.{name}")
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):
            raise _FieldError(where, f"expected a list, got {_shown(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _FieldError(where, f"expected {len(args)} items, got {len(value)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _FieldError(where, f"expected an object, got {_shown(value)}")
        if not args:
            return value
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _FieldError(where, f"expected a number, got {_shown(value)}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _FieldError(where, f"expected an integer, got {_shown(value)}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise _FieldError(where, f"expected {'a string' if tp is str else 'true or false'}, "
                                  f"got {_shown(value)}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"plan field type {tp!r} has no reader")   # a contract bug, not a user's file


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
