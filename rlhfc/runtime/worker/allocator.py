"""The host allocator of a CPU worker: memory a step frees stays with the process for the next step.

glibc's malloc hands every allocation of 32 MiB or more (its largest mmap threshold; less while its dynamic
threshold is low) to the kernel as a fresh mapping and unmaps it on free, and trims the heap's top when more
than its trim threshold is free. A training step allocates and frees the same activations every step, so
each step faults every page of them in again: on the 2-core VM of ``docs/benchmarks.md`` a third of a CPU
training step at 1024 tokens was page-fault time (kernel time), and how much depended on the heap's history,
±10-25 % from step to step. PyTorch's CUDA caching allocator keeps freed device memory for reuse; the
CPU-tuning advice for PyTorch is a caching allocator (jemalloc, tcmalloc) for the same reason. This module
asks glibc for the equivalent through ``mallopt``: no mmap for large blocks (they come from the heap, reused
once freed), no trimming, and heap growth in 64 MiB steps. A worker's resident memory then stays at its peak,
as a GPU worker's reserved memory does.

:func:`retain_freed_memory` is called by every CPU worker at start (:class:`rlhfc.runtime.worker.base.ModelWorker`)
and by ``rlhfc profile`` before it measures, so the profile prices what a worker pays. Set
``RLHFC_RETAIN_MEMORY=0`` to keep glibc's defaults (memory given back to the OS, page faults every step).
Elsewhere than glibc (macOS, musl) it does nothing.

Nothing here imports compiler code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["retain_freed_memory", "retaining"]

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_TOP_PAD = 64 << 20

_state = {"retaining": False}


def retaining() -> bool:
    """Whether this process asked glibc to keep freed memory (:func:`retain_freed_memory` succeeded)."""
    return _state["retaining"]


def retain_freed_memory() -> bool:
    """Ask glibc's malloc to keep what the process frees for its next allocations (see the module docstring).
    Returns whether it is in effect: False where the C library is not glibc or ``RLHFC_RETAIN_MEMORY=0``.
    Idempotent; blocks mapped before the call are unmapped as before when freed."""
    if _state["retaining"]:
        return True
    if os.environ.get("RLHFC_RETAIN_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return False                       # not glibc: its mallopt parameters mean something else, or nothing
        ok = (libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1
              and libc.mallopt(_M_TOP_PAD, _TOP_PAD) == 1)
    except OSError:
        return False
    _state["retaining"] = bool(ok)
    return _state["retaining"]
