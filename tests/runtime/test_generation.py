import pytest
import torch

from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.rollout.generation import (
    RolloutBatch,
    collate,
    decode_responses,
    encode_prompts,
    entropy_from_logits,
    generate,
    generate_stream,
    response_logprobs,
    response_logprobs_and_entropy,
    response_values,
    sample_next_token,
    sequence_scores,
)

PROMPTS = [[1, 5, 6, 7], [1, 8], [1, 9, 10, 11, 12, 13], [1, 20, 21]]
EOS, PAD = 2, 0


def _gen(model, seed=0, prompts=PROMPTS, max_new_tokens=12, **kw):
    g = torch.Generator().manual_seed(seed)
    return generate(model, prompts, max_new_tokens, eos_id=EOS, pad_id=PAD, generator=g, **kw)


@pytest.fixture(scope="module")
def small_vocab_policy(make_spec):
    # vocab 8: EOS has probability ~1/8 per step, so response lengths vary a lot.
    return build_model(make_spec("llama", vocab=8), seed=3)


def _check_layout(batch: RolloutBatch, prompts, max_new_tokens):
    b, p = len(prompts), max(len(x) for x in prompts)
    r = batch.response_width
    assert batch.prompt_len == p
    assert batch.input_ids.shape == batch.attention_mask.shape == (b, p + r)
    assert batch.response_mask.shape == (b, r)
    assert r == int(batch.response_lengths.max()) <= max_new_tokens
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        assert batch.input_ids[i, p - n : p].tolist() == prompt
        assert batch.attention_mask[i, : p - n].sum() == 0 and batch.attention_mask[i, p - n : p].all()
        length = int(batch.response_lengths[i])
        assert batch.response_mask[i].tolist() == [1] * length + [0] * (r - length)
        assert torch.equal(batch.attention_mask[i, p:], batch.response_mask[i])
        resp = batch.responses[i].tolist()
        assert all(t == PAD for t in resp[length:])
        assert EOS not in resp[: length - 1]  # EOS can only be the last token
        assert bool(batch.eos[i]) == (resp[length - 1] == EOS)
        assert bool(batch.eos[i]) or length == max_new_tokens


def test_shapes_and_masks(policy):
    batch = _gen(policy)
    _check_layout(batch, PROMPTS, 12)
    assert batch.prompt_token_lists() == PROMPTS


def test_eos_gives_varying_lengths(small_vocab_policy):
    prompts = [[1, 3 + i % 5] for i in range(16)]
    batch = _gen(small_vocab_policy, prompts=prompts, max_new_tokens=20)
    _check_layout(batch, prompts, 20)
    lengths = batch.response_lengths.tolist()
    assert len(set(lengths)) > 3 and batch.eos.any() and min(lengths) < 20


def test_same_seed_same_tokens_other_seed_other_tokens(policy):
    a, b, c = _gen(policy, seed=1), _gen(policy, seed=1), _gen(policy, seed=2)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_mask, b.response_mask)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_generation_does_not_touch_global_rng(policy):
    before = torch.random.get_rng_state()
    _gen(policy)
    assert torch.equal(before, torch.random.get_rng_state())


def _greedy_without_cache(model, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        ids = torch.tensor([seq])
        logits = model.forward_logits(ids, torch.ones_like(ids))
        seq.append(int(logits[0, -1].argmax()))
        if seq[-1] == EOS:
            break
    return seq[len(prompt) :]


@torch.no_grad()
def test_kv_cache_greedy_equals_full_recompute(policy):
    batch = _gen(policy, temperature=0.0, max_new_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        assert batch.response_token_lists()[i] == _greedy_without_cache(policy, prompt, 8)
    # top_k=1 and a tiny top_p are greedy too
    assert torch.equal(_gen(policy, top_k=1, max_new_tokens=8).input_ids, batch.input_ids)
    assert torch.equal(_gen(policy, top_p=1e-6, max_new_tokens=8).input_ids, batch.input_ids)


@torch.no_grad()
def test_kv_cache_logits_equal_full_forward(policy):
    """The log-probs the cached decoder sampled from equal a full forward's."""
    batch = _gen(policy, max_new_tokens=10)
    full = response_logprobs(policy, batch)
    # replay the cached decode with the batch's own tokens
    p = batch.prompt_len
    mask = batch.attention_mask[:, :p]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, cache = policy.decode_step(batch.input_ids[:, :p], mask, pos, None)
    last = pos[:, -1]
    steps = []
    for t in range(batch.response_width):
        steps.append(torch.log_softmax(logits[:, -1], -1).gather(1, batch.responses[:, t : t + 1]).squeeze(1))
        mask = torch.cat([mask, batch.response_mask[:, t : t + 1]], 1)
        last = last + 1
        logits, cache = policy.decode_step(batch.responses[:, t : t + 1], mask, last[:, None], cache)
    cached = torch.stack(steps, 1) * batch.response_mask
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_stream_yields_every_sample_in_finish_order_and_matches_plain(small_vocab_policy):
    prompts = [[1, 3 + i % 5] for i in range(12)]
    g = torch.Generator().manual_seed(4)
    samples = list(generate_stream(small_vocab_policy, prompts, 16, eos_id=EOS, pad_id=PAD, generator=g))
    assert sorted(s.index for s in samples) == list(range(12))
    assert [s.step for s in samples] == sorted(s.step for s in samples)
    for s in samples:
        assert len(s.response_ids) == s.step + 1
    plain = _gen(small_vocab_policy, seed=4, prompts=prompts, max_new_tokens=16)
    streamed = collate(samples, PAD)
    for field in ("input_ids", "attention_mask", "response_mask", "response_lengths", "eos"):
        assert torch.equal(getattr(plain, field), getattr(streamed, field))
    # a chunk collated with the full batch's shape lines up with the same rows of the batch
    first = sorted(samples[:5], key=lambda s: s.index)
    chunk = collate(first, PAD, prompt_len=plain.prompt_len, response_width=plain.response_width)
    sub = plain.select([s.index for s in first])
    assert torch.equal(chunk.input_ids, sub.input_ids) and torch.equal(chunk.response_mask, sub.response_mask)


def test_zero_new_tokens_and_bad_prompts(policy):
    batch = _gen(policy, max_new_tokens=0)
    assert batch.response_width == 0 and batch.response_lengths.sum() == 0
    with pytest.raises(ValueError, match="at least one token"):
        _gen(policy, prompts=[[1], []])


def test_sample_next_token_respects_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0, -5.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next_token(logits, 1.0, top_k=2, generator=g).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 1.0, top_p=0.9, generator=g).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 1.0, top_p=0.3, generator=g).tolist()) == {0}
    assert set(sample_next_token(logits, 0.0).tolist()) == {0}


