"""The ``recompute`` pass and the memory checks around it: a program over memory is rejected at -O0/-O1 (with
a hint that recomputation would make it fit), compiles at -O2 because ``recompute`` keeps fewer activations,
``explain`` says why, the decision round-trips through the IR text and reaches the job's plan."""

from __future__ import annotations

import pytest

from rlhfc.cli.optimise import optimise
from rlhfc.codegen.plan import build_plan
from rlhfc.cost import memory_issues
from rlhfc.explain import build_report
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, parse_ir, plan, print_module
from rlhfc.passes import parse_pipeline

#: one CPU device of 1.5 GB: the two train stages keep ~2 GiB of activations each without recomputation (a
#: vocabulary of 512 rarely samples EOS, so responses run long and training cut into length groups does not fit
#: either)
OVER_MEMORY = """
cluster local { devices = cpu:1; memory = "1.5GB" }

model actor  = llama(layers = 4, hidden = 64, heads = 4, vocab = 512, max_seq = 512) trainable
model critic = like(actor) head = value trainable
model ref    = copy(actor) frozen

data prompts = synthetic(count = 256, min_len = 4, max_len = 8)

pipeline ppo(batch = 64) {
  roll     = actor.generate(prompts, max_new_tokens = 400, temperature = 1.0)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv, clip = 0.2), lr = 1e-3, epochs = 1, minibatches = 1)
  critic.train(value_loss(roll, values, ret, clip = 0.2), lr = 1e-3, epochs = 1, minibatches = 1)
}

run { steps = 1; seed = 0 }
"""


def _module():
    module, diags = compile_source(OVER_MEMORY, "over_memory.rlhf")
    assert not [d for d in diags if d.severity == "error"]
    return module


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_over_memory_rejected_at_every_level(level):
    """-O0/-O1 keep every activation: the memory check after the pipeline rejects the program, naming the
    stage, the device, bytes needed vs available, and that recomputation would make it fit."""
    with pytest.raises(CompileError) as err:
        optimise(_module(), level, None)
    text = str(err.value)
    assert "stage %actor_train needs" in text and "on device 0 but it has 1.4 GiB" in text
    assert "recomputing its activations makes it fit" in text and "recompute pass" in text


def test_over_memory_fits_at_O2_thanks_to_recompute():
    """The same program at -O2 compiles: the recompute pass keeps a chosen subset of each block's activations,
    the plan fits, explain says what is kept and why, and the decision reaches plan.json for the trainers."""
    done = optimise(_module(), "O2", None)
    module = done.module
    assert not memory_issues(module)
    for name in ("actor_train", "critic_train"):
        d = plan.recompute_decision(module.graph.stage(name))
        assert d is not None and d.policy in ("ops", "full") and d.kept < d.autograd
    again = parse_ir(print_module(module))            # the decision round-trips through the IR text
    assert print_module(again) == print_module(module)
    notes = " ".join(build_report(module, records=done.records, level="O2").notes)
    assert "%actor_train keeps the outputs of" in notes or "%actor_train recomputes" in notes
    assert "why: without it %actor_train needs" in notes
    spec = build_plan(module, source=None, opt_level="O2", passes=done.passes).models["actor"].spec
    assert spec.recompute["policy"] in ("ops", "full")
    assert spec.recompute.get("save", []) == list(plan.recompute_decision(module.graph.stage("actor_train")).save)


def test_recompute_policies_order_memory_and_time():
    """Forced policies on the same stage: full keeps least and costs most; a budget between lands between;
    none removes the annotation."""
    got = {}
    for spec in ("recompute{policy=full}", "recompute{policy=selective}", "recompute{policy=none}",
                 "recompute{policy=budget,budget=200000000}"):
        module = _module()
        parse_pipeline(spec)[0].run(module)
        got[spec.split("=")[1].split(",")[0].rstrip("}")] = plan.recompute_decision(module.graph.stage("actor_train"))
    assert got["none"] is None
    full, budget = got["full"], got["budget"]
    assert full.kept == 0 and full.seconds > budget.seconds > 0
    assert budget.kept * 4 <= 200_000_000 < budget.autograd * 4      # 4 blocks fit the budget
    assert got["selective"].policy == "ops" and got["selective"].seconds < full.seconds
    with pytest.raises(CompileError, match="policy budget needs budget"):
        parse_pipeline("recompute{policy=budget}")


