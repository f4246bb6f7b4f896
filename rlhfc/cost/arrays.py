"""The formulas' inputs as numbers: a model's architecture quantities, a device's effective rates, and the
per-candidate layout arrays (:mod:`rlhfc.cost.formulas` takes them; one entry per candidate plan)."""

from __future__ import annotations

import numpy as np

from rlhfc.ir.lora import lora_params
from rlhfc.ir.plan import RECOMPUTE_POLICIES, Layout

from .hardware import DeviceSpec, table_speedup


def arch_numbers(model) -> dict:
    """The architecture quantities the formulas use (see :mod:`rlhfc.cost.formulas`)."""
    h, L, f, V = model.hidden, model.layers, model.ffn, model.vocab
    kv_dim = model.kv_heads * (h // model.heads)
    if model.arch == "gpt2":
        per_layer = h * (h + 2 * kv_dim) + h * h + 2 * h * f
    else:
        per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * f
    out = V * h if model.head == "lm" else h
    trained = lora_params(model) or model.params   # LoRA: gradients and optimizer state for the adapters only
    return {"N": float(model.params), "Nt": float(trained), "mm": float(L * per_layer + out), "L": float(L),
            "h": float(h), "heads": float(model.heads), "ffn": float(f), "vocab": float(V),
            "kv_tok": float(2 * L * kv_dim), "lm": model.head == "lm"}


def hw_numbers(spec: DeviceSpec) -> dict:
    """Effective rates the formulas use (per device; on CPU per thread, see ``f_scale``)."""
    return {"F_inf": spec.peak_flops * spec.infer_eff, "F_train": spec.peak_flops * spec.train_eff,
            "BW": spec.hbm_bw * spec.mem_eff, "bpp": float(spec.bytes_per_param), "latency": spec.latency,
            "layer_overhead": spec.layer_overhead, "step_overhead": spec.step_overhead, "flash": spec.flash,
            "cpu": spec.is_cpu, "host_bw": spec.host_bw * spec.net_eff, "host_mem_bw": spec.host_mem_bw}


def layout_arrays(layouts: list[Layout], spec: DeviceSpec, per_node: int, prof_threads: int | None = None,
                  runs: list | None = None, speedup: tuple | None = None) -> dict:
    """The per-candidate arrays the formulas take (1-D, one entry per layout).

    On a CPU cluster a layout runs as one process whose threads are the mesh's cores, unless ``runs`` gives
    its worker group's ``(dp, tp, pp)`` processes (the fsdp and megatron trainers): then each rank runs on
    one core of its own (two ranks share a core when they outnumber the mesh's cores) and the formulas see
    the group's dp, tp and pp and their gloo collectives. ``speedup``: the model's own measured thread
    speed-up (:meth:`rlhfc.cost.profile.Profile.thread_speedup`), which then scales the fitted work from the
    profiled thread count instead of the host's matmul probe."""
    cpu = spec.is_cpu
    rc = {p: i for i, p in enumerate(RECOMPUTE_POLICIES)}
    runs = list(runs) if runs is not None else [None] * len(layouts)

    def col(fn, dtype=np.float64):
        return np.asarray([fn(l, r) for l, r in zip(layouts, runs)], dtype=dtype)

    def split(key):
        return lambda l, r: getattr(l, key) if not cpu else (getattr(r, key) if r is not None else 1)

    def threads(l, r) -> int:   # cores per process
        return l.count if r is None else 1

    def crowd(l, r) -> float:   # processes per core
        return 1.0 if r is None else max(1.0, r.dp * r.tp * r.pp / max(1, l.count))

    intra, inter = spec.intra_bw * spec.net_eff, spec.inter_bw * spec.net_eff
    out = {
        "dp": col(split("dp")), "tp": col(split("tp")), "pp": col(split("pp")),
        "mb": col(lambda l, r: l.microbatches), "rc": col(lambda l, r: rc[l.recompute]),
        "threads": col(lambda l, r: l.count),
        "bw_tp": col(lambda l, r: inter if l.tp_inter_node(per_node) else intra),
        "bw_dp": col(lambda l, r: inter if l.dp_inter_node(per_node) else intra),
    }
    if cpu and prof_threads:
        sp = (lambda t: table_speedup(speedup, t)) if speedup else spec.speedup
        out["thread_factor"] = col(lambda l, r: sp(prof_threads) / sp(threads(l, r)) * crowd(l, r))
    else:
        out["thread_factor"] = col(lambda l, r: crowd(l, r) if cpu else 1.0)
    out["f_scale"] = col(lambda l, r: spec.speedup(threads(l, r)) / crowd(l, r)) if cpu else np.ones(len(layouts))
    return out
