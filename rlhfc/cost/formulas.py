"""The cost formulas, written once for any array namespace ``xp`` (NumPy, or ``jax.numpy``).

Every function takes the *layout* as a dict of equally shaped 1-D arrays (one
entry per candidate plan: ``dp``, ``tp``, ``pp``, ``mb`` micro-batches, ``rc``
recompute 0/1/2 = none/selective/full, ``threads`` devices of the mesh,
``bw_tp``/``bw_dp`` the link bandwidth its tensor-/data-parallel groups use,
``f_scale`` the compute speed-up of the mesh's CPU threads (1 on GPUs),
``thread_factor`` the slow-down of fitted work terms relative to the profiled
thread count)
and returns arrays of the same shape, so :class:`~rlhfc.cost.model.CostModel`
evaluates one plan (arrays of length 1) and :mod:`rlhfc.cost.batched` many at
once, with NumPy or jitted JAX, through the very same code.

Notation: ``N`` parameters, ``mm`` parameters touched by matrix multiplies per
token (layers + output head), ``L`` layers, ``h`` hidden size, ``S`` sequence
length, ``b`` sequences, ``bpp`` bytes per element. Formulas (one replica of a
(dp, tp, pp) layout; the stage's replicas run in parallel):

- forward FLOPs ``2*mm*b*S + 2*L*h*b*S^2`` (causal attention);
  training 3x that (fwd+bwd), 4x with full recomputation, x1.2 with selective
  (TECHNIQUES.md: +20 % time);
- micro-batched pipeline: ``(M + pp - 1)`` micro-batch slots of one stage's
  share (ReaL); tensor-parallel all-reduces: 2 per layer forward (4 training),
  each ``latency + 2(tp-1)/tp * bytes / bw``; data-parallel gradient
  all-reduce once per optimizer step; AdamW touches 28 bytes per (sharded)
  parameter;
- a decode step costs ``max(FLOPs / F, (weights + KV read) / BW)`` plus the
  step overhead, summed over the steps with the probability that the step
  happens; with continuous batching (GPU engines) the active batch shrinks as
  samples finish, with static batching (the torch backend) finished rows keep
  their slot until the longest response ends.

A profile replaces the analytical time of a primitive by its fit (see
:mod:`rlhfc.cost.profile`); the thread-count factor scales the fitted work
terms when a stage runs on a different number of CPU cores than profiled.
"""

from __future__ import annotations

OPT_BYTES_PER_PARAM = 28.0      # AdamW: read grad(2) + master/m/v (12), write master/m/v (12) + bf16 copy (2)
SELECTIVE_TIME = 1.2            # TECHNIQUES.md: selective recomputation ~ +20 % time
TRAIN_FLOP_FACTOR = {0: 3.0, 1: 3.0 * SELECTIVE_TIME, 2: 4.0}


def _rc_factor(xp, rc):
    return xp.where(rc >= 2, 4.0, xp.where(rc >= 1, 3.0 * SELECTIVE_TIME, 3.0))


def allreduce(xp, nbytes, group, bw, latency):
    """Ring all-reduce of ``nbytes`` over ``group`` ranks on links of ``bw`` B/s (0 for a group of one)."""
    return xp.where(group > 1, latency + 2.0 * (group - 1) / group * nbytes / bw, 0.0)


# ----------------------------------------------------------------------------------------- time


def _pipeline(xp, pp, rows):
    """A pipeline of ``pp`` stages over megatron's up to 2·pp micro-batches: (the factor by which the slowest
    stage's share of the work stretches, bubbles included: (M + pp - 1) / M; the factor on the fixed cost
    per call: each stage makes M calls of 1/pp of the model, one slot after another)."""
    m = xp.where(pp > 1, xp.minimum(2.0 * pp, xp.maximum(rows, 1.0)), 1.0)
    return (m + pp - 1.0) / m, (m + pp - 1.0) / pp


def rank_comm(xp, hw, arch, lay, tokens, passes):
    """A worker group's collectives in one forward (``passes`` = 1) or forward+backward (2) of ``tokens``
    tokens per data-parallel replica: two activation all-reduces per layer and pass within a
    tensor-parallel group (its layers, one pipeline stage's share) and one for the vocabulary-parallel input
    embedding, the vocabulary-parallel logits
    all-gathered on the last stage (an lm head), and the activations sent across each stage boundary."""
    tp, pp = lay["tp"], lay["pp"]
    act = tokens * arch["h"] * hw["bpp"]
    # per layer two all-reduces a pass; the vocabulary-parallel input embedding one more in the forward
    layers = ((arch["L"] / pp) * 2.0 * passes + 1.0) * allreduce(xp, act, tp, lay["bw_tp"], hw["latency"])
    logits = tokens * arch["vocab"] * hw["bpp"] if arch["lm"] else 0.0 * tokens
    gather = xp.where(tp > 1, passes * (hw["latency"] + (tp - 1) / tp * logits / lay["bw_tp"]), 0.0)
    bounds = xp.where(pp > 1, passes * (pp - 1) * (hw["latency"] + act / lay["bw_dp"]), 0.0)
    return layers + gather + bounds