def test_untraceable_block_warns_with_its_location_and_keeps_the_coarse_policy():
    """A model the pass cannot trace (here: one loaded from a folder) gets a located warning; the stage keeps
    the coarse policy placement chose."""
    module = _module()
    module.models["actor"].source = "checkpoints/actor"
    plan.set_recompute(module.graph.stage("actor_train"), plan.Recompute("full"))
    with pytest.warns(UserWarning, match=r"over_memory.rlhf:17:3: warning: model 'actor' comes from a folder"):
        parse_pipeline("recompute")[0].run(module)
    assert plan.recompute_decision(module.graph.stage("actor_train")) == plan.Recompute("full")


def test_a_model_from_a_hugging_face_folder_is_traced_like_a_config_built_one(tmp_path):
    """The actor loaded from a folder whose config.json builds the tracer's block (transformers' defaults,
    written by save_pretrained) gets the same recompute decision as the config-built actor, with no warning; a
    folder whose config sets another activation keeps the coarse policy, the warning naming the setting."""
    import json
    import warnings

    from transformers import LlamaConfig

    from rlhfc.passes.recompute import traceable

    base = _module()
    parse_pipeline("recompute")[0].run(base)
    want = plan.recompute_decision(base.graph.stage("actor_train"))
    assert want is not None and want.policy != "none"
    actor = base.models["actor"]
    config = LlamaConfig(vocab_size=actor.vocab, hidden_size=actor.hidden, intermediate_size=actor.ffn,
                         num_hidden_layers=actor.layers, num_attention_heads=actor.heads,
                         num_key_value_heads=actor.kv_heads, max_position_embeddings=actor.max_seq)
    config.save_pretrained(str(tmp_path / "same"))
    config.hidden_act = "gelu"
    config.save_pretrained(str(tmp_path / "gelu"))
    module = _module()
    module.models["actor"].source = str(tmp_path / "same")
    assert traceable(module.models["actor"]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_pipeline("recompute")[0].run(module)
    assert plan.recompute_decision(module.graph.stage("actor_train")) == want
    other = _module()
    other.models["actor"].source = str(tmp_path / "gelu")
    assert json.load(open(tmp_path / "gelu" / "config.json"))["hidden_act"] == "gelu"
    plan.set_recompute(other.graph.stage("actor_train"), plan.Recompute("full"))
    with pytest.warns(UserWarning, match="config.json sets hidden_act = 'gelu', a block the tracer does not build"):
        parse_pipeline("recompute")[0].run(other)
    assert plan.recompute_decision(other.graph.stage("actor_train")) == plan.Recompute("full")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_scaled_block_trace_equals_a_fresh_trace(arch, tmp_path, monkeypatch):
    """A block is traced once per model (at two primes no dimension shares) and scaled to each micro-batch
    shape analytically — bytes linear in rows and seq, attention's scores quadratic in seq, FLOPs alike: every
    op's bytes kept, bytes moved, FLOPs, kind, key and time equal a fresh trace at that shape. The trace kept on
    disk gives the same numbers in a process that did not trace."""
    from dataclasses import astuple

    from rlhfc.passes import recompute_trace as T

    monkeypatch.setenv("RLHFC_CACHE_DIR", str(tmp_path))
    T._scaled.cache_clear()
    T._trace_block.cache_clear()
    dims = (arch, 64, 4, 2 if arch == "llama" else 4, 192, 96)
    rates = dict(dtype="bfloat16", flops_per_s=3e14, bytes_per_s=2e12, kind_bw=(("softmax", 1e12),))
    shapes = ((1, 2), (3, 7), (8, 300))
    for rows, seq in shapes:
        scaled, fresh = T.trace_block(*dims, rows, seq, **rates), T.fresh_trace(*dims, rows, seq, **rates)
        assert astuple(scaled) == astuple(fresh)
        assert any(n.flops for n in scaled.nodes) and scaled.autograd_bytes > 0
    assert T._scaled.cache_info().misses == 1   # one trace per model, not per shape
    assert len(list((tmp_path / "traces").glob("*.json"))) == 1
    before = [astuple(T.trace_block(*dims, r, s, **rates)) for r, s in shapes]
    T._scaled.cache_clear()
    T._trace_block.cache_clear()
    assert [astuple(T.trace_block(*dims, r, s, **rates)) for r, s in shapes] == before   # read from disk


def test_profiled_replay_costs_reach_the_pass(tmp_path):
    """A profile's recompute probes (fresh outputs, the checkpoint's costs) reach the recompute pass through its
    ``profile`` option (``--profile`` on compile/explain): the decision's seconds are the traced ops' replay plus
    exactly those measured costs, and they are what the pass's trace priced with that profile says."""
    from rlhfc.cost.hardware import device_spec
    from rlhfc.cost.profile import Profile, model_key
    from rlhfc.passes import recompute_choice as choice
    from rlhfc.passes.recompute import RecomputePass, replay_spec, stage_trace
    from rlhfc.passes.recompute_prices import measured_dispatch, measured_ops

    host = {"matmul_flops_1": 50e9, "copy_bw": 8e9, "kind_bw": {"softmax": 2e9},
            "recompute": {"fresh_s_per_byte": [[1 << 20, 0.0]], "ckpt_region_s": 0.5, "ckpt_op_s": 0.01}}
    path = Profile("cpu", "test", 1, host, {}, {}).save(str(tmp_path / "prof.json"))
    got = {}
    for prof in ("", path):
        module = _module()
        RecomputePass(policy="selective", profile=prof).run(module)
        got[prof] = plan.recompute_decision(module.graph.stage("actor_train"))
        trace = stage_trace(module, module.graph.stage("actor_train"), rates=replay_spec(module, prof))[0]
        assert got[prof].seconds == pytest.approx(choice.selective(trace).recompute_s, rel=1e-3)
    assert (trace.ckpt_op_s, trace.ckpt_region_s) == (0.01, 0.5)
    cut = max(i for i, n in enumerate(trace.nodes) if n.saves)
    assert got[path].seconds > 0.5 + 0.01 * (len(trace.nodes) + cut + 1) > got[""].seconds
    assert replay_spec(_module(), "") is None
    # its block's forward ops, measured on it at its training shape (`rlhfc profile` with the program): at that
    # shape an op costs what it measured; at another, its price moves with its work (measured / priced there)
    actor = model_key(module.models["actor"])
    stage = module.graph.stage("actor_train")
    mm = next(n for n in trace.nodes if n.kind == "matmul")
    for rows, factor in ((trace.rows, 3.0), (2 * trace.rows, 1.5)):
        models = {actor: {"recompute": {"rows": rows, "seq": trace.seq, "op_s": {mm.key: 3 * mm.seconds}}}}
        spec = device_spec("cpu", Profile("cpu", "test", 1, host, models, {}))
        assert measured_ops(spec, "other") is None and measured_ops(spec, actor)[:2] == (rows, trace.seq)
        again = stage_trace(module, stage, rates=spec)[0]
        got = {n.key: n.seconds for n in again.nodes}
        assert got[mm.key] == pytest.approx(factor * mm.seconds, rel=0.02)
        assert all(got[n.key] == n.seconds for n in trace.nodes if n.key != mm.key)
        assert (again.ckpt_op_s, again.ckpt_region_s) == (0.01, 0.5)
    # a selective checkpoint's cost per forward call, measured on the same block at its shape, replaces the host's
    # rate for that model's forward calls only (the replay's calls and the per-block cost stay the host's)
    models = {actor: {"recompute": {"rows": trace.rows, "seq": trace.seq, "op_s": {mm.key: mm.seconds},
                                    "ckpt_op_s": 0.03}}}
    spec = device_spec("cpu", Profile("cpu", "test", 1, host, models, {}))
    assert measured_dispatch(spec, actor) == 0.03 and measured_dispatch(spec, "other") is None
    own = stage_trace(module, stage, rates=spec)[0]
    assert (own.ckpt_forward_op_s, own.ckpt_op_s, own.ckpt_region_s) == (0.03, 0.01, 0.5)
    assert choice.selective(own).recompute_s == pytest.approx(
        choice.selective(trace).recompute_s + 0.02 * len(trace.nodes), rel=1e-3)
    assert choice.full(own).recompute_s == pytest.approx(choice.full(trace).recompute_s, rel=1e-9)
    with pytest.raises(CompileError, match="recompute: "):
        replay_spec(_module(), str(tmp_path / "missing.json"))
