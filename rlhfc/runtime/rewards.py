"""Rule rewards: deterministic ``fn(prompt: str, response: str) -> float``.

A pipeline names one as ``rule("module:function")``; ``resolve_rule`` imports it
and ``rule_scores`` applies it to a batch. The built-in rules (all in [0, 1],
all 0 for an empty response unless stated):

* ``vowel_count``     ``min(#vowels in response, 8) / 8``: the recommended reward
  for ``SyntheticPrompts``; a random 2-layer width-64 policy starts near 0.17
  and PPO lifts it to about 0.4-0.6 within 20-40 steps on CPU (no length shortcut:
  a short response cannot score high).
* ``vowel_fraction``  share of response characters in ``aeiou``.
* ``digit_fraction``  share of response characters in ``0123456789``.
* ``target_length``   ``max(0, 1 - |len(response) - 8| / 8)``: 1 at exactly
  8 characters (an empty response scores 0).
* ``prompt_letters``  share of response characters that also occur in the prompt.
* ``echo_prompt``     share of the prompt's positions where the response has the
  same character (response compared position by position with the prompt).

Responses are the decoded texts (special tokens such as EOS removed).
"""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch

__all__ = [
    "vowel_count",
    "vowel_fraction",
    "digit_fraction",
    "target_length",
    "prompt_letters",
    "echo_prompt",
    "resolve_rule",
    "rule_scores",
]

RuleFn = Callable[[str, str], float]

VOWELS = frozenset("aeiou")
DIGITS = frozenset("0123456789")
TARGET_LENGTH = 8
VOWEL_CAP = 8


def vowel_count(prompt: str, response: str) -> float:
    """Number of lowercase vowels in the response, capped at 8, divided by 8."""
    return min(sum(c in VOWELS for c in response), VOWEL_CAP) / VOWEL_CAP


def vowel_fraction(prompt: str, response: str) -> float:
    """Share of response characters that are lowercase vowels."""
    if not response:
        return 0.0
    return sum(c in VOWELS for c in response) / len(response)


def digit_fraction(prompt: str, response: str) -> float:
    """Share of response characters that are decimal digits."""
    if not response:
        return 0.0
    return sum(c in DIGITS for c in response) / len(response)


def target_length(prompt: str, response: str, target: int = TARGET_LENGTH) -> float:
    """1 at ``len(response) == target``, falling linearly to 0 at 0 and 2 * target."""
    return max(0.0, 1.0 - abs(len(response) - target) / target)


def prompt_letters(prompt: str, response: str) -> float:
    """Share of response characters that occur somewhere in the prompt."""
    if not response:
        return 0.0
    allowed = set(prompt)
    return sum(c in allowed for c in response) / len(response)


def echo_prompt(prompt: str, response: str) -> float:
    """Share of prompt positions i with ``response[i] == prompt[i]`` (0 for an empty prompt)."""
    if not prompt:
        return 0.0
    return sum(1 for a, b in zip(prompt, response) if a == b) / len(prompt)


def resolve_rule(ref: str) -> RuleFn:
    """Import ``"package.module:function"``; a bare name looks in this module."""
    module_name, sep, attr = ref.partition(":")
    if not sep:
        module_name, attr = __name__, ref
    if not module_name or not attr:
        raise ValueError(f"a rule reference is 'module:function', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rule {ref!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rule {ref!r}: module {module_name!r} has no function {attr!r}")
    return fn


def rule_scores(fn: RuleFn, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
    """``fn`` applied pairwise -> float32 tensor [B] (on CPU)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return torch.tensor([float(fn(p, r)) for p, r in zip(prompts, responses)], dtype=torch.float32)