def grid_ratio(xp, grid, b, s):
    """Bilinear interpolation of a profile's measured/fitted ratio at (b, s) (held at the grid's edges)."""
    if not grid:
        return 1.0 + 0.0 * b
    bs = xp.asarray(grid["B"], dtype=float)
    ss = xp.asarray(grid["S"], dtype=float)
    along_s = xp.stack([xp.interp(s + 0.0 * bs[0], ss, xp.asarray(row, dtype=float)) for row in grid["ratio"]])
    return xp.interp(b, bs, along_s)


def forward_time(xp, hw, arch, work, lay, fit=None, grid=None):
    """No-grad forward (logprobs / values / score) of ``work['rows']`` sequences of ``work['seq']`` tokens."""
    B, S = work["rows"], work["seq"]
    dp, tp, pp, mb = lay["dp"], lay["tp"], lay["pp"], lay["mb"]
    if fit is not None:
        a, b1, b2 = fit
        k = lay["thread_factor"]
        per = B / (dp * mb)
        calls = work.get("calls", 1.0)    # length groups of an unpadded rollout: one call each
        ratio = grid_ratio(xp, grid, per, S)
        bubble, split = _pipeline(xp, pp, per)
        work_t = mb * k * (b1 * per * S + b2 * per * S * S) * ratio / (tp * pp) * bubble
        fixed = mb * calls * a * ratio * split
        comm = mb * rank_comm(xp, hw, arch, lay, per * S, passes=1.0)
        total = work_t + fixed + comm
        return {"total": total, "compute": total - comm - mb * calls * a, "memory": 0.0 * total, "comm": comm,
                "overhead": mb * calls * a + 0.0 * total}
    b = B / (dp * mb)
    flops = 2.0 * arch["mm"] * b * S + 2.0 * arch["L"] * arch["h"] * b * S * S
    compute = flops / (pp * tp * hw["F_inf"] * lay["f_scale"])
    memory = hw["bpp"] * arch["N"] / (tp * pp) / hw["BW"]
    act = b * S * arch["h"] * hw["bpp"]
    comm = (arch["L"] / pp) * 2.0 * allreduce(xp, act, tp, lay["bw_tp"], hw["latency"]) \
        + xp.where(pp > 1, hw["latency"] + act / lay["bw_dp"], 0.0)
    overhead = (arch["L"] / pp) * hw["layer_overhead"] + 0.0 * b
    slot = xp.maximum(compute, memory) + comm + overhead
    slots = mb + pp - 1
    return {"total": slots * slot, "compute": slots * compute, "memory": slots * memory, "comm": slots * comm,
            "overhead": slots * overhead}


