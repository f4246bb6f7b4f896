"""Mutation test of the frontend: random edits of the examples never crash the compiler.

Each example is edited at random (delete/insert/duplicate a character, replace a
token with another token of the program or with a keyword, number or string,
swap/delete/duplicate lines, drop a bracket) and compiled with
:func:`rlhfc.frontend.compile_source`. Every outcome must be either a module or a
:class:`~rlhfc.ir.CompileError` whose diagnostics all render, each error with a
location inside the file and a hint. Any other exception is a compiler bug.

The edits come from a seeded ``random.Random``, so a failure reproduces: the
message shows the seed, the example and the edited text.
"""

from __future__ import annotations

import os
import random
import re
import traceback
from pathlib import Path

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, print_module

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))
CHUNKS = 8            # test cases (each with its own seed) ...
EDITS_PER_CHUNK = 500  # ... of this many edited programs: 4000 in all

_TOKEN = re.compile(r'[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?[KMGBT]?|"(?:[^"\\\n]|\\.)*"|\S')
_WORDS = ["cluster", "model", "data", "pipeline", "run", "trainable", "frozen", "true", "false",
          "llama", "gpt2", "hf", "copy", "like", "synthetic", "jsonl", "rule", "gae", "kl_penalty",
          "group_advantages", "ppo_clip", "value_loss", "generate", "logprobs", "values", "score", "train",
          "head", "lm", "value", "size", "layers", "hidden", "heads", "kv_heads", "vocab", "max_seq", "batch",
          "devices", "cpu", "gpu", "nodes", "gpus_per_node", "steps", "seed", "optimize", "O0", "O2", "O7",
          "estimator", "k4", "n", "temperature", "top_p", "lr", "epochs", "clip", "actor", "critic", "ref",
          "reward", "prompts", "roll", "logp", "adv", "ret", "x", "_", "grpo", "rloo", "method", "count",
          "min_len", "max_len", "field", "whiten", "kl_coef", "coef", "checkpoint_every"]
_NUMBERS = ["0", "-1", "1", "2", "3", "5", "64", "0.0", "1.5", "1e-3", "-1e-3", "7B", "8B", "124M", "1.5B", "4K",
            "0K", "0.5K", "99999999999999999999", "1e309", ".5", "2e5", "13B", "-0.0", "0B", "1T"]
_STRINGS = ['""', '"x"', '"a:b"', '"rlhfc.runtime.rewards:vowel_fraction"', '"H100-80GB"', '"V100"', '"cpu"',
            '"."', '".."', '"ppo_tiny.rlhf"', '"/"', '"\\q"', '"\\x41"', '"\\u00e9"', '"é"', '"prompt"',
            '"llama"', '"\\\\"', '"\\n"', '"bad\\']
_CHARS = list("{}()[],;:=.-+*/#\"'\\@$%^&!?<>|~` \t\n") + list("aZ_09eE") + ["é", "\u00a0", "\x00", "\r", "😀"]


def _tokens(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _TOKEN.finditer(text)]


def _mutate_once(text: str, rng: random.Random) -> str:
    op = rng.randrange(12)
    n = len(text)
    if op == 0 and n:                                   # delete a character
        i = rng.randrange(n)
        return text[:i] + text[i + 1:]
    if op == 1:                                         # insert a character
        i = rng.randrange(n + 1)
        return text[:i] + rng.choice(_CHARS) + text[i:]
    if op == 2 and n:                                   # duplicate a character
        i = rng.randrange(n)
        return text[:i] + text[i] + text[i:]
    spans = _tokens(text)
    if op in (3, 4, 5, 6) and spans:                    # replace a token
        a, b = rng.choice(spans)
        if op == 3:
            new = text[slice(*rng.choice(spans))]       # ... with another token of the program
        elif op == 4:
            new = rng.choice(_WORDS)
        elif op == 5:
            new = rng.choice(_NUMBERS)
        else:
            new = rng.choice(_STRINGS)
        return text[:a] + new + text[b:]
    if op == 7 and spans:                               # delete a token
        a, b = rng.choice(spans)
        return text[:a] + text[b:]
    lines = text.split("\n")
    if op == 8 and len(lines) > 1:                      # swap two lines
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if op == 9 and lines:                               # delete a line
        del lines[rng.randrange(len(lines))]
        return "\n".join(lines)
    if op == 10 and lines:                              # duplicate a line
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i])
        return "\n".join(lines)
    brackets = [i for i, c in enumerate(text) if c in "{}()"]
    if brackets:                                        # drop a brace or parenthesis
        i = rng.choice(brackets)
        return text[:i] + text[i + 1:]
    return text


def mutate(text: str, rng: random.Random) -> str:
    """One to three random edits."""
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        text = _mutate_once(text, rng)
    return text


def check_outcome(text: str, file: str) -> tuple[str, str | None]:
    """Compile ``text``: ("ok" | "error", None) if the outcome is acceptable, else ("bug", what went wrong)."""
    try:
        module, warnings = compile_source(text, file)
    except CompileError as exc:
        return _check_error(exc, text, file)
    except Exception:
        return "bug", "crash:\n" + traceback.format_exc()
    try:
        for w in warnings:
            w.render(text)
        print_module(module)
    except Exception:
        return "bug", "crash after a successful compile:\n" + traceback.format_exc()
    return "ok", None


def _check_error(exc: CompileError, text: str, file: str) -> tuple[str, str | None]:
    if not exc.diagnostics:
        return "bug", "CompileError without diagnostics"
    try:
        rendered = exc.render()
    except Exception:
        return "bug", "diagnostics do not render:\n" + traceback.format_exc()
    n_lines = len(text.splitlines()) or 1
    for d in exc.diagnostics:
        if d.severity != "error":
            continue
        if d.loc is None:
            return "bug", f"error without a location: {d.render(text)}"
        if d.loc.file != file or not (1 <= d.loc.line <= n_lines + 1) or d.loc.col < 1:
            return "bug", f"error with a bad location {d.loc}: {d.message}"
        if not d.hint:
            return "bug", f"error without a hint:\n{d.render(text)}"
    if "Traceback" in rendered:
        return "bug", "a traceback in the diagnostics"
    return "error", None


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch):
    # hf()/jsonl() paths resolve against the program's folder, given relative to the current one
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_edits_never_crash(chunk: int):
    rng = random.Random(1000 + chunk)
    sources = [(os.path.relpath(p, ROOT), p.read_text()) for p in EXAMPLES]
    failures = []
    outcomes = {"ok": 0, "error": 0}
    for i in range(EDITS_PER_CHUNK):
        file, original = sources[i % len(sources)]
        text = mutate(original, rng)
        outcome, problem = check_outcome(text, file)
        if outcome == "bug":
            failures.append(f"--- edit {i} of chunk {chunk} ({file}): {problem}\n--- program:\n{text}")
        else:
            outcomes[outcome] += 1
    assert not failures, f"{len(failures)} of {EDITS_PER_CHUNK} edits broke the compiler; first:\n" + \
        "\n".join(failures[:3])
    # the edits must exercise both outcomes, or the test proves little
    assert outcomes["error"] > EDITS_PER_CHUNK // 4 and outcomes["ok"] > 0, outcomes


def test_unedited_examples_compile():
    for p in EXAMPLES:
        assert check_outcome(p.read_text(), os.path.relpath(p, ROOT)) == ("ok", None)
