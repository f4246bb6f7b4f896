"""Calibration probes the recompute pass prices with (``rlhfc profile``'s ``host.kind_bw`` and ``host.recompute``):
the memory-bound op kinds' bytes/s, what a fresh large output costs, and the checkpoint's own costs. Split out
of :mod:`rlhfc.calibrate`, which calls them from ``measure_host``; torch is imported only when measuring."""

from __future__ import annotations

import statistics
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
    finally:
        torch.set_num_threads(old)
        del held
    return out


#: the block :func:`measure_checkpoint` times when it is given none: a tiny llama block (eager attention)
TINY_BLOCK = dict(arch="llama", layers=1, hidden=64, heads=4, vocab=32, attn="eager")


def measure_checkpoint(reps: int = 5, spec: dict | None = None, rows: int = 1, seq: int = 64) -> dict[str, float]:
    """CPU seconds a checkpointed block pays beyond its recomputed ops, on one block of ``spec`` (a runtime
    model spec; default :data:`TINY_BLOCK`, what ``rlhfc profile`` measures) at a micro-batch of ``rows x seq``
    tokens, one thread, the runtime's own checkpoint (:mod:`rlhfc.runtime.models.recompute`):

    - ``ckpt_op_s``: per aten call seen by a selective checkpoint's policy (Python dispatch on every op of the
      forward and of the replay, and the outputs it caches): a block that keeps every op's output (nothing
      recomputed) trains slower than plain autograd by this times the calls it dispatches (its forward's and
      the replay's, until the last op that saves);
    - ``ckpt_region_s``: per checkpointed block, what a full checkpoint costs beyond replaying its forward
      (saving its input, the backward's recompute hook, the replay's allocations); a selective one pays it too,
      ``ckpt_op_s`` on top.

    Each run is a forward+backward after a warm-up; ``2 x reps`` rounds run the configurations in turn and each
    cost is the median over rounds of the differences within a round (a shared machine's speed drifts by
    ±15 % over seconds; taken between configurations timed one after another, the differences moved 2-5x
    between profiles). The profile takes them on the tiny block, where they are
    repeatable: on a big block (a 256-wide llama block at 1024 tokens on the 2-core VM of docs/benchmarks.md)
    the same differences are small against the step's page faults, which depend on the heap's state, and
    came out 0-15 ms a block and 0-94 us an op in three runs, while inside a 6-block model a full checkpoint
    cost its ops' forward time plus 1-2 ms a block, as on the tiny block.
    """
    import torch

    from rlhfc.runtime.models.recompute import apply_recompute

    model, block, args, kwargs = _block_at(spec, rows, seq)
    seen = {"k": kwargs}
    keys, _ = _calls(block, args, kwargs)

    def step():
        block(*args, **seen["k"])[0].sum().backward()

    def forward():
        block(*args, **seen["k"])

    configs = (("plain", None, step), ("forward", None, forward),
               ("kept_all", {"policy": "ops", "save": keys}, step), ("full", {"policy": "full"}, step))
    rounds = max(3, 2 * reps)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    region, per_op = [], []
    try:
        for name, decision, fn in configs:               # a warm-up of each
            apply_recompute(model, decision)
            fn()
        for _ in range(rounds):
            t = {}
            for name, decision, fn in configs:
                apply_recompute(model, decision)
                start = time.process_time()
                fn()
                t[name] = time.process_time() - start
            r = t["full"] - t["plain"] - t["forward"]
            region.append(r)
            per_op.append((t["kept_all"] - t["plain"] - max(0.0, r)) / (2 * len(keys)))
    finally:
        apply_recompute(model, None)
        torch.set_num_threads(old)
    return {"ckpt_op_s": max(0.0, statistics.median(per_op)), "ckpt_region_s": max(0.0, statistics.median(region))}


