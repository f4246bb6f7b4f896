"""Plan attributes: the single lists and the typed attributes that parse, print and verify themselves.

Why this file is long: every plan attribute a pass writes is a class here (one idea: the plan's typed values);
splitting them by pass would scatter what the verifier and every reader must agree on.
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from typing import ClassVar

from rlhfc.contract.engines import rollout_engines, train_backends

from ..core import Cluster, Stage, Symbol
from ..diagnostics import CompileError, Diagnostic

# -- the single lists ---------------------------------------------------------------------------------

#: optimisation levels, in order (``rlhfc.passes.pipelines`` says which passes each runs)
OPT_LEVELS = ("O0", "O1", "O2", "O3")
#: other systems whose plans ``placement = "baseline:NAME"`` builds (:mod:`rlhfc.passes.baselines`)
BASELINES = ("dschat", "openrlhf", "verl", "nemo")
#: placement strategies a plan can have (the module's ``strategy`` annotation)
STRATEGIES = ("flatten", "interleave", "separate", "search") + tuple(f"baseline:{b}" for b in BASELINES)
#: what a program's ``run { placement = ... }`` and ``--placement`` accept
PLACEMENTS = ("auto",) + STRATEGIES
#: activation recomputation policies of a training stage, cheapest in memory last
RECOMPUTE_POLICIES = ("none", "selective", "full")
#: the choice of ``run { trainer = auto }`` and ``run { rollout = auto }``: the compiler picks per model
AUTO = "auto"


def trainers() -> tuple[str, ...]:
    """What ``run { trainer = ... }`` may name: a registered train backend (:mod:`rlhfc.contract.engines`:
    ``torch`` — one process per model and mesh; ``fsdp`` — dp ranks sharded with FSDP2; ``megatron`` — dp × tp ×
    pp megatron-core ranks) or ``auto`` — per model, the backend of lowest rank that runs its layout
    (:func:`rlhfc.ir.plan.resolve_trainer`)."""
    return train_backends() + (AUTO,)


def rollouts() -> tuple[str, ...]:
    """What ``run { rollout = ... }`` may name: a registered rollout engine (``torch`` — rlhfc's own KV-cache
    decode loop in the generating model's worker; ``vllm`` — a vLLM engine that worker owns, refitted with the
    trained weights after every train step) or ``auto`` — the ``engine`` pass picks one per generating model
    from the cost model (:func:`rlhfc.ir.plan.stage_engine`)."""
    return rollout_engines() + (AUTO,)

#: the factors of a model's ``layout(...)`` clause, in the order a program writes them
LAYOUT_FACTORS = ("dp", "tp", "pp")
#: how a ``sync`` stage moves weights
TRANSPORTS = ("object_store", "collective")
#: op families whose stages run on a model's worker
WORKER_FAMILIES = ("generate", "forward", "train", "sync")


def placement_problem(name) -> tuple[str, str] | None:
    """What is wrong with a placement name (``run { placement = ... }``, ``--placement``), as (message,
    hint); None when it is one of :data:`PLACEMENTS`."""
    if name in PLACEMENTS:
        return None
    text = str(name)
    if text.startswith("baseline:"):
        return (f"unknown baseline '{text[len('baseline:'):]}'",
                f"baselines: {', '.join(f'baseline:{b}' for b in BASELINES)} (the plans of DeepSpeed-Chat, "
                "OpenRLHF, verl and NeMo-Aligner)")
    got = name if isinstance(name, str) else describe(name)
    return (f"placement must be one of {', '.join(PLACEMENTS)}, got {got}",
            "auto searches on multi-device clusters; e.g. placement = interleave")


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

    @classmethod
    def parse_fixed(cls, value) -> "Parallel":
        """Read a model's fixed layout (``Model.layout``): exactly ``{dp, tp, pp}``, integers >= 1."""
        if not isinstance(value, dict) or set(value) != set(LAYOUT_FACTORS) \
                or not all(_is_int(v) and v >= 1 for v in value.values()):
            raise PlanError(f"layout must be {{dp = D, tp = T, pp = P}} with integers >= 1, got {describe(value)}",
                            "e.g. layout(dp = 2, tp = 2, pp = 1) in the program (a factor left out is 1)")
        return cls(value["dp"], value["tp"], value["pp"])

    def text(self) -> str:
        """``dp2 tp1 pp1``"""
        return f"dp{self.dp} tp{self.tp} pp{self.pp}"


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
class Tail:
    """``tail = {below = K, move = M}`` on a streamed generate of a group of ranks (the ``tail_migrate`` pass): each
    rank decodes its own share and stops once fewer than K of its rows decode; their rows continue on one rank,
    with their KV caches (``move = kv``: the engine's ``kv_moves``) or re-prefilled from their tokens so far
    (``prefill``, the default of a plan that names none)."""

    below: int
    move: str = "prefill"
    key: ClassVar[str] = "tail"
    moves: ClassVar[tuple[str, ...]] = ("kv", "prefill")

    @classmethod
    def parse(cls, value) -> "Tail":
        inner = value.get("below") if isinstance(value, dict) else None
        move = value.get("move", "prefill") if isinstance(value, dict) else None
        extra = sorted(set(value) - {"below", "move"}) if isinstance(value, dict) else []
        if not _is_int(inner) or inner < 1 or extra or move not in cls.moves:
            raise PlanError(f"tail must be {{below = K, move = kv|prefill}} with an integer K >= 1, got "
                            f"{describe(value)}", 'write tail = {below = 2, move = "kv"}')
        return cls(inner, move)

    def print(self) -> dict:
        return {"below": self.below, "move": self.move}


