"""The -O levels: which passes run, in order. Defined here and nowhere else.

| level | meaning |
| ----- | ------- |
| O0    | no passes: the program runs exactly as written, one stage at a time |
| O1    | cleanups that cannot change results |
| O2    | O1 + the exact performance passes (padding removal, log-prob reuse, overlap, placement, long-tail migration on generating groups, fused pipeline training of two models on the same devices, recompute, optimizer offload where nothing else fits, reallocation, thread counts) |
| O3    | O2 + passes that change which samples a step trains on (opt-in) |

Placement runs last so its search prices plans with the overlap decisions
(overlap groups, streaming, overcommitment) already in the IR.
"""

from __future__ import annotations

from rlhfc.ir.plan import OPT_LEVELS, opt_level

from .base import Pass, parse_pipeline

PIPELINES: dict[str, list[str]] = {
    "O0": [],
    "O1": ["dce"],
    "O2": ["dce", "unpad", "reuse_logprobs", "parallelize", "stream", "placement", "tail_migrate{when=faster}", "fuse_training",
           "recompute", "offload", "realloc", "threads"],
    "O3": ["dce", "unpad", "reuse_logprobs", "parallelize", "stream", "overcommit{when=faster}",
           "async_rollout{when=faster}", "placement", "tail_migrate{when=faster}", "fuse_training", "recompute", "offload", "realloc",
           "threads"],
}
assert tuple(PIPELINES) == OPT_LEVELS, "every -O level of rlhfc.ir.plan.OPT_LEVELS has a pipeline, in order"


def pipeline_for(level: str) -> list[Pass]:
    """The configured passes of an -O level (``"O2"``, ``"o2"`` or ``"2"``; :func:`rlhfc.ir.plan.opt_level`
    names the level or raises the compile error)."""
    return parse_pipeline(",".join(PIPELINES[opt_level(level)]))
