"""The megatron-core trainer (tensor and pipeline parallel over gloo) equals one rank.

Each case starts ``dp·tp·pp`` processes, each hosting one :class:`~rlhfc.runtime.worker.base.ModelWorker` (``trainer = megatron``)
rank of a model; an in-process :class:`~rlhfc.runtime.worker.base.ModelWorker` built from the same seed is
the single-rank reference. Per case, in this order:

1. the forward (log-probs, values or scores) on a rollout — within 1e-5 relative of one rank;
2. one training step (two minibatches): every metric within 1e-5 relative, the updated weights within
   1e-4 absolute (WEIGHTS_TOL: Adam's step on rounding-noise gradients; lr is 1e-2);
3. a policy then samples, on the gathered weights, the tokens one rank samples;
4. the group's checkpoint loads into one rank (another layout): the same weights and optimizer state;
5. the group loads the single rank's checkpoint (layout → layout the other way) and trains a second
   step like the single rank does after loading it;
6. a weight sync (buckets of Hugging Face-layout tensors) leaves exact copies of the sender's weights.
"""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import PolicyLossInput, ValueLossInput
from rlhfc.runtime.worker.base import ModelWorker
from rlhfc.runtime.train.backend import join, open_store

from spawned import run_spawned   # tests/runtime/spawned.py

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

PROMPTS = ["abc", "hello there", "x", "the quick brown", "fox", "jumps over", "a lazy", "dog!"]
GEN = dict(max_new_tokens=6, temperature=1.0, top_p=1.0)
TRAIN = dict(lr=1e-2, epochs=1, minibatches=2, max_grad_norm=1.0, weight_decay=0.0)
TOL = dict(rtol=1e-5, atol=1e-6)
#: updated weights: Adam moves each element by lr·m/(sqrt(v) + eps). Where the true gradient is 0 and the
#: computed one is rounding noise (GPT-2's key bias: softmax ignores it) that is lr·g/eps, which differs
#: between layouts by up to ~1e-5..1e-4 at lr = 1e-2; any real error moves a weight by ~lr
WEIGHTS_TOL = dict(rtol=1e-5, atol=1e-4)
SEED = 7

#: (arch, head, dp, tp, pp): every layout of the issue, both archs, every head, GPT-2's tied embedding split
#: over two stages, grouped-query attention split over tensor-parallel ranks
CASES = [
    ("llama", "lm", 1, 2, 1),
    ("gpt2", "value", 1, 2, 1),
    ("gpt2", "lm", 1, 1, 2),
    ("llama", "value", 1, 1, 2),
    ("llama", "value", 2, 1, 1),
    pytest.param("llama", "lm", 2, 2, 1, marks=pytest.mark.slow),
    pytest.param("gpt2", "lm", 1, 2, 2, marks=pytest.mark.slow),
    pytest.param("llama", "score", 1, 2, 2, marks=pytest.mark.slow),
]


def _spec(make_spec, arch: str, head: str) -> dict:
    spec = make_spec(arch, head=head)
    if arch == "llama":
        spec["kv_heads"] = spec["heads"] // 2   # grouped-query attention: two query heads per key/value head
    return spec


def _rollout(make_spec, arch: str):
    return ModelWorker("gen", make_spec(arch), {"kind": "random"}, seed=3).generate(PROMPTS, **GEN)


def _loss(head: str, roll, second: bool = False):
    g = torch.Generator().manual_seed(11 if second else 5)
    adv = torch.randn(roll.mask.shape, generator=g) * roll.mask
    old = torch.randn(roll.mask.shape, generator=g) * 0.1 - 2.0
    if head == "lm":
        return PolicyLossInput(roll, old, adv, None, clip=0.2, entropy_coef=0.01, kl_coef=0.0, estimator="k3",
                               temperature=1.0)
    return ValueLossInput(roll, adv * 0.5, adv, clip=0.2)


def _forward(worker, head: str, roll):
    return {"lm": worker.logprobs, "value": worker.values, "score": worker.score}[head](roll)


def _steps(worker, head: str, roll, save_to: str | None, load_from: str | None) -> dict:
    """What both sides do: forward, train, (sample), save; then load the other side's checkpoint and train."""
    out = {"forward": _forward(worker, head, roll)}
    if head == "score":
        return out
    out["train"] = worker.train(_loss(head, roll), **TRAIN)
    out["weights"] = worker.get_weights()
    if head == "lm":
        if hasattr(worker.backend, "replica"):   # the plan's reshard stage: full copies, here in 1 MiB buckets
            out["reshard"] = worker.reshard(1)
            out["replica"] = {k: v.clone() for k, v in worker.backend.replica.state_dict().items()}
        out["sample"] = worker.generate(PROMPTS[:4], **GEN)
    if save_to:
        worker.save(save_to)
    if load_from:
        worker.load(load_from)
        out["train2"] = worker.train(_loss(head, roll, second=True), **TRAIN)
        out["weights2"] = worker.get_weights()
    return out