def train_time(xp, hw, arch, work, lay, fit=None, opt_fit=None, grid=None):
    """``epochs * minibatches`` optimizer steps on ``rows/minibatches`` sequences of ``seq`` tokens each."""
    B, S = work["rows"], work["seq"]
    steps = work["epochs"] * work["minibatches"]
    per_step = B / work["minibatches"]
    dp, tp, pp, mb = lay["dp"], lay["tp"], lay["pp"], lay["mb"]
    if fit is not None:
        a, b1, b2 = fit
        k = lay["thread_factor"]
        opt = min(opt_fit if opt_fit is not None else 0.0, a)
        once = min(work.get("call_s", 0.0), a - opt)   # the part of `a` a call pays once, not per minibatch
        a = a - once
        rcf = _rc_factor(xp, lay["rc"]) / 3.0
        micro = per_step / (dp * mb)
        ratio = grid_ratio(xp, grid, micro, S)
        calls = work.get("calls", 1.0)    # length groups of an unpadded minibatch: one forward+backward each
        bubble, split = _pipeline(xp, pp, micro)
        work_t = k * rcf * (b1 * micro * S + b2 * micro * S * S) * ratio / (tp * pp) * bubble
        fwd_bwd = calls * (a - opt) * ratio * split + work_t
        # the optimizer on this rank's pieces: 1/(tp·pp) of the model, and 1/dp more under FSDP (tp = pp = 1)
        shard = tp * pp * xp.where(tp * pp > 1, 1.0, dp)
        step_opt = opt * ratio / shard
        grad_sync = allreduce(xp, hw["bpp"] * arch["N"] / (tp * pp), dp, lay["bw_dp"], hw["latency"])
        comm = steps * (mb * rank_comm(xp, hw, arch, lay, micro * S, passes=2.0) + grad_sync)
        total = steps * (mb * fwd_bwd + step_opt) + once * ratio + comm
        overhead = steps * (mb * calls * (a - opt) * ratio * split + step_opt) + once * ratio + 0.0 * total
        return {"total": total, "compute": steps * mb * work_t, "memory": 0.0 * total, "comm": comm,
                "overhead": overhead}
    b = per_step / (dp * mb)
    flops = _rc_factor(xp, lay["rc"]) * (2.0 * arch["mm"] * b * S + 2.0 * arch["L"] * arch["h"] * b * S * S)
    compute = flops / (pp * tp * hw["F_train"] * lay["f_scale"])
    memory = 3.0 * hw["bpp"] * arch["N"] / (tp * pp) / hw["BW"]          # weights read fwd, bwd; grads written
    act = b * S * arch["h"] * hw["bpp"]
    n_ar = xp.where(lay["rc"] >= 2, 6.0, 4.0)
    comm = (arch["L"] / pp) * n_ar * allreduce(xp, act, tp, lay["bw_tp"], hw["latency"]) \
        + xp.where(pp > 1, 2.0 * (hw["latency"] + act / lay["bw_dp"]), 0.0)
    overhead = 3.0 * (arch["L"] / pp) * hw["layer_overhead"] + 0.0 * b
    slot = xp.maximum(compute, memory) + comm + overhead
    slots = mb + pp - 1
    grad_sync = allreduce(xp, hw["bpp"] * arch["N"] / (tp * pp), dp, lay["bw_dp"], hw["latency"])
    opt = OPT_BYTES_PER_PARAM * arch["N"] / (tp * pp * dp) / hw["BW"]
    total = steps * (slots * slot + grad_sync + opt)
    return {"total": total, "compute": steps * slots * compute, "memory": steps * (slots * memory + opt),
            "comm": steps * (slots * comm + grad_sync), "overhead": steps * slots * overhead}


def generate_time(xp, hw, arch, work, lay, fit=None):
    """Prefill of the prompts and the decode steps until the step's samples are done.

    ``work`` describes one *wave* (``mb`` waves run one after another): ``rows``
    prompts (of the B+delta submitted), ``prompt`` tokens each (padded
    width for static batching, mean for continuous), ``steps_w[t]`` = P(decode
    step t happens), ``active[t]`` = expected samples still decoding at step t
    given it happens (continuous) or ``rows`` (static), ``t`` = 0..T-1.
    """
    B, P = work["rows"], work["prompt"]
    w, act, t = work["steps_w"], work["active"], work["t"]
    dp, tp, pp = lay["dp"], lay["tp"], lay["pp"]
    if fit is not None:
        a, c_pf, c_step, c_step_b, c_step_ctx = fit
        k = lay["thread_factor"]
        steps = xp.sum(w) + 0.0 * k
        mean_ctx = P + steps / 2.0
        rows = xp.minimum(work.get("decode_rows", B), B) / dp   # decode batch per step (finished rows leave)
        mine = B / dp   # a group's ranks decode their shares of the rows on full copies
        work_terms = k * (c_pf * mine * P + steps * (c_step_b * rows + c_step_ctx * rows * mean_ctx))
        fixed = a + steps * c_step
        m = lay["mb"]   # waves of `rows` prompts, one after another
        lp = 1.0 + work.get("lp", 0.0)   # kept log-probs, streamed chunks: rlhfc.cost.model.CostModel._torch_extras
        compute, overhead = m * work_terms * lp, m * fixed * lp + work.get("chunk_s", 0.0)
        total = compute + overhead
        prefill = m * (k * c_pf * mine * P + a)
        return {"total": total, "compute": compute, "memory": 0.0 * total, "comm": 0.0 * total,
                "overhead": overhead, "prefill": prefill, "decode": total - prefill}
    b_rep = B / dp
    pf_flops = 2.0 * arch["mm"] * b_rep * P + 2.0 * arch["L"] * arch["h"] * b_rep * P * P
    f_inf = hw["F_inf"] * lay["f_scale"]
    pf_compute = pf_flops / (tp * pp * f_inf)
    pf_memory = hw["bpp"] * arch["N"] / tp / hw["BW"]
    pf_comm = arch["L"] * 2.0 * allreduce(xp, b_rep * P * arch["h"] * hw["bpp"], tp, lay["bw_tp"], hw["latency"])
    prefill = xp.maximum(pf_compute, pf_memory) + pf_comm + arch["L"] * hw["layer_overhead"]
    # decode: one row per candidate, one column per step
    bt = (act[None, :] / dp[:, None])
    ctx = P + t[None, :]
    d_compute = (2.0 * arch["mm"] * bt + 4.0 * arch["L"] * arch["h"] * bt * ctx) / (tp[:, None] * f_inf[:, None])
    d_memory = (hw["bpp"] * arch["N"] / tp[:, None] + arch["kv_tok"] * hw["bpp"] * bt * ctx / tp[:, None]) / hw["BW"]
    d_comm = arch["L"] * 2.0 * allreduce(xp, bt * arch["h"] * hw["bpp"], tp[:, None], lay["bw_tp"][:, None],
                                         hw["latency"]) + (pp[:, None] - 1) * hw["latency"]
    step = xp.maximum(d_compute, d_memory) + d_comm + hw["step_overhead"]
    wts = w[None, :]
    decode = xp.sum(wts * step, axis=-1)
    compute = pf_compute + xp.sum(wts * d_compute, axis=-1)
    memory = pf_memory + xp.sum(wts * d_memory, axis=-1)
    comm = pf_comm + xp.sum(wts * d_comm, axis=-1)
    overhead = arch["L"] * hw["layer_overhead"] + xp.sum(w) * hw["step_overhead"] + 0.0 * decode
    m = lay["mb"]   # waves of `rows` prompts, one after another
    return {"total": m * (prefill + decode), "compute": m * compute, "memory": m * memory, "comm": m * comm,
            "overhead": m * overhead, "prefill": m * prefill, "decode": m * decode}


