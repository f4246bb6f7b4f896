"""Calibration: measure this machine for a program's models and save a profile.

``rlhfc profile FILE`` times the runtime's own worker (the code a job runs)
in-process, for every distinct model shape of the program, at a small grid of
batch x length points, each model with as many torch threads as its workers
will run (one per whole core of a worker's share of its cores: 1 when several
models share a node's cores; the host probes use every core of a node):

========================  ====================================================  =============================
primitive                 what is timed                                         fitted as (seconds)
========================  ====================================================  =============================
``generate`` (lm head)    ``ModelWorker.generate``: B prompts of P tokens,       a + b*B*P + T*(c + d*B + e*B*(P+T/2))
                          T = the decode steps it took (prefill + T steps)
``forward``               ``ModelWorker.logprobs`` / ``values`` / ``score`` on   (a + b*B*S + c*B*S^2) * r(B, S)
                          B sequences of S tokens
``train`` (lm, value)     ``ModelWorker.train``, one optimizer step (actor or    (a + b*B*S + c*B*S^2) * r(B, S)
                          critic loss, forward+backward+clip+AdamW)
``optimizer``             ``clip_grad_norm_`` + ``AdamW.step`` alone            constant
``compute.<op>``          the driver-side op of ``rlhfc.runtime.compute``       a + b*B*R
========================  ====================================================  =============================

``r(B, S)`` is the measured/fitted ratio at the grid points, interpolated
bilinearly (held at the grid's edges): small CPU kernels do not scale smoothly.
Each point is the fastest of a few repetitions (after a warm-up): on a shared
machine the least-disturbed run is the most repeatable estimate of what the
code costs. Fits are non-negative least squares on relative error (every
point counts the same whatever its size); :func:`merge_profiles` combines
passes taken at different times. The host section holds a float32 matmul probe at
1..threads threads (the CPU's FLOP/s and thread scaling) and a memory-copy
bandwidth, which price models the profile did not measure.

The profile is JSON (``Profile.save``/``load_profile``); the default location is
``~/.cache/rlhfc/profile-<device>.json`` (``RLHFC_CACHE_DIR`` overrides the
folder). Torch is imported only when measuring.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

FORMAT = 1

#: the fitted form of each primitive: names of the features (see module docstring)
FEATURES = {
    "generate": ("1", "B*P", "T", "T*B", "T*B*ctx"),
    "forward": ("1", "B*S", "B*S^2"),
    "train": ("1", "B*S", "B*S^2"),
    "compute": ("1", "B*R"),
}


def generate_features(B, P, T):
    return [1.0, B * P, T, T * B, T * B * (P + T / 2.0)]


def forward_features(B, S):
    return [1.0, B * S, B * S * S]


def compute_features(B, R):
    return [1.0, B * R]


def model_key(spec) -> str:
    """A profile key for a model shape: architecture, sizes and head (``copy(actor)`` shares the actor's)."""
    get = (lambda k: spec[k]) if isinstance(spec, dict) else (lambda k: getattr(spec, k))
    return (f"{get('arch')}-L{get('layers')}-h{get('hidden')}-a{get('heads')}-kv{get('kv_heads')}"
            f"-f{get('ffn')}-v{get('vocab')}-{get('head')}")


@dataclass
class Profile:
    """Measured rates of one device kind (``cpu`` or a GPU kind) for some model shapes."""

    device_kind: str
    device_name: str
    threads: int
    host: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)
    compute: dict = field(default_factory=dict)
    created: str = ""
    path: str | None = None

    def fit(self, key: str, primitive: str):
        """Fitted coefficients of ``primitive`` for model ``key`` (None if not measured)."""
        entry = self.models.get(key)
        if not entry:
            return None
        return entry.get("fit", {}).get(primitive)

    def model_threads(self, key: str) -> int:
        return int(self.models.get(key, {}).get("threads", self.threads))

    def compute_fit(self, op: str):
        entry = self.compute.get(op)
        return entry.get("fit") if entry else None

    def to_json(self) -> dict:
        return {"format": FORMAT, "created": self.created,
                "device": {"kind": self.device_kind, "name": self.device_name, "threads": self.threads},
                "host": self.host, "models": self.models, "compute": self.compute}

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
        self.path = path
        return path


class ProfileError(ValueError):
    """A profile file that cannot be used (missing, unreadable, wrong format)."""


