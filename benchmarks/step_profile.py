"""Where a step's time goes, on both sides of the throughput comparison (``benchmarks/throughput.py``).

**rlhfc**, from the run's measured timeline (``trace.json``, :mod:`rlhfc.runtime.worker.trace`): per step, the
wall seconds during which at least one span of a family ran on any worker, rank or the driver —

* ``generation``: ``generate`` calls; ``forwards``: ``forward.logprobs/values/score``; ``training``: ``train``;
* ``transfers``: ``sync`` stages (weight syncs, reshards); ``driver``: the stages the driver computes itself
  (advantages, rule rewards, gathers);
* ``idle``: the step's seconds in which no span of any family ran — Ray's dispatch of the calls, the driver's
  Python between stages, the hand-over of results.

Families overlap when the plan overlaps stages (-O2 streams forwards beside generation, runs models' forwards in
parallel), so the families' seconds may add up to more than the step; each is reported as its own share of it.

**TRL** (``PPOTrainer``), from timers put around its phases for the run (:class:`TrlPhases`): ``generation``
(``batch_generation``), ``forwards`` (the rollout's no-grad ``forward`` and ``get_reward`` calls: reference,
value and reward models — the policy's own log-probs come from the generation's logits), ``training`` (from
an update's first grad-enabled forward to its last optimizer step: forwards, backwards, optimizer steps and
the loss arithmetic between them), ``gc`` (the ``gc.collect()`` calls the trainer makes every update), ``other``:
the rest of the update (advantages and whitening, statistics, ``empty_cache``, logging, the data loader). TRL
runs one thing at a time, so its phases add up to the step.

**TRL** (``GRPOTrainer``, :class:`TrlGrpoPhases`), per update (one generation round and the optimizer steps
trained on it): ``generation`` (``_generate``), ``forwards`` (no-grad ``_get_per_token_logps_and_entropies``: the
old policy's log-probs, the reference's when ``beta > 0``), ``rewards`` (``_calculate_rewards``), ``training``
(``training_step`` less the generation round it may run first, and the optimizer steps), ``other`` (the rest:
advantages, the data loader, logging).

Medians over the measured steps (after the warm-up).
"""

from __future__ import annotations

import json
import time
from statistics import median

#: a span's category (the op family, :mod:`rlhfc.runtime.worker.trace`) -> the profile's family
FAMILIES = {"generate": "generation", "forward": "forwards", "train": "training", "sync": "transfers"}
RLHFC_ORDER = ("generation", "forwards", "training", "transfers", "driver", "idle")
TRL_ORDER = ("generation", "forwards", "training", "gc", "other")
TRL_GRPO_ORDER = ("generation", "forwards", "rewards", "training", "other")


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def trace_split(path: str, skip: int = 0) -> dict[str, float]:
    """Per family the median seconds per step (``step``: the step's wall time) of ``trace.json`` at ``path``,
    over the steps after the first ``skip``."""
    with open(path, encoding="utf-8") as fh:
        events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "step")[skip:]
    spans = [(FAMILIES.get(e.get("cat"), "driver"), e["ts"], e["ts"] + e["dur"]) for e in events
             if e.get("cat") not in ("step", "wait")]
    per_step: dict[str, list[float]] = {k: [] for k in ("step",) + RLHFC_ORDER}
    for t0, t1 in steps:
        inside = [(fam, max(a, t0), min(b, t1)) for fam, a, b in spans if a < t1 and b > t0]
        for fam in RLHFC_ORDER[:-1]:
            per_step[fam].append(_covered([(a, b) for f, a, b in inside if f == fam]) / 1e6)
        per_step["idle"].append((t1 - t0 - _covered([(a, b) for _, a, b in inside])) / 1e6)
        per_step["step"].append((t1 - t0) / 1e6)
    return {k: median(v) for k, v in per_step.items() if v}


