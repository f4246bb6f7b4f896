"""Asynchronous rollout in the compiler (issue #37): ``run { staleness = K }``, the weight edge's bound in the IR,
the ``async_rollout`` pass, the schedule and the generated driver, the plan attribute, the decoupled loss's
bundling and the in-flight rollouts' checkpoint form. The runs are tests/e2e/test_async_run.py; the bad
programs (negative, fractional, frozen generator, shared prompts, refill) are tests/bad/run_staleness_*.rlhf."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from rlhfc.codegen import emit_job
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, parse_ir, plan, print_module, verify
from rlhfc.ir.schedule import build_schedule
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = open(os.path.join(ROOT, "examples", "ppo_tiny.rlhf")).read()


def _program(run_extra: str = "", text: str = PPO) -> str:
    return text.replace("optimize = O2 }", f"optimize = O2{run_extra} }}")


def _module(run_extra: str = "", passes: str = ""):
    module, _ = compile_source(_program(run_extra), "ppo_tiny.rlhf")
    return PassManager(parse_pipeline(passes)).run(module) if passes else module


def _edges(module) -> dict[str, str]:
    return {e.reader: e.span for e in module.graph.versions}


def test_staleness_puts_the_bound_on_the_generates_weight_edge_and_round_trips():
    for k in (1, 2):
        module = _module(f"; staleness = {k}")
        assert _edges(module) == {"roll": f"+1..+{1 + k}", "logp": "+1", "values": "+1"}
        text = print_module(module)
        assert f"version @actor %actor_train -> %roll [+1..+{1 + k}]" in text and f"staleness = {k}" in text
        assert print_module(parse_ir(text)) == text


def test_staleness_0_compiles_to_the_synchronous_job(tmp_path):
    """The same graph, edges and generated driver as without the setting; the plan differs only in the stated
    run setting, which the runtime does not read for a synchronous job — so it trains bitwise identically."""
    plain, zero = _module(), _module("; staleness = 0")
    assert _edges(zero) == _edges(plain) == {"roll": "+1", "logp": "+1", "values": "+1"}
    body = lambda m: re.sub(r' loc\([^)]*\)', "", print_module(m)).replace(", staleness = 0", "")  # noqa: E731
    assert body(zero) == body(plain)
    for level in ("O0", "O2", "O3"):
        jobs = {}
        # -O3 runs generation ahead (staleness 1) where the program states nothing: a stated 0 compiles to the
        # synchronous -O3 job, the one without async_rollout
        sync = [p for p in PIPELINES[level] if not p.startswith("async_rollout")]
        for name, extra, passes in (("plain", "", sync), ("zero", "; staleness = 0", PIPELINES[level])):
            module, _ = compile_source(_program(extra), "ppo_tiny.rlhf")
            module = PassManager(parse_pipeline(",".join(passes))).run(module)
            out = str(tmp_path / f"{name}_{level}")
            emit_job(module, out, source_path="ppo_tiny.rlhf", opt_level=level, passes=list(PIPELINES[level]))
            main = open(os.path.join(out, "main.py")).read()
            got = json.load(open(os.path.join(out, "plan.json")))
            got["run"].pop("staleness", None)
            got.pop("ir")
            jobs[name] = (main, got)
        assert jobs["zero"] == jobs["plain"], level
        assert "job.ahead" not in jobs["zero"][0]
    module, _ = compile_source(_program(), "ppo_tiny.rlhf")
    module = PassManager(parse_pipeline(",".join(PIPELINES["O3"]))).run(module)
    assert plan.async_rollout(module, module.graph.stage("roll")).staleness == 1   # -O3 alone: one step ahead


def test_a_wrong_edge_bound_is_a_located_error():
    text = print_module(_module("; staleness = 1"))
    for wrong in ("[+1]", "[+1..+3]"):
        bad = text.replace("%actor_train -> %roll [+1..+2]", f"%actor_train -> %roll {wrong}")
        with pytest.raises(CompileError) as err:
            verify(parse_ir(bad))
        assert "staleness bound is 1" in str(err.value) and "missing parameter-version edge" in str(err.value)
    with pytest.raises(CompileError, match=r"ends before it starts"):
        parse_ir(text.replace("[+1..+2]", "[+2..+1]"))


def test_the_pass_gives_k_where_the_program_states_none_and_keeps_a_stated_one():
    module = _module(passes="async_rollout{proximal=recompute}")
    roll = module.graph.stage("roll")
    assert roll.annotations["async_rollout"] == {"staleness": 1, "behaviour_cap": 5.0}
    assert plan.changes_training(module) == ["async_rollout"] and _edges(module)["roll"] == "+1..+2"
    module = _module(passes="async_rollout{staleness=2,behaviour_cap=3,proximal=recompute}")
    assert plan.async_rollout(module, module.graph.stage("roll")) == plan.AsyncRollout(2, 3.0)
    # a staleness the program states is its meaning: the pass neither overrides it nor calls it a change
    stated = _module("; staleness = 0", passes="async_rollout{staleness=2}")
    assert "async_rollout" not in stated.graph.stage("roll").annotations and not plan.changes_training(stated)
    stated = _module("; staleness = 3", passes="async_rollout{proximal=recompute}")
    assert plan.staleness(stated, stated.graph.stage("roll")) == 3 and not plan.changes_training(stated)
    # the reference's forward reads a frozen model: synchronous whatever the bound
    assert all(plan.staleness(stated, s) == 0 for s in stated.graph.stages if s.name != "roll")
    for bad in ("async_rollout{staleness=-1}", "async_rollout{behaviour_cap=1}"):
        with pytest.raises(Exception, match="staleness must be|behaviour_cap must be"):
            parse_pipeline(bad)


def test_an_async_generate_is_neither_streamed_overcommitted_nor_its_proximal_forward_replaced():
    passes = "async_rollout{proximal=recompute},unpad,reuse_logprobs,parallelize,stream,overcommit"
    module = _module(passes=passes)
    roll = module.graph.stage("roll")
    assert "stream" not in roll.annotations and "overcommit" not in roll.annotations
    assert module.graph.stage("logp").op == "forward.logprobs"   # decoupled PPO's proximal policy
    sync = _module(passes=passes.replace("async_rollout{proximal=recompute},", ""))
    assert "overcommit" in sync.graph.stage("roll").annotations
    assert sync.graph.stage("logp").op == "compute.sample_logprobs"


def test_the_driver_draws_prompts_inside_the_async_generate_and_the_loss_is_decoupled(tmp_path):
    module = _module("; staleness = 2", passes="dce,parallelize,placement{strategy=separate},realloc")
    schedule = build_schedule(module)
    assert schedule["roll"].kind == "ahead" and schedule["prompts"].kind == "in_stream"
    assert schedule["prompts"].within == "roll"
    out = str(tmp_path / "job")
    emit_job(module, out, source_path="ppo_tiny.rlhf", opt_level=None, passes=[])
    main = open(os.path.join(out, "main.py")).read()
    assert "job.next_prompts" not in main
    assert re.search(r"roll = job\.ahead\('roll', lambda prompts: w\.actor_at_0_1\.generate\.remote\(prompts, .*"
                     r"logprobs=True\), data='prompts', batch=16, staleness=2\)", main)
    assert "job.sync('actor_sync', w.actor, w.actor_at_0_1, bucket_mb=64, after=actor_train, wait=False)" in main
    assert "behaviour_cap=5.0" in main
    plan_json = json.load(open(os.path.join(out, "plan.json")))
    assert plan_json["run"]["staleness"] == 2
    assert {"model": "actor", "writer": "actor_train", "reader": "roll", "distance": 1, "staleness": 2} in \
        plan_json["graph"]["versions"]


def test_the_plan_attribute_parses_and_refuses():
    assert plan.AsyncRollout.parse({"staleness": 1}) == plan.AsyncRollout(1, 5.0)
    for bad in ({"staleness": -1}, {"staleness": 1.5}, {"staleness": 1, "behaviour_cap": 0.5},
                {"staleness": 1, "cap": 2}, 3):
        with pytest.raises(plan.PlanError, match="async_rollout must be"):
            plan.AsyncRollout.parse(bad)
    text = print_module(_module(passes="async_rollout")).replace("behaviour_cap = 5.0", "behaviour_cap = true")
    with pytest.raises(CompileError, match="async_rollout must be"):
        verify(parse_ir(text))


def _rollout(logprobs: bool = True):
    from rlhfc.runtime.data.values import Rollout
    from rlhfc.runtime.rollout.generation import RolloutBatch

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    batch = RolloutBatch(torch.randint(0, 50, (3, 7), generator=g), torch.ones(3, 7, dtype=torch.long), mask, 3,
                         mask.sum(1).long(), torch.tensor([3, 2, 3]), torch.tensor([True, True, False]))
    return Rollout(batch, ["a", "b", "c"], ["x", "y", "z"], "actor", 4, "tok", [0, 1, 2], [3, 3, 4], 5,
                   -torch.rand(3, 4, generator=g) * mask if logprobs else None, True, 40.0,
                   [{"answer": "1"}, {}, {"answer": "3"}], {"refit_s": 0.5}, "torch")


def test_an_in_flight_rollout_survives_its_checkpoint_form_exactly(tmp_path):
    from safetensors.torch import load_file, save_file

    from rlhfc.runtime.data.values import rollout_from_state, rollout_state

    roll = _rollout()
    meta, tensors = rollout_state(roll, "roll.0")
    save_file(tensors, str(tmp_path / "t.safetensors"))
    back = rollout_from_state(json.loads(json.dumps(meta)), load_file(str(tmp_path / "t.safetensors")), "roll.0")
    for f in ("prompts", "responses", "model", "version", "tokenizer", "rows", "born", "decode_steps", "unpad",
              "computed_tokens", "fields", "engine", "rollout_engine"):
        assert getattr(back, f) == getattr(roll, f), f
    for f in ("input_ids", "attention_mask", "response_mask", "response_lengths", "prompt_lengths", "eos"):
        assert torch.equal(getattr(back.batch, f), getattr(roll.batch, f)), f
    assert back.batch.prompt_len == 3 and torch.equal(back.logprobs, roll.logprobs)


def test_ppo_clip_hands_the_rollouts_logprobs_to_the_decoupled_loss():
    from rlhfc.runtime import compute
    from rlhfc.runtime.data.values import TokenValues

    roll = _rollout()
    logp = TokenValues(-torch.rand(3, 4), roll.mask)
    adv = TokenValues(torch.randn(3, 4), roll.mask)
    out = compute.ppo_clip(roll, logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3",
                           behaviour_cap=4.0)
    assert torch.equal(out.behaviour_logp, roll.logprobs) and out.behaviour_cap == 4.0
    assert torch.equal(out.advantages, adv.values)   # no TIS weight on top: the behaviour weight corrects
    plain = compute.ppo_clip(roll, logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3")
    assert plain.behaviour_logp is None and plain.behaviour_cap is None
    with pytest.raises(ValueError, match="log-probs on the rollout"):
        compute.ppo_clip(_rollout(logprobs=False), logp, adv, clip=0.2, entropy_coef=0.0, kl_coef=0.0,
                         estimator="k3", behaviour_cap=4.0)


def _overlap_program(k: int):
    text = open(os.path.join(ROOT, "benchmarks", "overlap.rlhf")).read()
    module, _ = compile_source(text, "overlap.rlhf")
    passes = "dce,parallelize,placement{strategy=separate},realloc" + (f",async_rollout{{staleness={k}}}" if k else "")
    return PassManager(parse_pipeline(passes)).run(module)


def test_the_simulator_pipelines_steps_under_the_bound_and_explain_prints_the_gain():
    from rlhfc.cost import simulate
    from rlhfc.cost.simulator import STEADY_STEPS
    from rlhfc.explain.report import build_report

    sync, ahead = simulate(_overlap_program(0), steps=4), simulate(_overlap_program(1), steps=4)
    assert ahead.step_time_s < 0.8 * sync.step_time_s   # generation (its own core) overlaps training
    gen = {t.step: t for t in ahead.tasks if t.stage == "roll"}
    train = {t.step: t for t in ahead.tasks if t.stage == "actor_train"}
    # fewer steps than STEADY_STEPS would price the pipeline's warm-up: the simulator runs that many
    assert ahead.steps == STEADY_STEPS and sorted(gen) == list(range(STEADY_STEPS)) and sync.steps == 4
    assert all(gen[k + 1].start < train[k].end for k in range(3))   # step k+1's generation runs while k trains
    assert all(gen[k + 1].start >= train[k - 1].end for k in range(1, 3))   # ... with weights at most 1 behind
    sync_gen = {t.step: t for t in sync.tasks if t.stage == "roll"}
    sync_train = {t.step: t for t in sync.tasks if t.stage == "actor_train"}
    assert all(sync_gen[k + 1].start >= sync_train[k].end for k in range(3))
    notes = build_report(_overlap_program(1)).notes
    gain = [n for n in notes if n.startswith("asynchronous rollout: predicted steady-state step")]
    # explain prices the steady state over STEADY_STEPS steps (the later half: the pipeline's warm-up left out)
    # against the same plan without the bound (A-3PO's sampling log-probs kept: the synchronous job reuses them)
    steady = simulate(_overlap_program(1), steps=STEADY_STEPS).step_time_s
    got = re.search(r"step ([0-9.]+) s against ([0-9.]+) s synchronous \(x([0-9.]+)\)", gain[0] if gain else "")
    assert got and float(got[1]) == pytest.approx(steady, rel=1e-2), notes
    # > 1.2: the synchronous plan overlaps its two trains (the sync waits after both are launched)
    assert float(got[3]) == pytest.approx(float(got[2]) / float(got[1]), abs=0.02) and float(got[3]) > 1.2
    assert any("runs up to 1 step(s) ahead" in n and "changes what the job trains on" in n for n in notes)


# -- A-3PO: the proximal policy interpolated instead of recomputed ----------------------------------------------


def test_a3po_drops_the_proximal_forward_and_the_loss_interpolates(tmp_path):
    """``async_rollout{proximal = loglinear}``: the policy's forward over the rollout becomes the sampling
    log-probs, the annotation says so (printed, parsed, verified), the generated loss asks for it, and the
    placement's take-back of log-prob reuse leaves it alone."""
    from rlhfc.passes.reuse_logprobs import take_back

    module = _module(passes="async_rollout{proximal=loglinear}")
    roll, logp = module.graph.stage("roll"), module.graph.stage("logp")
    assert logp.op == "compute.sample_logprobs" and plan.flag(roll, "logprobs")
    assert roll.annotations["async_rollout"] == {"staleness": 1, "behaviour_cap": 5.0, "proximal": "loglinear"}
    assert plan.async_rollout(module, roll) == plan.AsyncRollout(1, 5.0, "loglinear")
    text = print_module(module)
    assert 'proximal = "loglinear"' in text and print_module(verify(parse_ir(text)) or parse_ir(text)) == text
    assert take_back(module.clone()).graph.stage("logp").op == "compute.sample_logprobs"
    out = str(tmp_path / "job")
    emit_job(module, out, source_path="ppo_tiny.rlhf", opt_level=None, passes=[])
    assert "behaviour_cap=5.0, proximal='loglinear'" in open(os.path.join(out, "main.py")).read()
    # recompute keeps decoupled PPO's forward and prints as before
    kept = _module(passes="async_rollout{proximal=recompute}")
    assert kept.graph.stage("logp").op == "forward.logprobs" and "proximal" not in print_module(kept)
    with pytest.raises(Exception, match="proximal must be one of recompute, loglinear, auto"):
        parse_pipeline("async_rollout{proximal=guess}")
    with pytest.raises(plan.PlanError, match="async_rollout must be"):
        plan.AsyncRollout.parse({"staleness": 1, "proximal": "guess"})


