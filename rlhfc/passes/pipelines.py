"""The -O levels: which passes run, in order. Defined here and nowhere else.

| level | meaning |
| ----- | ------- |
| O0    | no passes: the program runs exactly as written, one stage at a time |
| O1    | cleanups that cannot change results |
| O2    | O1 + the exact performance passes (padding removal, log-prob reuse, overlap, placement, reallocation) |
| O3    | O2 + passes that change which samples a step trains on (opt-in) |

Placement runs last so its search prices plans with the overlap decisions
(overlap groups, streaming, overcommitment) already in the IR.
"""

from __future__ import annotations

from rlhfc.ir import error

from .base import Pass, parse_pipeline

PIPELINES: dict[str, list[str]] = {
    "O0": [],
    "O1": ["dce"],
    "O2": ["dce", "unpad", "reuse_logprobs", "parallelize", "stream", "placement", "realloc"],
    "O3": ["dce", "unpad", "reuse_logprobs", "parallelize", "stream", "overcommit", "placement", "realloc"],
}


def pipeline_for(level: str) -> list[Pass]:
    """The configured passes of an -O level (``"O2"``, ``"o2"`` or ``"2"``)."""
    text = str(level).strip()
    key = text.upper() if text[:1] in ("O", "o") else f"O{text}"
    if key not in PIPELINES:
        raise error(f"unknown optimisation level '{level}'", None,
                    f"levels: {', '.join(PIPELINES)} (-O0 … -O{len(PIPELINES) - 1})")
    return parse_pipeline(",".join(PIPELINES[key]))