class TrlPhases:
    """Timers around TRL PPOTrainer's phases (see the module docstring): :meth:`install` patches the trainer's
    module (``trl.experimental.ppo.ppo_trainer``) and its optimizer, :meth:`end_update` closes an update (call
    it from a callback's ``on_step_end``), :meth:`uninstall` puts everything back."""

    def __init__(self) -> None:
        self.updates: list[dict[str, float]] = []
        self._open()

    def _open(self) -> None:
        self.cur = {"generation": 0.0, "forwards": 0.0, "gc": 0.0}
        self.t_start = time.perf_counter()
        self.train0: float | None = None
        self.train1: float | None = None

    def install(self, ppo_mod, trainer) -> None:
        import torch

        self.mod, self.saved = ppo_mod, {n: getattr(ppo_mod, n) for n in ("batch_generation", "forward", "get_reward")}

        def timed(name: str, phase):
            fn = self.saved[name]

            def wrapper(*args, **kwargs):
                kind = phase()
                t0 = time.perf_counter()
                if kind == "training" and self.train0 is None:
                    self.train0 = t0
                try:
                    return fn(*args, **kwargs)
                finally:
                    if kind != "training":
                        self.cur[kind] += time.perf_counter() - t0
            return wrapper

        ppo_mod.batch_generation = timed("batch_generation", lambda: "generation")
        ppo_mod.forward = timed("forward", lambda: "training" if torch.is_grad_enabled() else "forwards")
        ppo_mod.get_reward = timed("get_reward", lambda: "forwards")
        self.saved["gc"] = ppo_mod.gc
        collect = ppo_mod.gc.collect

        class TimedGc:   # the trainer's module calls gc.collect(): a stand-in module for the run
            def __getattr__(_, name):
                return getattr(self.saved["gc"], name)

            @staticmethod
            def collect(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return collect(*args, **kwargs)
                finally:
                    self.cur["gc"] += time.perf_counter() - t0
        ppo_mod.gc = TimedGc()
        self.optimizer, step = trainer.optimizer, trainer.optimizer.step

        def optimizer_step(*args, **kwargs):
            try:
                return step(*args, **kwargs)
            finally:
                self.train1 = time.perf_counter()
        self.optimizer.step = optimizer_step
        self._open()

    def end_update(self) -> None:
        now = time.perf_counter()
        training = (self.train1 - self.train0) if self.train0 is not None and self.train1 is not None else 0.0
        step = now - self.t_start
        self.updates.append({**self.cur, "training": training,
                             "other": step - training - sum(self.cur.values()), "step": step})
        self._open()

    def uninstall(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)
        del self.optimizer.step   # the instance attribute: the class's step again

    def split(self, skip: int = 0) -> dict[str, float]:
        """Per phase the median seconds per update, over the updates after the first ``skip``."""
        return _medians(self.updates, TRL_ORDER, skip)


class TrlGrpoPhases:
    """Timers around TRL GRPOTrainer's phases (see the module docstring): :meth:`install` patches the trainer
    instance, :meth:`end_update` closes an update (after its last optimizer step), :meth:`uninstall` takes the
    patches off."""

    PHASES = ("generation", "forwards", "rewards", "training")

    def __init__(self) -> None:
        self.updates: list[dict[str, float]] = []
        self._open()

    def _open(self) -> None:
        self.cur = dict.fromkeys(self.PHASES, 0.0)
        self.t_start = time.perf_counter()
        self.prepare = 0.0   # the generation round inside the current training_step

    def install(self, trainer) -> None:
        import torch

        self.trainer, self.optimizer = trainer, None
        patched = {"_generate": lambda: "generation", "_calculate_rewards": lambda: "rewards",
                   "_get_per_token_logps_and_entropies": lambda: None if torch.is_grad_enabled() else "forwards",
                   "_prepare_inputs": lambda: "prepare", "training_step": lambda: "training"}
        self.names = list(patched)

        def timed(fn, phase):
            def wrapper(*args, **kwargs):
                kind = phase()
                t0 = time.perf_counter()
                before = self.prepare
                try:
                    return fn(*args, **kwargs)
                finally:
                    dt = time.perf_counter() - t0
                    if kind == "prepare":
                        self.prepare += dt
                    elif kind == "training":   # less the generation round it ran first
                        self.cur["training"] += dt - (self.prepare - before)
                    elif kind is not None:
                        self.cur[kind] += dt
            return wrapper

        for name, phase in patched.items():
            setattr(trainer, name, timed(getattr(trainer, name), phase))
        self.timed = timed
        self._open()

    def optimizer_ready(self, optimizer) -> None:
        """The optimizer the trainer made at the start of ``train()`` (a callback's ``on_train_begin``)."""
        self.optimizer = optimizer
        optimizer.step = self.timed(optimizer.step, lambda: "training")
        self._open()

    def end_update(self) -> None:
        step = time.perf_counter() - self.t_start
        self.updates.append({**self.cur, "other": step - sum(self.cur.values()), "step": step})
        self._open()

    def uninstall(self) -> None:
        for name in self.names:
            delattr(self.trainer, name)   # the instance attributes: the class's methods again
        if self.optimizer is not None:
            del self.optimizer.step

    def split(self, skip: int = 0) -> dict[str, float]:
        return _medians(self.updates, TRL_GRPO_ORDER, skip)


def _medians(updates: list[dict[str, float]], order: tuple[str, ...], skip: int) -> dict[str, float]:
    """Per phase of ``order`` (and ``step``) the median over the updates after the first ``skip`` (all of them
    when there are no more)."""
    used = updates[skip:] or updates
    return {k: median(u[k] for u in used) for k in ("step",) + order} if used else {}


def format_split(split: dict[str, float], order: tuple[str, ...]) -> str:
    """``generation 1.20 s (45 %), ...`` of a split, shares of its step."""
    step = split.get("step") or float("nan")
    return ", ".join(f"{k} {split[k]:.2f} s ({100 * split[k] / step:.0f} %)" for k in order if k in split)
