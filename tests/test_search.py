"""The placement search (issue #20): deterministic compiles (a budget of candidates, never seconds), cost-model
failures as located compile errors, ``--response-lengths`` reaching the search, one pricing path (the searched
plan's price is ``explain``'s price of the compiled job), and a search that explores."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, print_module
from rlhfc.passes import PassManager, parse_pipeline

#: small models on one node of 8 GPUs: the search has a real space and runs in a second
GPU_PROGRAM = """
cluster node {{ gpu = "A100-80GB"; nodes = 1; gpus_per_node = 8 }}

model actor  = llama(layers = 4, hidden = 512, heads = 8, vocab = 1024) trainable
model critic = like(actor) head = value trainable
model ref    = copy(actor) frozen
model reward = llama(layers = 2, hidden = 256, heads = 4, vocab = 1024) head = score frozen

data prompts = synthetic(count = 4096, min_len = 16, max_len = 64)

pipeline ppo(batch = {batch}) {{
  roll     = actor.generate(prompts, max_new_tokens = 256)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-5, minibatches = 4)
  critic.train(value_loss(roll, values, ret), lr = 1e-5, minibatches = 4)
}}

run {{ steps = 2; seed = 0 }}
"""


def gpu_module(batch: int = 256):
    module, _ = compile_source(GPU_PROGRAM.format(batch=batch), "gpu.rlhf")
    return module


def run_passes(module, pipeline: str):
    return PassManager(parse_pipeline(pipeline)).run(module)


# -- 1. deterministic compiles -------------------------------------------------------------------------------

SEARCH = "dce,parallelize,stream,placement{strategy=search,candidates=120},realloc"


def test_search_budget_is_candidates_not_seconds():
    from rlhfc.passes import get_pass

    options = {f.name for f in get_pass("placement").options()}
    assert "candidates" in options and "seconds" not in options
    with pytest.raises(CompileError, match="candidates must be >= 1"):
        parse_pipeline("placement{candidates=0}")


def test_same_plan_on_a_busy_machine():
    """The same program compiles to the same IR on an idle machine and while two processes burn the CPU."""
    idle = print_module(run_passes(gpu_module(), SEARCH))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        busy = print_module(run_passes(gpu_module(), SEARCH))
    finally:
        for p in burners:
            p.kill()
            p.wait()
    assert busy == idle


@pytest.mark.parametrize("bad", ["raise", "nan"])
def test_stream_cost_model_failure_is_a_located_error(monkeypatch, bad):
    """``stream`` never falls back to a made-up estimate: a failing cost model is a compile error at the
    generate stage whose chunk size it was choosing."""
    from rlhfc.cost import model as cost_model

    def broken(self, stage, layout=None, rows=None):
        if bad == "raise":
            raise ZeroDivisionError("float division by zero")
        return cost_model.StageCost(stage.name, stage.op, stage.target, layout, math.nan)

    monkeypatch.setattr(cost_model.CostModel, "stage_cost", broken)
    with pytest.raises(CompileError) as info:
        run_passes(gpu_module(), "dce,stream")
    diag = next(d for d in info.value.diagnostics if "stream:" in d.message)
    assert "%roll" in diag.message and diag.loc is not None and diag.loc.line == 12
    assert "stream{chunk=N}" in diag.hint
    assert ("ZeroDivisionError" in diag.message) if bad == "raise" else ("nan s" in diag.message)


# -- 2. --response-lengths reaches the search ------------------------------------------------------------------

SMALL = "dce,parallelize,stream,placement{{strategy=search,candidates=40{extra}}},realloc"


def test_response_lengths_reach_the_placement_search():
    """Two length laws give the search two different prices (and the pass records what it priced); the CLI's
    ``--response-lengths`` sets the law of every placement pass that does not set its own."""
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import CostConfig, simulate

    reports = {}
    for law in ("max", "geometric:0.01"):
        module = run_passes(gpu_module(), SMALL.format(extra=f",response_lengths={law}"))
        reports[law] = module.search_report
        # the price the search saw is the compiled plan's price under that law
        assert simulate(module, CostConfig(response_lengths=law)).step_time_s == module.search_report.best_s
    assert reports["max"].seeds != reports["geometric:0.01"].seeds
    assert reports["max"].best_s > reports["geometric:0.01"].best_s   # full-length responses cost more

    done = optimise(gpu_module(), None, SMALL.format(extra=""), memory_check=False, response_lengths="max")
    placement = next(p for p in done.manager.passes if p.name == "placement")
    assert placement.response_lengths == "max" and done.module.search_report.seeds == reports["max"].seeds
    with pytest.raises(CompileError, match="bad --response-lengths"):
        optimise(gpu_module(), None, SMALL.format(extra=""), response_lengths="lognormal:x")


# -- 3. one pricing path -----------------------------------------------------------------------------------------

#: the -O2 pipeline with a smaller search budget (the test's time); recompute and realloc run after placement
O2_SMALL = "dce,unpad,reuse_logprobs,parallelize,stream,placement{candidates=40},recompute,realloc"


@pytest.mark.parametrize("example", ["ppo_tiny", "ppo_7b", "ppo_70b"])
def test_searched_price_is_explains_price_of_the_compiled_job(example, tmp_path):
    """The search prices each candidate as the pipeline emits it (placement, then recompute and realloc), so
    the plan it picks has, to the last bit, the step time ``explain`` predicts for the compiled job."""
    import json

    from rlhfc.cli import main as cli

    out = tmp_path / "e.json"
    code = cli(["explain", f"examples/{example}.rlhf", "--passes", O2_SMALL, "--no-profile", "-f", "json",
                "-o", str(out)])
    assert code in (0, None)
    report = json.loads(out.read_text())
    search = report["search"]
    assert search["candidates"] >= 3 and search["fits"]
    assert search["best_s"] == report["predicted_step_time_s"]
    assert search["trajectory"][-1][1] == search["best_s"]


def test_searched_price_is_explains_price_under_the_vllm_engine(tmp_path, monkeypatch):
    """The same with ``rollout = vllm``: the batched prices the layouts are chosen with include the engine's
    refit (as its per-stage price does: tests/cost/test_engine_memory.py), and the searched plan's price is
    still explain's, refit included. The tiny example with heads vLLM runs (head size 32)."""
    import importlib.util
    import json
    from pathlib import Path

    from rlhfc.cli import main as cli

    real = importlib.util.find_spec   # the check's "vLLM is installed" answer, whatever this machine has
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real(n, *a))
    text = Path("examples/ppo_tiny.rlhf").read_text().replace("heads = 4,", "heads = 2,")
    text = text.replace("optimize = O2 }", "optimize = O2; rollout = vllm }")
    assert "rollout = vllm" in text and "heads = 4," not in text
    src, out = tmp_path / "ppo_vllm.rlhf", tmp_path / "e.json"
    src.write_text(text)
    code = cli(["explain", str(src), "--passes", O2_SMALL, "--no-profile", "-f", "json", "-o", str(out)])
    assert code in (0, None)
    report = json.loads(out.read_text())
    search = report["search"]
    gens = [s for s in report["stages"] if s["op"] == "generate"]
    assert gens and all(g["parts"]["refit"] > 0 for g in gens)
    assert search["candidates"] >= 3 and search["fits"]
    assert search["best_s"] == report["predicted_step_time_s"]
    assert search["trajectory"][-1][1] == search["best_s"]


