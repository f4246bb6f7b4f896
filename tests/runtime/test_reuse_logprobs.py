"""Log-probs kept from sampling (the reuse_logprobs pass) equal a fresh forward's, up to float rounding."""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import CarryOver, merge_rollouts
from rlhfc.runtime.worker.base import ModelWorker

PROMPTS = [f"prompt {i} " * (1 + i % 3) for i in range(10)]


def _worker(make_spec, arch):
    return ModelWorker("actor", make_spec(arch, vocab=16), {"kind": "random"}, seed=3)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_forward(make_spec, arch, temperature):
    w = _worker(make_spec, arch)
    roll = w.generate(PROMPTS, max_new_tokens=24, temperature=temperature, top_p=1.0, logprobs=True)
    assert roll.logprobs is not None and roll.logprobs.shape == roll.mask.shape
    fresh = w.logprobs(roll, temperature=temperature)
    assert torch.all(roll.logprobs[roll.mask == 0] == 0) and torch.all(roll.logprobs[roll.mask == 1] < 0)
    torch.testing.assert_close(roll.logprobs, fresh.values, rtol=0, atol=1e-5)
    # without the flag nothing is kept, and sampling is unchanged
    again = _worker(make_spec, arch).generate(PROMPTS, max_new_tokens=24, temperature=temperature, top_p=1.0)
    assert again.logprobs is None and torch.equal(again.batch.input_ids, roll.batch.input_ids)


def test_streamed_chunks_and_carried_samples_keep_logprobs_of_the_current_weights(make_spec, arch):
    """Carried (resumed) samples get their partial tokens' log-probs from the prefill under the current
    weights, so the whole response's log-probs match a forward with the weights that finish it."""
    w = _worker(make_spec, arch)
    out = list(w.generate_chunks(PROMPTS, chunk=3, max_new_tokens=24, temperature=1.0, top_p=1.0, take=6,
                                 unpad=True, logprobs=True))
    carry = out[-1]
    assert isinstance(carry, CarryOver) and carry.samples
    first = merge_rollouts(out[:-1])
    torch.testing.assert_close(first.logprobs, w.logprobs(first).values, rtol=0, atol=1e-5)
    with torch.no_grad():                      # "train": the carried samples resume under new weights
        for p in w.model.parameters():
            p.mul_(1.05)
    w.version += 1
    out = list(w.generate_chunks(PROMPTS[:4], chunk=4, max_new_tokens=24, temperature=1.0, top_p=1.0,
                                 take=8, carry=carry.samples, unpad=True, logprobs=True))
    second = merge_rollouts([x for x in out if not isinstance(x, CarryOver)])
    assert min(second.born) < second.version                  # some rows were carried over
    torch.testing.assert_close(second.logprobs, w.logprobs(second).values, rtol=0, atol=1e-5)