def test_response_forwards_shapes_and_masking(policy, value_model, score_model):
    batch = _gen(policy, max_new_tokens=10)
    with torch.no_grad():
        logp, ent = response_logprobs_and_entropy(policy, batch)
        values = response_values(value_model, batch)
        scores = sequence_scores(score_model, batch)
        chunked = response_logprobs(policy, batch, micro_batch_size=3)
    shape = batch.response_mask.shape
    assert logp.shape == ent.shape == values.shape == shape and scores.shape == (batch.batch_size,)
    off = batch.response_mask == 0
    assert (logp[off] == 0).all() and (ent[off] == 0).all() and (values[off] == 0).all()
    on = ~off
    assert (logp[on] < 0).all() and (ent[on] > 0).all() and (ent[on] <= torch.log(torch.tensor(96.0)) + 1e-4).all()
    torch.testing.assert_close(chunked, logp, atol=1e-5, rtol=1e-5)


def test_response_logprobs_keep_grad(policy):
    batch = _gen(policy, max_new_tokens=4)
    logp = response_logprobs(policy, batch)
    logp.sum().backward()
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    policy.zero_grad(set_to_none=True)


def test_temperature_scales_logits(policy):
    batch = _gen(policy, max_new_tokens=4)
    with torch.no_grad():
        hot = response_logprobs(policy, batch, temperature=2.0)
        logits = policy.forward_logits(batch.input_ids, batch.attention_mask)[:, batch.prompt_len - 1 : -1] / 2.0
        expect = torch.log_softmax(logits, -1).gather(-1, batch.responses[..., None]).squeeze(-1) * batch.response_mask
    torch.testing.assert_close(hot, expect, atol=1e-5, rtol=1e-5)


def test_entropy_from_logits():
    assert torch.isclose(entropy_from_logits(torch.zeros(7)), torch.log(torch.tensor(7.0)))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])) < 1e-6


def test_text_round_trip(policy):
    tok = CharTokenizer(96)
    texts = ["abc", "hello world"]
    batch = _gen(policy, prompts=encode_prompts(tok, texts), max_new_tokens=5)
    assert [tok.decode(p) for p in batch.prompt_token_lists()] == texts
    responses = decode_responses(tok, batch)
    assert len(responses) == 2 and all(isinstance(r, str) for r in responses)


def test_batch_dict_round_trip_and_select(policy):
    batch = _gen(policy)
    again = RolloutBatch.from_dict(batch.as_dict())
    assert torch.equal(again.input_ids, batch.input_ids) and again.prompt_len == batch.prompt_len
    sub = batch.select([2, 0])
    assert torch.equal(sub.input_ids[1], batch.input_ids[0]) and sub.response_width == batch.response_width


def test_too_long_for_max_seq_is_a_clear_error(make_spec):
    model = build_model(make_spec("gpt2", max_seq=16), 0)
    with pytest.raises(ValueError, match="max_seq"):
        _gen(model, max_new_tokens=12)
    assert _gen(model, max_new_tokens=10).response_width <= 10


