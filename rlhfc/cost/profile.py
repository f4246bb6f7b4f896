"""Profiles: the measured rates of one machine, their file format and the fits (NumPy only).

A profile holds, for every distinct model shape of a program, times at a small grid of batch x length
points, each model measured with as many torch threads as its workers will run. :mod:`rlhfc.calibrate`
(``rlhfc profile``) takes the measurements by timing the runtime's own worker; this module only stores,
loads, merges and fits them, and imports neither torch nor the runtime:

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
``train_call``            ``train`` with the same rows in 2 minibatches          ``a`` paid once per call
                          (a few points): :func:`train_call`
``generate_logprobs``,    one point, 1 thread: ``generate`` keeping log-probs,  fraction of the call;
``generate_chunk``        ``generate_chunks`` (8 chunks, each pickled)           seconds per chunk
``compute.<op>``          the driver-side op of ``rlhfc.runtime.compute``       a + b*B*R
========================  ====================================================  =============================

``r(B, S)`` is the measured/fitted ratio at the grid points, interpolated bilinearly (held at the grid's
edges; each ratio within ``GRID_CLAMP``, 0.8-1.25): small CPU kernels do not scale smoothly. Fits are
non-negative least squares on relative error (every point counts the same whatever its size);
:func:`merge_profiles` combines passes taken at different times. The host section holds a float32 matmul
probe at 1..threads threads (the CPU's FLOP/s and thread scaling), a memory-copy bandwidth, which price
models the profile did not measure, ``kind_bw``: the bytes/s of a softmax, an elementwise op and a copy on a
tensor the size of a block's attention scores (what the recompute pass prices op kinds at), and
``recompute``: what a replay pays beyond its ops (s/byte of a fresh output by size, a checkpoint's cost per block
and per dispatched op); a trained model's ``recompute``: its block's ops timed in a replay (``rows, seq, op_s``).

A model on more than one thread is also timed at 1 thread (and, without ``--quick``, the powers of two in
between), each point right after the main one: ``at_threads``. Their ratios are the model's own thread
speed-up (:meth:`Profile.thread_speedup`), which prices a stage that runs on fewer threads than its mesh
has cores (stages sharing cores at -O2); small models' kernels scale far worse than the host's matmul probe.

A model shape the profile did not measure borrows the fits of the nearest measured shape of the same
architecture and head (:meth:`Profile.fit`, :func:`transfer_fit`): each fitted term is split into what
scales with the matmul FLOPs (priced at the host's measured matmul rate) and a remainder that scales with
layers x width (elementwise work, per-layer overheads), so another width or depth is *predicted* from
measurements of a neighbour, not priced by the catalog roofline. The correction grid does not transfer.

With vLLM installed, ``rlhfc profile`` also times the vLLM engine of each generating model (a model entry's
``vllm`` section: generate points, refit points, the engine's ``max_num_seqs`` and KV-cache tokens, and
their fits; or ``unsupported`` with the reason vLLM cannot run the shape). :mod:`rlhfc.cost.engine` reads it;
a profile without it (older ones included) loads as before and vLLM is priced by the catalog assumption.

The profile is JSON (``Profile.save``/``load_profile``); the default location is
``~/.cache/rlhfc/profile-<device>.json`` (``RLHFC_CACHE_DIR`` overrides the folder).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
from dataclasses import dataclass, field

import numpy as np

from .fitting import fit_errors, fit_relative, nnls  # noqa: F401  (the profile's fits; re-exported)

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
        """Fitted coefficients of ``primitive`` for model ``key``; for a shape not measured, the nearest
        measured shape's, transferred (:func:`transfer_fit`; no correction grid); None if there is none."""
        entry = self.models.get(key)
        if entry:
            fit = entry.get("fit", {}).get(primitive)
            return clamp_grid(fit) if primitive.endswith("_grid") and fit else fit
        donor = self.donor(key)
        if donor is None or primitive.endswith("_grid"):
            return None
        fit = self.models[donor].get("fit", {}).get(primitive)
        return None if fit is None else transfer_fit(primitive, fit, donor, key, self.host,
                                                     self.model_threads(donor))

    def donor(self, key: str) -> str | None:
        """The measured shape an unmeasured ``key`` borrows from: same architecture and head, the nearest in
        matmul parameters (then in layers x width); None when the key is measured or none fits."""
        want = parse_key(key)
        if want is None or key in self.models:
            return None
        cands = [(abs(np.log(matmul_params(sh) / matmul_params(want))),
                  abs(np.log(sh["L"] * sh["h"] / (want["L"] * want["h"]))), k)
                 for k, sh in ((k, parse_key(k)) for k in self.models)
                 if sh is not None and sh["arch"] == want["arch"] and sh["head"] == want["head"]
                 and self.models[k].get("fit")]
        return min(cands)[2] if cands else None

    def thread_counts(self, key: str) -> list[int]:
        """The torch thread counts ``key`` (or its donor) was timed at: its fits' and ``at_threads``'."""
        entry = self.models.get(key) or self.models.get(self.donor(key) or "") or {}
        return sorted({self.model_threads(key)} | {int(t) for t in entry.get("at_threads") or {}})

    def fit_at(self, key: str, primitive: str, threads: int):
        """:meth:`fit` of the points timed at ``threads`` threads (None where none were); an unmeasured shape
        transfers its donor's, at that count's matmul rate."""
        if threads == self.model_threads(key):
            return self.fit(key, primitive)
        donor = None if key in self.models else self.donor(key)
        sub = ((self.models.get(donor or key) or {}).get("at_threads") or {}).get(str(threads))
        if sub is None:
            return None
        if "fit" not in sub:
            sub["fit"] = refit({"points": sub.get("points", {})})["fit"]
        fit = sub["fit"].get(primitive)
        if fit is None or donor is None:
            return clamp_grid(fit) if primitive.endswith("_grid") and fit else fit
        return None if primitive.endswith("_grid") else transfer_fit(primitive, fit, donor, key, self.host, threads)

    def thread_speedup(self, key: str, primitive: str) -> tuple | None:
        """The model's own measured speed-up of ``primitive`` at 1..n threads over one thread (n: the count
        its fits were measured at), from the points timed at other counts (``at_threads``, back to back with
        the main ones): at each count the median over the grid of T(1) / T(count), counts in between
        interpolated. None when the profile timed the model at one count only (the host's matmul probe then
        stands in). An unmeasured shape borrows its donor's."""
        entry = self.models.get(key) or self.models.get(self.donor(key) or "")
        at = (entry or {}).get("at_threads") or {}
        if primitive not in FEATURES or "1" not in at:
            return None
        by_count = {int(entry.get("threads", self.threads)): entry.get("points", {})}
        by_count.update({int(t): sub.get("points", {}) for t, sub in at.items()})
        one = _by_point(by_count.pop(1).get(primitive, []))
        known = {1: 1.0}
        for t, pts in by_count.items():
            ratios = [one[k] / sec for k, sec in _by_point(pts.get(primitive, [])).items() if k in one and sec > 0]
            if ratios:
                known[t] = float(statistics.median(ratios))
        if len(known) < 2:
            return None
        xs = sorted(known)
        return tuple(float(np.interp(t, xs, [known[x] for x in xs])) for t in range(1, xs[-1] + 1))

    def model_threads(self, key: str) -> int:
        entry = self.models.get(key) or self.models.get(self.donor(key) or "", {})
        return int(entry.get("threads", self.threads))

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


