"""Tools and environments in the language and the IR (issue #38): declarations that round-trip through the IR
text, the plan and the generated driver; the verifier's checks of a multi-turn generate."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, parse_ir, plan, print_module, verify
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "agent_tiny.rlhf")
EXAMPLE_PPO = os.path.join(ROOT, "examples", "agent_tiny_ppo.rlhf")
TOOL = os.path.join(ROOT, "tests", "e2e", "agent_tool.rlhf")


def _load(path):
    return compile_source(open(path).read(), path)[0]


@pytest.mark.parametrize("path", [EXAMPLE, TOOL], ids=["env", "tool"])
def test_tools_and_environments_round_trip_through_the_ir_text(path):
    module = _load(path)
    text = print_module(module)
    again = parse_ir(text)
    assert print_module(again) == text
    assert again.tools == module.tools and again.tools
    verify(again)


def test_the_plan_and_the_driver_carry_them(tmp_path):
    module = PassManager(parse_pipeline(",".join(PIPELINES["O2"]))).run(_load(EXAMPLE))
    emit_job(module, str(tmp_path / "job"), source_path=EXAMPLE, opt_level="O2", passes=PIPELINES["O2"])
    with open(tmp_path / "job" / "plan.json") as fh:
        tools = json.load(fh)["tools"]
    assert tools == {"lookup": {"fn": "agent_lookup:Lookup", "timeout": 10.0, "memory_mb": 512, "max_output": 1024,
                                "kind": "env"}}   # an environment's default limits (ENV_DEFAULTS)
    code = open(tmp_path / "job" / "main.py").read()
    assert "env=job.env('lookup'), max_turns=2, turn_tokens=1" in code
    assert "scores = job.compute('scores', compute.env_reward, traj)" in code
    gen = next(s for s in module.graph.stages if s.op == "generate")
    assert plan.multi_turn(gen) and plan.stream_chunk(gen) is None and plan.overcommit(gen) is None


def test_O3_neither_streams_nor_overcommits_a_multi_turn_generate():
    o3 = ["overcommit" if p.startswith("overcommit") else p for p in PIPELINES["O3"]]   # not only where faster
    module = PassManager(parse_pipeline(",".join(o3))).run(_load(TOOL))
    gen = next(s for s in module.graph.stages if s.op == "generate")
    assert plan.overcommit(gen) is None and plan.stream_chunk(gen) is None


def test_the_verifier_checks_the_ir_of_a_multi_turn_generate():
    text = print_module(_load(TOOL))
    bad = {
        'tools = "a"': ('tools = "b"', "calls tool 'b', which the module does not declare"),
        "max_turns = 4, turn_tokens = 1": ("max_turns = 4, turn_tokens = 11", "turn_tokens = 11 is longer"),
        "timeout = 2.0": ("timeout = 0.0", "timeout must be a number of at least 0.01"),
    }
    for old, (new, said) in bad.items():
        assert old in text
        with pytest.raises(CompileError) as exc:
            verify(parse_ir(text.replace(old, new)))
        assert said in str(exc.value), str(exc.value)


def test_env_reward_of_a_rollout_without_an_environment_is_a_located_error():
    text = open(TOOL).read().replace('scores   = rule("rlhfc.runtime.rewards:vowel_count", traj)',
                                     "scores   = env_reward(traj)")
    with pytest.raises(CompileError) as exc:
        compile_source(text, TOOL)
    assert "env_reward reads an environment's rewards, but %traj acts in no environment" in str(exc.value)


def test_env_turn_rewards_of_a_rollout_without_an_environment_is_a_located_error():
    text = open(TOOL).read().replace('scores   = rule("rlhfc.runtime.rewards:vowel_count", traj)',
                                     "scores   = env_turn_rewards(traj)")
    with pytest.raises(CompileError) as exc:
        compile_source(text, TOOL)
    assert "env_turn_rewards reads an environment's rewards, but %traj acts in no environment" in str(exc.value)


def test_per_turn_rewards_feed_kl_penalty_and_gae_and_report_their_sum_as_the_reward():
    """``env_turn_rewards(traj)`` is a TokenFloat: kl_penalty and gae take it; the job's reward metric is its
    per-row sum (no sequence score in the program)."""
    from rlhfc.codegen.plan import metric_roles

    text = open(EXAMPLE_PPO).read().replace(
        "  scores   = env_reward(traj)\n"
        "  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.0)",
        "  rewards  = env_turn_rewards(traj)\n"
        "  tok      = kl_penalty(rewards, logp, ref_logp, coef = 0.01)\n"
        "  adv, ret = gae(tok, values, gamma = 1.0, lam = 0.95)")
    assert "env_turn_rewards" in text
    module, _ = compile_source(text, EXAMPLE_PPO)
    ir = print_module(module)
    assert "%rewards = compute.env_turn_rewards(%traj) {} : TokenFloat[144]" in ir
    assert "%tok = compute.kl_penalty(%rewards, %logp, %ref_logp) {coef = 0.01" in ir
    roles = metric_roles(module)
    assert roles.reward == "rewards" and roles.kl == ("logp", "ref_logp")


def test_an_environment_class_without_step_is_a_located_error(tmp_path):
    (tmp_path / "envs.py").write_text("class Game:\n    def reset(self, record):\n        return ''\n")
    text = open(EXAMPLE).read().replace('python("agent_lookup:Lookup")', 'python("envs:Game")').replace(
        'jsonl("agent_tiny.jsonl", fields = [answer])', 'synthetic(count = 16)')
    with pytest.raises(CompileError) as exc:
        compile_source(text, str(tmp_path / "prog.rlhf"))
    assert "environment class 'envs:Game' has no method 'step'" in str(exc.value)


def test_an_environments_limits_round_trip_and_other_settings_are_located_errors(tmp_path):
    """``env NAME = python("module:Class", timeout = T, memory = M)``: the limits of its sandboxed process, printed
    in the IR only where not the defaults, carried by the plan; ``max_output`` (a tool's) is refused, located."""
    import shutil

    shutil.copy(os.path.join(ROOT, "examples", "agent_lookup.py"), tmp_path / "agent_lookup.py")
    shutil.copy(os.path.join(ROOT, "examples", "agent_tiny.jsonl"), tmp_path / "agent_tiny.jsonl")
    base = open(EXAMPLE).read()
    limited = base.replace('python("agent_lookup:Lookup")', 'python("agent_lookup:Lookup", timeout = 3, memory = 1G)')
    module = compile_source(limited, str(tmp_path / "limited.rlhf"))[0]
    ir = print_module(module)
    assert 'env @lookup {fn = "agent_lookup:Lookup", timeout = 3.0, memory_mb = 1000}' in ir
    assert parse_ir(ir).tools == module.tools
    default = print_module(compile_source(base, str(tmp_path / "default.rlhf"))[0])
    assert 'env @lookup {fn = "agent_lookup:Lookup"}' in default
    bad = base.replace('python("agent_lookup:Lookup")', 'python("agent_lookup:Lookup", max_output = 10)')
    with pytest.raises(CompileError) as exc:
        compile_source(bad, str(tmp_path / "bad.rlhf"))
    text = str(exc.value)
    assert "bad.rlhf:14:44: error: python() of environment 'lookup' has no setting 'max_output'" in text
    assert "settings: timeout (seconds per reset or step), memory (e.g. 512M)" in text