def _calls(block, args, kwargs) -> tuple[list[str], list[str]]:
    """(the keys of every aten call of one forward of ``block``, in order, as the runtime's selective policy names
    them; the keys of those whose output is a new storage, not a view or an in-place result of an input)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from rlhfc.runtime.models.recompute import op_key

    counts: dict = {}
    keys, allocating = [], []

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            key = op_key(func, counts.get(func, 0))
            counts[func] = counts.get(func, 0) + 1
            keys.append(key)
            ins = {t.untyped_storage().data_ptr() for t in a if isinstance(t, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in ins:
                allocating.append(key)
            return out

    with Calls():
        block(*args, **kwargs)
    return keys, allocating


def measure_dispatch(spec: dict | None = None, rows: int = 1, seq: int = 64, reps: int = 15) -> float:
    """CPU seconds per aten call that a selective checkpoint adds to a forward of one block of ``spec`` (the
    program's model) at ``rows x seq`` tokens, one thread: the median of :func:`dispatch_samples`' ``reps``
    paired differences, at least 0.

    The recompute pass prices the forward's calls of this model's selective checkpoints at this rate instead of
    the host's tiny-block rate (:func:`measure_checkpoint`; the replay's calls stay at that): the same Python
    per call costs more beside a large block's tensors — on the 2-core VM of docs/benchmarks.md 94-176 us a
    call on a 256-wide llama block at 1024 tokens (whatever it kept, from nothing to every allocating output)
    against 50-90 us on the tiny block, and a 6-block model's selective plans came out 12-15 ms a block dearer
    than the tiny block's rate priced them. A forward of ~0.1 s pairs well on a machine whose speed drifts over
    seconds; whole training steps (differences of ~50 ms in steps of 1.5 s) do not."""
    return max(0.0, statistics.median(dispatch_samples(spec, rows, seq, reps)))


def dispatch_samples(spec: dict | None = None, rows: int = 1, seq: int = 64, reps: int = 15) -> list[float]:
    """``reps`` (at least 3) samples of what a selective checkpoint adds per aten call to a forward of one block
    of ``spec`` at ``rows x seq`` tokens, one thread: each the block's forward under the runtime's selective
    checkpoint keeping every allocating op's output minus the same forward without a checkpoint, run as a pair
    (which goes first alternates), over the calls its policy sees. A sample may be negative: the checkpoint adds
    ~10 % to the forward and one forward scatters by a few per cent, so one pair tells the rate only to
    ±50-100 % (:class:`SpreadProbes` pools its rounds' samples before it takes the median)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from rlhfc.runtime.models.recompute import _selective_context

    model, block, args, kwargs = _block_at(spec, rows, seq)
    keys, allocating = _calls(block, args, kwargs)
    save = frozenset(allocating)

    def forward(selective: bool) -> float:
        start = time.process_time()
        if selective:
            out = checkpoint(block.forward, *args, use_reentrant=False,
                             context_fn=lambda: _selective_context(save), **kwargs)
        else:
            out = block(*args, **kwargs)
        del out
        return time.process_time() - start

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):                                   # warm-up
            forward(False), forward(True)
        samples = []
        for i in range(max(3, reps)):
            t = {sel: forward(sel) for sel in ((True, False) if i % 2 else (False, True))}
            samples.append((t[True] - t[False]) / max(1, len(keys)))
    finally:
        torch.set_num_threads(old)
    return samples