def _by_point(points: list) -> dict:
    """Seconds by grid point: (B, S) or (B, P) and the point's rank among those (generate: one per T)."""
    seen: dict = {}
    out = {}
    for p in points:
        k = (float(p[0]), float(p[1]))
        seen[k] = seen.get(k, -1) + 1
        out[k + (seen[k],)] = float(p[-1])
    return out


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


# ------------------------------------------------------------------------------------------ other shapes

_KEY = re.compile(r"^(?P<arch>[a-z0-9_]+)-L(?P<L>\d+)-h(?P<h>\d+)-a(?P<a>\d+)-kv(?P<kv>\d+)-f(?P<f>\d+)"
                  r"-v(?P<v>\d+)-(?P<head>[a-z]+)$")


def parse_key(key: str) -> dict | None:
    """The shape a :func:`model_key` names (None for a key of another form)."""
    m = _KEY.match(key)
    if m is None:
        return None
    out = {k: int(v) for k, v in m.groupdict().items() if k not in ("arch", "head")}
    return {**out, "arch": m["arch"], "head": m["head"]}


def matmul_params(sh: dict) -> float:
    """Matmul weights a token passes through (as :func:`rlhfc.cost.model.arch_numbers` counts them)."""
    h, f, kv_dim = sh["h"], sh["f"], sh["kv"] * (sh["h"] // max(sh["a"], 1))
    if sh["arch"] == "gpt2":
        per_layer = h * (h + 2 * kv_dim) + h * h + 2 * h * f
    else:
        per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * f
    return float(sh["L"] * per_layer + (sh["v"] * h if sh["head"] == "lm" else h))


#: per primitive, what each fitted coefficient scales with: "flops" (split into a matmul part at the host's
#: rate, times the FLOPs per unit, and a remainder scaling with layers x width), "Lh" (layers x width:
#: attention over the context, elementwise work) or "L" (per-layer overheads of a call or a decode step)
TRANSFER = {
    "forward": (("L", 0), ("flops", 2), ("Lh", 0)),
    "train": (("L", 0), ("flops", 6), ("Lh", 0)),
    "generate": (("L", 0), ("flops", 2), ("L", 0), ("flops", 2), ("Lh", 0)),
}


def transfer_fit(primitive: str, fit, donor: str, key: str, host: dict, threads: int):
    """``donor``'s fit of ``primitive`` carried over to shape ``key`` (see :data:`TRANSFER`). A "flops" term
    ``c`` (seconds per unit: a token, a row's decode step) is ``n * mm / R + rest``, with ``n * mm`` the
    FLOPs per unit (``n`` = 2 forward, 6 forward + backward) and ``R`` the host's matmul FLOP/s at the
    model's threads; the matmul part follows the new shape's FLOPs and ``rest`` (>= 0) its layers x width."""
    d, k = parse_key(donor), parse_key(key)
    r_l = k["L"] / d["L"]
    r_lh = k["L"] * k["h"] / (d["L"] * d["h"])
    if primitive == "optimizer":
        return float(fit) * (matmul_params(k) / matmul_params(d)) ** 0.5 * r_l ** 0.5
    if primitive in ("train_call", "generate_logprobs", "generate_chunk"):   # per call / chunk, or a fraction
        return float(fit)
    speed = host.get("thread_speedup") or [1.0]
    rate = float(host.get("matmul_flops_1", 0.0)) * float(speed[min(max(threads, 1), len(speed)) - 1])
    out = []
    for c, (kind, n) in zip(fit, TRANSFER[primitive]):
        if kind == "L":
            out.append(c * r_l)
        elif kind == "Lh":
            out.append(c * r_lh)
        else:
            mm_part = min(c, n * matmul_params(d) / rate) if rate > 0 else 0.0
            out.append(mm_part * matmul_params(k) / matmul_params(d) + (c - mm_part) * r_lh)
    return out


def train_call(pts: dict, fits: dict) -> float | None:
    """The part of a train call's fixed cost paid once per call, not per minibatch (moving the batch, the
    loss's inputs, the metrics): the fit's intercept ``a`` (one minibatch) less what a second minibatch of
    the same rows adds, ``T(2 minibatches) - T(1)`` (same rows and tokens: only per-minibatch fixed costs
    repeat), the median over the points timed both ways, within ``[0, a - optimizer]``."""
    if not pts.get("train_mb2") or not fits.get("train"):
        return None
    one = {(float(p[0]), float(p[1])): p[-1] for p in pts.get("train", [])}
    extra = [p[-1] - one[(float(p[0]), float(p[1]))] for p in pts["train_mb2"] if (float(p[0]), float(p[1])) in one]
    if not extra:
        return None
    a = float(fits["train"][0])
    return float(min(max(a - statistics.median(extra), 0.0), max(a - float(fits.get("optimizer", 0.0)), 0.0)))


def correction_grid(points: list, coef: list) -> dict | None:
    """Measured / fitted time on the (B, S) grid of the points, for bilinear interpolation.

    Small CPU kernels do not scale smoothly with size (threading thresholds, cache effects), so the fit alone
    can be 10-20 % off between its points; the model multiplies the fit by this ratio, interpolated inside the
    grid and held at its edges outside it (where the fit's shape extrapolates), within :data:`GRID_CLAMP`
    (:meth:`Profile.fit` applies it). None unless the points form a full grid.
    """
    bs = sorted({float(p[0]) for p in points})
    ss = sorted({float(p[1]) for p in points})
    table = {(float(p[0]), float(p[1])): p[2] for p in points}
    if len(bs) < 2 or len(ss) < 2 or len(table) != len(bs) * len(ss):
        return None
    ratio = [[table[(b, s_)] / max(float(np.dot(forward_features(b, s_), coef)), 1e-12) for s_ in ss] for b in bs]
    return {"B": bs, "S": ss, "ratio": ratio}


#: the correction grid's ratios are held within these bounds: between-point kernel effects are 10-20 %, so a
#: larger ratio is more likely a measurement another tenant disturbed (on a loaded 2-core machine the train
#: points of one profile came out 3.3x the fit at two points), which the grid would copy into predictions
GRID_CLAMP = (0.8, 1.25)


def clamp_grid(grid: dict) -> dict:
    lo, hi = GRID_CLAMP
    return {**grid, "ratio": [[min(hi, max(lo, float(r))) for r in row] for row in grid["ratio"]]}


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
    call = train_call(pts, fits)
    if call is not None:
        fits["train_call"] = call
    for n, plain, lp, streamed in [p[3:] for p in pts.get("generate_extras", [])[:1]]:   # [B, P, T, n, s...]
        fits.update(generate_logprobs=max(0.0, lp / plain - 1.0), generate_chunk=max(0.0, (streamed - lp) / n))
    entry["fit"] = fits
    return entry


# ------------------------------------------------------------------------------------------ merging


def _fastest(pa: dict, pb: dict) -> dict:
    """Per primitive, the faster time at every point measured in either (points keep the grid's order)."""
    points = {}
    for prim in ("generate", "forward", "train", "train_mb2"):
        best: dict = {}
        for p in pa.get(prim, []) + pb.get(prim, []):
            k = tuple(round(x, 6) for x in p[:-1])
            if k not in best or p[-1] < best[k][-1]:
                best[k] = p
        points[prim] = list(best.values())
    return points | {"generate_extras": pa.get("generate_extras") or pb.get("generate_extras") or []}


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
        points = _fastest(ea["points"], eb["points"])
        opt = ea["points"].get("optimizer", []) + eb["points"].get("optimizer", [])
        points["optimizer"] = [min(opt)] if opt else []
        out.models[key] = refit({"spec": ea["spec"], "threads": ea["threads"], "points": points})
        ta, tb = ea.get("at_threads") or {}, eb.get("at_threads") or {}
        if ta or tb:
            out.models[key]["at_threads"] = {
                t: {"points": _fastest((ta.get(t) or {}).get("points", {}), (tb.get(t) or {}).get("points", {}))}
                for t in sorted(set(ta) | set(tb))}
        vllm = eb.get("vllm") if (eb.get("vllm") or {}).get("fit") else ea.get("vllm") or eb.get("vllm")
        if vllm:   # the vLLM engine's measurements (rlhfc.cost.engine): the later pass's when it has a fit
            out.models[key]["vllm"] = json.loads(json.dumps(vllm))
        if eb.get("recompute") or ea.get("recompute"):   # the later pass's block replay times, if it took them
            out.models[key]["recompute"] = json.loads(json.dumps(eb.get("recompute") or ea["recompute"]))
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