def test_a3po_auto_takes_the_interpolation_only_where_the_step_is_predicted_faster():
    from rlhfc.cost import CostModel, simulate
    from rlhfc.passes.predict import AUTO_GAIN

    base = _module(passes="async_rollout{proximal=recompute}")
    inter = _module(passes="async_rollout{proximal=loglinear}")
    t_base = simulate(base, steps=3, cost_model=CostModel(base)).step_time_s
    t_inter = simulate(inter, steps=3, cost_model=CostModel(inter)).step_time_s
    faster = t_inter < (1 - AUTO_GAIN) * t_base
    for chosen in (_module(passes="async_rollout{proximal=auto}"), _module(passes="async_rollout")):   # the default
        assert (chosen.graph.stage("logp").op == "compute.sample_logprobs") == faster
    # a program's own bound with the interpolation the pass chose: a loss the program did not ask for, noted
    stated = _module("; staleness = 1", passes="async_rollout{proximal=loglinear}")
    assert plan.changes_training(stated) == ["async_rollout"]
    assert t_inter < t_base   # a forward fewer is never predicted slower


def test_a3po_weights_interpolate_between_behaviour_and_current():
    """alpha = s / (s + 1) per sample; alpha 0 (a fresh sample) is PPO against the behaviour policy itself;
    alpha 1 puts the proximal policy on the current one (ratio 1, no clipping)."""
    from rlhfc.runtime.rl import ppo

    assert ppo.proximal_alpha([3, 3, 4, 1], 4).flatten().tolist() == [0.5, 0.5, 0.0, 0.75]
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    logp = (-torch.rand(2, 4)).requires_grad_()
    behaviour, adv = -torch.rand(2, 4), torch.randn(2, 4)
    fresh, m0 = ppo.policy_loss(logp, torch.zeros(2, 4), adv, mask, behaviour_logp=behaviour, behaviour_cap=5.0,
                                proximal_alpha=torch.zeros(2, 1))
    plain, _ = ppo.policy_loss(logp, behaviour, adv, mask, behaviour_logp=behaviour, behaviour_cap=5.0)
    assert torch.equal(fresh, plain) and m0["behaviour_weight_mean"] == 1.0 and m0["proximal_alpha_mean"] == 0.0
    onto, m1 = ppo.policy_loss(logp, torch.zeros(2, 4), adv, mask, behaviour_logp=behaviour, behaviour_cap=50.0,
                               proximal_alpha=torch.ones(2, 1))
    assert m1["clipfrac"] == 0.0 and m1["ratio"] == pytest.approx(1.0)
    weight = torch.exp(logp.detach() - behaviour) * mask
    assert float(onto) == pytest.approx(float((-adv * weight).sum() / mask.sum()), rel=1e-6)
    onto.backward()
    assert logp.grad is not None and logp.grad[mask.bool()].abs().max() > 0
    with pytest.raises(ValueError, match="needs the behaviour log-probs"):
        ppo.policy_loss(logp, behaviour, adv, mask, proximal_alpha=torch.ones(2, 1))


