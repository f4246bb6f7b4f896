"""Final answers out of responses, for verifiable rewards: extractors and number parsing.

A rule stage's ``extract`` option (``rule("...", roll, extract = "last_number")``) names how the answer is
cut out of each response before the rule function sees it as ``response``; when nothing is found the rule
sees ``""``. The extractors:

* ``""`` (the default) — the whole response, unchanged.
* ``strip``        — the response without leading and trailing whitespace.
* ``first_line``   — the first non-blank line, stripped.
* ``last_line``    — the last non-blank line, stripped.
* ``first_number`` — the first number (``-12``, ``3.5``, ``1,000``; commas dropped).
* ``last_number``  — the last number (GSM8K style: the answer is the number a solution ends with).
* ``boxed``        — the text inside the last ``\\boxed{...}`` (braces inside balanced).
* ``after:MARK``   — the stripped text after the last ``MARK``, e.g. ``after:####`` or ``after:Answer:``.
* ``re:PATTERN``   — the first match of the regular expression: its first group if it has one, else the
  whole match.

:func:`extract_problem` says why a spec is not one of these (the compiler reports it at ``check`` time).
"""

from __future__ import annotations

import math
import re

__all__ = ["EXTRACTORS", "extract_answer", "extract_problem", "parse_number"]

#: the extractors named by a word (``after:`` and ``re:`` take an argument)
EXTRACTORS = ("strip", "first_line", "last_line", "first_number", "last_number", "boxed")

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")


def extract_problem(spec: str) -> str | None:
    """Why ``spec`` names no extractor, or None."""
    if spec in ("", *EXTRACTORS):
        return None
    if spec.startswith("after:"):
        return None if spec[len("after:"):] else "after: needs the text that precedes the answer, e.g. after:####"
    if spec.startswith("re:"):
        try:
            re.compile(spec[3:])
        except re.error as e:
            return f"re:{spec[3:]} is not a regular expression ({e})"
        return None if spec[3:] else "re: needs a pattern, e.g. re:answer is (\\d+)"
    return (f"unknown extractor {spec!r}; extractors: {', '.join(EXTRACTORS)}, after:MARK, re:PATTERN")


def extract_answer(response: str, spec: str) -> str:
    """The answer ``spec`` cuts out of ``response`` (``""`` when there is none)."""
    if spec == "":
        return response
    if spec == "strip":
        return response.strip()
    if spec in ("first_line", "last_line"):
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        return (lines[0] if spec == "first_line" else lines[-1]) if lines else ""
    if spec in ("first_number", "last_number"):
        found = _NUMBER.findall(response)
        return (found[0] if spec == "first_number" else found[-1]).replace(",", "") if found else ""
    if spec == "boxed":
        return _last_boxed(response)
    if spec.startswith("after:"):
        mark = spec[len("after:"):]
        at = response.rfind(mark)
        return response[at + len(mark):].strip() if at >= 0 else ""
    if spec.startswith("re:"):
        m = re.search(spec[3:], response)
        if m is None:
            return ""
        return (m.group(1) if m.re.groups else m.group(0)) or ""
    raise ValueError(extract_problem(spec))


def _last_boxed(text: str) -> str:
    at = text.rfind("\\boxed{")
    if at < 0:
        return ""
    depth, start = 1, at + len("\\boxed{")
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return ""   # unbalanced: no answer


def parse_number(text) -> float | None:
    """``text`` as a number (an int or float value, or a string such as ``" 1,000 "``, ``"-3.5"``, ``"3/4"``),
    or None when it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text) if math.isfinite(text) else None
    if not isinstance(text, str):
        return None
    t = text.strip().replace(",", "")
    if t.endswith("."):
        t = t[:-1]
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(t)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None