def test_a_resumed_row_with_a_small_budget_does_not_walk_past_max_positions():
    """Overcommitment resumes a carried sample from prompt + partial tokens with what is left of its
    budget; while the other rows go on decoding, its (finished) row must not run past max_seq."""
    import torch

    from rlhfc.runtime.models.build import build_model
    from rlhfc.runtime.rollout.generation import generate_stream

    model = build_model(dict(arch="gpt2", layers=1, hidden=32, heads=2, vocab=16, max_seq=40, head="lm"), seed=0)
    long_prefix, short = [1] + [5] * 29, [1, 4, 6]          # 30 + 2 and 3 + 30 tokens: both fit in 40
    out = list(generate_stream(model, [long_prefix, short], 30, eos_id=999, pad_id=0,
                               generator=torch.Generator().manual_seed(0), budgets=[2, 30]))
    assert sorted(len(s.response_ids) for s in out) == [2, 30]


def test_row_streams_sample_the_distribution_and_keep_zero_mass_out():
    from rlhfc.runtime.rollout.generation import row_uniforms

    u = row_uniforms(torch.arange(20000), 3)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u, row_uniforms(torch.arange(20000), 4))   # another step, other draws
    assert torch.equal(u[7:9], row_uniforms(torch.tensor([7, 8]), 3))   # a pure function of (key, step)
    logits = torch.tensor([[3.0, 2.9, -5.0, -5.0, -5.0]]).repeat(4000, 1)
    keys = torch.arange(4000)
    assert set(sample_next_token(logits, 1.0, top_k=2, keys=keys).tolist()) == {0, 1}
    assert set(sample_next_token(logits, 1.0, top_p=0.3, keys=keys).tolist()) == {0}
    drawn = sample_next_token(torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]])).repeat(4000, 1), 1.0, keys=keys)
    freq = torch.bincount(drawn, minlength=4).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1, 0.0], dtype=torch.float64), atol=0.03)


def test_a_row_samples_the_same_tokens_whatever_else_is_in_the_batch(small_vocab_policy):
    """Finished rows leaving the batch (compact) and a row generated in another batch (a data-parallel
    share, a streamed chunk) leave each row's tokens and log-probs as they were."""
    prompts = [[1, 3 + i % 5] + [4] * (i % 3) for i in range(12)]
    keys = [1000 + 17 * i for i in range(12)]

    def run(rows, **kw):
        out = list(generate_stream(small_vocab_policy, [prompts[i] for i in rows], 16, eos_id=EOS, pad_id=PAD,
                                   row_keys=[keys[i] for i in rows], logprob_temperature=1.0, **kw))
        return {rows[s.index]: s for s in out}

    full = run(list(range(12)))
    lengths = sorted(len(s.response_ids) for s in full.values())
    assert lengths[0] < lengths[-1]   # rows finish at different steps: compaction happened
    for other in (run(list(range(12)), compact=False), run([2, 5, 9]), run([11, 0])):
        for row, s in other.items():
            assert s.response_ids == full[row].response_ids, row
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(full[row].logprobs), rtol=1e-5,
                                       atol=1e-5)


@pytest.mark.parametrize("slots", [None, 3])
def test_carried_rows_are_prefilled_apart_from_fresh_prompts(small_vocab_policy, slots):
    """Overcommit's carried rows (prompt + a long partial response, ``resumed``) decode beside fresh prompts
    without padding them: a fresh row is charged its own prompt's width at prefill, not the carried prefix's
    (#40: -O3's generation padding efficiency), and every row samples the tokens it samples alone."""
    fresh = [[1, 3 + i] for i in range(4)]
    carried = [[1, 4] + [5, 6, 3] * 4, [1, 7, 5] + [6, 3] * 5]        # 2-3 prompt tokens + 12 and 10 carried
    prompts, resumed = carried + fresh, [12, 10, 0, 0, 0, 0]
    budgets = [4, 6, 16, 16, 16, 16]
    keys = [500 + 11 * i for i in range(6)]

    def run(rows, **kw):
        out = list(generate_stream(small_vocab_policy, [prompts[i] for i in rows], 16, eos_id=EOS, pad_id=PAD,
                                   row_keys=[keys[i] for i in rows], resumed=[resumed[i] for i in rows],
                                   budgets=[budgets[i] for i in rows], logprob_temperature=1.0, **kw))
        return {rows[s.index]: s for s in out}

    together = run(list(range(6)), slots=slots)
    assert sorted(together) == list(range(6))
    for row in range(6):
        alone = run([row])[row]
        assert together[row].response_ids == alone.response_ids, row
        torch.testing.assert_close(torch.tensor(together[row].logprobs), torch.tensor(alone.logprobs), rtol=1e-5,
                                   atol=1e-5)
    # one token each: nothing decodes after the prefill, so what a row is charged is its prefill width
    first = {s.index: s for s in generate_stream(small_vocab_policy, prompts, 1, eos_id=EOS, pad_id=PAD,
                                                  row_keys=keys, resumed=resumed, budgets=[1] * 6, slots=slots)}
    assert [first[i].computed for i in range(6)] == [14, 14, 2, 2, 2, 2]