@dataclass(frozen=True)
class Fused:
    """``fused = {role = R, with = "STAGE", orders = [...], gain = G}`` on two train stages (the ``fuse_training``
    pass): their pipeline schedules run interleaved on the same devices, ``role`` 0 with its stages on devices
    0 → P−1, 1 in reverse; ``orders``: per device the operations in turn, ``"<role><F|B><micro-batch>"`` separated
    by spaces (:func:`rlhfc.cost.fused_schedule.device_orders`); ``gain``: the two unfused schedules' time over the
    fused one's, as the search predicted it (what the cost model prices the pair with)."""

    role: int
    partner: str
    orders: tuple[str, ...]
    gain: float = 1.0
    key: ClassVar[str] = "fused"

    @classmethod
    def parse(cls, value) -> "Fused":
        ok = isinstance(value, dict) and set(value) - {"gain"} == {"role", "with", "orders"} \
            and value["role"] in (0, 1) and _is_number(value.get("gain", 1.0)) and value.get("gain", 1.0) >= 1.0 \
            and isinstance(value["with"], str) and isinstance(value["orders"], (list, tuple)) and value["orders"] \
            and all(isinstance(o, str) and o.split() and all(_FUSED_OP.fullmatch(x) for x in o.split())
                    for o in value["orders"])
        if not ok:
            raise PlanError(f"fused must be {{role = 0 | 1, with = \"STAGE\", orders = [\"0F0 1F0 ...\", ...], "
                            f"gain = G >= 1}}, "
                            f"got {describe(value)}", "let the fuse_training pass write it")
        return cls(int(value["role"]), value["with"], tuple(value["orders"]), float(value.get("gain", 1.0)))

    def print(self) -> dict:
        return {"role": self.role, "with": self.partner, "orders": list(self.orders), "gain": round(self.gain, 4)}

    def device_orders(self) -> list[list[tuple[int, str, int]]]:
        """Per device, (role, kind, micro-batch) in turn (what :class:`rlhfc.runtime.train.fused.FusedGate` reads)."""
        return [[(int(x[0]), x[1], int(x[2:])) for x in o.split()] for o in self.orders]


_FUSED_OP = re.compile(r"[01][FB]\d+")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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


#: how decoupled PPO's proximal log-probs are had (:class:`AsyncRollout`)
PROXIMAL_METHODS = ("recompute", "loglinear")


@dataclass(frozen=True)
class AsyncRollout:
    """``async_rollout = {staleness = K, behaviour_cap = C}`` on a generate stage of a trained model:
    generation runs up to K steps ahead of training (the samples a step trains on were generated by weights at
    most K versions old) and the policy loss is decoupled PPO, each token's surrogate weighted by
    exp(proximal − behaviour) and dropped above ``behaviour_cap`` (:mod:`rlhfc.passes.async_rollout`).
    Without the annotation a generate takes the program's ``run { staleness = K }`` (0: synchronous)."""

    staleness: int
    behaviour_cap: float = 5.0
    #: how the loss gets the proximal policy: ``recompute`` (a forward with the weights at the start of the
    #: step) or ``loglinear`` (A-3PO: interpolated from the behaviour and current log-probs, no forward)
    proximal: str = "recompute"
    key: ClassVar[str] = "async_rollout"

    @classmethod
    def parse(cls, value) -> "AsyncRollout":
        k = value.get("staleness") if isinstance(value, dict) else None
        cap = value.get("behaviour_cap", 5.0) if isinstance(value, dict) else None
        prox = value.get("proximal", "recompute") if isinstance(value, dict) else None
        extra = sorted(set(value) - {"staleness", "behaviour_cap", "proximal"}) if isinstance(value, dict) else []
        if not _is_int(k) or k < 0 or isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 1 \
                or extra or prox not in PROXIMAL_METHODS:
            raise PlanError(f"async_rollout must be {{staleness = K, behaviour_cap = C, proximal = P}} with an integer "
                            f"K >= 0, a number C > 1 and P one of {', '.join(PROXIMAL_METHODS)}, got "
                            f"{describe(value)}", "write async_rollout = {staleness = 1, behaviour_cap = 5.0}")
        return cls(k, float(cap), prox)

    def print(self) -> dict:
        out = {"staleness": self.staleness, "behaviour_cap": self.behaviour_cap}
        if self.proximal != "recompute":
            out["proximal"] = self.proximal
        return out