def _model_and_batch(spec: dict, rows: int, seq: int):
    """(a seeded model of ``spec`` in training mode, token ids, attention mask): a micro-batch of ``rows x seq``
    tokens whose first row is left-padded, as generation leaves them."""
    import torch

    from rlhfc.runtime.models.build import build_model

    spec = dict(spec, max_seq=max(int(spec.get("max_seq") or 0), seq))
    model = build_model(spec, seed=0)
    model.train()
    vocab = int(model.spec["vocab"])
    ids = torch.randint(min(3, vocab - 1), vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, : min(8, seq // 8)] = 0
    return model, ids, mask


def _block_at(spec: dict | None, rows: int, seq: int):
    """(model, its first block, the block's positional args and keywords) of a one-block model of ``spec``
    (default :data:`TINY_BLOCK`) fed a left-padded micro-batch of ``rows x seq`` tokens, as the runtime feeds
    it; the hidden-state input requires grad (a block inside a trained model)."""
    import torch

    from rlhfc.runtime.models.recompute import blocks

    model, ids, mask = _model_and_batch(dict(spec or TINY_BLOCK, layers=1), rows, seq)
    block = blocks(model)[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        model(ids, mask)
    hook.remove()
    return model, block, (seen["a"][0].detach().requires_grad_(True), *seen["a"][1:]), seen["k"]


def measure_block_ops(spec: dict | None = None, rows: int = 1, seq: int = 64, reps: int = 5) -> dict[str, float]:
    """CPU seconds of each aten call of a block of ``spec`` (the program's model, all its blocks) as a
    checkpoint's replay runs it, at ``rows x seq`` tokens, one thread, by op key
    (:func:`rlhfc.runtime.models.recompute.op_key`): the model trains ``reps`` steps after a warm-up (forward, a
    loss, backward) with every block under a full checkpoint (non-reentrant, as the runtime's), and each op of
    every block's replay in backward is timed; an op's time is the median over blocks and steps (ops after
    the replay's early stop: their forward's). These are the replay's prices on the program's block at its
    shape — its matrix products at their own shapes (a 1024 x 32 attention product runs at half the square
    probe's FLOP/s), its large outputs' page faults, and not the faults a forward pays for small outputs while
    the step's heap grows to hold its activations (a replay reuses what backward frees) — which the host
    probes' kind rates miss by 10-30 % on a CPU."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from rlhfc.runtime.models.recompute import blocks, op_key

    model, ids, mask = _model_and_batch(dict(spec or TINY_BLOCK), rows, seq)
    times: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}   # forward / replay
    phase: list = [None]
    counts: dict = {}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if phase[0] is None:
                return func(*a, **(kw or {}))
            key = op_key(func, counts.get(func, 0))
            counts[func] = counts.get(func, 0) + 1
            t = time.process_time()
            out = func(*a, **(kw or {}))
            times[phase[0]].setdefault(key, []).append(time.process_time() - t)
            return out

    def checkpointed(forward):
        def run(*a, **k):
            calls = [0]

            def timed(*a, **k):
                phase[0], calls[0] = calls[0] > 0, calls[0] + 1
                counts.clear()
                try:
                    return forward(*a, **k)
                finally:
                    phase[0] = None

            return checkpoint(timed, *a, use_reentrant=False, **k)
        return run

    for blk in blocks(model):
        blk.forward = checkpointed(blk.forward)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(max(1, reps) + 1):
            model.zero_grad(set_to_none=True)
            with Timer():
                model(ids, mask).float().pow(2).mean().backward()
            if i == 0:
                times[False].clear()                      # the warm-up
                times[True].clear()
    finally:
        torch.set_num_threads(old)
        for blk in blocks(model):
            blk.__dict__.pop("forward", None)
    return {k: statistics.median(times[True].get(k) or v) for k, v in times[False].items()}


class SpreadProbes:
    """The recompute probes taken in rounds at moments spread over a profile, each value the median over rounds.

    A 2-vCPU VM's speed swings ±25 % over tens of seconds; the probes taken once (~10 s) priced a whole run at one
    moment of it, and a run whose probes fell in a slow spell over-priced every plan by 18-40 % (run D in
    docs/benchmarks.md). ``rlhfc profile`` calls :meth:`take` after the host probes, between a model's generate,
    forward and train probes (:func:`rlhfc.calibrate.measure_model`'s ``between``, at most two such rounds)
    and at the profile's end, so the rounds span the profile's minutes; each round takes fewer repetitions than
    the single-moment probes did, the four together about twice as long (for a 256-wide llama block at 1024
    tokens ~25 s more a profile, ~2 s a round of it the call rate's 9 pairs).

    ``blocks``: ``{model key: (runtime spec, rows, seq)}``, each trained model's block at its training shape
    (:func:`measure_block_ops` and :func:`dispatch_samples` there); the host's tiny block
    (:func:`measure_checkpoint`) is taken in every round too, with ``seed``, the host probes' own, as one more.

    The per-call rate of a block's selective checkpoint is the median of every round's paired samples pooled
    (9 pairs a round), not a median of rounds' medians: a round of 3-5 pairs read it anywhere from 25 to 357 us
    on a 256-wide block whose rounds' medians agreed on 134-200 us (session 15), and that rate prices every call of
    a selective plan's forward (±13 % of a small plan's overhead)."""

    def __init__(self, blocks: dict, quick: bool = False, seed: dict | None = None):
        self.blocks = dict(blocks)
        self.quick = quick
        self.host: list[dict] = [dict(seed)] if seed else []
        self.ops: dict[str, list[dict]] = {k: [] for k in self.blocks}
        self.calls: dict[str, list[list[float]]] = {k: [] for k in self.blocks}    # each round's samples

    def take(self) -> None:
        """One round: the tiny block's checkpoint costs, then each block's op times and checkpoint call rate."""
        self.host.append(measure_checkpoint(2))
        for key, (spec, rows, seq) in self.blocks.items():
            self.ops[key].append(measure_block_ops(spec, rows, seq, 1 if self.quick else 2))
            self.calls[key].append(dispatch_samples(spec, rows, seq, 3 if self.quick else 9))

    def middle(self, most: int = 3) -> None:
        """A round between other probes, while fewer than ``most`` rounds of the blocks were taken (the last
        round, :meth:`take` at the profile's end, comes on top: a profile of several models does not pay a round
        per probe section of each)."""
        if len(next(iter(self.calls.values()), [])) < most:
            self.take()

    def extend(self, other: "SpreadProbes") -> None:
        """Add ``other``'s rounds (of the same blocks) to these."""
        self.host += other.host
        for key in self.blocks:
            self.ops[key] += other.ops[key]
            self.calls[key] += other.calls[key]

    def per_round(self, key: str) -> list[tuple[float, float, float]]:
        """Each round's (tiny block's s per call, ``key``'s block's s per call — that round's median —, its
        forward ops' total s)."""
        n = len(self.calls[key])
        return [(h["ckpt_op_s"], max(0.0, statistics.median(c)), sum(o.values()))
                for h, c, o in zip(self.host[len(self.host) - n:], self.calls[key], self.ops[key])]

    def host_costs(self) -> dict[str, float]:
        """``ckpt_op_s`` and ``ckpt_region_s``, medians over the rounds (and the seed)."""
        return {k: statistics.median(r[k] for r in self.host) for k in ("ckpt_op_s", "ckpt_region_s")}

    def block(self, key: str) -> dict | None:
        """The profile's ``recompute`` entry of one model: ``rows``, ``seq``, ``op_s`` (each op's median over
        rounds), ``ckpt_op_s`` (the median of every round's call-rate samples, at least 0), ``rounds``; None
        before a round."""
        if not self.calls.get(key):
            return None
        _, rows, seq = self.blocks[key]
        ops = self.ops[key]
        op_s = {k: statistics.median(r.get(k, v) for r in ops) for k, v in ops[0].items()}
        pooled = [x for samples in self.calls[key] for x in samples]
        return dict(rows=rows, seq=seq, op_s=op_s, ckpt_op_s=max(0.0, statistics.median(pooled)),
                    rounds=len(self.calls[key]))
