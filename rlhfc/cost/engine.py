"""The vLLM rollout engine priced (``run { rollout = vllm | auto }``): its decoding and its refit.

**Decoding.** vLLM batches continuously: a request costs its own decode steps, not the longest row's, and
at most ``concurrency`` requests decode at once — ``max_num_seqs`` or as many as its KV cache holds at
prompt + ``max_new_tokens`` tokens each, whichever is fewer. More rows than that are priced as waves of
``concurrency`` rows one after another (an upper bound: vLLM admits a waiting request as soon as one
finishes). The per-step and per-token rates are, in order of preference:

1. the profile's vLLM fit for the model's shape (``rlhfc profile`` with vLLM installed times the engine
   through the runtime's worker: :func:`rlhfc.calibrate.vllm_engine.measure_vllm`), or a measured neighbour's fit
   carried over as the torch fits are (:func:`rlhfc.cost.profile.transfer_fit`);
2. otherwise the *catalog assumption*: the torch engine's rates for that shape (its profile fit, or the
   roofline) under continuous batching, plus :data:`VLLM_STEP_S` per decode step (vLLM's scheduler and
   sampler in Python). ``source`` says ``assumed`` then.

The fit has the torch generate primitive's form (:data:`rlhfc.cost.profile.FEATURES`), with the rows' own
tokens in place of ``T x B`` (:func:`vllm_features`).

**Refit.** A refit is one session of vLLM's layerwise reload: every layer is reset, loaded and re-processed
into its kernels' layout, so besides moving the bytes it costs a fixed time per layer:
``refit_s = buckets x latency + 2 x bytes / memory bandwidth + layers x per_layer`` (the first two terms are
:func:`rlhfc.cost.sync.refit_time`). ``per_layer`` is measured
by ``rlhfc profile`` (the refit time less the byte term, over the layers), else :data:`VLLM_REFIT_LAYER_S`
(this repository's CPU benchmark: a 4-layer llama refits in 0.08-0.31 s; on GPUs a guess).

**The torch engine inside a job** (:meth:`CostModel._torch_extras <rlhfc.cost.model.CostModel._torch_extras>`). The profile's generate points time a plain
``ModelWorker.generate``; a job's generate may also keep the sampled tokens' log-probs (``logprobs = true``,
the ``reuse_logprobs`` pass) and, streamed, build each chunk as its own rollout that Ray serializes as the
worker yields it (inside the stage). ``rlhfc profile`` times both at one point (``generate_logprobs``: the
fraction the log-probs add; ``generate_chunk``: seconds per chunk), and a stage pays them where its plan
says so; a profile without them prices neither.

**Where each part lives.** This module holds the engine's rules over numbers and the profile: the catalog
assumptions (``VLLM_*``), the fit's features and the profile's vLLM entry, the refit formula
(:func:`predict_refit`). What a stage costs on the engine also needs the cost model's state (the stage's
generation work, its layout, the device), so :class:`~rlhfc.cost.model.CostModel` computes it with these:
``vllm_work``, ``vllm_concurrency``, ``gpu_fraction``, ``gpu_kv_bytes``, ``engine_bytes``, ``refit_seconds``,
``add_refit_batched``.
"""

from __future__ import annotations

import math

import numpy as np

from .hardware import DeviceSpec
from .profile import Profile, fit_relative, model_key, parse_key, transfer_fit
from .sync import refit_time

#: seconds per decode step vLLM adds to the torch loop's rates when no profile measured it (catalog assumption)
VLLM_STEP_S = {"cpu": 4e-3, "gpu": 2e-3}
#: seconds per layer of a refit (vLLM's layerwise reload), when no profile measured it (catalog assumption)
VLLM_REFIT_LAYER_S = {"cpu": 0.02, "gpu": 0.003}
#: vLLM's default ``max_num_seqs`` (requests decoded at once) when the profile did not record the engine's
VLLM_MAX_SEQS = 256
#: KV-cache bytes the runtime gives vLLM on CPU (``VLLM_CPU_KVCACHE_SPACE`` = 1 GiB) / fraction of a GPU
VLLM_CPU_KV_BYTES = 2 ** 30
VLLM_GPU_MEMORY_FRACTION = 0.9
#: bytes of a GPU the engine needs besides its weights and KV cache: the activations of vLLM's profiling
#: forward (``max_num_batched_tokens`` tokens), its CUDA graphs and the sampler (a catalog assumption)
VLLM_GPU_OVERHEAD_BYTES = 2 * 2 ** 30
#: ``gpu_memory_utilization`` below this is not asked of vLLM (the engine's fraction is never smaller)
VLLM_GPU_MIN_FRACTION = 0.05