# ----------------------------------------------------------------------------------------- memory


def weights_bytes(xp, hw, arch, lay):
    """Weights held by each device of the layout."""
    return hw["bpp"] * arch["N"] / (lay["tp"] * lay["pp"]) + 0.0 * lay["dp"]


def train_state_bytes(xp, hw, arch, lay):
    """Gradients and optimizer state held by each device of a train layout (persistent).

    GPU: bf16 gradients (2N/(tp*pp)) + fp32 master weights and Adam moments
    sharded over data parallel ranks (12N/(tp*pp*dp), a distributed optimizer).
    CPU (the torch backend, float32, one process): gradients 4N + moments 8N. Under LoRA, N is the
    adapters' parameter count (``Nt``; the frozen base has neither gradients nor optimizer state).
    """
    shard = arch.get("Nt", arch["N"]) / (lay["tp"] * lay["pp"])
    if hw["cpu"]:
        return hw["bpp"] * shard + 8.0 * shard + 0.0 * lay["dp"]
    return hw["bpp"] * shard + 12.0 * shard / lay["dp"]


def offloaded_state_bytes(xp, hw, arch, lay):
    """Gradients and optimizer state a train layout holds per device when its optimizer is offloaded (the
    ``offload`` pass): the gradients only; the float32 master weights and Adam moments live on the host.
    On CPU clusters the host is the device: nothing moves."""
    if hw["cpu"]:
        return train_state_bytes(xp, hw, arch, lay)
    shard = arch.get("Nt", arch["N"]) / (lay["tp"] * lay["pp"])
    return hw["bpp"] * shard + 0.0 * lay["dp"]


OFFLOAD_HOST_BYTES_PER_PARAM = 28.0   # an Adam step on the host: reads master, moments, gradient (4 x 4 B), writes 3 x 4 B


def offload_step_seconds(xp, hw, arch, work, lay):
    """What an offloaded optimizer adds per train stage (ZeRO-Offload's schedule, not overlapped): per optimizer
    step, each device sends its shard's gradients to the host and receives its updated weights (``host_bw``,
    PCIe) while the host runs Adam on the shard (``host_mem_bw``: 28 bytes of traffic per parameter). 0 on
    CPU clusters."""
    if hw["cpu"]:
        return 0.0 * lay["dp"]
    shard = arch.get("Nt", arch["N"]) / (lay["tp"] * lay["pp"] * lay["dp"])
    steps = work["epochs"] * work["minibatches"]
    return steps * (shard * 2.0 * hw["bpp"] / hw["host_bw"] + shard * OFFLOAD_HOST_BYTES_PER_PARAM / hw["host_mem_bw"])


