"""The cost model, the simulator and measured profiles.

- :mod:`~rlhfc.cost.hardware`: device catalog (A100-40GB/80GB, H100-80GB, H200, cpu).
- a stage's mesh and (dp, tp, pp) are read through :mod:`rlhfc.ir.plan` (re-exported here).
- :mod:`~rlhfc.cost.lengths`: prompt and response length distributions (the long tail).
- :mod:`~rlhfc.cost.formulas` / :mod:`~rlhfc.cost.model`: per-stage time and memory.
- :mod:`~rlhfc.cost.sync`: weight sync between two layouts (resharding included).
- :mod:`~rlhfc.cost.simulator` (schedulers in :mod:`~rlhfc.cost.scheduling`): discrete-event simulation of several steps.
- :mod:`~rlhfc.cost.memory`: memory per device; :func:`check_memory` for placement passes.
- :mod:`~rlhfc.cost.quick`: what a placement search asks of each candidate (step time, memory verdict), fast.
- :mod:`~rlhfc.cost.batched`: many candidate layouts at once (NumPy, or JAX when installed).
- :mod:`~rlhfc.cost.profile`: the profile format, loading and fits (measuring is :mod:`rlhfc.calibrate`).

Stability: the names exported here are the public API for passes
(experimental: formulas and defaults may change between minor versions).
Importing this package does not import torch or JAX.
"""

from .batched import candidate_layouts, evaluate, have_jax
from .hardware import CATALOG, DeviceSpec, device_spec
from rlhfc.ir.plan import Layout, overcommit_delta, overlap_group, stage_layout, stream_chunk
from .lengths import LengthDist, response_dist
from .memory import MemoryIssue, check_memory, fits, memory_issues, suggest_layout
from .model import CostConfig, CostModel, StageCost
from .shared import shared_prices
from .profile import Profile, ProfileError, default_profile_path, find_default_profile, load_profile, model_key
from .simulator import SimResult, Task, simulate
from .sync import sync_time
from . import baselines  # noqa: F401,E402 - registers the baselines' cost model (CostModel picks it by strategy)

__all__ = [
    "CATALOG", "DeviceSpec", "device_spec", "Layout", "stage_layout", "overlap_group", "stream_chunk",
    "overcommit_delta", "LengthDist", "response_dist", "CostConfig", "CostModel", "StageCost", "sync_time",
    "simulate", "SimResult", "Task", "check_memory", "memory_issues", "fits", "shared_prices", "MemoryIssue",
    "suggest_layout",
    "evaluate", "candidate_layouts", "have_jax", "Profile", "ProfileError", "load_profile",
    "default_profile_path", "find_default_profile", "model_key",
]