# -- 4. a search that explores -----------------------------------------------------------------------------------

def test_search_is_never_worse_than_a_strategy():
    """Each strategy's plan is a candidate, priced as that strategy compiles: the search's seed prices are the
    strategies' compiled prices exactly, and the plan found is at least as fast as each."""
    from rlhfc.cost import simulate

    module = run_passes(gpu_module(), SMALL.format(extra=""))
    found = module.search_report
    for strategy in ("flatten", "interleave", "separate"):
        other = run_passes(gpu_module(), f"dce,parallelize,stream,placement{{strategy={strategy}}},realloc")
        assert simulate(other).step_time_s == found.seeds[strategy]
        assert found.best_s <= found.seeds[strategy]
    assert found.best_s == simulate(module).step_time_s
    assert found.proposals >= found.candidates == 40 and found.strategy == "mcmc"


def test_search_is_never_slower_than_a_baseline_systems_placement():
    """Each baseline system's plan (DeepSpeed-Chat, OpenRLHF, verl, NeMo-Aligner) seeds the search twice, both
    priced under rlhfc's runtime terms: its whole plan (meshes and layouts, without streaming, as it runs) and
    its meshes with rlhfc's layouts. The plan found is at least as fast as each, and as each baseline plan as
    that system runs it (its own slowness terms only add cost)."""
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import simulate
    from rlhfc.ir.plan import BASELINES

    module = run_passes(gpu_module(), SMALL.format(extra=""))
    found = module.search_report
    for name in BASELINES:
        assert found.best_s <= found.seeds[f"baseline:{name}"]
        assert found.best_s <= found.seeds[f"baseline:{name}:meshes"]
        own = optimise(gpu_module(), None, None, placement=f"baseline:{name}", memory_check=False).module
        assert found.seeds[f"baseline:{name}"] <= simulate(own).step_time_s
    # NeMo-Aligner's own layouts were 1.3 % faster than the greedy layouts rlhfc picked on the same meshes
    assert found.seeds["baseline:nemo"] < found.seeds["baseline:nemo:meshes"]


