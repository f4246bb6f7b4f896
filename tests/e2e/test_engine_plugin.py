"""Adding an engine touches no rlhfc file (docs/runtime.md, "Adding an engine"): a rollout engine registered by
a plugin module (tests/e2e/plugins/toy_sampler.py) is checked by the compiler by its traits and runs a job —
its rollouts, metrics and checkpoints — on a local Ray, its workers importing the plugin from the plan."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.cli import main as cli
from rlhfc.contract.plan import load_plan

HERE = os.path.dirname(__file__)
PLUGIN = os.path.join(HERE, "plugins", "toy_sampler.py")

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _registry_restored(monkeypatch):
    """The plugin registers into a copy of the registry and is imported afresh: no later test sees it."""
    import sys

    from rlhfc.contract import engines
    from rlhfc.contract.plugins import module_name

    monkeypatch.setattr(engines, "_ROLLOUT", dict(engines._ROLLOUT))
    sys.modules.pop(module_name(PLUGIN), None)
    yield
    sys.modules.pop(module_name(PLUGIN), None)


def _program(tmp_path, rollout: str = "toy_sampler") -> str:
    text = open(os.path.join(HERE, "tiny_ppo.rlhf")).read()
    path = tmp_path / "toy.rlhf"
    path.write_text(text.replace("run { steps = 4; seed = 3; checkpoint_every = 2 }",
                                 f"run {{ steps = 2; seed = 3; rollout = {rollout} }}"))
    return str(path)


def test_an_engine_from_a_plugin_runs_a_job(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    program = _program(tmp_path)
    assert cli(["check", program]) == 2                      # without the plugin the name is unknown
    assert "rollout must be one of torch, vllm, auto, got toy_sampler" in capsys.readouterr().err
    assert cli(["run", program, "--plugin", PLUGIN, "-O1", "--out", "run", "--no-progress"]) == 0, \
        capsys.readouterr().err
    plan = load_plan("run/job/plan.json")
    assert plan.plugins == (os.path.abspath(PLUGIN),) and plan.placement.workers["actor"].engine == "toy_sampler"
    rows = [json.loads(line) for line in open("run/metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and all(r["toy_rows"] == 4 for r in rows)   # its rollouts
    assert os.path.isdir("run/checkpoints/step_2")


def test_the_compiler_checks_a_plugin_engine_by_its_traits(tmp_path, capsys):
    program = _program(tmp_path)
    text = open(program).read().replace("max_new_tokens = 6)", "max_new_tokens = 6, top_p = 0.0)")
    open(program, "w").write(text)
    assert cli(["check", program, "--plugin", PLUGIN]) == 2
    err = capsys.readouterr().err
    assert "top_p = 0.0 is not a sampling setting the toy sampler supports" in err and "Traceback" not in err
