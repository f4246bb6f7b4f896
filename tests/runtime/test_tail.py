"""Long-tail migration on one worker (the runtime side of the ``tail_migrate`` pass, without Ray): a split
streamed generate that stops below K live rows and hands its tail back, then the tail continued in any order,
gives the rollout an unmigrated generate gives — the same tokens on the same rows."""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import CarryOver, merge_rollouts
from rlhfc.runtime.worker.base import ModelWorker

PROMPTS = ["abc", "hello there", "x", "the quick brown", "fox", "jumps over", "a lazy", "dog!"]
GEN = dict(max_new_tokens=24, temperature=1.0, top_p=1.0)


def _worker(make_spec) -> ModelWorker:
    return ModelWorker("actor", make_spec("llama", vocab=24), {"kind": "random"}, seed=5)


@pytest.mark.parametrize("kv", [False, True], ids=["prefill", "kv"])
def test_a_tail_handed_back_and_continued_in_any_order_gives_the_unmigrated_rows(make_spec, kv):
    want = _worker(make_spec).generate(PROMPTS, logprobs=True, **GEN)
    worker = _worker(make_spec)
    out = list(worker.generate_chunks(PROMPTS, chunk=2, split=True, tail_below=4, tail_kv=kv, logprobs=True, **GEN))
    carry = [x for x in out if isinstance(x, CarryOver)]
    chunks = [x for x in out if not isinstance(x, CarryOver)]
    assert len(carry) == 1 and 1 <= len(carry[0].samples) <= 3   # stopped with fewer than 4 rows decoding
    tail = sorted(carry[0].samples, key=lambda c: -c["row"])     # handed on out of batch order
    assert all({"key", "row", "width_p"} <= set(c) for c in tail)
    assert all(("state" in c) == kv for c in tail)                # the KV cache moves with the row, or not
    chunks += list(worker.generate_chunks([], chunk=2, carry=tail, logprobs=True, **GEN))
    got = merge_rollouts(chunks)
    assert got.rows == list(range(len(PROMPTS))) and got.prompts == want.prompts
    lengths = want.batch.response_lengths
    assert torch.equal(got.batch.response_lengths, lengths)
    for row in range(len(PROMPTS)):
        n = int(lengths[row])
        assert got.batch.responses[row, :n].tolist() == want.batch.responses[row, :n].tolist(), row
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-4)