def forward_activation_bytes(xp, hw, arch, work, lay):
    """Peak transient memory of a forward on one device: one layer's working set, the attention scores
    (unless the backend uses flash attention) and the float32 logits (lm head: logits + log-softmax)."""
    b = work["rows"] / (lay["dp"] * lay["mb"])
    S = work["seq"]
    layer = b * S * (4.0 * arch["h"] + 2.0 * arch["ffn"]) * hw["bpp"] / lay["tp"]
    scores = 0.0 if hw["flash"] else b * arch["heads"] * S * S * hw["bpp"] / lay["tp"]
    logits = 2.0 * b * S * arch["vocab"] * 4.0 / lay["tp"] if arch["lm"] else 0.0 * b
    return layer + scores + logits


def train_activation_bytes(xp, hw, arch, work, lay):
    """Peak transient memory of training on one device: stored activations of the micro-batches in flight
    (Korthikanti et al.: ``S*b*h*(34 + 5*a*S/h)`` bytes per layer at 2 bytes per element, the second term
    being the attention scores that flash attention never stores; 34 with selective recomputation; only the
    layer inputs with full), the first pipeline stage holding ``min(M, pp)``
    micro-batches of ``L/pp`` layers, plus float32 logits, their softmax and gradients (lm head)."""
    b = work["rows"] / work["minibatches"] / (lay["dp"] * lay["mb"])
    S = work["seq"]
    h = arch["h"]
    scale = hw["bpp"] / 2.0
    scores = 0.0 if hw["flash"] else 5.0 * arch["heads"] * S / h      # flash attention stores no s x s scores
    full = S * b * h * (34.0 + scores) * scale
    sel = S * b * h * 34.0 * scale
    inp = S * b * h * 2.0 * scale
    per_layer = xp.where(lay["rc"] >= 2, inp, xp.where(lay["rc"] >= 1, sel, full)) / lay["tp"]
    in_flight = xp.minimum(lay["mb"], lay["pp"])
    stored = per_layer * arch["L"] / lay["pp"] * in_flight
    recompute_peak = xp.where(lay["rc"] >= 2, full / lay["tp"], 0.0)
    logits = 4.0 * b * S * arch["vocab"] * 4.0 / lay["tp"] if arch["lm"] else 0.0 * b
    return stored + recompute_peak + logits


def traced_train_activation_bytes(xp, hw, arch, work, lay):
    """:func:`train_activation_bytes` from a traced recompute decision (the ``recompute`` pass): each block keeps
    ``rc_kept`` bytes per micro-batch besides its input, and while one block recomputes, its full autograd set
    (``rc_autograd``) is live once more; plus the float32 logits of the lm head."""
    b = work["rows"] / work["minibatches"] / (lay["dp"] * lay["mb"])
    S = work["seq"]
    inp = S * b * arch["h"] * hw["bpp"]
    per_layer = (work["rc_kept"] + inp) / lay["tp"]
    stored = per_layer * arch["L"] / lay["pp"] * xp.minimum(lay["mb"], lay["pp"])
    peak = work["rc_autograd"] / lay["tp"] if work["rc_seconds"] > 0 else 0.0
    logits = 4.0 * b * S * arch["vocab"] * 4.0 / lay["tp"] if arch["lm"] else 0.0 * b
    return stored + peak + logits


def traced_recompute_seconds(xp, arch, work, lay):
    """Time the traced decision adds to a train stage: ``rc_seconds`` per block and micro-batch, for the
    ``L/pp`` blocks of a device, every micro-batch of every optimizer step."""
    steps = work["epochs"] * work["minibatches"]
    return steps * lay["mb"] * (arch["L"] / lay["pp"]) * work["rc_seconds"] + 0.0 * lay["dp"]


def generate_cache_bytes(xp, hw, arch, work, lay):
    """KV cache (+ float32 logits of one step + one prefill layer) on one device while generating."""
    b_rep = work["rows"] / lay["dp"]
    kv = arch["kv_tok"] * hw["bpp"] * work["kv_tokens"] / lay["dp"] / (lay["tp"] * lay["pp"])
    P = work["prompt"]
    prefill = b_rep * P * (4.0 * arch["h"] + 2.0 * arch["ffn"]) * hw["bpp"] / lay["tp"]
    scores = 0.0 if hw["flash"] else b_rep * arch["heads"] * P * P * hw["bpp"] / lay["tp"]
    logits = b_rep * arch["vocab"] * 4.0 * 2.0 / lay["tp"]
    return kv + prefill + scores + logits