def test_layout_search_improves_on_greedy_layouts(monkeypatch):
    """After the walk, the layout search pins one stage at a time to another layout of its mesh (the rest
    re-chosen around it) and tries the plan without streaming: it keeps only improvements, and on the 8-GPU
    program it finds a plan faster than every seed and than the walk with greedy layouts alone."""
    from rlhfc.passes import search as S

    with_layouts = run_passes(gpu_module(), SMALL.format(extra="")).search_report
    monkeypatch.setattr(S, "POLISH_SHARE", 10 ** 9)   # no budget for the layout search
    greedy = run_passes(gpu_module(), SMALL.format(extra="")).search_report
    assert with_layouts.best_s < greedy.best_s
    assert with_layouts.best_s < min(with_layouts.seeds.values())
    assert with_layouts.candidates == greedy.candidates == 40


def test_a_pinned_layout_is_kept_and_the_others_fit_around_it():
    """A plan may pin a stage's whole layout (a baseline's, or the layout search's): placement keeps it as
    given; the other stages still get the hardware rules' layouts on their meshes."""
    from rlhfc.ir import plan
    from rlhfc.passes.layouts import place
    from rlhfc.passes.strategies import flatten

    module = run_passes(gpu_module(), "dce,parallelize")
    pinned = plan.Layout(0, 8, dp=2, tp=2, pp=2, microbatches=4, recompute="full")
    assign = {**flatten(module), "actor_train": pinned}
    place(module, assign, "search")
    assert plan.stage_layout(module, module.graph.stage("actor_train")) == pinned
    critic = plan.stage_layout(module, module.graph.stage("critic_train"))
    assert (critic.first, critic.count) == (0, 8) and critic.dp * critic.tp * critic.pp == 8


#: (nodes, GPUs per node, GPU) of the never-worse table: one and two A100 nodes (the baselines benchmark's
#: HybridFlow GPU at small scale); ppo_70b runs on its own 16 x 8 H100 cluster (it fits on nothing smaller here)
NEVER_WORSE_CLUSTERS = [(1, 8, "A100-80GB"), (2, 8, "A100-80GB")]
#: the CPU clusters of the table, for the examples that compile there (the tiny ones; ppo_7b and ppo_70b fit no
#: CPU): their own 2 cores, one core (placement flattens), four
CPU_CLUSTERS = [(1, 2, "cpu"), (1, 1, "cpu"), (1, 4, "cpu")]
EXAMPLE_NAMES = ["agent_tiny", "agent_tiny_ppo", "arith_tiny", "dapo_tiny", "grpo_tiny", "ppo_tiny", "ppo_7b", "ppo_70b"]


@pytest.mark.parametrize("example", EXAMPLE_NAMES)
def test_searched_plan_is_never_worse_than_any_strategy_or_baseline(example):
    """Over every example and a table of clusters: the searched plan's predicted step time (as ``explain
    --compare`` prices it) is at most each strategy's (flatten, interleave, separate, compiled at the same
    level) and each baseline system's plan (``baseline:NAME``, as that system runs it, with its own terms);
    the same numbers twice (deterministic). On CPU clusters too, where a baseline (which neither streams nor
    takes log-probs from sampling) can be faster than -O2's earlier decisions: the search prices them taken
    back."""
    from pathlib import Path

    from rlhfc.cli.load import load
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import simulate
    from rlhfc.cost.baselines import SYSTEMS

    assert sorted(p.stem for p in Path("examples").glob("*.rlhf")) == sorted(EXAMPLE_NAMES)
    o2 = "dce,unpad,reuse_logprobs,parallelize,stream,placement{%s},recompute,realloc"
    clusters = [(16, 8, "H100-80GB")] if example == "ppo_70b" else NEVER_WORSE_CLUSTERS
    if example.endswith("_tiny"):
        clusters = CPU_CLUSTERS + clusters

    def price(cluster, passes, placement=None):
        module, _ = load(f"examples/{example}.rlhf", [])
        module.cluster.nodes, module.cluster.per_node, module.cluster.device = cluster
        return simulate(optimise(module, None, passes, placement=placement, memory_check=False).module).step_time_s

    for cluster in clusters:
        found = price(cluster, o2 % "candidates=60")
        if cluster == clusters[0]:
            assert price(cluster, o2 % "candidates=60") == found
        for strategy in ("flatten", "interleave", "separate"):
            assert found <= price(cluster, o2 % f"strategy={strategy}"), (cluster, strategy)
        for name in SYSTEMS:
            assert found <= price(cluster, None, f"baseline:{name}"), (cluster, name)


