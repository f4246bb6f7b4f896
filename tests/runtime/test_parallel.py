"""Data-parallel ranks (FSDP2 over gloo): dp2 equals dp1.

Two processes each host one :class:`~rlhfc.runtime.worker.base.ModelWorker` (``trainer = fsdp``); a third, in-process
:class:`~rlhfc.runtime.worker.base.ModelWorker` is the single-rank reference built from the same seed. The
forwards, the sampled tokens and one training step's loss and metrics must agree within 1e-5 relative
(float rounding: batched products over fewer rows, gradients summed in another order); the updated
weights, and a checkpoint saved by the group and loaded by a single rank, within 1e-4 absolute (see
WEIGHTS_TOL).
"""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import PolicyLossInput, ValueLossInput
from rlhfc.runtime.worker.base import ModelWorker
from rlhfc.runtime.train.backend import join, open_store, row_share
from spawned import run_spawned   # tests/runtime/spawned.py

PROMPTS = ["abc", "hello there", "x", "the quick brown", "fox", "jumps over", "a lazy", "dog!"]
GEN = dict(max_new_tokens=8, temperature=1.0, top_p=1.0)
TRAIN = dict(lr=1e-2, epochs=1, minibatches=2, max_grad_norm=1.0, weight_decay=0.0)
TOL = dict(rtol=1e-5, atol=1e-6)
#: updated weights: Adam moves each element by lr·m/(sqrt(v) + eps). Where the true gradient is 0 and the
#: computed one is rounding noise (GPT-2's key bias: softmax ignores it) that is lr·g/eps, which differs
#: between layouts by up to ~1e-5..1e-4 at lr = 1e-2; any real error moves a weight by ~lr
WEIGHTS_TOL = dict(rtol=1e-5, atol=1e-4)


def _policy_loss(roll, old, adv) -> PolicyLossInput:
    return PolicyLossInput(roll, old, adv, None, clip=0.2, entropy_coef=0.01, kl_coef=0.0, estimator="k3",
                           temperature=1.0)


def _rank_main(rank: int, world: int, store, specs: dict, role: str, folder: str) -> dict:
    """One rank's work: the actor generates, computes log-probs, trains and checkpoints; the critic
    computes values and trains (one data-parallel rank per process, as the runtime starts them)."""
    torch.set_num_threads(1)
    worker = ModelWorker(role, specs[role], {"kind": "random"}, seed=7, trainer="fsdp", rank=rank, world=world,
                         store=store)
    if role == "actor":
        roll = _broadcast(worker.generate(PROMPTS, **GEN), rank)   # rank 0 samples every row
        res = {"roll": roll, "logp": worker.logprobs(roll)}
        old, adv, _ = _loss_inputs(roll)
        res["train"] = worker.train(_policy_loss(roll, old, adv), **TRAIN)
        res["weights"] = worker.get_weights()
        worker.save(folder)
        return res
    roll = specs["roll"]
    _, _, ret = _loss_inputs(roll)
    return {"values": worker.values(roll),
            "train": worker.train(ValueLossInput(roll, ret * 0.5, ret, clip=0.2), **TRAIN)}


def _loss_inputs(roll):
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(roll.mask.shape, generator=g) * roll.mask
    old = torch.randn(roll.mask.shape, generator=g) * 0.1 - 2.0
    ret = torch.randn(roll.mask.shape, generator=g) * roll.mask
    return old, adv, ret


def _broadcast(obj, rank: int):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run_group(world: int, specs: dict, role: str, folder: str) -> list[dict]:
    store = open_store()
    return run_spawned([(_rank_main, (r, world, store, specs, role, folder)) for r in range(world)],
                       what=f"{role} rank", timeout=300)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dp2_fsdp_matches_one_rank(arch, tmp_path, make_spec):
    specs = {"actor": make_spec(arch), "critic": make_spec(arch, head="value")}
    ranks = _run_group(2, specs, "actor", str(tmp_path / "ckpt"))

    one = ModelWorker("actor", specs["actor"], {"kind": "random"}, seed=7)
    roll = one.generate(PROMPTS, **GEN)
    # the group samples the tokens one rank samples
    assert torch.equal(ranks[0]["roll"].batch.input_ids, roll.batch.input_ids)
    # each rank computed its share of the rows; joined in row order they are the single rank's
    logp = join([r["logp"] for r in ranks])
    torch.testing.assert_close(logp.values, one.logprobs(roll).values, **TOL)
    assert [len(r["logp"].values) for r in ranks] == [hi - lo for lo, hi in (row_share(8, i, 2) for i in range(2))]

    old, adv, ret = _loss_inputs(roll)
    metrics = one.train(_policy_loss(roll, old, adv), **TRAIN)
    for r in ranks:
        assert r["train"].keys() == metrics.keys()
        for k, v in metrics.items():
            assert r["train"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    weights = one.get_weights()
    for r in ranks:
        for k, v in weights.items():
            torch.testing.assert_close(r["weights"][k], v, **WEIGHTS_TOL)

    # a checkpoint the dp2 group wrote loads into one rank (another layout) with the same weights
    resumed = ModelWorker("actor", specs["actor"], {"kind": "random"}, seed=99)
    assert resumed.load(str(tmp_path / "ckpt")) == 1
    for k, v in weights.items():
        torch.testing.assert_close(resumed.get_weights()[k], v, **WEIGHTS_TOL)

    critics = _run_group(2, {**specs, "roll": roll}, "critic", str(tmp_path / "unused"))
    critic = ModelWorker("critic", specs["critic"], {"kind": "random"}, seed=7)
    torch.testing.assert_close(join([r["values"] for r in critics]).values, critic.values(roll).values, **TOL)
    cm = critic.train(ValueLossInput(roll, ret * 0.5, ret, clip=0.2), **TRAIN)
    for r in critics:
        for k, v in cm.items():
            assert r["train"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_dp2_fsdp_with_recompute_trains_like_one_rank_without(tmp_path, make_spec):
    """FSDP2 ranks whose blocks recompute part of their activations (a selective-checkpoint decision from the
    plan) train to the same metrics and weights as one rank that keeps everything."""
    spec = make_spec("llama")
    decided = dict(spec, recompute={"policy": "ops", "save": ["mm.default#0", "mm.default#4", "silu.default#0"]})
    ranks = _run_group(2, {"actor": decided}, "actor", str(tmp_path / "ckpt"))
    one = ModelWorker("actor", spec, {"kind": "random"}, seed=7)
    roll = one.generate(PROMPTS, **GEN)
    assert torch.equal(ranks[0]["roll"].batch.input_ids, roll.batch.input_ids)
    old, adv, _ = _loss_inputs(roll)
    metrics = one.train(_policy_loss(roll, old, adv), **TRAIN)
    for r in ranks:
        for k, v in metrics.items():
            assert r["train"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        for k, v in one.get_weights().items():
            torch.testing.assert_close(r["weights"][k], v, **WEIGHTS_TOL)
