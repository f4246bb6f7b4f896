"""How a pass that chooses by prediction compares two plans: each plan's predicted steady-state step
(:func:`rlhfc.cost.simulate` over :data:`rlhfc.cost.simulator.STEADY_STEPS` steps) and the gain a change
that alters training must promise before an automatic choice takes it (:data:`AUTO_GAIN`).

Used by ``overcommit{when=faster}`` and ``async_rollout{when=faster}`` (-O3), ``tail_migrate{when=faster}``
(-O2 and -O3, at :data:`EXACT_GAIN`) and by ``async_rollout``'s
``proximal = auto``: a change that trains on other samples, or on an approximated loss, is taken only where
the cost model predicts it pays, since a gain within the model's error is not worth a change of what the
job learns from.
"""

from __future__ import annotations

from rlhfc.cost import CostModel, simulate
from rlhfc.cost.simulator import STEADY_STEPS
from rlhfc.ir import Module

#: a change that alters training is taken automatically only when its step is predicted this much faster
AUTO_GAIN = 0.05
#: an exact change that moves work between processes (``tail_migrate{when=faster}``, -O2) is taken only when its
#: step is predicted this much faster: below it the prediction cannot tell it from no change, and on an
#: overhead-bound CPU job the split it makes measured slower (docs/benchmarks.md, RLHFuse)
EXACT_GAIN = 0.01


def steady_step(module: Module) -> float:
    """``module``'s predicted steady-state step, seconds."""
    return simulate(module, steps=STEADY_STEPS, cost_model=CostModel(module)).step_time_s


class Faster:
    """``faster(candidate, base)``: is ``candidate``'s step predicted at least ``gain`` (default
    :data:`AUTO_GAIN`) shorter than ``base``'s? Each module is simulated once (the modules must not change between
    calls)."""

    def __init__(self, gain: float = AUTO_GAIN) -> None:
        self._steps: dict[int, tuple[Module, float]] = {}
        self.gain = gain

    def step(self, module: Module) -> float:
        if id(module) not in self._steps:
            self._steps[id(module)] = (module, steady_step(module))   # the module kept: its id stays its own
        return self._steps[id(module)][1]

    def __call__(self, candidate: Module, base: Module) -> bool:
        return self.step(candidate) < (1.0 - self.gain) * self.step(base)
