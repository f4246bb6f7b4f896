"""Multi-turn generates priced as the runtime runs them (rlhfc.cost.model.CostModel.turn_work): one decode call
per turn over the trajectories still going, re-prefilling prompt + trajectory, then the turn's tool calls;
``--turns`` prices a mean, the default every turn (an upper bound); explain shows the loop."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlhfc.cli import main
from rlhfc.cost import CostConfig, CostModel
from rlhfc.cost.batched import candidate_layouts, evaluate
from rlhfc.cost.model import TOOL_CALL_S
from rlhfc.frontend import load_file
from rlhfc.passes import PassManager, parse_pipeline

from .helpers import EXAMPLES, ROOT

AGENT_TOOL = ROOT / "tests" / "e2e" / "agent_tool.rlhf"   # tool a, max_turns 4, turn_tokens 1, 16 rows, width 10


def _module(path=AGENT_TOOL, edit=None):
    text = path.read_text()
    if edit:
        text = edit(text)
    target = path.parent / f"_price_{path.name}"
    target.write_text(text)
    try:
        module, _, _ = load_file(str(target))
    finally:
        target.unlink()
    return PassManager(parse_pipeline("dce")).run(module)


def _gen(module):
    return next(s for s in module.graph.stages if s.op == "generate")


def test_every_turn_is_priced_by_default_and_turns_prices_the_mean():
    module = _module()
    gen = _gen(module)
    full = CostModel(module).stage_cost(gen).work
    assert full["max_turns"] == 4 and full["expected_turns"] == 4 and full["turns_source"].startswith("max_turns")
    assert full["turn_rows"] == [16, 16, 16, 16]
    assert full["tool_calls"] == 48   # every trajectory calls after each turn but its last
    mean = CostModel(module, CostConfig(turns=2.5)).stage_cost(gen).work
    assert mean["turn_rows"] == [16, 16, 8]   # all take two turns, half a third
    assert mean["tool_calls"] == 24 and mean["turns_source"] == "given"
    priced = [CostModel(module, CostConfig(turns=t)).stage_cost(gen).time_s for t in (1, 2, 3, 4)]
    assert priced == sorted(priced) and len(set(priced)) == 4


def test_a_streamed_multi_turn_generate_hands_on_the_trajectories_that_end_at_each_turn():
    """Finish offsets: at ``turns = 2.5`` of 4, half the trajectories end after turn 2 (when its decode and the
    tool calls after turn 1 are done), the rest with the stage; at the default (every turn) all end with it. The
    stream pass streams a multi-turn generate only with a chunk given."""
    module = _module()
    gen = _gen(module)
    every = CostModel(module).stage_cost(gen)
    assert set(every.finish_offsets) == {every.time_s - CostModel(module).dispatch}
    cost = CostModel(module, CostConfig(turns=2.5)).stage_cost(gen)
    turn_s, end = cost.work["turn_s"], cost.time_s - CostModel(module).dispatch
    calls_1 = cost.parts["tools"] / cost.work["tool_calls"] * 16   # every trajectory calls after turn 1
    assert cost.finish_offsets[:8] == pytest.approx([turn_s[0] + calls_1 + turn_s[1]] * 8)
    assert cost.finish_offsets[8:] == pytest.approx([end] * 8) and cost.finish_offsets[7] < end
    auto = PassManager(parse_pipeline("stream")).run(_module())
    assert "stream" not in _gen(auto).annotations
    given = PassManager(parse_pipeline("stream{chunk=4}")).run(_module())
    assert "stream" in _gen(given).annotations


def test_tool_calls_add_the_sandbox_and_the_tools_own_seconds():
    module = _module()
    gen = _gen(module)
    base = CostModel(module, CostConfig(turns=3)).stage_cost(gen)
    slow = CostModel(module, CostConfig(turns=3, tool_s=0.05)).stage_cost(gen)
    calls = base.work["tool_calls"]
    assert calls == 32
    assert base.parts["tools"] == pytest.approx(calls * TOOL_CALL_S)
    assert slow.time_s - base.time_s == pytest.approx(calls * 0.05)
    assert slow.parts["tools"] == pytest.approx(calls * (TOOL_CALL_S + 0.05))


def test_a_turn_costs_what_a_one_turn_generate_of_its_rows_and_prompt_costs():
    """Turn 1 of the loop = the same generate without tools, ``max_new_tokens = turn_tokens``."""
    loop = _module()
    one = _module(edit=lambda t: t.replace("max_new_tokens = 10, turn_tokens = 1, tools = [a], max_turns = 4",
                                           "max_new_tokens = 1"))
    cm_loop, cm_one = CostModel(loop), CostModel(one)
    single = cm_one.stage_cost(_gen(one))
    assert "turn_s" not in single.work
    assert cm_loop.stage_cost(_gen(loop)).work["turn_s"][0] == pytest.approx(single.time_s - cm_one.dispatch, rel=1e-12)


def test_the_trajectory_length_law_sums_the_turns_and_answers():
    """Every turn one token (law ``max``), an answer of 2 tokens after each but the last: 3 turns = 3 + 2·2 = 7
    tokens; the rollout downstream is priced on that law."""
    module = _module()
    w = CostModel(module, CostConfig(turns=3, obs_tokens=2, response_lengths="max")).generation_work(_gen(module))
    pmf = w["dist"].array()
    assert len(pmf) == 10 and pmf[6] == pytest.approx(1.0)
    assert w["mean_response"] == pytest.approx(7.0)
    assert w["T"] == 10   # the rollout's width: max_new_tokens
    cut = CostModel(module, CostConfig(turns=4, obs_tokens=5, response_lengths="max")).generation_work(_gen(module))
    assert cut["dist"].array()[-1] == pytest.approx(1.0)   # 4 + 3·5 = 19 tokens, cut at the width


def test_a_later_turn_re_prefills_a_longer_prompt_and_holds_more_cache():
    module = _module()
    w = CostModel(module, CostConfig(turns=4, obs_tokens=2)).generation_work(_gen(module))
    prompts = [t["prompt"] for t in w["turns"]]
    assert prompts == sorted(prompts) and prompts[1] - prompts[0] == pytest.approx(w["turns"][0]["mean_response"] + 2)
    assert w["kv_tokens"] == max(t["kv_tokens"] for t in w["turns"])


@pytest.mark.parametrize("backend", ["numpy", "jax"])
def test_the_placement_search_prices_a_multi_turn_generate_as_the_stage_price(backend):
    module = _module(EXAMPLES / "agent_tiny.rlhf")
    cm = CostModel(module, CostConfig(turns=1.5, tool_s=0.01))
    gen = _gen(module)
    model = module.models["actor"]
    lay = cm.layout(gen)
    cands = candidate_layouts(lay.first, lay.count, per_node=module.cluster.per_node, heads=model.heads,
                              kv_heads=model.kv_heads, layers=model.layers)
    res = evaluate(module, gen.name, cands, backend=backend, cost_model=cm)
    for i, c in enumerate(cands):
        one = cm.stage_cost(gen, c)
        assert res["total"][i] == pytest.approx(one.time_s, rel=1e-9)
        assert res["transient_bytes"][i] == pytest.approx(one.transient_bytes, rel=1e-9)
    assert np.all(np.isfinite(res["total"]))


def test_explain_shows_the_loop(capsys):
    code = main(["explain", str(AGENT_TOOL), "--no-profile", "--turns", "2.5", "--tool-s", "0.01"])
    out, err = capsys.readouterr()
    assert code == 0, err
    note = next(line for line in out.splitlines() if "multi-turn loop" in line)
    assert "up to 4 policy turns of at most 1 token, tool(s) a between them" in note
    assert "priced at 2.5 turns per trajectory (--turns or a run's, --turns-from)" in note
    assert re.search(r"turn 1 [\d.]+ [mu]?s \(16 rows\), turn 2 [\d.]+ [mu]?s \(16 rows\), turn 3 [\d.]+ [mu]?s "
                     r"\(8 rows\); 24 tool calls", note)
    code = main(["explain", str(EXAMPLES / "agent_tiny.rlhf"), "--no-profile"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "priced at 2 turns per trajectory (max_turns, an upper bound" in out
    assert "144 environment steps (in the worker, not priced)" in out


def test_turns_below_one_is_refused(capsys):
    code = main(["explain", str(AGENT_TOOL), "--no-profile", "--turns", "0.5"])
    out, err = capsys.readouterr()
    assert code == 2 and "--turns" in err


def test_turns_from_a_run_prices_what_it_measured(capsys, tmp_path):
    import json

    from rlhfc.cli.explain import measured_turns

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "turns_mean": 2.0, "tool_calls": 16.0, "tool_s": 0.2},
            {"step": 1, "turns_mean": 3.0, "tool_calls": 24.0, "tool_s": 0.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "tur')
    turns, per_call = measured_turns(str(run))
    assert turns == 2.5 and per_call == pytest.approx(0.4 / 40 - TOOL_CALL_S)
    code = main(["explain", str(AGENT_TOOL), "--no-profile", "--turns-from", str(run)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "priced at 2.5 turns per trajectory (--turns or a run's, --turns-from)" in out
    assert "turn 3" in out and "(8 rows); 24 tool calls" in out
    code = main(["explain", str(AGENT_TOOL), "--no-profile", "--turns-from", str(tmp_path / "none")])
    out, err = capsys.readouterr()
    assert code == 2 and "--turns-from: run folder" in err and "does not exist" in err and "Traceback" not in err
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 1.0}) + "\n")
    code = main(["explain", str(AGENT_TOOL), "--no-profile", "--turns-from", str(run)])
    out, err = capsys.readouterr()
    assert code == 2 and "has no turns_mean" in err
