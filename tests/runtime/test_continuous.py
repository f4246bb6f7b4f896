"""Continuous batching in the decoding engine: with ``slots = K`` at most K rows decode at once and waiting
prompts join as rows finish; every row samples the tokens it samples without the limit."""

from __future__ import annotations

import pytest
import torch

from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.rollout.decoding import FinishedSample, PartialSample, generate_stream

PROMPTS = [[1] + [3 + (i * 7) % 9] * (1 + i % 5) for i in range(14)]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def long_tail_policy(request, make_spec):
    return build_model(make_spec(request.param, vocab=12), seed=0)   # EOS often: long-tailed lengths


def _run(model, **kw):
    out = list(generate_stream(model, PROMPTS, 30, eos_id=2, pad_id=0, row_keys=list(range(100, 114)),
                               logprob_temperature=1.0, **kw))
    return out


@pytest.mark.parametrize("slots", [1, 4, 9])
def test_rows_sample_the_same_tokens_with_a_slot_limit(long_tail_policy, slots):
    free = {s.index: s for s in _run(long_tail_policy)}
    limited = {s.index: s for s in _run(long_tail_policy, slots=slots)}
    assert sorted(limited) == list(range(len(PROMPTS)))
    lengths = [len(s.response_ids) for s in free.values()]
    assert max(lengths) > 3 * min(lengths)                          # a long tail, or the test proves little
    for i, s in free.items():
        assert limited[i].response_ids == s.response_ids and limited[i].eos == s.eos
        assert limited[i].logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_a_slot_limit_bounds_the_decode_batch_and_later_prompts_join(long_tail_policy):
    sizes = []
    step = long_tail_policy.decode_step

    def counting(ids, mask, pos, cache):
        sizes.append(tuple(ids.shape))      # prefills [rows, prompt width], decode steps [rows, 1]
        return step(ids, mask, pos, cache)

    long_tail_policy.decode_step = counting
    try:
        out = _run(long_tail_policy, slots=4)
    finally:
        long_tail_policy.decode_step = step
    assert max(r for r, _ in sizes) <= 4 and len(out) == len(PROMPTS)
    assert sum(1 for _, w in sizes if w > 1) > 1                    # prompts were prefilled as slots freed
    # every token the engine computed is charged to a sample
    assert sum(s.computed for s in out) == pytest.approx(sum(r * w for r, w in sizes))
    first = {s.index: s.step for s in out}
    assert min(first[i] for i in range(4, len(PROMPTS))) > 0       # later prompts started after decoding began


def test_stop_after_carries_started_and_waiting_rows(long_tail_policy):
    out = list(generate_stream(long_tail_policy, PROMPTS, 30, eos_id=2, pad_id=0, row_keys=list(range(100, 114)),
                               slots=4, stop_after=3))
    done = [s for s in out if isinstance(s, FinishedSample)]
    partial = [s for s in out if isinstance(s, PartialSample)]
    assert len(done) >= 3 and len(done) + len(partial) == len(PROMPTS)
    assert any(s.response_ids == () for s in partial)               # prompts that never started
    assert sorted(s.index for s in out) == list(range(len(PROMPTS)))


def test_budgets_and_resumed_rows_count_their_own_tokens(long_tail_policy):
    budgets = [1 + i % 6 for i in range(len(PROMPTS))]
    free = {s.index: s for s in _run(long_tail_policy, budgets=budgets, resumed=[i % 2 for i in range(14)])}
    limited = {s.index: s for s in _run(long_tail_policy, budgets=budgets, resumed=[i % 2 for i in range(14)],
                                        slots=3)}
    for i, s in free.items():
        assert len(s.response_ids) <= budgets[i]
        assert limited[i].response_ids == s.response_ids
        assert limited[i].logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_a_generation_planned_in_micro_batches_runs_with_slots(make_spec, tmp_path):
    """The plan's micro-batches of a generate stage reach the job as ``slots`` (continuous batching instead of
    waves), and a worker generating with slots samples the tokens it samples without them."""
    import pathlib

    from rlhfc.codegen.emitter import PythonEmitter
    from rlhfc.frontend import load_file
    from rlhfc.runtime.worker.base import ModelWorker

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    m, _, _ = load_file(str(examples / "ppo_tiny.rlhf"))
    m.graph.stage("roll").annotations["microbatches"] = 3
    line = next(x for x in PythonEmitter(m, source=None, opt_level="O0", passes=[]).emit().splitlines()
                if "generate.remote" in x)
    assert "slots=6" in line                                        # ⌈16 / 3⌉

    worker = ModelWorker("actor", make_spec(vocab=12), {"kind": "random"}, 0)
    prompts = [f"p{i}" * (1 + i % 3) for i in range(8)]
    free = worker.generate(prompts, max_new_tokens=20, temperature=1.0, top_p=1.0)
    again = ModelWorker("actor", make_spec(vocab=12), {"kind": "random"}, 0)
    limited = again.generate(prompts, max_new_tokens=20, temperature=1.0, top_p=1.0, slots=3)
    assert torch.equal(free.batch.input_ids, limited.batch.input_ids)


@pytest.mark.parametrize("slots", [None, 4])
def test_rows_moved_with_their_kv_cache_continue_as_if_never_stopped(long_tail_policy, slots):
    """Long-tail migration's KV move: rows stopped by ``stop_after`` hand back their decode state (``carry_kv``)
    and a second call continues them from it (``states``: one decode step over each row's last token, no
    prefill) — the tokens of the uninterrupted run, their log-probs within rounding, as a re-prefill does."""
    free = {s.index: s for s in _run(long_tail_policy)}
    first = list(generate_stream(long_tail_policy, PROMPTS, 30, eos_id=2, pad_id=0, row_keys=list(range(100, 114)),
                                 logprob_temperature=1.0, stop_after=5, carry_kv=True, slots=slots))
    left = [s for s in first if isinstance(s, PartialSample) and s.response_ids]
    assert left and all(s.state is not None and len(s.state["logprobs"]) == len(s.response_ids) for s in left)
    assert not any(s.state for s in first if isinstance(s, PartialSample) and not s.response_ids)
    for moved in (True, False):        # from the KV cache, and by re-prefill
        sizes = []
        step = long_tail_policy.decode_step

        def counting(ids, mask, pos, cache):
            sizes.append(ids.shape[1])
            return step(ids, mask, pos, cache)

        long_tail_policy.decode_step = counting
        try:
            rest = list(generate_stream(
                long_tail_policy, [list(s.prompt_ids) + list(s.response_ids) for s in left], 30, eos_id=2, pad_id=0,
                row_keys=[100 + s.index for s in left], logprob_temperature=1.0,
                budgets=[30 - len(s.response_ids) for s in left], resumed=[len(s.response_ids) for s in left],
                states=[s.state for s in left] if moved else None))
        finally:
            long_tail_policy.decode_step = step
        assert max(sizes) == 1 if moved else max(sizes) > 1          # no prefill when the cache moved
        for s in rest:
            row = left[s.index]
            whole = free[row.index]
            assert row.response_ids + s.response_ids == whole.response_ids and s.eos == whole.eos
            assert s.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


def test_a_state_for_a_row_that_is_not_resumed_is_refused(long_tail_policy):
    with pytest.raises(ValueError, match="only resumed rows"):
        list(generate_stream(long_tail_policy, PROMPTS[:2], 5, eos_id=2, pad_id=0, states=[{"kv": []}, None]))
