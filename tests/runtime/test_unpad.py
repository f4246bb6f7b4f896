"""The runtime side of the ``unpad`` pass: cropped rollouts, merging chunks of different widths,
and minibatches cut to their longest response."""

from __future__ import annotations

import torch

from rlhfc.runtime.data.values import Rollout, TokenValues, merge_parts, merge_rollouts
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.rollout.generation import FinishedSample, collate, response_logprobs
from rlhfc.runtime.train.packing import crop_padding

SPEC = dict(arch="gpt2", layers=1, hidden=32, heads=2, vocab=16, max_seq=64, head="lm")


def _samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate([3, 9, 1, 5, 12, 2]):
        prompt = tuple(int(x) for x in torch.randint(3, 16, (2 + i % 3,), generator=g))
        resp = tuple(int(x) for x in torch.randint(3, 16, (n,), generator=g))
        out.append(FinishedSample(i, (1,) + prompt, resp, False, n - 1))
    return out


def _rollout(samples, p, width=None):
    batch = collate(samples, 0, prompt_len=p, response_width=width)
    return Rollout(batch, ["x"] * len(samples), ["y"] * len(samples), "actor", 0, "tok",
                   [s.index for s in samples], [0] * len(samples))


def test_cropped_chunks_merge_to_the_padded_batch_cut_to_its_longest_response():
    samples = _samples()
    p = max(len(s.prompt_ids) for s in samples)
    full = _rollout(samples, p, width=20)
    chunks = [_rollout(samples[i:i + 2], p) for i in (4, 0, 2)]     # finish order, each its own width
    assert [c.batch.response_width for c in chunks] == [12, 9, 5]
    merged = merge_rollouts(chunks)
    r = 12
    assert merged.rows == list(range(6))
    assert torch.equal(merged.batch.input_ids, full.batch.input_ids[:, : p + r])
    assert torch.equal(merged.batch.attention_mask, full.batch.attention_mask[:, : p + r])
    assert torch.equal(merged.batch.response_mask, full.batch.response_mask[:, :r])
    parts = [TokenValues(torch.ones(c.size, c.batch.response_width) * c.batch.response_mask, c.batch.response_mask)
             for c in chunks]
    tv = merge_parts(parts, chunks)
    assert tv.values.shape == (6, r) and torch.equal(tv.values, full.batch.response_mask[:, :r].float())


def test_cropped_logprobs_equal_the_padded_ones_to_rounding():
    model = build_model(SPEC, seed=0)
    samples = _samples()
    p = max(len(s.prompt_ids) for s in samples)
    full, cropped = collate(samples, 0, prompt_len=p, response_width=40), collate(samples, 0, prompt_len=p)
    with torch.no_grad():
        a, b = response_logprobs(model, full), response_logprobs(model, cropped)
    assert cropped.response_width == 12
    torch.testing.assert_close(a[:, :12], b, rtol=0, atol=1e-5)
    assert torch.count_nonzero(a[:, 12:]) == 0


def test_crop_padding_cuts_every_response_aligned_tensor():
    samples = _samples()[:4]          # longest response 9
    p = max(len(s.prompt_ids) for s in samples)
    batch = collate(samples, 0, prompt_len=p, response_width=20).as_dict()
    batch["advantages"] = torch.randn(4, 20)
    batch["old_logp"] = torch.randn(4, 20)
    out = crop_padding(batch)
    assert out["input_ids"].shape == (4, p + 9) and out["attention_mask"].shape == (4, p + 9)
    assert out["response_mask"].shape == out["advantages"].shape == out["old_logp"].shape == (4, 9)
    assert torch.equal(out["advantages"], batch["advantages"][:, :9])
    assert torch.equal(out["response_lengths"], batch["response_lengths"]) and out["prompt_len"] == p
    again = crop_padding(out)
    assert all(torch.equal(again[k], out[k]) for k in out if isinstance(out[k], torch.Tensor))

