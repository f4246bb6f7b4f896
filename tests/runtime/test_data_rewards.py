import json
import string

import pytest
import torch

from rlhfc.runtime import rewards
from rlhfc.runtime.data.prompts import JsonlPrompts, SyntheticPrompts, prompt_source_from_spec, repeat_each


def test_synthetic_prompts_are_deterministic_lowercase_and_in_range():
    a = SyntheticPrompts(50, min_len=4, max_len=16, seed=0)
    b = SyntheticPrompts(80, min_len=4, max_len=16, seed=0)
    c = SyntheticPrompts(50, min_len=4, max_len=16, seed=1)
    assert a.prompts == b.prompts[:50]  # prompt i depends on (seed, i) only
    assert a.prompts != c.prompts
    assert all(4 <= len(p) <= 16 and set(p) <= set(string.ascii_lowercase) for p in a.prompts)
    assert len({len(p) for p in a.prompts}) > 5
    assert set("".join(SyntheticPrompts(5, 3, 3, alphabet="xy").prompts)) <= {"x", "y"}


def test_cursor_wraps_and_state_round_trips():
    src = SyntheticPrompts(5, 2, 4, seed=3)
    first = src.next_batch(3)
    assert first == src.prompts[:3]
    saved = json.loads(json.dumps(src.state()))
    assert saved == {"epoch": 0, "position": 3, "served": 3}
    wrapped = src.next_batch(4)
    assert wrapped == src.prompts[3:5] + src.prompts[:2]
    assert src.state() == {"epoch": 1, "position": 2, "served": 7}
    other = SyntheticPrompts(5, 2, 4, seed=3)
    other.load_state(saved)
    assert other.next_batch(4) == wrapped


def test_shuffled_cursor_is_reproducible_and_restorable():
    src = SyntheticPrompts(7, 2, 4, seed=0, shuffle=True)
    epochs = [src.next_batch(7) for _ in range(3)]
    assert all(sorted(e) == sorted(src.prompts) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    again = SyntheticPrompts(7, 2, 4, seed=0, shuffle=True)
    assert [again.next_batch(7) for _ in range(3)] == epochs
    again.load_state({"epoch": 1, "position": 3, "served": 10})
    assert again.next_batch(4) == epochs[1][3:]


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "x": 1}\n{"prompt": "c"}\n')
    src = JsonlPrompts(str(path))
    assert src.next_batch(4) == ["a", "b", "c", "a"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        JsonlPrompts(str(bad))
    src = prompt_source_from_spec({"kind": "jsonl", "path": str(path), "field": "prompt"})
    assert len(src) == 3
    assert len(prompt_source_from_spec({"kind": "synthetic", "count": 4, "min_len": 1, "max_len": 2})) == 4
    with pytest.raises(ValueError, match="kind"):
        prompt_source_from_spec({"kind": "csv"})


def test_bad_arguments():
    with pytest.raises(ValueError):
        SyntheticPrompts(0)
    with pytest.raises(ValueError):
        SyntheticPrompts(3, min_len=5, max_len=4)
    with pytest.raises(ValueError):
        SyntheticPrompts(3).next_batch(0)


def test_repeat_each():
    assert repeat_each(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]


@pytest.mark.parametrize(
    "fn,prompt,response,expected",
    [
        (rewards.vowel_count, "x", "", 0.0),
        (rewards.vowel_count, "x", "abcde", 2 / 8),
        (rewards.vowel_count, "x", "aeiouaeiouaa", 1.0),
        (rewards.vowel_fraction, "x", "", 0.0),
        (rewards.vowel_fraction, "x", "abcd", 0.25),
        (rewards.digit_fraction, "x", "a1b2", 0.5),
        (rewards.target_length, "x", "", 0.0),
        (rewards.target_length, "x", "12345678", 1.0),
        (rewards.target_length, "x", "1234", 0.5),
        (rewards.target_length, "x", "x" * 20, 0.0),
        (rewards.prompt_letters, "abc", "aaxd", 0.5),
        (rewards.echo_prompt, "abcd", "abzd!!", 0.75),
        (rewards.echo_prompt, "", "abc", 0.0),
    ],
)
def test_rule_rewards(fn, prompt, response, expected):
    assert fn(prompt, response) == pytest.approx(expected)


def test_resolve_rule_and_rule_scores():
    assert rewards.resolve_rule("rlhfc.runtime.rewards:vowel_count") is rewards.vowel_count
    assert rewards.resolve_rule("digit_fraction") is rewards.digit_fraction
    for bad in ("no.such.module:f", "rlhfc.runtime.rewards:nope", ":f", "rlhfc.runtime.rewards:"):
        with pytest.raises(ValueError):
            rewards.resolve_rule(bad)
    scores = rewards.rule_scores(rewards.vowel_fraction, ["p", "q"], ["aa", "ab"])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.5]
    with pytest.raises(ValueError):
        rewards.rule_scores(rewards.vowel_fraction, ["p"], [])