def load_profile(path: str) -> Profile:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f"profile {path} has format {data.get('format') if isinstance(data, dict) else '?'}, "
                           f"expected {FORMAT}; re-run `rlhfc profile`")
    dev = data.get("device", {})
    return Profile(dev.get("kind", "cpu"), dev.get("name", ""), int(dev.get("threads", 1)), data.get("host", {}),
                   data.get("models", {}), data.get("compute", {}), data.get("created", ""), path)


def cache_dir() -> str:
    return os.environ.get("RLHFC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "rlhfc")


def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "device"


def default_profile_path(device_kind: str = "cpu", device_name: str | None = None) -> str:
    """``<cache>/profile-<device>.json``: the host CPU's model name for cpu, the GPU kind otherwise."""
    name = device_name or (cpu_name() if device_kind == "cpu" else device_kind)
    return os.path.join(cache_dir(), f"profile-{slug(name)}.json")


def find_default_profile(device_kind: str) -> Profile | None:
    """The default profile for ``device_kind`` on this machine, if one was saved."""
    path = default_profile_path(device_kind) if device_kind == "cpu" else default_profile_path(device_kind,
                                                                                                 device_kind)
    if not os.path.isfile(path):
        return None
    try:
        prof = load_profile(path)
    except ProfileError:
        return None
    return prof if prof.device_kind == device_kind else None


# ------------------------------------------------------------------------------------------ fitting


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares min ||a x - b||, x >= 0 (Lawson-Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iters):
        if passive.all() or (w[~passive] <= 1e-12).all():
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_relative(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Coefficients c >= 0 minimising the relative error of ``features @ c`` against ``seconds``."""
    a = np.asarray(features, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / np.maximum(t, 1e-9)
    coef = nnls(a / scale * w[:, None], t * w)
    return [float(c) for c in coef / scale]


def fit_errors(features: list[list[float]], seconds: list[float], coef: list[float]) -> list[float]:
    pred = np.asarray(features, dtype=np.float64) @ np.asarray(coef)
    return [float(p / t - 1) for p, t in zip(pred, seconds)]


def correction_grid(points: list, coef: list) -> dict | None:
    """Measured / fitted time on the (B, S) grid of the points, for bilinear interpolation.

    Small CPU kernels do not scale smoothly with size (threading thresholds, cache effects), so the fit alone
    can be 10-20 % off between its points; the model multiplies the fit by this ratio, interpolated inside the
    grid and held at its edges outside it (where the fit's shape extrapolates). None unless the points form a
    full grid.
    """
    bs = sorted({float(p[0]) for p in points})
    ss = sorted({float(p[1]) for p in points})
    table = {(float(p[0]), float(p[1])): p[2] for p in points}
    if len(bs) < 2 or len(ss) < 2 or len(table) != len(bs) * len(ss):
        return None
    ratio = [[table[(b, s_)] / max(float(np.dot(forward_features(b, s_), coef)), 1e-12) for s_ in ss] for b in bs]
    return {"B": bs, "S": ss, "ratio": ratio}


def refit(entry: dict) -> dict:
    """(Re)compute an entry's fits from its raw points."""
    pts = entry.get("points", {})
    fits: dict = {}
    if pts.get("generate"):
        fits["generate"] = fit_relative([generate_features(*p[:3]) for p in pts["generate"]],
                                        [p[3] for p in pts["generate"]])
    for prim in ("forward", "train"):
        if pts.get(prim):
            fits[prim] = fit_relative([forward_features(*p[:2]) for p in pts[prim]], [p[2] for p in pts[prim]])
            grid = correction_grid(pts[prim], fits[prim])
            if grid is not None:
                fits[prim + "_grid"] = grid
    if pts.get("optimizer"):
        fits["optimizer"] = float(statistics.median(pts["optimizer"]))
    entry["fit"] = fits
    return entry


# ------------------------------------------------------------------------------------------ measuring


def _timeit(fn, reps: int = 5) -> float:
    fn()  # warm-up (allocator, lazy init)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(min(times))


def _set_passive_waits() -> None:
    """Idle OpenMP threads sleep instead of spinning, so a busy co-tenant on a small machine does not turn
    2-thread kernels into 10-100x slower ones (the same setting makes measurements repeatable). OpenMP reads
    it once, so it only matters before torch is first imported (``rlhfc profile`` on the command line)."""
    import sys

    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def measure_host(threads: int, device: str = "cpu") -> dict:
    """FLOP/s of a float32 (cpu) / bf16 (cuda) matmul at 1..threads threads, and memory-copy bandwidth."""
    import torch

    out: dict = {}
    if device == "cpu":
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
    return out


def _synthetic_batch(B: int, P: int, R: int, vocab: int, device):
    """A RolloutBatch of B rows, P prompt columns (prompts of P/2..P tokens, left-padded, as real batches are)
    and R response tokens; random ids."""
    import torch

    from rlhfc.runtime.generation import RolloutBatch

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


def _grid(max_seq: int, quick: bool):
    """Batch sizes and lengths to measure, within the model's max_seq."""
    batches = (4, 16, 64) if not quick else (4, 24)
    seqs = sorted({min(max_seq, s) for s in ((16, 40, 64) if not quick else (16, 48))})
    gen_p = sorted({min(p, max(1, max_seq // 4)) for p in (6, 16)})
    gen_t = sorted({max(1, min(t, max_seq - max(gen_p))) for t in ((8, 40) if not quick else (8, 32))})
    return batches, seqs, gen_p, gen_t


def measure_model(spec: dict, threads: int, *, device: str = "cpu", quick: bool = False, reps: int = 5,
                  log=None) -> dict:
    """Time the primitives of one model shape through the runtime's own worker (the calls a job makes:
    ``ModelWorker.generate/logprobs/values/score/train``), see the module docstring.

    Generation runs with the model's own EOS; the fit uses the decode steps it actually took (random-weight
    models rarely stop early). Returns a profile entry with raw points and fits.
    """
    import torch

    from rlhfc.runtime.values import PolicyLossInput, Rollout, ValueLossInput
    from rlhfc.runtime.worker import ModelWorker

    old = torch.get_num_threads()
    sync = (lambda: torch.cuda.synchronize()) if device != "cpu" else (lambda: None)
    try:
        worker = ModelWorker("profile", dict(spec), {"kind": "random"}, 0, max(1, threads), device)
        torch.set_num_threads(max(1, threads))
        head = worker.model.spec["head"]
        vocab = int(worker.model.spec["vocab"])
        batches, seqs, gen_p, gen_t = _grid(int(worker.model.spec.get("max_seq") or 512), quick)
        points: dict = {"generate": [], "forward": [], "train": [], "optimizer": []}

        def rollout(B, S):
            P = max(1, S // 3)
            rb = _synthetic_batch(B, P, S - P, vocab, device)
            return Rollout(rb, ["x" * (P - 1)] * B, ["y" * (S - P)] * B, "profile", 0, worker.tok_id)

        if head == "lm":
            for B in batches:
                for P in gen_p:
                    for T in gen_t:
                        # prompts of P/2..P tokens (BOS + characters), so batches are left-padded like real ones
                        prompts = [("abcdefghijklmnopqrstuvwxyz" * 8)[i % 7: i % 7 + max(1, P - 1 - (i * (P // 2))
                                                                                       // max(B - 1, 1))]
                                   for i in range(B)]
                        steps = []

                        def run(prompts=prompts, T=T, steps=steps):
                            out = worker.generate(prompts, max_new_tokens=T, temperature=1.0, top_p=1.0)
                            sync()
                            steps.append(int(out.batch.response_lengths.max()))

                        sec = _timeit(run, reps)
                        points["generate"].append([B, P, float(statistics.median(steps)), sec])
            if log:
                log(f"  generate: {len(points['generate'])} points")
        call = {"lm": lambda r: worker.logprobs(r, temperature=1.0), "value": worker.values,
                "score": worker.score}[head]
        for B in batches:
            for S in seqs:
                r = rollout(B, S)

                def run_fwd(r=r):
                    call(r)
                    sync()

                points["forward"].append([B, S, _timeit(run_fwd, reps)])
        if log:
            log(f"  forward: {len(points['forward'])} points")
        if head in ("lm", "value"):
            for B in (2, 8, 32) if not quick else (2, 12):
                for S in seqs:
                    r = rollout(B, S)
                    zeros = torch.zeros(B, r.batch.response_width)
                    loss = (PolicyLossInput(r, zeros - 4.0, zeros + 0.1, None, 0.2, 0.0, 0.0, "k3", 1.0)
                            if head == "lm" else ValueLossInput(r, zeros, zeros + 0.5, 0.2))

                    def run_train(loss=loss):
                        worker.train(loss, lr=1e-6, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
                        sync()

                    points["train"].append([B, S, _timeit(run_train, reps)])
            model, opt = worker.model, worker.optimizer
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad = torch.zeros_like(p)

            def run_opt():
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sync()

            points["optimizer"] = [_timeit(run_opt, 7)]
            opt.zero_grad(set_to_none=True)
            if log:
                log(f"  train: {len(points['train'])} points")
        return refit({"spec": {k: worker.model.spec[k] for k in ("arch", "layers", "hidden", "heads", "kv_heads",
                                                                  "ffn", "vocab", "max_seq", "head")},
                      "threads": threads, "points": points})
    finally:
        torch.set_num_threads(old)


def measure_compute(ops: list[str], threads: int, *, reps: int = 5) -> dict:
    """Time the driver-side ``compute.*`` ops of the runtime at two sizes each."""
    import torch

    from rlhfc.runtime import compute as rt_ops
    from rlhfc.runtime.values import Rollout, TokenValues

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


def merge_profiles(a: Profile, b: Profile) -> Profile:
    """One profile from two of the same device: at every measured point the faster time, then refitted.

    Repeated profiling passes spread over time, merged, see through another tenant's passing load."""
    out = Profile(a.device_kind, a.device_name, a.threads, dict(a.host), {}, {}, a.created, a.path)
    for k in ("matmul_flops", "matmul_flops_1", "copy_bw"):
        if k in b.host:
            out.host[k] = max(a.host.get(k, 0.0), b.host[k])
    keys = list(a.models) + [k for k in b.models if k not in a.models]
    for key in keys:
        ea, eb = a.models.get(key), b.models.get(key)
        if ea is None or eb is None:
            out.models[key] = json.loads(json.dumps(ea or eb))
            continue
        points = {}
        for prim in ("generate", "forward", "train"):
            best: dict = {}
            for p in ea["points"].get(prim, []) + eb["points"].get(prim, []):
                k = tuple(round(x, 6) for x in p[:-1])
                if k not in best or p[-1] < best[k][-1]:
                    best[k] = p
            points[prim] = list(best.values())
        points["optimizer"] = [min(ea["points"].get("optimizer", []) + eb["points"].get("optimizer", []),
                                   default=None)] if (ea["points"].get("optimizer") or
                                                      eb["points"].get("optimizer")) else []
        out.models[key] = refit({"spec": ea["spec"], "threads": ea["threads"], "points": points})
    for op in list(a.compute) + [o for o in b.compute if o not in a.compute]:
        ca, cb = a.compute.get(op), b.compute.get(op)
        if ca is None or cb is None:
            out.compute[op] = ca or cb
            continue
        best = {}
        for p in ca["points"] + cb["points"]:
            if tuple(p[:2]) not in best or p[2] < best[tuple(p[:2])][2]:
                best[tuple(p[:2])] = p
        pts = list(best.values())
        out.compute[op] = {"points": pts, "fit": fit_relative([compute_features(x, y) for x, y, _ in pts],
                                                              [t for _, _, t in pts])}
    return out


def run_profile(module, *, threads: int | None = None, quick: bool = False, log=None,
                max_params: float | None = None, reps: int = 5) -> Profile:
    """Measure the host and every model shape of ``module`` that is small enough to build here
    (``max_params``: 5e8 on CPU, 3e9 on a GPU; bigger models keep the analytical model)."""
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
    prof.host = measure_host(threads, device)
    prof.host["torch"] = torch.__version__
    if module is None:
        return prof
    seen: set[str] = set()
    worker_threads: dict[str, int] = {}
    if device == "cpu":   # a model is measured with the threads its workers run (1 when models share cores)
        from .layout import cpu_workers

        for (model, _), w in cpu_workers(module).items():
            worker_threads[model] = min(worker_threads.get(model, threads), w["threads"])
    for m in module.models.values():
        if not module.graph.stages_on(m.name):
            continue
        key = model_key(m)
        if key in seen:
            continue
        seen.add(key)
        if m.params > max_params:
            log(f"model @{m.name} ({key}): {m.params / 1e9:.1f}B parameters is too large to build here; "
                "its stages use the analytical model")
            continue
        spec = {"arch": m.arch, "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
                "ffn": m.ffn, "vocab": m.vocab, "max_seq": m.max_seq, "head": m.head, "source": None}
        log(f"model @{m.name} ({key})")
        prof.models[key] = measure_model(spec, min(threads, worker_threads.get(m.name, threads)), device=device,
                                         quick=quick, log=log, reps=reps)
    ops = sorted({s.op for s in module.graph.stages if s.op.startswith("compute.")})
    if ops:
        prof.compute = measure_compute(ops, threads, reps=reps)
        log(f"compute ops: {', '.join(prof.compute)}")
    return prof
