"""The registries of rollout engines and train backends: what each one is, by traits, and what runs it.

An engine is known to the compiler by its traits (what it can run, what it costs beside the trainer, what it
needs installed) and to the runtime by a class (``runtime``: ``"package.module:Class"``, imported in the worker
process when a worker is built with it). The compiler and runtime ask the traits, never the name.

The built-in ones register below — ``torch`` (rlhfc's own decode loop) and ``vllm`` as rollout engines;
``torch`` (one process), ``fsdp`` (FSDP2 data parallel) and ``megatron`` (megatron-core dp x tp x pp) as train
backends. Another engine is one module that calls :func:`register_rollout` or :func:`register_train` at import
and defines its runtime class (docs/runtime.md, "Adding an engine"); a program loads it with
``run { plugins = ["module"] }``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: how the optional extras install
EXTRA_INSTALL = "pip install -c constraints.txt -e '.[{extra}]'"


@dataclass(frozen=True)
class RolloutTraits:
    """A rollout engine: the runtime class that decodes (``runtime``) and what the compiler must know of it.

    ``trainer_numerics``: it samples with the trainer's own forward, so its tokens' log-probs equal the
    trainer's (the ``reuse_logprobs`` pass may keep them; no importance correction); False: another kernel
    set, whose log-probs are the behaviour policy's (kept on every rollout, corrected for by TIS).
    ``own_weights``: it holds its own copy of the weights (and KV cache) beside the trainer's, refitted after
    every train step; the cost model prices the refit and the memory with the engine's own fitted rates.
    ``head_sizes``: the attention head sizes it runs (None: any). ``top_p_zero``: whether it samples with
    ``top_p <= 0`` (greedy through the nucleus cut). ``package``: the import it needs (None: none),
    ``install`` how to get it. ``auto``: ``rollout = auto`` may choose it for a stage the cost model prices
    faster on it. ``title``: how messages name it (``vLLM``). ``driver_env``: environment variables of the driver
    the engine reads in its workers, forwarded with its rollout options (``options["env"]``: a Ray worker's
    environment is the one its Ray started with, on another node none of the driver's). ``shares_process``: its
    workers may share one process with other models' (:mod:`rlhfc.runtime.worker.host`) — it keeps no state of
    the process's own and runs in the calling thread (an engine that starts a runtime of its own does not).
    ``row_streams``: each row samples from a random stream of its own, keyed by the row and the token position,
    so a row's tokens do not depend on the other rows of its call and a row resumed in another call (another
    rank: the ``tail_migrate`` pass) samples on as it would have. ``kv_moves``: a row it stops hands back its
    KV cache, and a later call under the same weights continues the row from it instead of a prefill of its
    tokens (the ``tail_migrate`` pass's ``move = kv``)."""

    name: str
    runtime: str
    title: str = ""
    shares_process: bool = False
    trainer_numerics: bool = True
    own_weights: bool = False
    head_sizes: tuple[int, ...] | None = None
    top_p_zero: bool = True
    package: str | None = None
    install: str | None = None
    auto: bool = False
    driver_env: tuple[str, ...] = ()
    row_streams: bool = False
    kv_moves: bool = False


@dataclass(frozen=True)
class TrainTraits:
    """A train backend: the class a worker of the model's group holds (``runtime``, a
    :class:`~rlhfc.runtime.train.backend.TrainBackend`) and its traits.

    ``dims``: the layout factors it splits a model over (``dp``, ``tp``, ``pp``; empty: one process). ``shards``:
    the factors whose product divides the weights each rank holds (FSDP2 shards over dp; megatron over tp and
    pp). ``packs_rows``: its forwards and training may run an unpadded batch as length groups (a data-parallel
    rank must run as many forwards as the others, so FSDP's ranks do not). ``precisions``: the arithmetic it
    runs. ``shares_process``: a one-process backend whose workers may share a process with other models'
    (:mod:`rlhfc.runtime.worker.host`). ``lora``: whether it trains LoRA adapters. ``package``/``install``: the import it needs.
    ``auto_rank``: ``trainer = auto`` picks, for a layout, the backend of lowest rank among those whose
    ``dims`` hold every factor above 1 (torch 0, fsdp 1, megatron 2). ``solo``: the backend a one-rank layout
    runs on instead (FSDP needs no sharding on one rank: torch). ``hf_models``: whether it trains a model loaded
    from a Hugging Face folder. ``title``: how messages name its package (``megatron-core``)."""

    name: str
    runtime: str
    title: str = ""
    dims: frozenset = frozenset()
    shards: frozenset = frozenset()
    packs_rows: bool = True
    shares_process: bool = False
    precisions: tuple[str, ...] = ("fp32", "bf16")
    lora: bool = False
    package: str | None = None
    install: str | None = None
    auto_rank: int = 0
    solo: str | None = None
    hf_models: bool = True

    def runs(self, dp: int, tp: int, pp: int) -> bool:
        """Whether it runs a model split ``dp`` x ``tp`` x ``pp``."""
        return all(n == 1 or d in self.dims for d, n in (("dp", dp), ("tp", tp), ("pp", pp)))

    def held_fraction(self, dp: int, tp: int, pp: int) -> float:
        """The share of the weights one rank holds."""
        split = {"dp": dp, "tp": tp, "pp": pp}
        n = 1
        for d in self.shards:
            n *= split[d]
        return 1.0 / n


_ROLLOUT: dict[str, RolloutTraits] = {}
_TRAIN: dict[str, TrainTraits] = {}


def register_rollout(traits: RolloutTraits) -> RolloutTraits:
    """Register (or replace) a rollout engine by ``traits.name``."""
    _ROLLOUT[traits.name] = traits
    return traits


def register_train(traits: TrainTraits) -> TrainTraits:
    """Register (or replace) a train backend by ``traits.name``."""
    _TRAIN[traits.name] = traits
    return traits


def rollout_traits(name: str) -> RolloutTraits:
    """The traits of rollout engine ``name`` (KeyError naming the registered ones)."""
    try:
        return _ROLLOUT[name]
    except KeyError:
        raise KeyError(f"no rollout engine '{name}' is registered (registered: {', '.join(_ROLLOUT)})") from None


def train_traits(name: str) -> TrainTraits:
    """The traits of train backend ``name`` (KeyError naming the registered ones)."""
    try:
        return _TRAIN[name]
    except KeyError:
        raise KeyError(f"no train backend '{name}' is registered (registered: {', '.join(_TRAIN)})") from None


def rollout_engines() -> tuple[str, ...]:
    """The registered rollout engines' names, in registration order (the default first)."""
    return tuple(_ROLLOUT)


def train_backends() -> tuple[str, ...]:
    """The registered train backends' names, in registration order (the default first)."""
    return tuple(_TRAIN)


def auto_backend(dp: int, tp: int, pp: int) -> str:
    """``trainer = auto``'s backend for a layout: the lowest ``auto_rank`` that runs it."""
    fits = [t for t in _TRAIN.values() if t.runs(dp, tp, pp)]
    return min(fits, key=lambda t: t.auto_rank).name


#: the engine and backend a program gets when it names none
DEFAULT_ROLLOUT = "torch"
DEFAULT_TRAINER = "torch"

# -- the built-in engines ------------------------------------------------------------------------------------
register_rollout(RolloutTraits(DEFAULT_ROLLOUT, "rlhfc.runtime.rollout.base:TorchDecoder", title="torch",
                               shares_process=True, row_streams=True, kv_moves=True))
register_rollout(RolloutTraits(
    "vllm", "rlhfc.runtime.rollout.vllm:VllmRollout", title="vLLM", trainer_numerics=False, own_weights=True,
    head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256), top_p_zero=False, package="vllm",
    install=EXTRA_INSTALL.format(extra="vllm"), auto=True, driver_env=("RLHFC_VLLM_CACHE",)))

register_train(TrainTraits(DEFAULT_TRAINER, "rlhfc.runtime.train.backend:TrainBackend", title="torch", lora=True,
                           shares_process=True))
register_train(TrainTraits("fsdp", "rlhfc.runtime.train.fsdp:FsdpBackend", title="FSDP2", dims=frozenset({"dp"}),
                           shards=frozenset({"dp"}), packs_rows=False, auto_rank=1, solo=DEFAULT_TRAINER))
register_train(TrainTraits("megatron", "rlhfc.runtime.train.megatron:MegatronBackend", title="megatron-core",
                           dims=frozenset({"dp", "tp", "pp"}), shards=frozenset({"tp", "pp"}), packs_rows=False,
                           precisions=("fp32",), package="megatron.core", hf_models=False,
                           install=EXTRA_INSTALL.format(extra="megatron"), auto_rank=2))