@dataclass(frozen=True)
class Recompute:
    """``recompute`` on a training stage: ``"none" | "selective" | "full"`` (a coarse policy, as placement
    picks it), or the ``recompute`` pass's decision from a trace of the model's block::

        recompute = {policy = "ops", save = ["mm.default#0", ...], kept = 129416, autograd = 263808,
                     seconds = 0.00036, budget = 131072}

    ``policy``: ``none``/``selective``/``full``, or ``ops`` (keep the outputs of the ``save`` aten calls,
    recompute the rest; :mod:`rlhfc.runtime.models.recompute`); ``kept``: bytes one block keeps for backward per
    micro-batch under the decision, ``autograd`` without recomputation; ``seconds``: recompute time added
    per block and micro-batch; ``budget``: the bytes per block the decision had to fit (when one did)."""

    policy: str = "none"
    save: tuple[str, ...] = ()
    kept: int | None = None
    autograd: int | None = None
    seconds: float | None = None
    budget: int | None = None
    key: ClassVar[str] = "recompute"
    DECIDED: ClassVar[tuple[str, ...]] = RECOMPUTE_POLICIES + ("ops",)

    @classmethod
    def parse(cls, value) -> "Recompute":
        if isinstance(value, str) and value in RECOMPUTE_POLICIES:
            return cls(value)
        hint = 'write recompute = "selective", or {policy = "ops", save = ["mm.default#0"], kept = N}'
        if not isinstance(value, dict) or value.get("policy") not in cls.DECIDED:
            raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)} or a decision "
                            f"{{policy = ..., ...}}, got {describe(value)}", hint)
        extra = sorted(set(value) - {"policy", "save", "kept", "autograd", "seconds", "budget"})
        save = value.get("save", [])
        ints = [value.get(k) for k in ("kept", "autograd", "budget") if value.get(k) is not None]
        secs = value.get("seconds")
        if extra or not isinstance(save, list) or not all(isinstance(x, str) and "#" in x for x in save) \
                or not all(_is_int(x) and x >= 0 for x in ints) \
                or (secs is not None and (isinstance(secs, bool) or not isinstance(secs, (int, float)) or secs < 0)) \
                or (value["policy"] == "ops") != bool(save):
            raise PlanError(f"malformed recompute decision {describe(value)}: save (op keys like "
                            "\"mm.default#0\") goes with policy ops only; kept/autograd/budget are byte counts, "
                            "seconds a time", hint)
        return cls(value["policy"], tuple(save), value.get("kept"), value.get("autograd"),
                   None if secs is None else float(secs), value.get("budget"))

    @property
    def coarse(self) -> str:
        """The coarse policy the analytical formulas price when no trace numbers are given (ops: selective)."""
        return "selective" if self.policy == "ops" else self.policy

    def print(self):
        if self.kept is None and not self.save:
            return self.policy
        out: dict = {"policy": self.policy}
        if self.save:
            out["save"] = list(self.save)
        for k in ("kept", "autograd", "seconds", "budget"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    def runtime(self) -> dict:
        """What the trainer needs (:func:`rlhfc.runtime.models.recompute.apply_recompute`)."""
        policy = "full" if self.policy == "selective" and not self.save else self.policy
        return {"policy": policy, "save": list(self.save)} if policy == "ops" else {"policy": policy}


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
        """The nodes the mesh touches (its devices are consecutive)."""
        if self.count <= 0:
            return []
        return list(range(self.first // per_node, (self.first + self.count - 1) // per_node + 1))

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
