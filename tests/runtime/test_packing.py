"""Token-proportional forwards and training (rlhfc.runtime.train.packing): rows in length groups, each cut to its
own width, give the padded results — forwards within 1e-5, a training step's loss, metrics and gradients
within 1e-5 relative — while computing only a little more than the real tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.rollout.generation import (
    collate,
    generate_stream,
    response_logprobs,
    response_values,
    sequence_scores,
)
from rlhfc.runtime.train import loop
from rlhfc.runtime.train.packing import bucketed, crop_part, crop_rows, length_groups, packed_backward, row_lengths

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def long_tailed(make_spec):
    """A rollout of 12 rows with prompts of 2-7 tokens and responses of 1-40 tokens (per-row budgets)."""
    policy = build_model(make_spec("gpt2"), seed=5)
    prompts = [[1] + [3 + (i * 7 + j) % 50 for j in range(1 + i % 6)] for i in range(12)]
    budgets = [1, 3, 40, 5, 2, 33, 7, 1, 20, 4, 2, 12]
    samples = list(generate_stream(policy, prompts, 40, eos_id=EOS, pad_id=PAD, row_keys=list(range(12)),
                                   budgets=budgets))
    batch = collate(samples, PAD, response_width=40)
    assert batch.response_lengths.min() < 10 and batch.response_lengths.max() >= 20   # really long-tailed
    return policy, batch


def _brute(lengths, cost):
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    best = None
    for cuts in itertools.product([0, 1], repeat=len(order) - 1):
        groups, cur = [], [order[0]]
        for c, i in zip(cuts, order[1:]):
            if c:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        total = sum(len(g) * max(lengths[i] for i in g) + cost for g in groups)
        best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("cost", [0, 8, 40, 10_000])
def test_length_groups_are_optimal_and_cover_every_row(cost):
    lengths = [3, 40, 7, 7, 12, 39, 1, 25]
    groups = length_groups(lengths, cost)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    got = sum(len(g) * max(lengths[i] for i in g) + cost for g in groups)
    assert got == _brute(lengths, cost)
    if cost >= 10_000:
        assert len(groups) == 1


def test_crop_keeps_every_real_token_in_place(long_tailed):
    _, batch = long_tailed
    index = [0, 3, 5]
    sub, cut = batch.select(index), crop_rows(batch, index)
    assert cut.input_ids.shape[1] < sub.input_ids.shape[1]
    assert cut.prompt_token_lists() == sub.prompt_token_lists()
    assert cut.response_token_lists() == sub.response_token_lists()
    assert cut.attention_mask.sum() == sub.attention_mask.sum()


def test_grouped_forwards_equal_padded_ones(long_tailed, make_spec):
    policy, batch = long_tailed
    critic = build_model(make_spec("gpt2", head="value"), seed=6)
    reward = build_model(make_spec("gpt2", head="score"), seed=7)
    computed = sum(len(g) * max(row_lengths(batch)[i] for i in g) for g in length_groups(row_lengths(batch)))
    assert computed < 0.8 * batch.input_ids.numel()   # the groups compute well under the padded rectangle
    with torch.no_grad():
        for fn in (lambda b: response_logprobs(policy, b), lambda b: response_values(critic, b),
                   lambda b: sequence_scores(reward, b)):
            torch.testing.assert_close(bucketed(fn, batch, group_cost=16), fn(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_packed_training_step_equals_padded(long_tailed, loss_agg):
    """Also under a sequence-mean loss (DAPO/GRPO aggregations), where each group weighs by its rows."""
    policy, batch = long_tailed
    part = _policy_part(batch, loss_agg, seed=1)
    loss_fn = loop.actor_loss_fn(entropy_coef=0.01, loss_agg=loss_agg)
    assert crop_part(part, [1, 2])["old_logp"].shape[1] <= batch.response_width

    def grads(run):
        policy.zero_grad(set_to_none=True)
        loss, metrics = run()
        out = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        return float(loss), metrics, out

    loss_a, m_a, g_a = grads(lambda: _padded(policy, part, loss_fn))
    loss_b, m_b, g_b = grads(lambda: packed_backward(policy, part, loss_fn))
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for k in m_a:
        assert m_b[k] == pytest.approx(m_a[k], rel=1e-5, abs=1e-7), k
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], rtol=1e-5, atol=1e-6 * float(g_a[n].abs().max()) + 1e-9)
    policy.zero_grad(set_to_none=True)


def _policy_part(batch, loss_agg: str, seed: int) -> dict:
    """A policy-training minibatch of ``batch``: seeded old log-probs and advantages on its response tokens."""
    g = torch.Generator().manual_seed(seed)
    part = batch.as_dict()
    part["old_logp"] = (torch.randn(batch.response_mask.shape, generator=g) * 0.1 - 2.0) * batch.response_mask
    part["advantages"] = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    part["loss_agg"] = loss_agg
    return part


def _padded(model, part, loss_fn):
    loss, metrics = loss_fn(model, part)
    loss.backward()
    return loss.detach(), metrics


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("packed", [False, True])
def test_micro_batches_accumulate_the_whole_minibatchs_gradient(long_tailed, loss_agg, packed):
    """``train(micro_batch = K)``: pieces of at most K rows (length groups of at most K rows under unpad),
    gradients accumulated: the loss, metrics and gradient of the minibatch in one piece, up to rounding."""
    from rlhfc.runtime.train.packing import accumulate, length_groups, row_lengths

    policy, batch = long_tailed
    part = _policy_part(batch, loss_agg, seed=2)
    loss_fn = loop.actor_loss_fn(entropy_coef=0.01, loss_agg=loss_agg)
    sizes = []

    def counted(model, piece):
        sizes.append(int(piece["response_mask"].shape[0]))
        return loss_fn(model, piece)

    def grads(**kw):
        policy.zero_grad(set_to_none=True)
        loss, metrics = accumulate(policy, part, counted, **kw)
        return float(loss.detach()), metrics, {n: p.grad.clone() for n, p in policy.named_parameters()
                                               if p.grad is not None}

    loss_a, m_a, g_a = grads()
    sizes.clear()
    loss_b, m_b, g_b = grads(packed=packed, micro_batch=3)
    assert len(sizes) >= -(-batch.batch_size // 3) and max(sizes) <= 3
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    for k in m_a:
        assert m_b[k] == pytest.approx(m_a[k], rel=1e-5, abs=1e-7), k
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], rtol=1e-5, atol=1e-6 * float(g_a[n].abs().max()) + 1e-9)
    policy.zero_grad(set_to_none=True)
    assert all(len(x) <= 2 for x in length_groups(row_lengths(batch), max_rows=2))


def test_every_data_parallel_rank_runs_as_many_micro_batches():
    """FSDP ranks must make the same number of forward/backward calls: with ``pieces`` from the smallest
    share, every rank's share of every minibatch runs in that many micro-batches."""
    from rlhfc.runtime.train.packing import accumulate

    def calls(rows, micro, pieces):
        n = []

        def loss_fn(model, piece):
            n.append(int(piece["response_mask"].shape[0]))
            return torch.zeros((), requires_grad=True), {}

        accumulate(None, {"response_mask": torch.ones(rows, 2)}, loss_fn, micro_batch=micro, pieces=pieces)
        return len(n)

    for full in range(2, 13):
        for world in range(1, min(full, 4) + 1):
            for micro in range(1, 7):
                shares = [len(x) for x in torch.tensor_split(torch.arange(full), world)]
                pieces = -(-(full // world) // micro)
                assert len({calls(s, micro, pieces) for s in shares}) == 1, (full, world, micro)
