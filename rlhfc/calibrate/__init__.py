"""Calibration: measure this machine for a program's models and save a profile (``rlhfc profile``).

This is the one part of the compiler that runs real models: it times the runtime's own worker
(:class:`rlhfc.runtime.worker.base.ModelWorker`, the code a job runs) in-process, for every distinct model
shape of a program, at a small grid of batch x length points, and stores the points and their fits in a
:class:`rlhfc.cost.profile.Profile` (which documents the primitives and the fitted forms). Each model is
measured with as many torch threads as its workers will run (:func:`rlhfc.ir.plan.workers`: one per whole
core of a worker's share of its cores, so 1 when several models share a node's cores); the host probes
use every core of a node.

Each model-call point is the median of a few repetitions (after a warm-up): a job reports a stage as the
median of its steps, so the profile measures the same statistic (the host probes keep the fastest: peak
rates). Each repetition of a model call follows a short idle pause (:data:`JOB_PAUSE_S`), as a job's worker calls follow a wait: a tight loop
of calls runs faster than a job's calls do. Torch and the runtime are
imported only when measuring, so importing this module is cheap. It sits above :mod:`rlhfc.cost`, which
imports neither torch nor the runtime.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from rlhfc.cost.profile import Profile, compute_features, cpu_name, fit_relative, model_key, refit
from rlhfc.ir.plan import workers


#: seconds a model call is timed after (idle, not timed): a job's worker waits between its calls (for the
#: driver, for the other workers' stages: 2-80 ms in the tiny examples' traces, most of a step for a worker
#: with one stage), and a call after such a wait runs slower than in a tight loop. On the idle 2-core VM of
#: docs/benchmarks.md, after 0 / 5 / 20 / 50 / 100 ms: a forward 2.10 / 2.19 / 2.54 / 3.40 / 3.56 ms, a train
#: step 8.1 / 8.1 / 9.0 / 9.9 / 10.1 ms, a generation 26.7 / 27.3 / 28.9 / 29.5 / 29.9 ms (fastest of 8):
#: most of the effect is there by 50 ms
JOB_PAUSE_S = 0.05


def _timeit(fn, reps: int = 5, pause: float = 0.0, stat=min) -> float:
    """``stat`` (the fastest, or the median) of ``reps`` timed calls of ``fn`` after one untimed call."""
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(reps):
        if pause > 0:
            time.sleep(pause)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(stat(times))


def _set_passive_waits() -> None:
    """Idle OpenMP threads sleep instead of spinning, so a busy co-tenant on a small machine does not turn
    2-thread kernels into 10-100x slower ones (the same setting makes measurements repeatable). OpenMP reads
    it once, so it only matters before torch is first imported (``rlhfc profile`` on the command line)."""
    if sys.modules.get("torch") is None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def measure_host(threads: int, device: str = "cpu", quick: bool = False) -> dict:
    """FLOP/s of a float32 (cpu) / bf16 (cuda) matmul at 1..threads threads, and memory-copy bandwidth; on a
    cpu also what a recompute pays beyond its ops (``recompute``: fresh outputs, the checkpoint itself). On a
    cpu the measuring process first takes a CPU worker's allocator settings
    (:func:`rlhfc.runtime.worker.allocator.retain_freed_memory`), so what it measures is what a worker pays
    (``allocator``: ``"retain"``, or ``"default"`` where they are off)."""
    import torch

    from rlhfc.calibrate.recompute import FRESH_SIZES, measure_checkpoint, measure_fresh_bytes, measure_kinds
    from rlhfc.runtime.worker.allocator import retain_freed_memory

    out: dict = {}
    if device == "cpu":
        out["allocator"] = "retain" if retain_freed_memory() else "default"
        n = 384
        a, b = torch.randn(n, n), torch.randn(n, n)
        speeds = []
        old = torch.get_num_threads()
        for th in range(1, max(1, threads) + 1):
            torch.set_num_threads(th)
            sec = _timeit(lambda: torch.mm(a, b), 15)
            speeds.append(2 * n ** 3 / sec)
        torch.set_num_threads(old)
        out["matmul_flops_1"] = speeds[0]
        out["matmul_flops"] = speeds[-1]
        out["thread_speedup"] = [s / speeds[0] for s in speeds]
        x = torch.empty(16 * 2 ** 20 // 4)
        y = torch.empty_like(x)
        sec = _timeit(lambda: y.copy_(x), 10)
        out["copy_bw"] = 2 * x.numel() * 4 / sec
        out["kind_bw"] = measure_kinds(torch.float32, "cpu")
        sizes = FRESH_SIZES if not quick else FRESH_SIZES[:1]     # quick: 32 MiB
        out["recompute"] = dict(measure_checkpoint(3 if quick else 5), fresh_s_per_byte=measure_fresh_bytes(sizes))
        return out
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def mm():
        torch.mm(a, b)
        torch.cuda.synchronize()

    out["matmul_flops"] = 2 * n ** 3 / _timeit(mm, 10)
    x = torch.empty(2 ** 30 // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def cp():
        y.copy_(x)
        torch.cuda.synchronize()

    out["copy_bw"] = 2 * x.numel() * 2 / _timeit(cp, 10)
    out["kind_bw"] = measure_kinds(torch.bfloat16, device)
    return out


def _synthetic_batch(B: int, P: int, R: int, vocab: int, device):
    """A RolloutBatch of B rows, P prompt columns (prompts of P/2..P tokens, left-padded, as real batches are)
    and R response tokens; random ids."""
    import torch

    from rlhfc.runtime.rollout.generation import RolloutBatch

    g = torch.Generator().manual_seed(B * 1000 + P * 10 + R)
    ids = torch.randint(3, max(vocab, 4), (B, P + R), generator=g)
    lengths = torch.tensor([P - (i * (P // 2)) // max(B - 1, 1) for i in range(B)], dtype=torch.long)
    cols = torch.arange(P + R)
    mask = (cols[None, :] >= (P - lengths)[:, None]).long()
    ids = ids * mask
    return RolloutBatch(input_ids=ids.to(device), attention_mask=mask.to(device),
                        response_mask=mask[:, P:].clone().to(device), prompt_len=P,
                        response_lengths=torch.full((B,), R, dtype=torch.long, device=device),
                        prompt_lengths=lengths.to(device),
                        eos=torch.zeros(B, dtype=torch.bool, device=device))


def profile_prompts(B: int, P: int) -> list[str]:
    """``B`` prompts of P/2..P tokens (BOS + characters), so a batch is left-padded like a real one."""
    return [("abcdefghijklmnopqrstuvwxyz" * 8)[i % 7: i % 7 + max(1, P - 1 - (i * (P // 2)) // max(B - 1, 1))]
            for i in range(B)]


def _grid(max_seq: int, quick: bool):
    """Batch sizes and lengths to measure, within the model's max_seq."""
    batches = (4, 16, 64) if not quick else (4, 24)
    seqs = sorted({min(max_seq, s) for s in ((16, 40, 64) if not quick else (16, 48))})
    gen_p = sorted({min(p, max(1, max_seq // 4)) for p in (6, 16)})
    gen_t = sorted({max(1, min(t, max_seq - max(gen_p))) for t in ((8, 40) if not quick else (8, 32))})
    return batches, seqs, gen_p, gen_t


def thread_counts(threads: int, quick: bool = False) -> list[int]:
    """The other torch thread counts a model is measured at besides its workers' ``threads``: 1 (what a
    stage gets whenever it shares its cores: parallel forwards, streamed consumers beside generation) and,
    unless ``quick``, the powers of two in between."""
    if threads <= 1:
        return []
    return [1] if quick else [t for t in (1, 2, 4, 8, 16, 32, 64) if t < threads]


def _generate_extras(worker, B: int, P: int, T: int, reps: int, pause: float, sync) -> list:
    """What a job's generate pays beyond the profiled call, at one point on 1 thread (``[B, P, T, chunks,
    plain s, with log-probs s, streamed s]``): the sampled tokens' log-probs kept (the ``reuse_logprobs``
    pass) and a streamed generate's chunks (8), each built as its own rollout and pickled (what Ray does with
    each chunk a streaming generator yields, inside the stage's span). Timed in turn, each after ``pause``,
    so each repetition's three calls see the same machine: the log-probs' ratio and the chunks' difference
    are medians over the repetitions of each one's own (drifts of the machine's speed cancel)."""
    import pickle

    import torch

    torch.set_num_threads(1)
    prompts, chunk = profile_prompts(B, P), max(1, B // 8)
    kw = dict(max_new_tokens=T, temperature=1.0, top_p=1.0)

    def streamed():
        for part in worker.generate_chunks(prompts, chunk=chunk, logprobs=True, **kw):
            pickle.dumps(part, protocol=5)

    calls = [lambda: worker.generate(prompts, **kw), lambda: worker.generate(prompts, logprobs=True, **kw), streamed]
    times: list[list[float]] = [[], [], []]
    for call in calls:
        call()   # warm-up
    for _ in range(reps):
        for i, call in enumerate(calls):
            if pause > 0:
                time.sleep(pause)
            t0 = time.perf_counter()
            call()
            sync()
            times[i].append(time.perf_counter() - t0)
    plain = float(statistics.median(times[0]))
    lp = plain * float(statistics.median(b / a for a, b in zip(times[0], times[1])))
    return [B, P, T, -(-B // chunk), plain, lp, lp + float(statistics.median(c - b for b, c in zip(*times[1:])))]


def measure_model(spec: dict, threads: int, *, device: str = "cpu", quick: bool = False, reps: int = 5,
                  log=None, extra_threads: tuple = (), pause: float = JOB_PAUSE_S, between=None) -> dict:
    """Time the primitives of one model shape through the runtime's own worker (the calls a job makes:
    ``ModelWorker.generate/logprobs/values/score/train``), see the module docstring.

    Generation runs with the model's own EOS; the fit uses the decode steps it actually took (random-weight
    models rarely stop early). Returns a profile entry with raw points and fits. ``extra_threads``: other
    thread counts to time every point at as well, right after the main count's timing (the same spell of
    machine load: their ratios are the model's own thread speed-up); they go to ``at_threads``. Each timed
    call follows ``pause`` idle seconds, as a job's worker calls follow a wait (:data:`JOB_PAUSE_S`).
    ``between``: called after the generate probes and after the forward probes (other probes spread over the
    model's, :class:`.recompute.SpreadProbes`; they restore the thread count they change).
    """
    import torch

    from rlhfc.runtime.data.values import PolicyLossInput, Rollout, ValueLossInput
    from rlhfc.runtime.worker.base import ModelWorker

    old = torch.get_num_threads()
    sync = (lambda: torch.cuda.synchronize()) if device != "cpu" else (lambda: None)
    try:
        worker = ModelWorker("profile", dict(spec), {"kind": "random"}, 0, max(1, threads), device)
        torch.set_num_threads(max(1, threads))
        head = worker.model.spec["head"]
        vocab = int(worker.model.spec["vocab"])
        batches, seqs, gen_p, gen_t = _grid(int(worker.model.spec.get("max_seq") or 512), quick)
        points: dict = {"generate": [], "forward": [], "train": [], "train_mb2": [], "optimizer": []}
        at = {t: {"generate": [], "forward": [], "train": []} for t in extra_threads if t != threads}

        def timed(prim: str, key: list, fn, extra=None) -> None:
            """The point ``key + [seconds]`` at the main count, then at each extra count (back to back)."""
            for t, dest in [(threads, points)] + list(at.items()):
                torch.set_num_threads(max(1, t))
                sec = _timeit(fn, reps, pause, statistics.median)
                dest.setdefault(prim, []).append(key + (extra() if extra else []) + [sec])
            torch.set_num_threads(max(1, threads))

        def rollout(B, S):
            P = max(1, S // 3)
            rb = _synthetic_batch(B, P, S - P, vocab, device)
            return Rollout(rb, ["x" * (P - 1)] * B, ["y" * (S - P)] * B, "profile", 0, worker.tok_id)

        if head == "lm":
            for B in batches:
                for P in gen_p:
                    for T in gen_t:
                        prompts = profile_prompts(B, P)
                        steps = []

                        def run(prompts=prompts, T=T, steps=steps):
                            out = worker.generate(prompts, max_new_tokens=T, temperature=1.0, top_p=1.0)
                            sync()
                            steps.append(int(out.batch.response_lengths.max()))

                        def taken(steps=steps):
                            med = float(statistics.median(steps))
                            steps.clear()
                            return [med]

                        timed("generate", [B, P], run, taken)
            points["generate_extras"] = [_generate_extras(worker, batches[len(batches) // 2], gen_p[-1], gen_t[-1],
                                                          max(reps, 5), pause, sync)]
            torch.set_num_threads(max(1, threads))
            if log:
                log(f"  generate: {len(points['generate'])} points")
            if between:
                between()
        call = {"lm": lambda r: worker.logprobs(r, temperature=1.0), "value": worker.values,
                "score": worker.score}[head]
        for B in batches:
            for S in seqs:
                r = rollout(B, S)

                def run_fwd(r=r):
                    call(r)
                    sync()

                timed("forward", [B, S], run_fwd)
        if log:
            log(f"  forward: {len(points['forward'])} points")
        if between:
            between()
        if head in ("lm", "value"):
            for B in (2, 8, 32) if not quick else (2, 12):
                for S in seqs:
                    r = rollout(B, S)
                    zeros = torch.zeros(B, r.batch.response_width)
                    loss = (PolicyLossInput(r, zeros - 4.0, zeros + 0.1, None, 0.2, 0.0, 0.0, "k3", 1.0)
                            if head == "lm" else ValueLossInput(r, zeros, zeros + 0.5, 0.2))

                    def run_train(loss=loss, mb=1):
                        worker.train(loss, lr=1e-6, epochs=1, minibatches=mb, max_grad_norm=1.0, weight_decay=0.0)
                        sync()

                    timed("train", [B, S], run_train)
                    if S == seqs[len(seqs) // 2]:   # the same rows in two minibatches, right after: what a call
                        timed("train_mb2", [B, S], lambda: run_train(mb=2))   # pays once (refit: train_call)
            model, opt = worker.model, worker.optimizer
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)

            def run_opt():
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sync()

            points["optimizer"] = [_timeit(run_opt, 7, stat=statistics.median)]
            opt.zero_grad(set_to_none=True)
            if log:
                log(f"  train: {len(points['train'])} points")
        entry = refit({"spec": {k: worker.model.spec[k] for k in ("arch", "layers", "hidden", "heads", "kv_heads",
                                                                   "ffn", "vocab", "max_seq", "head")},
                       "threads": threads, "points": points})
        if at:
            entry["at_threads"] = {str(t): {"points": pts} for t, pts in sorted(at.items())}
        return entry
    finally:
        torch.set_num_threads(old)


def measure_compute(ops: list[str], threads: int, *, reps: int = 5) -> dict:
    """Time the driver-side ``compute.*`` ops of the runtime at two sizes each."""
    import torch

    from rlhfc.runtime import compute as rt_ops
    from rlhfc.runtime.data.values import Rollout, TokenValues

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    out: dict = {}
    try:
        for op in ops:
            name = op.split(".", 1)[1]
            fn = getattr(rt_ops, name, None)
            if fn is None:
                continue
            pts = []
            for B, R in ((8, 16), (64, 48)):
                rb = _synthetic_batch(B, 8, R, 96, "cpu")
                roll = Rollout(rb, ["abc"] * B, ["def ghi"] * B, "m", 0, "char:96")
                tv = TokenValues(torch.randn(B, R) * 0.1, rb.response_mask)
                seq = torch.randn(B)
                call = {
                    "gae": lambda: fn(seq, tv, tv, tv, gamma=1.0, lam=0.95, kl_coef=0.05, estimator="k1",
                                      whiten=True),
                    "kl_penalty": lambda: fn(seq, tv, tv, coef=0.05, estimator="k1"),
                    "group_advantages": lambda: fn(roll, seq, method="grpo", normalize_std=True, group=4),
                    "rule": lambda: fn(roll, fn="rlhfc.runtime.rewards:vowel_fraction"),
                    "ppo_clip": lambda: fn(roll, tv, tv, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3"),
                    "value_loss": lambda: fn(roll, tv, tv, clip=0.2),
                }.get(name)
                if call is None:
                    break
                try:
                    pts.append([B, R, _timeit(call, reps)])
                except Exception:  # an op whose signature changed: leave it to the defaults
                    pts = []
                    break
            if pts:
                out[op] = {"points": pts, "fit": fit_relative([compute_features(b, r) for b, r, _ in pts],
                                                              [t for _, _, t in pts])}
    finally:
        torch.set_num_threads(old)
    return out


def detect_device() -> tuple[str, str]:
    """(kind, name) of the local accelerator: a catalogued GPU kind when CUDA has one, else ``cpu``."""
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            mem = torch.cuda.get_device_properties(0).total_memory
            kind = "H200" if "H200" in name else "H100-80GB" if "H100" in name else \
                ("A100-80GB" if mem > 50e9 else "A100-40GB") if "A100" in name else None
            if kind:
                return kind, name
    except Exception:
        pass
    return "cpu", cpu_name()


def run_profile(module, *, threads: int | None = None, quick: bool = False, log=None,
                max_params: float | None = None, reps: int = 5, pause: float = JOB_PAUSE_S,
                vllm: bool = True, train_shapes: dict | None = None) -> Profile:
    """Measure the host and every model shape of ``module`` that is small enough to build here
    (``max_params``: 5e8 on CPU, 3e9 on a GPU; bigger models keep the analytical model; ``pause``: idle
    seconds before each timed model call, 0 for what calls back to back in one process). With ``vllm`` and
    vLLM installed, the vLLM engine of every generating model's shape too (:func:`.vllm_engine.measure_vllm`; the
    profile's host section names the vLLM version, or ``None`` when it was not measured). ``train_shapes``
    (``{model key: (rows, seq)}``, :func:`rlhfc.cost.profile.model_key`; on a CPU): the micro-batch each trained
    model's block trains at; each op of that block's forward is timed there (the model's ``recompute`` entry,
    :func:`.recompute.measure_block_ops`), which the recompute pass prices a replay with rather than the host's
    kind rates, and what a selective checkpoint adds per aten call there (:func:`.recompute.measure_dispatch`),
    rather than the host's tiny-block rate."""
    _set_passive_waits()
    import torch

    kind, name = detect_device()
    device = "cpu" if kind == "cpu" else "cuda"
    if threads is None:
        threads = module.cluster.per_node if (module is not None and module.cluster.device == "cpu") \
            else (os.cpu_count() or 1)
    log = log or (lambda msg: None)
    if max_params is None:
        max_params = 5e8 if device == "cpu" else 3e9
    log(f"profiling {name} ({kind}) with {threads} torch thread(s)")
    prof = Profile(kind, name, threads, created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    prof.host = measure_host(threads, device, quick)
    prof.host["torch"] = torch.__version__
    from rlhfc.calibrate.vllm_engine import _vllm_version, measure_vllm

    vllm_version = _vllm_version() if vllm else None
    prof.host["vllm"] = vllm_version
    if module is None:
        return prof
    seen: set[str] = set()
    worker_threads: dict[str, int] = {}
    if device == "cpu":   # a model is measured with the threads its workers run (1 when models share cores)
        for w in workers(module).values():
            worker_threads[w.model] = min(worker_threads.get(w.model, threads), w.threads)
    todo = []
    for m in module.models.values():
        key = model_key(m)
        if module.graph.stages_on(m.name) and key not in seen:
            seen.add(key)
            todo.append((m, key, {"arch": m.arch, "layers": m.layers, "hidden": m.hidden, "heads": m.heads,
                                  "kv_heads": m.kv_heads, "ffn": m.ffn, "vocab": m.vocab, "max_seq": m.max_seq,
                                  "head": m.head, "source": None}))
    # what a replay of each trained block costs (each op, on that block at its shape) and what a selective
    # checkpoint adds per call there: in rounds spread over the model probes, medians kept
    shapes = train_shapes or {}
    blocks = {key: (spec, int(shapes[key][0]), int(shapes[key][1])) for m, key, spec in todo
              if key in shapes and m.params <= max_params} if device == "cpu" else {}
    probes = None
    if blocks:
        from rlhfc.calibrate.recompute import SpreadProbes

        probes = SpreadProbes(blocks, quick, seed=prof.host.get("recompute"))
        probes.take()
    for m, key, spec in todo:
        if m.params > max_params:
            log(f"model @{m.name} ({key}): {m.params / 1e9:.1f}B parameters is too large to build here; "
                "its stages use the analytical model")
            continue
        log(f"model @{m.name} ({key})")
        count = min(threads, worker_threads.get(m.name, threads))
        prof.models[key] = measure_model(spec, count, device=device, quick=quick, log=log,
                                         reps=min(reps, 3) if quick else reps,   # each after a JOB_PAUSE_S wait
                                         extra_threads=tuple(thread_counts(count, quick)) if device == "cpu" else (),
                                         pause=pause, between=probes.middle if probes else None)
        if vllm_version and any(s.op == "generate" for s in module.graph.stages_on(m.name)):
            prof.models[key]["vllm"] = measure_vllm(spec, count, device=device, quick=quick, reps=3 if quick else reps,
                                                    copy_bw=float(prof.host.get("copy_bw", 0.0)), log=log)
            if "unsupported" in prof.models[key]["vllm"]:
                log(f"  vllm: {prof.models[key]['vllm']['unsupported']}")
    ops = sorted({s.op for s in module.graph.stages if s.op.startswith("compute.")})
    if ops:
        prof.compute = measure_compute(ops, threads, reps=reps)
        log(f"compute ops: {', '.join(prof.compute)}")
    if probes:
        probes.take()
        prof.host["recompute"].update(probes.host_costs())
        for key in blocks:
            entry = prof.models[key]["recompute"] = probes.block(key)
            log(f"@{key}'s block at {entry['rows']} x {entry['seq']} tokens ({entry['rounds']} rounds over the "
                f"profile): forward ops {sum(entry['op_s'].values()) * 1e3:.2f} ms, a selective checkpoint's call "
                f"{entry['ckpt_op_s'] * 1e6:.1f} us")
    return prof
