"""Recompute selection, measured: what each policy keeps for backward and what it costs in step time.

A llama trunk of 6 blocks x 256 hidden (vocab 96, so the blocks' activations dominate) trains on one
micro-batch of ``--seq`` tokens (default 1024). For every policy — none, full, Megatron's selective (core
attention), and rlhfc's knapsack at three budgets (the bytes Megatron-selective keeps, half and a quarter of
them) — the benchmark measures:

- the bytes kept for backward by one block (storages the forward allocated that are still alive after it:
  :func:`rlhfc.runtime.models.recompute.kept_activation_bytes`), against the trace's estimate;
- the forward+backward time of the whole model (CPU time; ``--repeat`` rounds run round-robin over the
  policies, each policy's step paired with a step of ``none`` right beside it, which goes first alternating),
  and its overhead over ``none`` — the median of the paired differences — and, measured directly, the CPU time
  of the checkpointed blocks' forwards re-run inside backward (replays timed: the recomputation itself, not the
  checkpoint's bookkeeping — a selective policy's call per op in the forward, its cache of kept outputs, the
  saved-tensor hooks — which the difference of steps includes and the prediction prices), against the predicted
  overhead (the policy's recompute seconds per block x blocks) priced two ways: **profile prices** (what the
  recompute pass does with a profile ``rlhfc profile`` takes with this program, its probes run in a child
  process at one thread, in four rounds spread over a model probe as the profile spreads them, medians kept:
  each op of this block's forward timed on it at its shape,
  :func:`rlhfc.calibrate.recompute.measure_block_ops` — a replay costs what the forward does — plus the
  checkpoint's own costs: per block, and per call of the replay, the host's tiny-block probe,
  :func:`rlhfc.calibrate.recompute.measure_checkpoint`; per call of the forward, the same block's at its shape,
  :func:`rlhfc.calibrate.recompute.measure_dispatch`; :mod:`rlhfc.passes.recompute_prices`) and, for comparison,
  **the same pricing with the probes taken during the rounds** (after every ``--probe-every`` rounds and the
  last, one round of probes each, medians kept) and **the profile prices at the steps' forward speed** (scaled by
  the median time the `none` steps took for their blocks' forwards, timed by module hooks, over the profile's
  block ops: the pricing apart from the machine's speed, read off the very steps the overhead is measured in,
  where a round of probes in another process reads another moment). rlhfc's choices are made on the profile
  prices. (The kind-rate
  pricing before session 11 — each op by its kind at the host probes' rates — and the tiny block's call rate of
  session 12 are in docs/benchmarks.md's earlier tables.)

A profile is one stretch of a machine's speed and the steps another: on a shared VM whose speed moves ±25 %
over minutes the first column carries that drift, the second prices at the speed the steps ran — the pricing
itself, apart from when its probes were taken. Each round of probes is printed.

Two budgets often choose the same plan (rlhfc's knapsack and the greedy ranking at ½ or ¼, rlhfc at
selective's budget and ``none`` with sdpa): a plan is measured once and its other rows say so, so every round
measures each distinct plan and the same minutes buy more rounds. Each overhead comes with the **90 % interval
of its median** (a bootstrap over the rounds' paired differences): what the measurement itself can tell apart,
against which a prediction's 15 % is read. A step of this model scatters by ~10 % from one step to the next on a
shared VM (the same step back to back: 1.08-1.78 s), so a paired difference carries ~100-150 ms of noise and a
small overhead (sdpa's plans, +130-200 ms) is not measured to ±15 % in 31 pairs; with ``--max-repeat N`` the
rounds go on past ``--repeat`` for the plans whose interval is still wider than ±15 % of their median (only
those: two steps a round each), up to N pairs each.

The median, not the best, of paired differences: a shared VM's speed drifts by ±15 % over minutes, and a
step's time scatters as much (with glibc's default allocator, ``--allocator default``, also by the page faults
its heap's history decides, a third of a step's CPU time); the best is the luckiest step, not what a step
costs. By default the benchmark runs with a CPU worker's allocator settings (:mod:`rlhfc.runtime.worker.allocator`:
freed memory kept, no page faults after the first steps), as jobs and ``rlhfc profile`` do.

With ``--attn eager`` the s x s attention scores are stored (where Megatron's selective pays off); the default
``sdpa`` (what the runtime trains with) never stores them. With ``--cuda`` the same runs on a GPU and bytes are
also read from ``torch.cuda.max_memory_allocated``.

``--replay`` (CPU) first times the ops full and Megatron-selective replay inside the checkpointed backward against
the same ops in a forward, by kind, and counts a block step's page faults.

    python benchmarks/recompute.py [--seq 1024] [--attn eager|sdpa] [--repeat 21] [--max-repeat 0] [--probe-every 8] [--allocator retain|default] [--replay] [--cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace as dc_replace

import torch

from rlhfc.calibrate import measure_host
from rlhfc.cost.hardware import device_spec, own_block
from rlhfc.cost.profile import Profile, model_key
from rlhfc.passes import recompute_choice as choice
from rlhfc.passes.recompute_prices import (
    measured_dispatch,
    measured_ops,
    spec_costs,
    with_measured_ops,
    with_replay_costs,
)
from rlhfc.passes.recompute_trace import fit_kind_rates, reprice, trace_block
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.models.recompute import apply_recompute, blocks, kept_activation_bytes, op_key
from rlhfc.runtime.worker.allocator import retain_freed_memory

SPEC = dict(arch="llama", layers=6, hidden=256, heads=8, vocab=96, max_seq=4096)


def _batch(seq: int, device: str):
    ids = torch.randint(3, 90, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :8] = 0                                      # a left-padded row, as generation leaves them
    return ids, mask


def _block_call(model, batch):
    block = blocks(model)[0]
    seen = {}
    hook = block.register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        model(*batch)
    hook.remove()
    x = seen["a"][0].detach().requires_grad_(True)
    return block, (x, *seen["a"][1:]), seen["k"]


def _op_seconds(block, bargs, bkw, rounds: int, cuda: bool) -> dict[str, float]:
    """Each aten call of a block forward (with gradients, as the recompute replays it), timed: best of
    ``rounds``, by op key — what a profile of the block gives the trace."""
    from torch.utils._python_dispatch import TorchDispatchMode

    clock = time.perf_counter if cuda else time.process_time
    best: dict[str, float] = {}
    counts: dict = {}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            key = op_key(func, counts.get(func, 0))
            counts[func] = counts.get(func, 0) + 1
            t = clock()
            out = func(*a, **(kw or {}))
            if cuda:
                torch.cuda.synchronize()
            best[key] = min(best.get(key, float("inf")), clock() - t)
            return out

    for _ in range(rounds):
        counts.clear()
        with Timer():
            block(*bargs, **bkw)
    return best


def _replay_vs_forward(block, bargs, bkw, trace, op_times: dict, plans: dict) -> None:
    """``--replay``: for each plan, the CPU seconds of its replayed ops inside the checkpointed backward against
    the same ops in a forward (``op_times``), by kind, and the minor page faults of one block forward+backward
    (none against the plan): is a replay dearer than a forward, and where do its faults come from?"""
    import resource

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from rlhfc.runtime.models.recompute import _selective_context

    kind = {n.key.split("#")[0]: n.kind for n in reversed(trace.nodes) if n.kind != "view"}
    phase, spent = ["fwd"], {}

    class Timer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            t = time.process_time()
            out = func(*a, **(kw or {}))
            if phase[0] == "replay":
                k = kind.get(str(func)[5:], "view")
                spent[k] = spent.get(k, 0.0) + time.process_time() - t
            return out

    def step(ch, timer: bool):
        calls = [0]

        def fn(*a, **k):
            phase[0] = "fwd" if calls[0] == 0 else "replay"
            calls[0] += 1
            try:
                return block.forward(*a, **k)
            finally:
                phase[0] = "bwd"

        ctx = (lambda: _selective_context(frozenset(ch.save))) if ch.policy == "ops" else None
        with Timer() if timer else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            if ch.policy == "none":
                out = block(*bargs, **bkw)
            elif ctx is None:
                out = checkpoint(fn, *bargs, use_reentrant=False, **bkw)
            else:
                out = checkpoint(fn, *bargs, use_reentrant=False, context_fn=ctx, **bkw)
            out[0].pow(2).mean().backward()

    def faults(ch):
        step(ch, False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(ch, False)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    base = faults(choice.price(trace, None))
    cut = choice._cut(trace)
    for label, ch in plans.items():
        best: dict[str, float] = {}
        for _ in range(3):
            spent.clear()
            step(ch, True)
            best = {k: min(v, best.get(k, float("inf"))) for k, v in spent.items()}
        fwd: dict[str, float] = {}
        for i, n in enumerate(trace.nodes):
            if i <= cut and n.key not in set(ch.save) and n.key in op_times:
                fwd[n.kind] = fwd.get(n.kind, 0.0) + op_times[n.key]
        print(f"# replay of {label}: " + ", ".join(
            f"{k} {best.get(k, 0) * 1e3:.1f} vs {fwd.get(k, 0) * 1e3:.1f} ms in a forward"
            for k in sorted(set(best) | set(fwd)) if k != "view")
            + f"; minor page faults a block step: {faults(ch)} vs {base} without recompute")


def _probes(spec: dict, seq: int, retain: bool, spread: bool = True):
    """(``rlhfc profile``'s host probes at one thread, with the checkpoint's tiny-block costs the medians over
    its rounds; the rounds, :class:`rlhfc.calibrate.recompute.SpreadProbes` of this block at 1 x ``seq`` as
    model ``"m"``: its ``block("m")`` is the profile's recompute entry), taken in a separate process
    as the profile is (with ``retain`` False, under glibc's default allocator settings): with those settings, run
    in the measuring process, the probes' large allocations leave its heap holding free memory that its steps
    then reuse without page faults (a run measured full recomputation at +190 ms instead of +460-500).

    With ``spread`` the rounds are spread as ``rlhfc profile`` spreads them
    (:class:`rlhfc.calibrate.recompute.SpreadProbes`): one first, two between this model's generate, forward and
    train probes (:func:`rlhfc.calibrate.measure_model` at ``--quick``, one thread), one last; without, one round
    (what the benchmark takes after its rounds, to show how far the machine's speed moved)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_probe_child, (spec, seq, retain, spread))


def _probe_child(spec: dict, seq: int, retain: bool, spread: bool):
    from rlhfc.calibrate import measure_model
    from rlhfc.calibrate.recompute import SpreadProbes

    if not retain:
        os.environ["RLHFC_RETAIN_MEMORY"] = "0"
    torch.set_num_threads(1)
    if not spread:                       # the allocator settings measure_host takes first (a CPU worker's)
        retain_freed_memory()
    host = measure_host(1) if spread else {}
    probes = SpreadProbes({"m": (spec, 1, seq)}, seed=host.get("recompute"))
    probes.take()
    if spread:
        measure_model(dict(spec, head="lm", source=None), 1, quick=True, reps=3, between=probes.middle)
        probes.take()
        host["recompute"].update(probes.host_costs())
    return host, probes


def _own_pricing(trace, host: dict, entry: dict, key: str, seq: int):
    """(the device spec of a profile with host probes ``host`` whose model ``key`` has the recompute ``entry``,
    ``trace`` priced at its kind rates, ``trace`` priced as the recompute pass prices it with that profile)."""
    dev = device_spec("cpu", Profile("cpu", "here", 1, host))
    ops = reprice(trace, dev.peak_flops * dev.train_eff, {k: dev.hbm_bw * dev.mem_eff * e for k, e in dev.kind_eff})
    dev = dc_replace(dev, block_ops=(own_block(key, dict(entry, rows=1, seq=seq)),))
    own = with_replay_costs(ops, **spec_costs(dev), ckpt_forward_op_s=measured_dispatch(dev, key))
    return dev, ops, with_measured_ops(own, own, measured_ops(dev, key)[2])


def _rounds(rounds) -> str:
    return "; ".join(f"tiny {t * 1e6:.0f} us, block {c * 1e6:.0f} us a call, ops {o * 1e3:.1f} ms"
                     for t, c, o in rounds)


#: seconds spent re-running checkpointed blocks' forwards during backward, and in the blocks' forwards before it,
#: by the step that timed them
_REPLAY = {"backward": False, "seconds": 0.0, "forward": 0.0}


def _time_block_forwards(model) -> None:
    """Hooks that add each block's forward (its module call, not a replay inside backward) to
    ``_REPLAY["forward"]``: a `none` step's block forwards are what the machine's speed was during that step."""
    start = {}

    def pre(block, args):
        start[block] = time.process_time()

    def post(block, args, out):
        _REPLAY["forward"] += time.process_time() - start.pop(block)

    for block in blocks(model):
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)


def _timed_replays(model, decision: dict) -> None:
    """Apply ``decision`` as the runtime does, each block's checkpointed forward timed when it runs again inside
    backward (the recomputation itself: replayed ops, the selective policy's calls, a kept output's lookup), into
    :data:`_REPLAY` — the overhead measured directly instead of as the difference of two steps."""
    from rlhfc.runtime.models.recompute import _checkpointed

    apply_recompute(model, decision)
    if decision["policy"] == "none":
        return
    for block in blocks(model):
        inner = block._rlhfc_forward

        def timed(*a, _inner=inner, **k):
            if not _REPLAY["backward"]:
                return _inner(*a, **k)
            t = time.process_time()
            try:
                return _inner(*a, **k)
            finally:   # also when the checkpoint stops a replay early, once it has what backward needs
                _REPLAY["seconds"] += time.process_time() - t

        block.forward = _checkpointed(timed, decision["policy"], frozenset(decision.get("save") or ()))


def _step_seconds(model, batch, cuda: bool) -> tuple[float, float]:
    """(seconds of one forward+backward, peak CUDA bytes or 0): on CPU the process's CPU time (one thread), which
    other processes on a shared machine disturb far less than wall time; on CUDA wall time."""
    clock = time.perf_counter if cuda else time.process_time
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = clock()
    _REPLAY["forward"] = 0.0
    loss = model(*batch).float().pow(2).mean()
    _REPLAY["backward"], _REPLAY["seconds"] = True, 0.0
    try:
        loss.backward()
    finally:
        _REPLAY["backward"] = False
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    return clock() - t, peak


def _median_interval(xs: list[float], level: float = 0.9, draws: int = 2000) -> tuple[float, float]:
    """The ``level`` interval of the median of ``xs`` (a percentile bootstrap, seeded): how far another run of as
    many rounds could put the measured median."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    tail = (1 - level) / 2
    return meds[int(tail * draws)], meds[min(draws - 1, int((1 - tail) * draws))]


def _told(xs: list[float], within: float = 0.15) -> bool:
    """Whether the median of ``xs`` is measured to ±``within`` of itself: half its 90 % interval no wider."""
    lo, hi = _median_interval(xs)
    return (hi - lo) / 2 <= within * abs(statistics.median(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--attn", default="eager", choices=("eager", "sdpa"))
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--max-repeat", type=int, default=0,
                    help="after --repeat rounds, go on measuring the plans whose overhead's 90 %% interval is wider "
                         "than ±15 %% of its median, up to this many rounds each (default: --repeat, no more)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe-every", type=int, default=8,
                    help="take the profile's recompute probes again after every N rounds (and the last)")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--replay", action="store_true", help="time the replayed ops against a forward, count page faults")
    ap.add_argument("--allocator", default="retain", choices=("retain", "default"),
                    help="a CPU worker's allocator settings (rlhfc.runtime.worker.allocator, the default) or glibc's own")
    args = ap.parse_args()
    args.max_repeat = max(args.max_repeat, args.repeat)
    if args.allocator == "retain" and not retain_freed_memory():
        raise SystemExit("--allocator retain: not a glibc malloc here (or RLHFC_RETAIN_MEMORY=0)")
    torch.set_num_threads(args.threads)
    device = "cuda" if args.cuda else "cpu"
    spec = dict(SPEC, attn=args.attn)
    model = build_model(spec, seed=0, device=device)
    model.train()
    full_spec = model.spec
    batch = _batch(args.seq, device)
    block, bargs, bkw = _block_call(model, batch)
    trace = trace_block("llama", spec["hidden"], spec["heads"], full_spec["kv_heads"], full_spec["ffn"],
                        spec["vocab"], 1, args.seq, attn=args.attn)
    op_times = _op_seconds(block, bargs, bkw, 3, args.cuda) if args.cuda or args.replay else {}
    before = reprice(trace, *fit_kind_rates(trace, op_times)) if args.cuda else trace  # kind rates from a forward
    host, probes = _probes(spec, args.seq, args.allocator == "retain") if not args.cuda else (None, None)
    entry = probes.block("m") if probes else None
    own_ops, own_call = (entry["op_s"], entry["ckpt_op_s"]) if entry else (None, None)
    key, base = model_key(full_spec), trace
    if not args.cuda:
        # what `rlhfc profile` measures with the program: each forward op of this block at its shape (one row of
        # --seq tokens), CPU time, a selective checkpoint's cost per call there, and on the host's tiny block its
        # cost per block and per call of a replay; priced as the recompute pass prices with them
        dev, ops, trace = _own_pricing(base, host, entry, key, args.seq)
        kinds = with_replay_costs(ops, **spec_costs(dev))
        print(f"# profile probes: matmul {dev.peak_flops / 1e9:.1f} GFLOP/s, copy (16 MiB) {dev.hbm_bw / 1e9:.2f} "
              "GB/s; at 32 MiB: " + ", ".join(f"{k} {e * dev.hbm_bw / 1e9:.2f} GB/s" for k, e in dev.kind_eff)
              + "; fresh outputs (ps/byte by MiB): "
              + ", ".join(f"{int(n) >> 20}: {r * 1e12:.0f}" for n, r in dev.fresh_s_per_byte)
              + f"; checkpoint, tiny block: {dev.ckpt_region_s * 1e3:.2f} ms a block + {dev.ckpt_op_s * 1e6:.1f} us "
              f"an op dispatched; at this block's shape {own_call * 1e6:.1f} us a call")
        print(f"# this block at 1 x {args.seq}: forward ops {sum(own_ops.values()) * 1e3:.1f} ms (priced at the "
              f"probes' kind rates and fresh outputs: {kinds.forward_s * 1e3:.1f}; {len(trace.nodes)} ops, "
              f"{choice._cut(trace) + 1} replayed up to the last that saves)")
        print(f"# the recompute probes' {len(probes.per_round('m'))} rounds over the profile (medians kept): "
              + _rounds(probes.per_round("m")))
    else:   # CUDA: no host probes of a recompute's extra costs (a caching allocator, no page faults)
        trace = before
    sel = choice.selective(trace)
    if args.replay and not args.cuda:
        _replay_vs_forward(block, bargs, bkw, trace, op_times, {"full": choice.full(trace), "selective": sel})
    if args.repeat < 1:
        return
    runs = [("none", choice.choose(trace, "none")), ("full", choice.full(trace)), ("megatron-selective", sel)]
    for frac in (1.0, 0.5, 0.25):
        budget = frac * sel.saved_bytes
        runs.append((f"rlhfc budget {frac:g}x sel ({budget / 2**20:.1f} MiB)", choice.within(trace, budget)))
        if frac < 1.0:
            runs.append((f"torch-greedy {frac:g}x sel", choice.greedy(trace, budget)))
    print(f"# llama {spec['layers']} x {spec['hidden']}, seq {args.seq}, attn {args.attn}, {device}, "
          f"{args.threads} thread(s); plain autograd keeps {trace.autograd_bytes / 2**20:.1f} MiB per block")
    # one measurement per distinct plan: a later row choosing the same plan (or `none`'s) says so and shares it
    first: dict[tuple, str] = {}
    same = {label: first.setdefault((ch.policy, frozenset(ch.save)), label) for label, ch in runs}
    measured_runs = [(label, ch) for label, ch in runs if same[label] == label]
    print("| policy | kept/block est. | kept/block measured | step s (median; best–worst) | overhead measured "
          "(median of paired differences; its 90 % interval) | replays timed (median; quartiles) | predicted (profile "
          "prices) | predicted, probes taken during the rounds | predicted, at the steps' forward speed |"
          + (" cuda peak |" if args.cuda else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.cuda else ""))
    kept, steps, peaks, ch_of = {}, {label: [] for label, _ in runs}, {}, dict(runs)
    _time_block_forwards(model)
    forwards = []                         # each `none` step's block forwards: the steps' own speed
    for _ in range(2):                    # warm-up: a process's first steps run slow (its heap and caches settle)
        for label, ch in measured_runs:
            apply_recompute(model, {"policy": ch.policy, "save": list(ch.save)})
            if label not in kept:
                _, kept[label] = kept_activation_bytes(block, *bargs, **bkw)
            _step_seconds(model, batch, args.cuda)
    plain = {"policy": "none"}
    diffs = {label: [] for label, _ in runs}
    during = None
    replays = {label: [] for label, _ in runs}
    r, todo = 0, [label for label, _ in measured_runs[1:]]
    while todo:   # round robin: a busy shared machine slows some rounds, not one policy's
        for label in todo:
            ch = ch_of[label]
            # each policy's step right beside a step of `none`, in turn: the overhead is the median of these paired
            # differences, so a machine whose speed drifts over minutes (other tenants' load) shifts both sides of a
            # pair alike (medians of separate rounds moved the overhead by the drift of `none`'s own median)
            pair = {}
            order = [(label, {"policy": ch.policy, "save": list(ch.save)}), ("none", plain)]
            for name, d in order[::-1] if r % 2 else order:                    # which goes first alternates
                _timed_replays(model, d)
                if args.allocator == "default":
                    # glibc's default gives freed blocks back: a step pays the heap the step before it left, so a
                    # job's step (after a step of its own policy) is timed after an untimed one of the same policy
                    _step_seconds(model, batch, args.cuda)
                pair[name], peaks[name] = _step_seconds(model, batch, args.cuda)
                steps[name].append(pair[name])
                if name == label:
                    replays[label].append(_REPLAY["seconds"])
                else:
                    forwards.append(_REPLAY["forward"])
            diffs[label].append(pair[label] - pair["none"])
        r += 1
        if r >= args.repeat:
            # past --repeat, more rounds only for the plans whose overhead is not yet measured to ±15 % (a small
            # overhead on a noisy step needs many pairs), up to --max-repeat: the target's 15 % is then read
            # against a measurement that can tell it
            todo = [label for label in todo if len(diffs[label]) < args.max_repeat and not _told(diffs[label])]
        if not args.cuda and (r % args.probe_every == 0 or not todo):
            # the profile's probes again, between rounds: what the same pricing gives at the speed the steps ran
            taken = _probes(spec, args.seq, args.allocator == "retain", spread=False)[1]
            if during is None:
                during = taken
            else:
                during.extend(taken)
    at_run = trace
    if during is not None:
        host_d = dict(host, recompute=dict(host["recompute"], **during.host_costs()))
        at_run = _own_pricing(base, host_d, during.block("m"), key, args.seq)[2]
    # the profile's prices scaled by how fast the `none` steps ran their blocks' forwards against the profile's
    # block ops: the pricing apart from the machine's speed, read off the steps themselves (CPU only)
    speed = statistics.median(forwards) / (trace.forward_s * spec["layers"]) if forwards and not args.cuda else 0.0
    within, within_run, within_speed, resolved, distinct, within_resolved = 0, 0, 0, 0, 0, 0
    for label, _ in runs:
        ch, src = ch_of[label], same[label]
        step = statistics.median(steps[src])
        measured = statistics.median(diffs[src]) if diffs[src] else 0.0
        lo, hi = _median_interval(diffs[src]) if diffs[src] else (measured, measured)
        predicted = ch.recompute_s * spec["layers"]
        old = choice.price(at_run, set(ch.save) if ch.policy != "none" else None).recompute_s * spec["layers"]
        rep = statistics.median(replays[src]) if replays[src] else 0.0
        rq = statistics.quantiles(replays[src], n=4) if len(replays[src]) >= 2 else [rep, rep, rep]

        def err(x):
            return f" ({(x - measured) / measured * 100:+.0f} %)" if ch.policy != "none" and measured > 0 else ""

        def near(x):                                  # the target: within 15 % of the measured median
            return abs(x - measured) <= 0.15 * measured

        if src == label and ch.policy != "none" and measured > 0:
            distinct += 1
            within += near(predicted)
            within_run += near(old)
            within_speed += near(predicted * speed)
            told = _told(diffs[src])
            resolved += told
            within_resolved += told and near(predicted)
        note = f" (the plan of {src})" if src != label else ""
        print(f"| {label}{note} | {ch.saved_bytes / 2**20:.2f} MiB | {kept[src] / 2**20:.2f} MiB | {step:.3f} "
              f"({min(steps[src] or [step]):.3f}–{max(steps[src] or [step]):.3f}) | {measured * 1e3:+.0f} ms "
              f"({lo * 1e3:+.0f} to {hi * 1e3:+.0f}; {len(diffs[src])} pairs) | {rep * 1e3:.0f} ms ({rq[0] * 1e3:.0f} to {rq[2] * 1e3:.0f}) | "
              f"{predicted * 1e3:+.0f} ms{err(predicted)} | {old * 1e3:+.0f} ms{err(old)} | "
              + (f"{predicted * speed * 1e3:+.0f} ms{err(predicted * speed)} |" if speed else "— |")
              + (f" {peaks[src] / 2**20:.0f} MiB |" if args.cuda else ""))
    print(f"# {args.repeat} rounds (up to {args.max_repeat} for a plan not yet measured to ±15 %); distinct plans with "
          f"recomputation: {distinct}; predicted within 15 % of the measured median: {within} of {distinct} (priced "
          f"with the probes taken during the rounds: {within_run} of {distinct}; at the steps' forward speed: "
          f"{within_speed if speed else '—'} of {distinct}); measured to ±15 % (half the 90 % "
          f"interval within 15 % of the median): {resolved} of {distinct}, and of those predicted within 15 %: "
          f"{within_resolved}")
    if speed:
        print(f"# the `none` steps' block forwards: {statistics.median(forwards) * 1e3 / spec['layers']:.1f} ms a block "
              f"(median of {len(forwards)} steps), the profile's block ops {trace.forward_s * 1e3:.1f} ms: x{speed:.3f}")
    if during is not None:
        print(f"# the probes during the rounds (after every {args.probe_every} rounds and the last): "
              + _rounds(during.per_round("m")))
    apply_recompute(model, None)


if __name__ == "__main__":
    main()
