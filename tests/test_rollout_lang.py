"""``run { rollout = torch | vllm }`` and ``ppo_clip(..., tis_cap = C)`` in the language (issue #15): printed only
when not default and round-tripping, the ``--rollout`` override, what check refuses, and reuse_logprobs
leaving the trainer's forward in place under the vLLM engine. Needs no vLLM (the engine's own tests are
tests/runtime/test_vllm_engine.py)."""

from __future__ import annotations

import importlib.util

import pytest

from rlhfc.ir import CompileError, DiagnosticSink, parse_ir, print_module

PROGRAM = (
    'cluster local {{ devices = cpu:1 }}\n'
    'model actor = llama(layers = 1, hidden = 64, heads = {heads}, vocab = 64) trainable\n'
    'data prompts = synthetic(count = 64, min_len = 4, max_len = 8)\n'
    'pipeline grpo(batch = 4) {{\n'
    '  roll = actor.generate(prompts, n = 2, max_new_tokens = 8)\n'
    '  logp = actor.logprobs(roll)\n'
    '  actor.train(ppo_clip(roll, logp, group_advantages(roll, '
    'rule("rlhfc.runtime.rewards:vowel_count", roll)){tis}), lr = 1e-3)\n'
    '}}\n{run}')


def _load(tmp_path, name: str, heads: int = 1, tis: str = "", run: str = ""):
    from rlhfc.frontend import load_file

    path = tmp_path / f"{name}.rlhf"
    path.write_text(PROGRAM.format(heads=heads, tis=tis, run=run))
    module, _, _ = load_file(str(path))
    return module