def test_explain_text_reports_the_search(capsys):
    from rlhfc.cli import main as cli

    cli(["explain", "examples/ppo_tiny.rlhf", "--passes", O2_SMALL, "--no-profile"])
    text = capsys.readouterr().out
    assert "placement search (" in text and "candidate plans priced in" in text


def test_an_explicit_profile_prices_the_search(tmp_path):
    """``--profile PATH`` (explain, compile) reaches the search: the plan's price under that profile is the
    price the search saw; a missing profile file is a compile error."""
    from rlhfc.cli.optimise import optimise
    from rlhfc.cost import CostConfig, Profile, load_profile, simulate

    path = str(tmp_path / "a100.json")
    Profile("A100-80GB", "A100", 8, {"matmul_flops": 1e14, "copy_bw": 1e12}).save(path)
    done = optimise(gpu_module(), None, SMALL.format(extra=""), memory_check=False, profile=path)
    found = done.module.search_report
    catalog = run_passes(gpu_module(), SMALL.format(extra="")).search_report
    assert found.seeds != catalog.seeds
    assert simulate(done.module, CostConfig(profile=load_profile(path))).step_time_s == found.best_s
    with pytest.raises(CompileError, match="cannot read profile"):
        optimise(gpu_module(), None, SMALL.format(extra=""), profile=str(tmp_path / "none.json"))


def test_jax_compiles_once_per_stage_for_any_batch_size():
    """Padded candidate batches: pricing one stage's layouts with JAX for several batch sizes (up to 64)
    compiles once, and gives NumPy's numbers."""
    pytest.importorskip("jax")
    import numpy as np

    from rlhfc.cost import CostModel, candidate_layouts, evaluate
    from rlhfc.cost import batched

    module = run_passes(gpu_module(), "dce,placement{strategy=flatten}")
    cm = CostModel(module)
    cands = candidate_layouts(0, 8, per_node=8, heads=8, layers=4, microbatches=(1, 2, 4, 8),
                              recompute=("none", "selective", "full"))
    assert len(cands) > 30
    before = batched.JAX_COMPILES[0]
    for n in (len(cands) // 3, len(cands) // 2, len(cands)):
        fast = evaluate(module, "actor_train", cands[:n], cost_model=CostModel(module), backend="jax")
        slow = evaluate(module, "actor_train", cands[:n], cost_model=cm, backend="numpy")
        for k in fast:
            np.testing.assert_allclose(fast[k], slow[k], rtol=1e-12)
    assert batched.JAX_COMPILES[0] - before == (1 if len(cands) <= 64 else 2)


def test_taking_reuse_logprobs_back_gives_the_program_as_written():
    """A plan with ``OLD_LOGPROBS`` taken back (``reuse_logprobs.take_back``, regrouped by ``parallelize``) is the
    module the pipeline without ``reuse_logprobs`` gives: the actor's forward restored, same overlap groups."""
    from rlhfc.cli.load import load
    from rlhfc.passes.parallelize import Parallelize
    from rlhfc.passes.reuse_logprobs import reuses, take_back

    reused, _ = load("examples/grpo_tiny.rlhf", [])
    reused = run_passes(reused, "dce,reuse_logprobs,parallelize")
    plain, _ = load("examples/grpo_tiny.rlhf", [])
    plain = run_passes(plain, "dce,parallelize")
    assert reuses(reused) and not reuses(plain)
    back = Parallelize().run(take_back(reused))
    assert print_module(back) == print_module(plain)
