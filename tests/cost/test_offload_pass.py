"""Optimizer offload where nothing else fits (issue #40): the ``offload`` annotation (verified, round-tripped),
its price (device memory freed, host transfers and host-side Adam added), the pass that marks a train stage
only where the plan does not fit otherwise (after placement and recompute), explain's column and note, and the
plan the runtime reads. OpenRLHF trains four 70B models on 32 A800s by offloading Adam to the host; rlhfc
refused that program before. The runtime side is tests/runtime/test_offload.py."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.cli.optimise import optimise
from rlhfc.cost import CostModel, memory_issues
from rlhfc.cost import formulas as F
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, parse_ir, plan, print_module

from .helpers import gpu_ppo
from .test_annotation_checks import _errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
cluster c {{ gpu = "A100-80GB"; nodes = {nodes}; gpus_per_node = 8 }}
model actor  = llama(size = {size}) trainable
model critic = llama(size = {size}) head = value trainable
model ref    = copy(actor) frozen
model reward = llama(size = {size}) head = score frozen
data prompts = synthetic(count = 100000, min_len = 1024, max_len = 1024)
pipeline ppo(batch = 1024) {{
  roll     = actor.generate(prompts, max_new_tokens = 1024, temperature = 1.0)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv, clip = 0.2), lr = 1e-6, epochs = 1, minibatches = 8)
  critic.train(value_loss(roll, values, ret, clip = 0.2), lr = 5e-6, epochs = 1, minibatches = 8)
}}
run {{ steps = 10; seed = 0; optimize = O2 }}
"""


def _compiled(size: str, nodes: int, passes: str | None = None):
    module, _ = compile_source(PROGRAM.format(size=size, nodes=nodes), f"ppo_{size}.rlhf")
    return optimise(module, "O2" if passes is None else None, passes).module


@pytest.fixture(scope="module")
def four_70b():
    """OpenRLHF's largest published configuration: four 70B models on 32 80-GB GPUs."""
    return _compiled("70B", 4)


def test_four_70b_models_on_32_gpus_compile_with_the_optimizer_on_the_host(four_70b):
    trains = [s for s in four_70b.graph.stages if s.op == "train"]
    assert trains and all(plan.offload(s) for s in trains)
    assert memory_issues(four_70b) == []
    text = print_module(four_70b)
    assert "offload = true" in text and print_module(parse_ir(text)) == text


def test_without_the_offload_pass_the_same_program_is_refused_naming_offload():
    passes = "dce,unpad,reuse_logprobs,parallelize,stream,placement,recompute,realloc,threads"
    with pytest.raises(CompileError) as exc:
        _compiled("70B", 4, passes)
    assert "needs" in str(exc.value) and "offload" in str(exc.value)


def test_a_program_that_fits_keeps_its_optimizer_on_the_device():
    module = _compiled("7B", 2)
    assert not any(plan.offload(s) for s in module.graph.stages)


def test_offload_frees_the_optimizer_state_and_prices_host_transfers_and_host_adam(four_70b):
    cm = CostModel(four_70b)
    actor = four_70b.graph.stage("actor_train")
    on = cm.stage_cost(actor)
    trial = four_70b.clone()
    plan.set_offload(trial.graph.stage("actor_train"), False)
    off = CostModel(trial).stage_cost(trial.graph.stage("actor_train"))
    lay = on.layout
    n = four_70b.models["actor"].params
    shard = n / (lay.tp * lay.pp)
    assert on.state_bytes == pytest.approx(2.0 * shard)                       # bf16 gradients only
    assert off.state_bytes == pytest.approx(2.0 * shard + 12.0 * shard / lay.dp)
    spec = cm.spec
    steps = 8   # one epoch of 8 minibatches
    host = steps * shard / lay.dp * (4.0 / (spec.host_bw * spec.net_eff) + F.OFFLOAD_HOST_BYTES_PER_PARAM /
                                     spec.host_mem_bw)
    assert on.parts["offload"] == pytest.approx(host, rel=1e-6)
    assert on.time_s == pytest.approx(off.time_s + host, rel=1e-6)


def test_explain_shows_the_host_optimizer_and_what_it_costs(four_70b):
    from rlhfc.explain.report import build_report
    from rlhfc.explain.text import render_text

    report = build_report(four_70b)
    text = render_text(report)
    assert "opt:host" in text
    note = next(n for n in report.notes if n.startswith("%actor_train keeps @actor's optimizer state on the host"))
    assert "frees" in note and "GiB per device" in note and "s of host transfers" in note


def test_the_worker_that_trains_an_offloaded_model_is_told_so(four_70b, tmp_path):
    from rlhfc.codegen import emit_job
    from rlhfc.contract.plan import load_plan

    emit_job(four_70b, str(tmp_path / "job"), source_path="ppo_70B.rlhf", opt_level="O2", passes=[])
    p = load_plan(str(tmp_path / "job" / "plan.json"))
    trained = {w.model: w.offload for w in p.placement.workers.values() if w.model in ("actor", "critic")}
    assert trained and all(trained.values())
    assert not any(w.offload for w in p.placement.workers.values() if w.model in ("ref", "reward"))
    raw = json.load(open(tmp_path / "job" / "plan.json"))
    for w in raw["placement"]["workers"].values():   # a plan written before the field reads as not offloaded
        w.pop("offload")
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert not any(w.offload for w in load_plan(str(tmp_path / "old.json")).placement.workers.values())


def test_on_a_cpu_cluster_the_pass_changes_nothing_and_a_hand_mark_is_priced_as_is():
    from rlhfc.passes import PassManager, parse_pipeline

    text = open(os.path.join(ROOT, "examples", "ppo_tiny.rlhf")).read()
    module, _ = compile_source(text, "ppo_tiny.rlhf")
    out = PassManager(parse_pipeline("offload")).run(module.clone())
    assert print_module(out) == print_module(module)
    plan.set_offload(module.graph.stage("actor_train"), True)
    marked = CostModel(module).stage_cost(module.graph.stage("actor_train"))
    plan.set_offload(module.graph.stage("actor_train"), False)
    plain = CostModel(module).stage_cost(module.graph.stage("actor_train"))
    assert marked.state_bytes == plain.state_bytes and marked.time_s == pytest.approx(plain.time_s)


@pytest.mark.parametrize("ann,stage,message", [
    ({"offload": 3}, "actor_train", "offload must be true or false, got int 3"),
    ({"offload": True}, "logp", "'offload' applies to train stages only, not forward.logprobs"),
])
def test_a_malformed_offload_mark_is_a_located_error(ann, stage, message):
    (d,) = _errors({stage: ann}, gpu_ppo())
    assert message in d.message and d.loc is not None and "offload = true" in d.hint