def test_realloc_syncs_a_copy_that_runs_ahead_through_the_object_store_on_gpu_clusters():
    """``transport = auto`` is a broadcast on GPU clusters, which would hold the trainer until the generating copy
    finished the generation in flight; for a copy that runs ahead it takes the object store, imported between
    generations without waiting (``wait=False``). A named transport is kept."""
    gpu = PPO.replace("cluster local { devices = cpu:2 }", 'cluster gpus { gpu = "H100-80GB"; gpus_per_node = 2 }')
    passes = "dce,parallelize,placement{strategy=separate},realloc"

    def transport(extra: str, pipe: str = passes) -> str:
        module, _ = compile_source(_program(extra, gpu), "ppo_tiny.rlhf")
        module = PassManager(parse_pipeline(pipe)).run(module)
        return next(s.attrs["transport"] for s in module.graph.stages if s.op == "sync")

    assert transport("") == "collective"
    assert transport("; staleness = 1") == "object_store"
    assert transport("; staleness = 1", passes.replace("realloc", "realloc{transport=collective}")) == "collective"


def test_O3_runs_ahead_only_where_predicted_faster_than_its_synchronous_plan():
    """-O3's ``async_rollout{when=faster}`` comes after stream and overcommit: where the simulator's steady-state
    step of the generate run ahead (its stream, overcommitment and log-prob reuse taken back) is at least 5 %
    below the synchronous plan's, it runs ahead; else the synchronous plan stays, overcommitted. On ppo_tiny the
    first, on overlap.rlhf (two cores shared by every model, where the runs measured the synchronous plan
    faster) the second."""
    from rlhfc.cost import simulate
    from rlhfc.cost.simulator import STEADY_STEPS
    from rlhfc.frontend import load_file

    sync_passes = [p for p in PIPELINES["O3"] if not p.startswith("async_rollout")]
    for name, runs_ahead in (("examples/ppo_tiny.rlhf", True), ("benchmarks/overlap.rlhf", False)):
        def compiled(passes):
            module, _, _ = load_file(os.path.join(ROOT, name))
            return PassManager(parse_pipeline(",".join(passes))).run(module)

        o3, sync = compiled(PIPELINES["O3"]), compiled(sync_passes)
        roll = o3.graph.stage("roll")
        assert (plan.async_rollout(o3, roll) is not None) == runs_ahead, name
        t_o3, t_sync = (simulate(m, steps=STEADY_STEPS).step_time_s for m in (o3, sync))
        if runs_ahead:
            assert t_o3 < 0.95 * t_sync
            assert plan.overcommit(roll) is None and plan.stream_chunk(roll) is None
            assert not plan.stream_consumers(o3.graph, roll) and plan.changes_training(o3) == ["async_rollout"]
        else:
            assert t_o3 == t_sync and plan.overcommit(roll) is not None
            assert plan.changes_training(o3) == ["overcommit"]


def test_a_generate_running_ahead_shares_the_cores_with_the_other_workers_stages():
    """The generate of step t+1 runs while step t's forwards and critic train on the same cores (its own
    worker's train waits for it): each gets its share of the cores in threads, not all of them — two torch
    threads per process on two busy cores stall at every parallel region (measured on the throughput
    benchmark's wide point: the ahead generate 1.8x slower than alone, -O3 slower than -O2)."""
    from rlhfc.ir.schedule import stage_threads

    sync, ahead = stage_threads(_module()), stage_threads(_module("; staleness = 1"))
    assert set(sync.values()) == {2}   # -O0: every stage runs alone on both cores
    assert ahead["roll"] == 1
    assert ahead["ref_logp"] == ahead["values"] == ahead["scores"] == ahead["critic_train"] == 1
    assert ahead["actor_train"] == 2   # the generate's own worker: its calls run one at a time
