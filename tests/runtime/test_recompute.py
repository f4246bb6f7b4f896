"""Recompute selection: the fx trace's estimate of what a block keeps for backward against what torch keeps,
and gradients with every policy against those without recomputation (tiny llama / gpt2 blocks, fp32)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from rlhfc.passes import recompute_choice as choice
from rlhfc.passes.recompute_trace import trace_block
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.models.recompute import apply_recompute, blocks, kept_activation_bytes, saved_tensor_bytes

ROWS, SEQ = 2, 24
SPECS = {
    "llama": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=96),
    "gpt2": dict(arch="gpt2", layers=2, hidden=64, heads=4, vocab=96, attn="eager"),
}


def _batch():
    ids = torch.randint(3, 90, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[0, :3] = 0                                   # a left-padded row, as generation leaves them
    return ids, mask


def _trace(name):
    m = build_model(SPECS[name]).spec
    return trace_block(m["arch"], m["hidden"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"], ROWS, SEQ,
                       attn=m["attn"])


def _choices(trace):
    """Every policy, and the budget policy at three budgets (fractions of what plain autograd keeps)."""
    out = {"none": choice.choose(trace, "none"), "full": choice.choose(trace, "full"),
           "selective": choice.choose(trace, "selective")}
    for frac in (0.8, 0.5, 0.2):
        out[f"budget{frac}"] = choice.choose(trace, "budget", frac * trace.autograd_bytes)
    return out


def _block_call(model):
    """The first block of ``model`` and the (args, kwargs) the model calls it with on the test batch."""
    block = blocks(model)[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        model(*_batch())
    hook.remove()
    x = seen["a"][0].detach().requires_grad_(True)
    return block, (x, *seen["a"][1:]), seen["k"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recompute_saved_bytes_match_trace(name):
    """What each policy keeps for backward, measured (storages allocated in the block's forward and alive after
    it; saved_tensors_hooks for plain autograd), is the trace's estimate within 10 % (it is exact here), and
    it drops as the budget drops while the recompute time grows."""
    trace = _trace(name)
    model = build_model(SPECS[name], seed=0)
    model.train()
    block, args, kwargs = _block_call(model)
    inputs = [t for t in torch.utils._pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    _, hooked = saved_tensor_bytes(block, *args, exclude=[*inputs, *block.parameters()], **kwargs)
    assert hooked == pytest.approx(trace.autograd_bytes, rel=0.10)
    measured = {}
    for label, ch in _choices(trace).items():
        apply_recompute(model, {"policy": ch.policy, "save": list(ch.save)})
        _, measured[label] = kept_activation_bytes(block, *args, **kwargs)
        assert measured[label] == pytest.approx(ch.saved_bytes, rel=0.10, abs=64), label
    assert measured["none"] == hooked
    assert measured["full"] == 0
    budgets = [_choices(trace)[k] for k in ("none", "budget0.8", "budget0.5", "budget0.2")]
    kept = [measured[k] for k in ("none", "budget0.8", "budget0.5", "budget0.2")]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    times = [c.recompute_s for c in budgets]
    assert times == sorted(times) and times[-1] <= choice.full(trace).recompute_s


@pytest.mark.parametrize("name", sorted(SPECS))
def test_recompute_gradients_equal(name):
    """Gradients under every policy equal those without recomputation (within 1e-6 relative; fp32 CPU
    recomputation replays the same kernels, so they are bitwise equal)."""
    trace = _trace(name)

    def grads(decision):
        model = build_model(SPECS[name], seed=0)
        model.train()
        assert apply_recompute(model, decision) == (decision or {}).get("policy", "none")
        model(*_batch()).pow(2).mean().backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for label, ch in _choices(trace).items():
        got = grads({"policy": ch.policy, "save": list(ch.save)})
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=label)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_model_loaded_from_a_folder_keeps_what_the_config_built_trace_says(name, tmp_path):
    """A model saved as a Hugging Face folder and loaded from it (``hf(...)``: the runtime's from_pretrained)
    has the block the tracer builds from the shape alone: under each policy it keeps the bytes the config-built
    trace predicts (what lets the recompute pass trace an ``hf(...)`` model from its config.json), and its
    gradients are those without recomputation."""
    from rlhfc.passes.recompute import block_config_differs

    trace = _trace(name)
    built = build_model(SPECS[name], seed=0)
    built.hf.save_pretrained(str(tmp_path))
    spec = {**SPECS[name], "source": str(tmp_path)}
    assert block_config_differs(name, str(tmp_path), spec["heads"], spec["hidden"]) is None
    model = build_model(spec, seed=0)
    model.train()
    block, args, kwargs = _block_call(model)
    for label, ch in _choices(trace).items():
        apply_recompute(model, {"policy": ch.policy, "save": list(ch.save)})
        _, kept = kept_activation_bytes(block, *args, **kwargs)
        assert kept == pytest.approx(ch.saved_bytes, rel=0.10, abs=64), label

    def grads(decision):
        m = build_model(spec, seed=0)
        m.train()
        apply_recompute(m, decision)
        m(*_batch()).pow(2).mean().backward()
        return [p.grad for p in m.parameters()]

    want, ch = grads(None), _choices(trace)["budget0.5"]
    for a, b in zip(grads({"policy": ch.policy, "save": list(ch.save)}), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


def test_recompute_inference_unchanged_and_reversible():
    """Forwards without a graph never checkpoint; applying ``none`` restores the plain block forward."""
    model = build_model(SPECS["llama"], seed=0)
    before = model(*_batch()).detach()
    apply_recompute(model, {"policy": "full"})
    with torch.no_grad():
        assert torch.equal(model(*_batch()), before)
    apply_recompute(model, {"policy": "none"})
    assert all("_rlhfc_forward" not in b.__dict__ and "forward" not in b.__dict__ for b in blocks(model))
    with pytest.raises(ValueError, match="recompute policy"):
        apply_recompute(model, {"policy": "sometimes"})


def test_worker_out_of_memory_names_the_stage(tmp_path):
    """When the cost model was wrong and a worker runs out of memory, the job's error says so and names the
    stage (a torch allocation failure raised in the worker, as Ray hands it to the driver)."""
    from rlhfc.runtime.job import Job

    job = Job.__new__(Job)
    from rlhfc.contract import plan as contract

    job.plan = SimpleNamespace(graph=contract.GraphPlan("p", {}, (contract.StagePlan("actor_train", "train", "actor",
                                                                                     ("loss",), ("stats",)),)))
    job.out, job.last_checkpoint, job.resume_command = str(tmp_path), None, ["python", "main.py"]
    err = job._ray_failure("actor_train", RuntimeError("[enforce fail at alloc_cpu.cpp:117] "
                                                       "DefaultCPUAllocator: can't allocate memory"))
    assert "stage %actor_train (train on model 'actor') failed: its worker ran out of memory" in str(err)
    assert "memory check expected it to fit" in str(err)
    other = job._ray_failure("actor_train", ValueError("bad value"))
    assert "out of memory" not in str(other)


def test_megatron_recompute_settings_nearest_the_decision():
    """The megatron trainer expresses full and selective itself; a traced op set becomes full (keeps less)."""
    pytest.importorskip("megatron.core")
    from rlhfc.runtime.models.build import normalize_spec
    from rlhfc.runtime.models.megatron import recompute_settings, transformer_config

    assert recompute_settings(None) == {} == recompute_settings({"policy": "none"})
    got = {}
    for policy in ("full", "selective", "ops"):
        spec = normalize_spec(dict(SPECS["llama"], recompute={"policy": policy, "save": ["mm.default#0"]}))
        with warnings.catch_warnings():   # megatron notes that fused attention needs no core_attn recompute
            warnings.simplefilter("ignore")
            got[policy] = transformer_config(spec, 1, 1).recompute_granularity
    assert got == {"full": "full", "selective": "selective", "ops": "full"}


def test_recompute_is_priced_per_op_kind():
    """Each op is priced by its kind: matmuls by FLOPs, softmax / elementwise / copy ops by the bytes they move
    at their own bandwidth; a profile's per-kind rates are recovered from op times made at those rates."""
    from rlhfc.cost.hardware import device_spec
    from rlhfc.cost.profile import Profile
    from rlhfc.passes.recompute_trace import fit_kind_rates, reprice

    trace = _trace("gpt2")                                   # eager attention: a softmax over the scores
    kinds = {n.kind for n in trace.nodes}
    assert {"matmul", "softmax", "elementwise", "view"} <= kinds
    assert all((n.kind == "matmul") == (n.flops > 0) and (n.kind == "view") == (n.bytes == 0) for n in trace.nodes)
    rates = {"softmax": 1e9, "elementwise": 4e9, "copy": 8e9}
    priced = reprice(trace, 20e9, rates, op_s=0.0)
    for n in priced.nodes:
        if n.kind in rates:
            assert n.seconds == pytest.approx(n.moved / rates[n.kind])
        elif n.kind == "matmul":
            assert n.seconds == pytest.approx(max(n.flops / 20e9, n.moved / 8e9))
    soft = next(n for n in priced.nodes if n.kind == "softmax")
    slower = reprice(trace, 20e9, dict(rates, softmax=0.5e9), op_s=0.0)
    assert slower.forward_s - priced.forward_s == pytest.approx(soft.moved / 0.5e9 - soft.moved / 1e9)
    # rates fitted from op times made at known rates (matmuls compute-bound there) come back exactly
    made = {n.key: n.flops / 20e9 + 5e-6 if n.kind == "matmul" else n.moved / rates[n.kind] + 5e-6
            for n in trace.nodes if n.kind in ("matmul", *rates)}
    flops, fitted = fit_kind_rates(trace, made)
    assert flops == pytest.approx(20e9) and fitted == pytest.approx({k: rates[k] for k in fitted})
    # a profile's host probe gives the pass each kind's fraction of the copy bandwidth
    spec = device_spec("cpu", Profile("cpu", "test", 1, {"copy_bw": 10e9, "kind_bw": {"softmax": 2.5e9}}, {}, {}))
    assert dict(spec.kind_eff) == {"softmax": 0.25}


def test_recompute_choice_follows_replay_costs():
    """What a replay pays beyond its ops changes what the knapsack keeps: a fresh-output cost on the largest
    allocations (the s x s scores) makes keeping those ops worth their bytes; a per-op dispatch cost of the
    selective checkpoint can make ``full`` (which pays none) the cheaper plan at a budget; and every price is
    the sum the choice reports (synthetic rates on a tiny gpt2 block)."""
    from rlhfc.passes.recompute_prices import fresh_seconds, with_replay_costs

    curve = ((1 << 20, 0.0), (2 << 20, 1e-9), (8 << 20, 5e-9))
    assert fresh_seconds(3 << 20, curve) == pytest.approx(3 * 2 ** 20 * 1e-9)
    assert fresh_seconds(1 << 19, ((1 << 20, 1e-9),)) == 0.0 == fresh_seconds(1 << 30, ())
    trace = _trace("gpt2")                                   # eager attention: the scores are the largest outputs
    largest = max(n.bytes for n in trace.nodes)
    budget = 0.5 * choice.selective(trace).saved_bytes
    plain = choice.within(trace, budget)
    costly = with_replay_costs(trace, fresh=((largest, 1e-6),))
    fresh = choice.within(costly, budget)
    big = {n.key for n in trace.nodes if n.bytes == largest}
    assert fresh.saved_bytes <= budget and set(fresh.save) != set(plain.save)
    assert len(big & set(fresh.save)) > len(big & set(plain.save))
    assert fresh.recompute_s < choice.price(costly, set(plain.save)).recompute_s
    # the checkpoint's own cost: a block priced + region, a selective one + per dispatched op as well
    cut = max(i for i, n in enumerate(trace.nodes) if n.saves)
    fixed = with_replay_costs(trace, ckpt_op_s=1e-3, ckpt_region_s=2e-3)
    assert choice.full(fixed).recompute_s == pytest.approx(choice.full(trace).recompute_s + 2e-3)
    assert choice.price(fixed, set(plain.save)).recompute_s == pytest.approx(
        choice.price(trace, set(plain.save)).recompute_s + 2e-3 + 1e-3 * (len(trace.nodes) + cut + 1))
    assert plain.policy == "ops" and choice.within(fixed, budget).policy == "full"


def test_checkpoint_costs_are_measured():
    """The profile's checkpoint probe (the runtime's own selective and full checkpoints on a tiny block, or on
    another block at another shape) and its fresh-output probe give non-negative seconds, per aten call a
    selective policy dispatches (also on the program's own block at its shape) and per byte; the block probe times every op of a block's forward by the keys
    the runtime's checkpoint policy names them (what the trace prices)."""
    from rlhfc.calibrate.recompute import measure_block_ops, measure_checkpoint, measure_dispatch, measure_fresh_bytes

    costs = measure_checkpoint(reps=2)
    assert set(costs) == {"ckpt_op_s", "ckpt_region_s"}
    assert 0 < costs["ckpt_op_s"] < 1e-3 and 0 <= costs["ckpt_region_s"] < 0.1
    gpt2 = dict(arch="gpt2", layers=4, hidden=32, heads=2, vocab=40, max_seq=16)
    own = measure_checkpoint(2, gpt2, rows=2, seq=24)
    assert set(own) == {"ckpt_op_s", "ckpt_region_s"}
    assert 0 < own["ckpt_op_s"] < 1e-3 and 0 <= own["ckpt_region_s"] < 0.1
    assert 0 < measure_dispatch(gpt2, 2, 24, reps=3) < 1e-3     # a selective checkpoint's call, on that block
    ops = measure_block_ops(gpt2, 2, 24, reps=2)
    m = build_model(gpt2).spec
    trace = trace_block("gpt2", m["hidden"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"], 2, 24, attn=m["attn"])
    priced = {n.key for n in trace.nodes if n.kind != "view"}
    assert priced <= set(ops) and all(0 <= t < 0.1 for t in ops.values())
    (size, per_byte), = measure_fresh_bytes((1 << 20,), reps=2)
    assert size == 1 << 20 and 0 <= per_byte < 1e-8


def test_spread_probes_keep_medians_over_rounds():
    """The profile's recompute probes, taken in rounds spread over it: each round measures the tiny block and
    every trained block; what the profile keeps is each value's median over the rounds (one slow round, as a
    VM's slow spell, does not move it)."""
    from rlhfc.calibrate.recompute import SpreadProbes

    gpt2 = dict(arch="gpt2", layers=2, hidden=32, heads=2, vocab=40, max_seq=16)
    probes = SpreadProbes({"g": (gpt2, 2, 24)}, quick=True, seed={"ckpt_op_s": 1.0, "ckpt_region_s": 1.0})
    assert probes.block("g") is None
    probes.take()
    probes.middle(most=1)                                  # already one round of the blocks: nothing taken
    assert len(probes.host) == 2 and len(probes.calls["g"]) == 1 and len(probes.calls["g"][0]) == 3  # quick: 3 pairs
    entry = probes.block("g")
    assert (entry["rows"], entry["seq"], entry["rounds"]) == (2, 24, 1) and 0 < entry["ckpt_op_s"] < 1e-3
    assert len(entry["op_s"]) > 10 and all(t >= 0 for t in entry["op_s"].values())
    assert probes.host_costs()["ckpt_op_s"] == (1.0 + probes.host[1]["ckpt_op_s"]) / 2   # the seed is a round
    # medians over rounds: a round three times slower than the others does not move the values
    ops = entry["op_s"]
    probes.ops["g"] += [{k: 3 * v for k, v in ops.items()}, dict(ops)]
    probes.host.append(dict(probes.host[1]))
    probes.ops["g"] += [{k: 3 * v for k, v in ops.items()}, dict(ops)]
    # the call rate is the median of every round's samples pooled: rounds of samples (1, 2, 9), (3, 4, 5) and
    # (6, 7, 8) have medians 2, 4 and 7 (their median 4), the nine samples together 5; a round's own median is
    # what it prints
    probes.calls["g"] = [[1e-6, 2e-6, 9e-6], [3e-6, 4e-6, 5e-6], [6e-6, 7e-6, 8e-6]]
    again = probes.block("g")
    assert again["op_s"] == ops and again["ckpt_op_s"] == pytest.approx(5e-6) and again["rounds"] == 3
    assert [c for _, c, _ in probes.per_round("g")] == pytest.approx([2e-6, 4e-6, 7e-6])
    assert probes.host_costs() == {k: probes.host[1][k] for k in ("ckpt_op_s", "ckpt_region_s")}
    probes.calls["g"] = [[-3e-6, -1e-6, 2e-6]]                 # more slow plain forwards than not: no negative rate
    assert probes.block("g")["ckpt_op_s"] == 0.0
