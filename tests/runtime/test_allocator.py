"""A CPU worker keeps the memory a step frees (rlhfc.runtime.worker.allocator): a step's large activations stop faulting
their pages in again every step. Measured in fresh processes, so the settings of this one do not matter."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="glibc only")

# allocate and free a 64 MiB tensor (above glibc's largest mmap threshold) after a warm-up; count minor faults
LOOP = """
import json, resource, sys
import torch
from rlhfc.runtime.worker.allocator import retain_freed_memory, retaining
on = retain_freed_memory() if sys.argv[1] == "call" else False
for _ in range(4):                       # the heap grows to hold it (two rounds here)
    torch.ones(16 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(16 << 20)
print(json.dumps({"on": on, "retaining": retaining(),
                  "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

PAGES = (64 << 20) // 4096


def _run(arg: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", LOOP, arg], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_retained_memory_is_reused_without_page_faults():
    kept = _run("call")
    assert kept["on"] and kept["retaining"]
    assert kept["faults"] < PAGES // 8, kept           # 5 x 64 MiB reused from the heap: almost no faults
    plain = _run("skip")
    assert not plain["retaining"]
    assert plain["faults"] >= 4 * PAGES, plain          # glibc's default: every 64 MiB block mapped afresh


def test_the_opt_out_keeps_glibcs_defaults():
    off = _run("call", RLHFC_RETAIN_MEMORY="0")
    assert not off["on"] and not off["retaining"]
    assert off["faults"] >= 4 * PAGES, off


def test_a_cpu_worker_takes_the_settings():
    code = """
import json
from rlhfc.runtime.worker.allocator import retaining
from rlhfc.runtime.worker.base import ModelWorker
before = retaining()
ModelWorker("m", dict(arch="llama", layers=1, hidden=32, heads=2, vocab=32, max_seq=32), {"kind": "random"}, seed=0)
print(json.dumps([before, retaining()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True]
    # (the profile's side: tests/cost/test_profile.py checks that `rlhfc profile` measured with the settings)