def _rank_main(rank, world, store, spec, layout, roll, save_to, load_from):
    torch.set_num_threads(1)
    dp, tp, pp = layout
    worker = ModelWorker("m", spec, {"kind": "random"}, seed=SEED, trainer="megatron", rank=rank, world=world,
                         store=store, tp=tp, pp=pp)
    out = _steps(worker, spec["head"], roll, save_to, load_from)
    # a weight sync brings another model's weights in buckets (numpy arrays, Hugging Face layout)
    other = ModelWorker("m", spec, {"kind": "random"}, seed=SEED + 1).get_weights()
    names = list(other)
    for bucket in (names[:3], names[3:7], names[7:]):
        worker.sync_import({k: other[k].numpy() for k in bucket})
    out["synced"] = worker.get_weights()
    return out


def _run_group(spec, layout, roll, save_to, load_from) -> list[dict]:
    world = layout[0] * layout[1] * layout[2]
    store = open_store()
    return run_spawned([(_rank_main, (r, world, store, spec, layout, roll, save_to, load_from))
                        for r in range(world)], what="rank")


def _same_metrics(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def _same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **WEIGHTS_TOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("arch,head,dp,tp,pp", CASES)
def test_megatron_layout_matches_one_rank(arch, head, dp, tp, pp, tmp_path, make_spec):
    spec = _spec(make_spec, arch, head)
    roll = _rollout(make_spec, arch)
    one = ModelWorker("m", spec, {"kind": "random"}, seed=SEED)
    want = _steps(one, head, roll, str(tmp_path / "one"), None)
    ranks = _run_group(spec, (dp, tp, pp), roll, str(tmp_path / "group"), str(tmp_path / "one"))

    # 1. the answering ranks' shares, joined in rank order, are the single rank's rows
    parts = [r["forward"] for r in ranks if r["forward"] is not None]
    assert len(parts) == dp
    got = join(parts)
    want_fwd = want["forward"]
    if head != "score":   # TokenValues; scores are plain tensors
        got, want_fwd = got.values, want_fwd.values
    torch.testing.assert_close(got, want_fwd, **TOL)
    other = ModelWorker("m", spec, {"kind": "random"}, seed=SEED + 1).get_weights()
    assert all(torch.equal(ranks[0]["synced"][k], v) for k, v in other.items())   # 6. exact copies
    if head == "score":
        return
    # 2. one training step: the metrics every rank reports and the gathered weights
    for r in ranks:
        _same_metrics(r["train"], want["train"])
    _same_weights(ranks[0]["weights"], want["weights"])
    # 3. rank 0 samples on the gathered weights: the single rank's tokens
    if head == "lm":
        for r in ranks:   # 3a. every rank's reshard gathered the weights it lacked, in buckets, exactly
            assert r["reshard"][0] > 0 if tp * pp > 1 else r["reshard"] == (0, 0)
            assert all(torch.equal(r["replica"][k], v) for k, v in ranks[0]["weights"].items())
        assert torch.equal(ranks[0]["sample"].batch.input_ids, want["sample"].batch.input_ids)
        assert all(r["sample"] is None for r in ranks[1:])
    # 4. the group's checkpoint loads into one rank: weights and optimizer state
    resumed = ModelWorker("m", spec, {"kind": "random"}, seed=99)
    assert resumed.load(str(tmp_path / "group")) == 1
    _same_weights(resumed.get_weights(), want["weights"])
    mine, theirs = resumed.optimizer.state_dict()["state"], one.optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for i in theirs:
        for key in ("exp_avg", "exp_avg_sq"):
            # gradient moments: rounding-level differences, judged against the tensor's scale
            scale = float(theirs[i][key].abs().max())
            torch.testing.assert_close(mine[i][key], theirs[i][key], rtol=1e-4, atol=1e-4 * scale + 1e-12)
    # 5. the group loaded the single rank's checkpoint and trained a second step as one rank does
    one.load(str(tmp_path / "one"))
    second = one.train(_loss(head, roll, second=True), **TRAIN)
    _same_metrics(ranks[0]["train2"], second)
    _same_weights(ranks[0]["weights2"], one.get_weights())
