"""Overcommitted generation (``take``): a step trains on exactly ``take`` samples, the rest carry over."""

from __future__ import annotations

from rlhfc.runtime.data.values import CarryOver, merge_rollouts
from rlhfc.runtime.worker.base import ModelWorker

PROMPTS = [f"p{i}" for i in range(12)]


def _chunks(out):
    assert isinstance(out[-1], CarryOver)
    return merge_rollouts(out[:-1]), out[-1].samples


def test_a_step_takes_exactly_take_samples_when_several_finish_in_the_same_decoding_step(make_spec):
    """With 3 new tokens and a 96-token vocabulary almost every row finishes at the cap, in the same
    decoding step: the step still trains on exactly ``take`` (the earlier rows); the later rows that
    finished in that step are carried, cut before their last token, and finish in the next call."""
    w = ModelWorker("actor", make_spec("llama", vocab=96), {"kind": "random"}, seed=3)
    roll, carry = _chunks(list(w.generate_chunks(PROMPTS, chunk=4, max_new_tokens=3, temperature=1.0,
                                                 top_p=1.0, take=8)))
    assert roll.size == 8 and len(carry) == 4
    assert sorted(roll.rows) == roll.rows[:] == list(range(8))          # ties go to the earlier rows
    assert [c["prompt"] for c in carry] == PROMPTS[8:]
    assert all(len(c["partial"]) == 2 for c in carry)                   # cut before the third token
    # the next call: 4 new prompts + 4 carried, take 8 -> exactly 8 again, carried ones resumed
    roll2, carry2 = _chunks(list(w.generate_chunks(PROMPTS[:4], chunk=4, max_new_tokens=3, temperature=1.0,
                                                   top_p=1.0, take=8, carry=carry)))
    assert roll2.size == 8 and carry2 == []
    resumed = [r for r, p in zip(roll2.responses, roll2.prompts) if p in PROMPTS[8:]]
    assert len(resumed) == 4
    lengths = roll2.batch.response_lengths.tolist()
    assert max(lengths) <= 3                                              # a carried row keeps its budget


def test_without_ties_nothing_changes(make_spec):
    """``take`` equal to the batch: every sample trains, nothing is carried."""
    w = ModelWorker("actor", make_spec("llama", vocab=96), {"kind": "random"}, seed=3)
    roll, carry = _chunks(list(w.generate_chunks(PROMPTS, chunk=4, max_new_tokens=3, temperature=1.0,
                                                 top_p=1.0, take=12)))
    assert roll.size == 12 and carry == []


def test_carried_samples_record_the_weights_version_of_every_token(make_spec):
    """A sample carried into a call made after a train step keeps its partial tokens' version and gets the new
    one for the rest (runs ``[[version, tokens], ...]``); the runs survive merging, row selection and a
    checkpoint's state, and the oldest of them is the rollout's oldest version."""
    import torch

    from rlhfc.runtime.data.values import oldest_version, rollout_from_state, rollout_state, select_rows

    w = ModelWorker("actor", make_spec("llama", vocab=96), {"kind": "random"}, seed=3)
    roll, carry = _chunks(list(w.generate_chunks(PROMPTS, chunk=4, max_new_tokens=3, temperature=1.0,
                                                 top_p=1.0, take=8)))
    assert all(v == [[0, n]] for v, n in zip(roll.versions, roll.batch.response_lengths.tolist()))
    assert [c["versions"] for c in carry] == [[[0, 2]]] * 4
    w.version = 1   # as a train step leaves it
    roll2, _ = _chunks(list(w.generate_chunks(PROMPTS[:4], chunk=4, max_new_tokens=3, temperature=1.0,
                                              top_p=1.0, take=8, carry=carry)))
    lengths = roll2.batch.response_lengths.tolist()
    for prompt, runs, n, born in zip(roll2.prompts, roll2.versions, lengths, roll2.born):
        assert sum(k for _, k in runs) == n
        assert runs == ([[0, 2], [1, n - 2]] if prompt in PROMPTS[8:] else [[1, n]])
        assert born == runs[0][0]
    assert oldest_version(roll2) == 0
    picked = select_rows(roll2, torch.tensor([7, 0]))
    assert picked.versions == [roll2.versions[7], roll2.versions[0]]
    meta, tensors = rollout_state(roll2, "r")
    assert rollout_from_state(meta, tensors, "r").versions == roll2.versions
