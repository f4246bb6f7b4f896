"""``run { precision = bf16 }``: forwards, generation and the loss's forward under bf16 autocast, float32
master weights and optimizer state (rlhfc.runtime.models.precision)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlhfc.runtime.data.values import PolicyLossInput
from rlhfc.runtime.models.precision import autocast, under_autocast
from rlhfc.runtime.worker.base import ModelWorker


def _worker(make_spec, precision):
    return ModelWorker("actor", make_spec("llama", vocab=64), {"kind": "random"}, seed=3, precision=precision)


def test_bf16_train_step_is_close_to_fp32_and_keeps_fp32_weights(make_spec):
    fp32, bf16 = _worker(make_spec, "fp32"), _worker(make_spec, "bf16")
    start = torch.cat([p.detach().reshape(-1).clone() for p in fp32.model.parameters()])
    roll = fp32.generate(["abc", "de"], max_new_tokens=4, temperature=1.0, top_p=1.0, n=2)
    lp32, lp16 = fp32.logprobs(roll).values, bf16.logprobs(roll).values
    mask = roll.mask.bool()
    assert lp16.dtype == torch.float32 and not torch.equal(lp32[mask], lp16[mask])   # bf16 arithmetic ran
    # bf16 keeps 8 bits of mantissa: log-probs of a 64-token vocabulary (about -4.2) agree to 0.05
    assert torch.allclose(lp32[mask], lp16[mask], atol=0.05)
    adv = torch.linspace(-1.0, 1.0, lp32.numel()).reshape(lp32.shape)
    stats = {}
    for name, w in (("fp32", fp32), ("bf16", bf16)):
        loss = PolicyLossInput(roll, lp32, adv, None, 0.2, 0.0, 0.0, "k3", 1.0)
        stats[name] = w.train(loss, lr=1e-3, epochs=1, minibatches=2, max_grad_norm=1.0, weight_decay=0.0)
    a, b = stats["fp32"], stats["bf16"]
    assert all(torch.isfinite(torch.tensor(v)) for v in b.values())
    assert abs(a["pg_loss"] - b["pg_loss"]) < 0.02, (a, b)   # the same minibatches (same seed), bf16 rounding
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())          # master weights
    assert all(t.dtype == torch.float32 for s in bf16.optimizer.state.values() for t in s.values()
               if torch.is_tensor(t) and t.is_floating_point())                     # optimizer state
    # the two updates (two AdamW steps of lr 1e-3) point the same way: bf16 only perturbs the gradients
    d32, d16 = (torch.cat([p.detach().reshape(-1) for p in w.model.parameters()]) - start for w in (fp32, bf16))
    cosine = float(torch.nn.functional.cosine_similarity(d32, d16, dim=0))
    assert cosine > 0.9 and float(d16.abs().max()) > 0


def test_bf16_generation_runs_under_autocast_and_stops_between_items():
    seen = []

    def stream():
        for i in range(3):
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            yield i

    for item in under_autocast(stream(), "cpu", "bf16"):
        assert not torch.is_autocast_enabled("cpu")   # the consumer runs outside autocast
    assert seen == [torch.bfloat16] * 3
    assert list(under_autocast(iter([0, None, 2]), "cpu", "bf16")) == [0, None, 2]   # items may be falsy/None
    with autocast("cpu", "fp32"):
        assert not torch.is_autocast_enabled("cpu")


def _fsdp_rank(store, spec, queue):
    """One FSDP2 rank (a group of one) under bf16: generate, log-probs, one train step (a spawned process)."""
    try:
        from rlhfc.runtime.worker.base import ModelWorker

        torch.set_num_threads(1)
        w = ModelWorker("actor", spec, {"kind": "random"}, seed=3, precision="bf16", trainer="fsdp", rank=0, world=1,
                        store=store)
        roll = w.generate(["abc", "de"], max_new_tokens=4, temperature=1.0, top_p=1.0, n=2)
        lp = w.logprobs(roll).values
        adv = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
        stats = w.train(PolicyLossInput(roll, lp, adv, None, 0.2, 0.0, 0.0, "k3", 1.0), lr=1e-3, epochs=1,
                        minibatches=2, max_grad_norm=1.0, weight_decay=0.0)
        dtypes = sorted({str(t.dtype) for t in w.get_weights().values()})
        # bytes, not tensors: torch shares tensors through file descriptors that die with this process
        queue.put(pickle.dumps({"roll": roll.batch.input_ids, "lp": lp, "loss": stats["pg_loss"], "dtypes": dtypes}))
    except BaseException:   # report, do not hang the parent
        import traceback

        queue.put(traceback.format_exc())


@pytest.mark.slow
def test_bf16_under_an_fsdp2_group_trains_as_the_single_process_worker(make_spec):
    from rlhfc.runtime.train.backend import open_store

    from spawned import context   # tests/runtime/spawned.py

    spec = make_spec("llama", vocab=64)
    ctx = context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_fsdp_rank, args=(open_store(), spec, queue))
    proc.start()
    got = queue.get(timeout=300)
    proc.join(timeout=60)
    assert isinstance(got, bytes), got   # else the child's traceback
    got = pickle.loads(got)
    one = _worker(make_spec, "bf16")
    roll = one.generate(["abc", "de"], max_new_tokens=4, temperature=1.0, top_p=1.0, n=2)
    assert torch.equal(got["roll"], roll.batch.input_ids)           # the same bf16 sampling
    lp = one.logprobs(roll).values
    torch.testing.assert_close(got["lp"], lp, rtol=0, atol=1e-2)    # bf16 products, FSDP's own kernels
    adv = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    stats = one.train(PolicyLossInput(roll, lp, adv, None, 0.2, 0.0, 0.0, "k3", 1.0), lr=1e-3, epochs=1,
                      minibatches=2, max_grad_norm=1.0, weight_decay=0.0)
    assert abs(got["loss"] - stats["pg_loss"]) < 0.02 and got["dtypes"] == ["torch.float32"]
