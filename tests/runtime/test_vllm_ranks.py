"""A generating model of several ranks on vLLM (issue #15): an engine per FSDP2 rank, in the group's world.

Skipped where vLLM is not installed. Two processes host the ranks of a dp2 group (``trainer = fsdp``) whose
rollout engine is vLLM, each starting one engine (~10-20 s on CPU), side by side. The one-engine reference
is a separate single-process worker on vLLM, in a third process (and rank 0's engine decoding every row
alone, a streamed call, as ``stream`` runs on a group).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from rlhfc.runtime.data.values import PolicyLossInput  # noqa: E402
from rlhfc.runtime.worker.base import ModelWorker  # noqa: E402
from rlhfc.runtime.train.backend import join, open_store, row_share  # noqa: E402
from spawned import run_spawned  # noqa: E402   # tests/runtime/spawned.py

#: head size 64 (what vLLM's CPU attention runs)
SPEC = dict(arch="llama", layers=2, hidden=128, heads=2, vocab=96, max_seq=128)
#: the second half repeats the first: rank 1's share holds rank 0's prompts
PROMPTS = [f"{w} {i}" for i in range(3) for w in ("the cat", "hello", "xyz", "a")] * 2
GEN = dict(max_new_tokens=12, top_p=1.0)


def _broadcast(obj, rank: int):
    import torch.distributed as dist

    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank(rank: int, world: int, store, folder: str) -> dict:
    """One rank: greedy and sampled generation on its engine, a training step, the refit at the reshard
    stage, a sampled rollout on the refitted engines, a stream from rank 0, and a two-rank sync group."""
    from rlhfc.runtime.worker.base import ModelWorker

    torch.set_num_threads(1)
    w = ModelWorker("actor", SPEC, {"kind": "random"}, seed=7, rollout={"engine": "vllm", "folder": folder},
                    trainer="fsdp", rank=rank, world=world, store=store)
    out = {"greedy": _broadcast(w.generate(PROMPTS, temperature=0.0, **GEN), rank),
           "alone": list(w.generate_chunks(PROMPTS, chunk=8, temperature=0.0, **GEN))}   # rank 0: every row
    roll = _broadcast(w.generate(PROMPTS, temperature=1.0, **GEN), rank)
    logp = w.logprobs(roll)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(roll.mask.shape, generator=g) * roll.mask
    old = torch.randn(roll.mask.shape, generator=g) * 0.1 - 2.0
    w.train(PolicyLossInput(roll, old, adv, None, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3",
                            temperature=1.0), lr=3e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
    out["reshard"] = w.reshard(1)   # the refit: every rank gathers the trained shards into its engine
    out["engine_version"] = w.rollout_engine.engine.version
    after = w.generate(PROMPTS, temperature=1.0, **GEN)   # no refit left to do
    after = _broadcast(after, rank)
    out.update(roll=roll, logp=logp, after=after, trainer=w.logprobs(after), version=w.version)
    # a two-rank sync group (ModelWorker.sync_open ... sync_recv) beside vLLM's groups in the same world
    where = _broadcast(w.sync_open("t") if rank == 0 else None, rank)
    w.sync_join("t", rank, *where, "gloo")
    flat = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    w._broadcast("t", flat)
    out["synced"] = flat.tolist()
    return out


def _single(folder: str) -> list[list[int]]:
    """The reference: one worker of the same model, not in any group, greedy on its own vLLM engine."""
    torch.set_num_threads(1)
    w = ModelWorker("actor", SPEC, {"kind": "random"}, seed=7, rollout={"engine": "vllm", "folder": folder})
    try:
        return w.generate(PROMPTS, temperature=0.0, **GEN).batch.response_token_lists()
    finally:
        w.rollout_engine.shutdown()


def _two_ranks(body, tmp_path) -> list[dict]:
    """Run ``body(rank, world, store, folder)`` in two spawned processes; their results, by rank."""
    store = open_store()
    return run_spawned([(body, (r, 2, store, str(tmp_path))) for r in range(2)], what="rank")


def _one_process(fn, *args):
    """``fn(*args)`` in a spawned process of its own (a vLLM engine outside the test process)."""
    return run_spawned([(fn, args)], what="the single-process reference")[0]


def test_dp2_ranks_generate_on_their_own_engines_and_refit_from_their_shards(tmp_path):
    ranks = _two_ranks(_rank, tmp_path)
    single = _one_process(_single, str(tmp_path / "single"))

    # greedy: each rank decodes its share on its own engine; row for row what one engine decodes alone
    greedy = ranks[0]["greedy"]
    alone: dict[int, list[int]] = {}
    for chunk in ranks[0]["alone"]:   # streamed chunks, as the rows finished
        alone.update(zip(chunk.rows, chunk.batch.response_token_lists()))
    assert [c.size for c in ranks[0]["alone"]] == [8, 8, 8] and ranks[1]["alone"] == []
    assert greedy.batch.response_token_lists() == [alone[i] for i in range(len(PROMPTS))]
    assert greedy.batch.response_token_lists() == single   # a separate one-process engine: the same tokens
    assert greedy.rollout_engine == "vllm" and greedy.logprobs is not None

    # sampled: the ranks draw from seeds of their own, so the same prompt on rank 1 continues otherwise
    n = len(PROMPTS)
    lo, hi = row_share(n, 1, 2)
    rows = ranks[0]["roll"].batch.response_token_lists()
    assert (lo, hi) == (n // 2, n) and rows[:lo] != rows[lo:]

    # the engines' sampled-token log-probs are the trainer's at equal weights, then after the step's refit
    roll, after = ranks[0]["roll"], ranks[0]["after"]
    before = join([r["logp"] for r in ranks]).values
    assert float((roll.logprobs - before).abs()[roll.mask.bool()].max()) < 1e-3
    nbytes, buckets = ranks[0]["reshard"]
    assert buckets >= 1 and nbytes > 0 and all(r["engine_version"] == r["version"] == 1 for r in ranks)
    mask = after.mask.bool()
    trainer = join([r["trainer"] for r in ranks]).values
    assert float((after.logprobs - trainer).abs()[mask].max()) < 1e-3   # rows of both ranks' engines
    initial = ModelWorker("actor", SPEC, {"kind": "random"}, seed=7).logprobs(after).values
    assert float((after.logprobs - initial).abs()[mask].max()) > 1e-2   # so the refit really changed them
    assert after.engine["refit_buckets"] == buckets   # the reshard stage's refit, reported with the rollout

    assert ranks[1]["synced"] == [0.0, 1.0, 2.0, 3.0]


def _megatron_rank(rank: int, world: int, store, folder: str) -> dict:
    """A megatron-core rank of a tp = 2 group: an engine of the whole model (refitted from its gathered
    single-rank copy), its share of the rows; then rank 0 streams every row."""
    from rlhfc.runtime.worker.base import ModelWorker

    torch.set_num_threads(1)
    w = ModelWorker("actor", SPEC, {"kind": "random"}, seed=7, rollout={"engine": "vllm", "folder": folder},
                    trainer="megatron", rank=rank, world=world, store=store, tp=2)
    roll = _broadcast(w.generate(PROMPTS, temperature=1.0, **GEN), rank)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(roll.mask.shape, generator=g) * roll.mask
    old = torch.randn(roll.mask.shape, generator=g) * 0.1 - 2.0
    w.train(PolicyLossInput(roll, old, adv, None, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3",
                            temperature=1.0), lr=3e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
    w.reshard(1)
    after = _broadcast(w.generate(PROMPTS, temperature=1.0, **GEN), rank)
    chunks = list(w.generate_chunks(PROMPTS[:6], chunk=3, temperature=1.0, **GEN))
    return {"after": after, "trainer": w.logprobs(after), "streamed": [c.size for c in chunks]}


@pytest.mark.slow
def test_megatron_tp2_ranks_each_generate_on_an_engine_of_the_whole_model(tmp_path):
    pytest.importorskip("megatron.core")
    ranks = _two_ranks(_megatron_rank, tmp_path)
    after = ranks[0]["after"]
    trainer = join([r["trainer"] for r in ranks if r["trainer"] is not None]).values
    assert float((after.logprobs - trainer).abs()[after.mask.bool()].max()) < 1e-3
    assert sum(ranks[0]["streamed"]) == 6 and ranks[1]["streamed"] == []
