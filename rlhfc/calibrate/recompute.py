"""Calibration probes the recompute pass prices with (``rlhfc profile``'s ``host.kind_bw`` and ``host.recompute``):
the memory-bound op kinds' bytes/s, what a fresh large output costs, and the checkpoint's own costs. Split out
of :mod:`rlhfc.calibrate`, which calls them from ``measure_host``; torch is imported only when measuring."""

from __future__ import annotations

import time

from rlhfc.calibrate import _timeit


def measure_kinds(dtype, device: str = "cpu") -> dict[str, float]:
    """Bytes/s of the memory-bound op kinds the recompute pass prices (rlhfc.passes.recompute_trace.op_kind)
    — on a CPU at one thread, in CPU time (the pass scales them by the worker's thread speed-up) —
    on a tensor the size of a block's attention scores at 1024 tokens (8 heads x 1024 x 1024: larger than a
    CPU's caches, as the s x s ops a recompute replays are): a softmax, an elementwise product and a copy (bytes
    read + written over seconds), each writing into a buffer it reuses — the bandwidth alone; what a *fresh*
    output costs on top is :func:`measure_fresh_bytes`."""
    import torch

    x = torch.randn(8, 1024, 1024, device=device).to(dtype)
    y = torch.randn_like(x)
    z = torch.empty_like(x)
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    size = x.numel() * x.element_size()
    probes = {"softmax": (lambda: (torch.ops.aten._softmax.out(x, -1, False, out=z), sync()), 2 * size),
              "elementwise": (lambda: (torch.mul(x, y, out=z), sync()), 3 * size),
              "copy": (lambda: (z.copy_(x), sync()), 2 * size)}
    if device != "cpu":
        return {k: moved / _timeit(fn, 10) for k, (fn, moved) in probes.items()}
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {k: moved / _cpu_time(fn, 5) for k, (fn, moved) in probes.items()}
    finally:
        torch.set_num_threads(old)


def _cpu_time(fn, reps: int) -> float:
    """The least CPU time of ``reps`` calls after a warm-up: kernel time (page faults) included, other
    processes' turns on a shared machine not (what a wall clock would add)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


#: sizes of the fresh-output probe, 32 and 64 MiB (the pass prices an output at the rate of the largest size not
#: above it, a smaller one free): glibc's largest mmap threshold on 64-bit Linux is 32 MiB, so allocations of that
#: size and more are mapped afresh every time; smaller ones come from the heap the process already touched (on
#: the benchmark's block only the four 32 MiB outputs a replay recreates add page faults, none of the 1-3 MiB
#: ones), and a probe of them reads the heap's history, not what a training step pays
FRESH_SIZES = (2 ** 25, 2 ** 26)


def measure_fresh_bytes(sizes=FRESH_SIZES, reps: int = 3, resident: int = 256 << 20) -> list[list[float]]:
    """CPU: seconds per byte a freshly allocated output of each size costs beyond writing it, ``[[bytes,
    s/byte], ...]``: an elementwise product into a new tensor (freed after) minus the same into a reused one,
    beside ``resident`` bytes in use (a training process holds weights, optimizer state and other blocks'
    activations, and a page fault costs more in a larger process: 263 ps/byte alone, 312 with 384 MiB
    resident on the 2-core VM of docs/benchmarks.md). Each the least CPU time (one thread; page faults are
    kernel time, which CPU time counts and a wall clock on a shared machine would inflate with other processes'
    turns) of ``reps`` after a warm-up. Large allocations come from the OS (glibc maps blocks of 32 MiB and more
    afresh every time) and each of their pages faults on first touch, about a microsecond per 4 KiB page — a
    recomputed s x s attention op pays it again in backward (:data:`FRESH_SIZES`). The recompute pass adds
    ``bytes x s/byte`` (of the largest measured size not above it) to each op that allocates."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    held = torch.ones(max(1, resident // 4))
    out = []
    try:
        for n in sizes:
            x = torch.ones(n // 4)
            y = torch.ones_like(x)
            z = torch.empty_like(x)
            fresh = _cpu_time(lambda: torch.mul(x, y), reps)
            reused = _cpu_time(lambda: torch.mul(x, y, out=z), reps)
            out.append([float(n), max(0.0, fresh - reused) / n])
            del x, y, z
    finally:
        torch.set_num_threads(old)
        del held
    return out


def measure_checkpoint(reps: int = 5) -> dict[str, float]:
    """CPU seconds a checkpointed block pays beyond its recomputed ops, on a tiny llama block (eager attention,
    one thread; the runtime's own checkpoint, :mod:`rlhfc.runtime.recompute`):

    - ``ckpt_op_s``: per aten call seen by a selective checkpoint's policy (Python dispatch on every op of the
      forward and of the replay): a block that keeps every op's output (nothing recomputed) trains slower
      than plain autograd by this times the calls it dispatches (its forward's and the replay's, until the
      last op that saves);
    - ``ckpt_region_s``: per checkpointed block, what a full checkpoint costs beyond replaying its forward
      (saving its input, the backward's recompute hook); a selective one pays it too, ``ckpt_op_s`` on top.

    Each is the fastest of ``reps`` forward+backward runs (after a warm-up) minus the baseline's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhfc.runtime.models import build_model
    from rlhfc.runtime.recompute import apply_recompute, blocks, op_key

    model = build_model(dict(arch="llama", layers=1, hidden=64, heads=4, vocab=32, attn="eager"), seed=0)
    model.train()
    ids = torch.randint(3, 30, (1, 64), generator=torch.Generator().manual_seed(0))
    block = blocks(model)[0]
    seen, keys = {}, []
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        model(ids, torch.ones_like(ids))
    hook.remove()
    args = (seen["a"][0].detach().requires_grad_(True), *seen["a"][1:])

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            keys.append(op_key(func, sum(k.startswith(str(func)[5:] + "#") for k in keys)))
            return func(*a, **(kw or {}))

    with Calls():
        block(*args, **seen["k"])

    def step():
        block(*args, **seen["k"])[0].sum().backward()

    def forward():
        block(*args, **seen["k"])

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, fwd = _cpu_time(step, reps), _cpu_time(forward, reps)
        apply_recompute(model, {"policy": "ops", "save": keys})
        kept_all = _cpu_time(step, reps)
        apply_recompute(model, {"policy": "full"})
        full = _cpu_time(step, reps)
    finally:
        apply_recompute(model, None)
        torch.set_num_threads(old)
    region = max(0.0, full - plain - fwd)
    return {"ckpt_op_s": max(0.0, kept_all - plain - region) / (2 * len(keys)), "ckpt_region_s": region}
