"""The ``overcommit`` pass's choice at -O3 (``overcommit{when=faster}``): kept only where the steady-state step
is predicted at least ``AUTO_GAIN`` faster than without it, the IR left as it was otherwise; named, it
overcommits wherever it can."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfc.frontend import load_file
from rlhfc.ir import plan, print_module
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline
from rlhfc.passes.predict import AUTO_GAIN, steady_step

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "dce,unpad,reuse_logprobs,parallelize,stream"   # the passes -O3 runs before overcommit


def _compiled(program: str, passes: str):
    module, _, _ = load_file(str(ROOT / program))
    return PassManager(parse_pipeline(passes)).run(module)


def _overcommitted(module) -> bool:
    return any(plan.overcommit(s) for s in module.graph.stages)


@pytest.mark.parametrize("program,kept", [("tests/e2e/tiny_ppo_tail.rlhf", True), ("tests/e2e/tiny_ppo.rlhf", False),
                                          ("examples/ppo_7b.rlhf", False)], ids=["long-tail", "short", "7b"])
def test_O3_overcommits_only_where_the_step_is_predicted_faster(program, kept):
    base = _compiled(program, BEFORE)
    always = _compiled(program, BEFORE + ",overcommit")
    chosen = _compiled(program, BEFORE + ",overcommit{when=faster}")
    assert _overcommitted(always)   # it could: a generate of one sample per prompt, its prompts read by it alone
    gain = 1 - steady_step(always) / steady_step(base)
    assert (gain >= AUTO_GAIN) == kept, gain
    assert _overcommitted(chosen) == kept
    assert print_module(chosen) == print_module(always if kept else base)
    assert plan.changes_training(chosen) == (["overcommit"] if kept else [])


def test_the_O3_pipeline_overcommits_where_faster_and_the_option_is_checked():
    assert "overcommit{when=faster}" in PIPELINES["O3"]
    with pytest.raises(Exception, match="when must be always or faster"):
        parse_pipeline("overcommit{when=sometimes}")