@pytest.fixture
def vllm_installed(monkeypatch):
    """check's "vLLM is installed" answer, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))


def test_rollout_and_tis_cap_print_only_when_not_default_and_round_trip(tmp_path, vllm_installed):
    texts = {}
    for name, run, tis in (("plain", "", ""), ("set", "run { rollout = vllm }\n", ", tis_cap = 2.0"),
                           ("defaults", "run { rollout = torch }\n", "")):
        text = print_module(_load(tmp_path, name, tis=tis, run=run))
        assert print_module(parse_ir(text)) == text
        texts[name] = "\n".join(x.split(" loc(")[0] for x in text.splitlines())   # not the file's path
    assert 'rollout = "vllm"' in texts["set"] and "tis_cap = 2.0" in texts["set"]
    for name in ("plain", "defaults"):
        assert "rollout" not in texts[name] and "tis_cap" not in texts[name]


def test_reuse_logprobs_keeps_the_trainers_forward_under_the_vllm_engine(tmp_path, vllm_installed):
    from rlhfc.passes import PassManager, parse_pipeline

    ops = {}
    for name, run in (("torch", ""), ("vllm", "run { rollout = vllm }\n")):
        module = PassManager(parse_pipeline("reuse_logprobs")).run(_load(tmp_path, name, run=run))
        ops[name] = [s.op for s in module.graph.stages]
    assert "compute.sample_logprobs" in ops["torch"] and "forward.logprobs" not in ops["torch"]
    assert "forward.logprobs" in ops["vllm"] and "compute.sample_logprobs" not in ops["vllm"]


def test_check_says_how_to_install_vllm_when_it_is_missing(tmp_path, monkeypatch):
    from rlhfc.contract.engines import rollout_traits
    from rlhfc.ir.plan import verify_rollout

    VLLM_INSTALL = rollout_traits("vllm").install

    module = _load(tmp_path, "ok")
    module.run.rollout = "vllm"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    sink = DiagnosticSink()
    verify_rollout(module, sink)
    assert [d.message for d in sink.errors] == ["rollout = vllm, but vLLM is not installed"]
    assert VLLM_INSTALL in sink.errors[0].hint and "[vllm]" in VLLM_INSTALL


def test_rollout_flag_overrides_the_program_and_is_checked(tmp_path, vllm_installed):
    from rlhfc.cli.optimise import optimise

    done = optimise(_load(tmp_path, "flag"), "O0", None, rollout="vllm")
    assert done.module.run.rollout == "vllm"
    done = optimise(_load(tmp_path, "auto", heads=4), "O0", None, rollout="auto")   # head size 16: torch, no error
    assert done.module.run.rollout == "auto" and done.passes == ["engine"]
    assert "engine" not in done.module.graph.stages[1].annotations
    with pytest.raises(CompileError, match="unknown --rollout 'vlm'"):
        optimise(_load(tmp_path, "bad"), "O0", None, rollout="vlm")
    with pytest.raises(CompileError, match="head size 16"):   # the engine's own checks run on the override
        optimise(_load(tmp_path, "heads", heads=4), "O0", None, rollout="vllm")


def test_the_cost_model_prices_the_engines_refit_in_the_generate_stage(tmp_path, vllm_installed):
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import CostModel
    from rlhfc.cost.engine import VLLM_REFIT_LAYER_S
    from rlhfc.cost.sync import refit_time

    costs = {}
    for name, run in (("torch", ""), ("vllm", "run { rollout = vllm }\n")):
        module = optimise(_load(tmp_path, name, run=run), "O2", None).module
        gen = next(s for s in module.graph.stages if s.op == "generate")
        assert gen.annotations.get("refit_mb") == (64 if name == "vllm" else None)   # the realloc pass's option
        text = print_module(module)
        assert print_module(parse_ir(text)) == text   # the annotation round-trips
        cm = CostModel(module)
        costs[name] = cm.stage_cost(gen)
    refit = costs["vllm"].parts["refit"]
    # without a profile: the bytes moved plus the catalog's per-layer re-processing (1 layer here)
    assert refit == pytest.approx(refit_time(costs["vllm"].weights_bytes, 64, cm.spec) + VLLM_REFIT_LAYER_S["cpu"])
    assert costs["vllm"].work["refit_source"] == "assumed" and costs["vllm"].work["engine"] == "vllm"
    assert "refit" not in costs["torch"].parts and "engine" not in costs["torch"].work
    # continuous batching: vLLM computes each row's own tokens, the torch loop carries finished rows a while
    assert costs["vllm"].work["computed_tokens"] < costs["torch"].work["computed_tokens"]


def test_a_generating_model_of_several_ranks_runs_on_vllm_each_rank_priced_on_its_share(tmp_path, vllm_installed):
    """trainer = fsdp on cpu:2 runs the actor as two ranks: check accepts vLLM for it (an engine per rank), the
    engine pass may pick vLLM for it, and the generate stage is priced per rank: each decodes half the rows
    and refits the whole model; explain says so."""
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import CostModel
    from rlhfc.explain.engines import engine_notes
    from rlhfc.ir import plan

    def compiled(name: str, run: str, devices: int):
        from rlhfc.frontend import load_file

        path = tmp_path / f"{name}.rlhf"
        path.write_text(PROGRAM.format(heads=1, tis="", run=run).replace("cpu:1", f"cpu:{devices}"))
        return optimise(load_file(str(path))[0], "O1", None).module

    dp2 = compiled("dp2", "run { rollout = vllm; trainer = fsdp }\n", 2)
    one = compiled("one", "run { rollout = vllm }\n", 1)
    assert plan.engine_problem(dp2, "actor", "vllm") is None
    assert {w.ranks for w in plan.workers(dp2).values() if w.model == "actor"} == {2}
    costs = {}
    for name, module in (("dp2", dp2), ("one", one)):
        gen = next(s for s in module.graph.stages if s.op == "generate")
        costs[name] = CostModel(module).stage_cost(gen)
    assert costs["dp2"].layout.dp == 2 and costs["one"].layout.dp == 1
    assert costs["dp2"].parts["refit"] == pytest.approx(costs["one"].parts["refit"])   # the whole model each
    assert costs["dp2"].parts["decode"] < costs["one"].parts["decode"]   # half the rows per engine
    notes = engine_notes(dp2, CostModel(dp2))
    assert any("generates on vllm on 2 ranks, an engine each decoding its share of the 8 rows" in n for n in notes)
