"""Passes over the IR: base class, registry, manager and the -O pipelines.

Built-in passes live one per file and are imported lazily by name.
"""

from .base import (Pass, get_pass, load_plugin, parse_pipeline, register_lazy, register_pass, registered_passes,
                   unregister_pass)
from .manager import PassFailure, PassManager, PassRecord
from .pipelines import PIPELINES, pipeline_for

for _name, _module in {
    "dce": "rlhfc.passes.dce",
    "async_rollout": "rlhfc.passes.async_rollout",
    "unpad": "rlhfc.passes.unpad",
    "engine": "rlhfc.passes.engine",
    "reuse_logprobs": "rlhfc.passes.reuse_logprobs",
    "parallelize": "rlhfc.passes.parallelize",
    "stream": "rlhfc.passes.stream",
    "tail_migrate": "rlhfc.passes.tail_migrate",
    "fuse_training": "rlhfc.passes.fuse_training",
    "overcommit": "rlhfc.passes.overcommit",
    "placement": "rlhfc.passes.placement",
    "realloc": "rlhfc.passes.realloc",
    "recompute": "rlhfc.passes.recompute",
    "offload": "rlhfc.passes.offload",
    "threads": "rlhfc.passes.threads",
}.items():
    register_lazy(_name, _module)

__all__ = ["Pass", "PassManager", "PassRecord", "PassFailure", "register_pass", "unregister_pass",
           "registered_passes", "get_pass",
           "parse_pipeline", "load_plugin", "PIPELINES", "pipeline_for"]
