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

**The torch engine inside a job** (:func:`torch_extras`). The profile's generate points time a plain
``ModelWorker.generate``; a job's generate may also keep the sampled tokens' log-probs (``logprobs = true``,
the ``reuse_logprobs`` pass) and, streamed, build each chunk as its own rollout that Ray serializes as the
worker yields it (inside the stage). ``rlhfc profile`` times both at one point (``generate_logprobs``: the
fraction the log-probs add; ``generate_chunk``: seconds per chunk), and a stage pays them where its plan
says so; a profile without them prices neither.
"""

from __future__ import annotations

import math

import numpy as np

from rlhfc.ir import plan

from .arrays import arch_numbers
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


def concurrency(cm, model, prompt: float, max_new: float) -> int:
    """Requests vLLM decodes at once for ``model``: ``max_num_seqs`` or what the KV cache holds at
    ``prompt + max_new`` tokens each (the profile's recorded engine figures when it has them)."""
    entry, _ = vllm_entry(cm.profile, model_key(model))
    entry = entry or {}
    seqs = int(entry.get("max_num_seqs") or VLLM_MAX_SEQS)
    per_token = float(arch_numbers(model)["kv_tok"]) * cm.spec.bytes_per_param
    if entry.get("kv_tokens"):
        kv_tokens = float(entry["kv_tokens"])
    elif cm.spec.is_cpu:
        kv_tokens = VLLM_CPU_KV_BYTES / max(per_token, 1.0)
    else:   # the KV cache is what the engine's fraction leaves beside its weights and overhead
        kv_tokens = gpu_kv_bytes(cm, model, gpu_fraction(cm, model)) / max(per_token, 1.0)
    fits = int(kv_tokens // max(prompt + max_new, 1.0))
    return max(1, min(seqs, fits))


def gpu_kv_bytes(cm, model, fraction: float) -> float:
    """KV-cache bytes a CUDA engine of ``model`` gets from ``gpu_memory_utilization = fraction``: the share
    of the device less its weight copy and :data:`VLLM_GPU_OVERHEAD_BYTES`."""
    copy = arch_numbers(model)["N"] * cm.spec.bytes_per_param
    return max(0.0, fraction * cm.spec.memory - copy - VLLM_GPU_OVERHEAD_BYTES)


def gpu_fraction(cm, model, dp: int | None = None) -> float:
    """``gpu_memory_utilization`` for the CUDA vLLM engine of ``model``: what it needs — its weight copy, KV
    cache for every row of one rank's share of its largest generate stage at prompt + ``max_new_tokens``
    tokens (at most ``max_num_seqs`` rows at once), and :data:`VLLM_GPU_OVERHEAD_BYTES` —, as a share of
    the device rounded up to 0.01, between :data:`VLLM_GPU_MIN_FRACTION` and vLLM's default 0.9. Not all of the
    device (vLLM's default): the trained model co-located with it keeps its weights, gradients and optimizer
    state on the device while the engine generates, and vLLM refuses to start when less than its fraction is free.
    A stage's ``gpu_memory`` annotation, when the compiler set it, is the answer; ``dp`` overrides the stage's
    data-parallel ranks (each rank's engine decodes its share)."""
    gens = [s for s in cm.module.graph.stages if s.op == "generate" and s.target == model.name]
    marked = [plan.gpu_memory(s) for s in gens if plan.gpu_memory(s) is not None]   # passes.engine.set_gpu_memory
    if marked and dp is None:
        return max(marked)
    arch = arch_numbers(model)
    entry, _ = vllm_entry(cm.profile, model_key(model))
    seqs = int((entry or {}).get("max_num_seqs") or VLLM_MAX_SEQS)
    kv = 0.0
    for s in gens:
        one = cm.generation_work(s, 1, continuous=True)
        ranks = dp if dp is not None else max(1, int(cm.layout(s).dp))
        rows = min(seqs, math.ceil((int(one["batch"]) + int(one["delta"])) / max(1, ranks)))
        kv = max(kv, rows * (float(one["prompt"]) + float(one["T"])) * arch["kv_tok"] * cm.spec.bytes_per_param)
    need = arch["N"] * cm.spec.bytes_per_param + kv + VLLM_GPU_OVERHEAD_BYTES
    return min(VLLM_GPU_MEMORY_FRACTION, max(VLLM_GPU_MIN_FRACTION, math.ceil(100.0 * need / cm.spec.memory) / 100.0))


def vllm_work(cm, stage, model, dp: int = 1) -> tuple[dict, int, str]:
    """(the generation work of one wave under continuous batching, the waves, the fit's source) of
    generate ``stage`` on vLLM (module docstring). ``dp``: the generating group's data-parallel ranks, each
    of which runs an engine on its share of the rows, so the waves are those of one rank's share."""
    one = cm.generation_work(stage, 1, continuous=True)
    n = int(one["batch"]) + int(one["delta"])
    share = math.ceil(n / max(1, int(dp)))
    waves = max(1, math.ceil(share / concurrency(cm, model, one["prompt"], one["T"])))
    work = dict(one if waves == 1 else cm.generation_work(stage, waves, continuous=True))
    return work, waves, "profile" if vllm_generate_fit(cm.profile, model) is not None else "assumed"


def step_overhead(cm, model) -> float:
    """Seconds per decode step added to the torch rates under the catalog assumption (0 with a vLLM fit)."""
    if vllm_generate_fit(cm.profile, model) is not None:
        return 0.0
    return VLLM_STEP_S["cpu" if cm.spec.is_cpu else "gpu"]


def refit_seconds(cm, model, nbytes: float, bucket_mb: int) -> tuple[float, str]:
    """(seconds, source) of a refit of ``model``'s ``nbytes`` of weights in buckets of ``bucket_mb`` MiB
    (module docstring): ``profile`` when the per-layer term was measured, else ``assumed``."""
    entry, _ = vllm_entry(cm.profile, model_key(model))
    per_layer = (entry or {}).get("fit", {}).get("refit_layer_s")
    return predict_refit(nbytes, model.layers, bucket_mb, cm.spec, per_layer), \
        "profile" if per_layer is not None else "assumed"


def predict_refit(nbytes: float, layers: int, bucket_mb: int, spec, per_layer: float | None = None) -> float:
    """Seconds of a refit of ``nbytes`` over ``layers`` layers on device ``spec`` (module docstring);
    ``per_layer`` None: the catalog's :data:`VLLM_REFIT_LAYER_S`."""
    if per_layer is None:
        per_layer = VLLM_REFIT_LAYER_S["cpu" if spec.is_cpu else "gpu"]
    return float(refit_time(nbytes, bucket_mb, spec) + layers * per_layer)


# -- the cost model's hooks (rlhfc.cost.model.CostModel calls these for generate stages on vLLM) ----------


def vllm_inputs(cm, stage, model, lay: dict) -> dict:
    """The work of one wave of ``stage`` on vLLM; sets the layout arrays' ``mb`` to the waves. A group of
    ``dp`` ranks runs an engine per rank (:mod:`rlhfc.runtime.rollout.vllm`), each on its share of the rows:
    the formulas divide each wave's rows by ``dp``, and the waves are one share's (candidate layouts of
    different ``dp`` are priced with the fewest ranks' waves, an upper bound for the others)."""
    dp = int(np.min(np.asarray(lay["dp"]))) if np.size(lay["dp"]) else 1
    work, waves, _ = vllm_work(cm, stage, model, dp)
    lay["mb"] = 0.0 * lay["mb"] + waves
    return work


def vllm_fit(cm, model, torch_fit):
    """The generate fit vLLM is priced with: its own (profile), else the torch fit plus the assumed per-step
    overhead, else None (the roofline under continuous batching)."""
    fit = vllm_generate_fit(cm.profile, model)
    if fit is not None or torch_fit is None:
        return fit
    return list(torch_fit[:2]) + [torch_fit[2] + step_overhead(cm, model)] + list(torch_fit[3:])


def add_refit(cm, stage, model, first: dict, summary: dict) -> None:
    """Record the engine in a generate's summary and add a trained model's refit to its time (and, on GPUs,
    the engine's awake footprint to its transient memory: :func:`engine_bytes`)."""
    summary["engine"], summary["engine_source"] = "vllm", vllm_work(cm, stage, model)[2]
    if model.trainable:
        bucket = plan.refit_mb(stage) or 64   # the realloc pass's, else the runtime's default
        # every rank's engine holds the whole model, whatever the trainer's layout: it loads all of it
        first["refit"], summary["refit_source"] = refit_seconds(cm, model, full_bytes(cm, model), bucket)
        first["total"] += first["refit"]
    awake = engine_bytes(cm, model)["transient"]
    if awake:
        first["transient_bytes"] = awake
        summary["gpu_memory_utilization"] = gpu_fraction(cm, model)


def add_refit_batched(cm, stage, model, out: dict, layouts=None) -> None:
    """:func:`add_refit` on a batch of candidate layouts' prices (:func:`rlhfc.cost.batched.evaluate`): the
    refit of the whole model (every rank's engine holds it, whatever the candidate's layout), and the
    engine's awake footprint, as the per-stage price has (on GPUs each candidate's: its ``dp`` sets the rows
    a rank's engine holds KV cache for, :func:`gpu_fraction`)."""
    if model.trainable:
        bucket = plan.refit_mb(stage) or 64
        refit = refit_seconds(cm, model, full_bytes(cm, model), bucket)[0]   # the whole model on every rank
        out["total"] = np.asarray(out["total"], dtype=np.float64) + refit
    if cm.spec.is_cpu or not layouts:
        awake = engine_bytes(cm, model)["transient"]
    else:
        by_dp = {dp: engine_bytes(cm, model, dp)["transient"] for dp in {int(x.dp) for x in layouts}}
        awake = np.array([by_dp[int(x.dp)] for x in layouts], dtype=np.float64)
    if np.any(awake):
        out["transient_bytes"] = 0.0 * np.asarray(out["transient_bytes"], dtype=np.float64) + awake


def full_bytes(cm, model) -> float:
    """Bytes of the whole model in the engine's dtype (what a rank's engine holds and a refit loads)."""
    return float(arch_numbers(model)["N"] * cm.spec.bytes_per_param)


def engine_bytes(cm, model, dp: int | None = None) -> dict[str, float]:
    """Device memory the vLLM engine of ``model`` takes besides the trainer's own copy: ``{"resident": bytes
    held for the whole run, "transient": bytes held while its generate stages run}``.

    On CPU the engine never sleeps: its copy of the weights (in the model's dtype) and its KV-cache
    reservation (``VLLM_CPU_KVCACHE_SPACE``, :data:`VLLM_CPU_KV_BYTES`; the profile's recorded KV tokens when
    it has them) stay for the whole run. On CUDA the runtime puts the engine to sleep (level 1) after every
    generate call, which offloads its weights to host memory and frees its KV cache, so it holds memory only
    while a generate stage runs — then its ``gpu_memory_utilization`` share of the device
    (:func:`gpu_fraction`: its weights copy, the KV cache its rows need and vLLM's overhead), in place of the
    torch decode loop's KV cache."""
    arch = arch_numbers(model)
    copy = arch["N"] * cm.spec.bytes_per_param
    if not cm.spec.is_cpu:
        return {"resident": 0.0, "transient": max(copy, gpu_fraction(cm, model, dp) * cm.spec.memory)}
    entry, _ = vllm_entry(cm.profile, model_key(model))
    kv_tokens = (entry or {}).get("kv_tokens")
    kv = float(kv_tokens) * arch["kv_tok"] * cm.spec.bytes_per_param if kv_tokens else float(VLLM_CPU_KV_BYTES)
    return {"resident": float(copy + kv), "transient": 0.0}


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


def torch_extras(cm, stage, model, work: dict) -> dict:
    """A torch-engine generate's ``lp`` (fraction its kept log-probs add) and ``chunk_s`` (seconds its
    streamed chunks add), from the profile (see the module docstring); {} without a profile or on vLLM."""
    if cm.profile is None or cm.own_weights(stage):
        return {}
    key, chunk = model_key(model), plan.stream_chunk(stage)
    lp = cm.profile.fit(key, "generate_logprobs") if plan.flag(stage, "logprobs") else None
    per = cm.profile.fit(key, "generate_chunk") if chunk else None
    return {"lp": float(lp or 0.0), "chunk_s": float(per or 0.0) * (math.ceil(work["batch"] / chunk) if chunk else 0)}