def vllm_features(B, P, steps, tokens):
    """Features of one vLLM generate point: B requests of P prompt tokens that generated ``tokens`` in all, the
    longest in ``steps`` steps (the torch form with each row's own tokens: :data:`rlhfc.cost.profile.FEATURES`)."""
    return [1.0, B * P, steps, tokens, tokens * (P + tokens / max(B, 1) / 2.0)]


def fit_vllm_entry(entry: dict) -> dict:
    """(Re)compute a profile entry's ``vllm`` fits from its points: ``generate`` (five coefficients, as
    :func:`vllm_features`) and ``refit_layer_s`` (median of (seconds - byte term) / layers over the points)."""
    pts = entry.get("points", {})
    fit: dict = {}
    if pts.get("generate"):
        fit["generate"] = fit_relative([vllm_features(*p[:4]) for p in pts["generate"]], [p[4] for p in pts["generate"]])
    if pts.get("refit"):
        per = [max(0.0, (sec - 2.0 * nbytes / max(entry.get("copy_bw", 0.0), 1.0))) / max(layers, 1)
               for nbytes, layers, sec in pts["refit"]]
        fit["refit_layer_s"] = float(np.median(per))
    entry["fit"] = fit
    return entry


def vllm_entry(profile: Profile | None, key: str) -> tuple[dict | None, str | None]:
    """(the profile's vLLM entry for model ``key`` — its own, else the nearest measured shape's of the same
    architecture and head —, the donor key or None). (None, None) without one."""
    if profile is None:
        return None, None
    own = profile.models.get(key, {}).get("vllm")
    if own is not None:
        return own, None
    want = parse_key(key)
    if want is None:
        return None, None
    cands = [(abs(math.log(sh["L"] * sh["h"] / (want["L"] * want["h"]))), k) for k, sh in
             ((k, parse_key(k)) for k, e in profile.models.items() if (e.get("vllm") or {}).get("fit"))
             if sh is not None and sh["arch"] == want["arch"] and sh["head"] == want["head"]]
    if not cands:
        return None, None
    donor = min(cands)[1]
    return profile.models[donor]["vllm"], donor


def vllm_generate_fit(profile: Profile | None, model):
    """The vLLM generate fit for ``model`` (carried over from a measured neighbour if need be), or None."""
    key = model_key(model)
    entry, donor = vllm_entry(profile, key)
    fit = (entry or {}).get("fit", {}).get("generate")
    if fit is None or donor is None:
        return fit
    return transfer_fit("generate", fit, donor, key, profile.host, profile.model_threads(donor))


def unsupported(profile: Profile | None, model) -> str | None:
    """Why the profile says vLLM cannot run ``model`` (``rlhfc profile`` recorded it), or None."""
    if profile is None:
        return None
    return (profile.models.get(model_key(model), {}).get("vllm") or {}).get("unsupported")


def predict_refit(nbytes: float, layers: int, bucket_mb: int, spec: DeviceSpec, per_layer: float | None = None) -> float:
    """Seconds of a refit of ``nbytes`` over ``layers`` layers on device ``spec`` (module docstring);
    ``per_layer`` None: the catalog's :data:`VLLM_REFIT_LAYER_S`."""
    if per_layer is None:
        per_layer = VLLM_REFIT_LAYER_S["cpu" if spec.is_cpu else "gpu"]
    return float(refit_time(nbytes, bucket_mb, spec) + layers * per_layer)


def reusable_forwards(module, gens: list) -> list:
    """The forwards ``reuse_logprobs`` would replace on the torch engine: the generating model's log-probs
    over its own rollout at the sampling temperature, with no train of it in between."""
    g = module.graph
    out = []
    for gen in gens:
        for s in g.stages:
            if s.op != "forward.logprobs" or s.target != gen.target or len(s.inputs) != 1 or s.inputs[0] \
                    is not gen.outputs[0]:
                continue
            temperature = float(s.attrs.get("temperature", 1.0))
            between = g.stages[g.stages.index(gen) + 1:g.stages.index(s)]
            if temperature > 0 and float(gen.attrs.get("temperature", 1.0)) == temperature and \
                    not any(x.op == "train" and x.target == s.target for x in between):
                out.append(s)
    return out

