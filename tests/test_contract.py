"""The contract between compiler and runtime (``rlhfc.contract``): ``plan.json`` round-trips through its typed
dataclasses, a malformed or old plan is an error naming where it is wrong, and the engine registries answer
by traits."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.contract import engines
from rlhfc.contract.plan import PLAN_FORMAT, Plan, PlanFormatError, load_plan
from rlhfc.frontend import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("job")
    path = os.path.join(ROOT, "examples", "ppo_tiny.rlhf")
    module, _, _ = load_file(path)
    emit_job(module, str(out), source_path=path, opt_level="O0", passes=[])
    return out


def test_plan_json_round_trips_through_the_dataclasses(job):
    raw = json.loads((job / "plan.json").read_text())
    plan = Plan.from_json(raw)
    assert raw["format"] == PLAN_FORMAT and plan.to_json() == raw
    assert plan.placement.workers["actor"].engine == "torch" and plan.placement.workers["actor"].ranks == 1
    assert plan.models["ref"].init.kind == "copy" and plan.models["ref"].init.source_model == "actor"
    assert plan.graph.value_to_stage["roll"] == "roll" and plan.graph.stages_by_name["roll"].op == "generate"
    assert plan.metrics.kl == ("logp", "ref_logp")


@pytest.mark.parametrize("change,where", [
    (lambda p: p["placement"]["workers"]["actor"].__setitem__("ranks", "two"),
     "placement.workers.actor.ranks: expected an integer, got \"two\""),
    (lambda p: p["models"]["actor"]["spec"].pop("hidden"), "models.actor.spec: missing field 'hidden'"),
    (lambda p: p["run"].__setitem__("stepz", 3), "run: unknown field(s) stepz"),
    (lambda p: p["graph"]["stages"][0].__setitem__("inputs", "prompts"), "graph.stages[0].inputs: expected a list"),
    (lambda p: p["cluster"].__setitem__("nodes", True), "cluster.nodes: expected an integer, got true"),
])
def test_a_malformed_plan_names_the_field(job, change, where):
    raw = json.loads((job / "plan.json").read_text())
    change(raw)
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json(raw)
    assert err.value.message == f"plan.json: {where}" or err.value.message.startswith(f"plan.json: {where}")
    assert "recompile" in err.value.hint


def test_a_plan_of_another_format_asks_to_recompile(job, tmp_path):
    raw = json.loads((job / "plan.json").read_text())
    raw["format"] = 1
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    with pytest.raises(PlanFormatError, match="plan format 1, but this rlhfc reads format 2") as err:
        load_plan(str(tmp_path / "plan.json"))
    assert "rlhfc compile" in err.value.hint
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(PlanFormatError, match="not a readable JSON file"):
        load_plan(str(tmp_path / "plan.json"))


def test_a_job_with_a_malformed_plan_stops_naming_the_field(job, tmp_path, capsys):
    from rlhfc.runtime.job import main

    bad = tmp_path / "job"
    bad.mkdir()
    for f in ("main.py", "plan.json"):
        (bad / f).write_text((job / f).read_text())
    raw = json.loads((bad / "plan.json").read_text())
    raw["placement"]["workers"]["critic"]["cores"] = "0,1"
    (bad / "plan.json").write_text(json.dumps(raw))
    assert main(str(bad / "main.py"), ["--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "placement.workers.critic.cores: expected a list" in err and "hint: recompile" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_registries_answer_by_traits():
    assert engines.rollout_engines()[0] == engines.DEFAULT_ROLLOUT and "vllm" in engines.rollout_engines()
    assert engines.train_backends() == ("torch", "fsdp", "megatron")
    assert not engines.rollout_traits("vllm").trainer_numerics and engines.rollout_traits("torch").trainer_numerics
    assert engines.auto_backend(1, 1, 1) == "torch" and engines.auto_backend(2, 1, 1) == "fsdp"
    assert engines.auto_backend(2, 2, 1) == "megatron" and engines.auto_backend(1, 1, 2) == "megatron"
    assert engines.train_traits("fsdp").held_fraction(4, 1, 1) == 0.25
    assert engines.train_traits("megatron").held_fraction(2, 2, 2) == 0.25
    with pytest.raises(KeyError, match="no rollout engine 'sglang' is registered"):
        engines.rollout_traits("sglang")
