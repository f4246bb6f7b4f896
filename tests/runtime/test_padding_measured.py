"""Padding efficiency as the runtime measures it: generation charges each sample the tokens computed for it
(its padded prompt, its share of each decode step's batch), and the metrics row reports generation's and the
forwards' efficiency."""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.data.values import Rollout
from rlhfc.runtime.driver.metrics import padding_efficiency
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.rollout.generation import FinishedSample, collate, generate_stream
from rlhfc.runtime.train.packing import computed_tokens, length_groups, row_lengths


def test_generation_charges_add_up_to_the_tokens_decoding_computed(make_spec):
    model = build_model(make_spec(vocab=12), seed=0)   # a small vocabulary: EOS often, long tails
    calls = []
    step = model.decode_step

    def counting(ids, mask, pos, cache):
        calls.append(ids.shape[0] * ids.shape[1])
        return step(ids, mask, pos, cache)

    model.decode_step = counting
    prompts = [[1] + [3 + i % 5] * (2 + i % 4) for i in range(12)]
    out = list(generate_stream(model, prompts, 40, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(0)))
    assert all(isinstance(s, FinishedSample) for s in out)
    assert sum(s.computed for s in out) == pytest.approx(sum(calls))
    lengths = [len(s.response_ids) for s in out]
    assert max(lengths) > 2 * min(lengths)                       # the tail this is about
    assert sum(calls) < len(prompts) * (max(len(p) for p in prompts) + max(lengths))   # rows left the batch


def test_metrics_report_generation_and_forward_padding_efficiency(make_spec):
    model = build_model(make_spec(vocab=12), seed=0)
    prompts = [[1] + [3 + i % 5] * (2 + i % 4) for i in range(12)]
    out = list(generate_stream(model, prompts, 40, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(1)))
    batch = collate(sorted(out, key=lambda s: s.index), 0)
    roll = Rollout(batch, ["p"] * 12, ["r"] * 12, "actor", 0, "char:12", computed_tokens=sum(s.computed for s in out))
    padded = padding_efficiency(roll)
    roll.unpad = True
    grouped = padding_efficiency(roll)
    real = float(batch.prompt_lengths.sum() + batch.response_lengths.sum())
    assert padded["pad_eff_forward"] == pytest.approx(real / (12 * (batch.prompt_len + batch.response_width)))
    groups = length_groups(row_lengths(batch))
    assert computed_tokens(batch, True) == sum(
        len(g) * (max(batch.prompt_lengths[g].tolist()) + max(batch.response_lengths[g].tolist())) for g in groups)
    assert grouped["pad_eff_forward"] > padded["pad_eff_forward"]
    assert 0 < padded["pad_eff_generate"] <= 1



