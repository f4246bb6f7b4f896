"""The hardware catalog: what one device of each kind can do.

Peak numbers are the vendors' published spec-sheet figures (dense bf16, no
sparsity; HBM bandwidth and size; NVLink and per-GPU network bandwidth of the
usual 8-GPU nodes: DGX A100 with one 200 Gb/s HDR NIC per GPU, DGX H100/H200
with one 400 Gb/s NDR NIC per GPU). The *efficiencies* say which fraction of a
peak real kernels reach; they are the commonly reported figures for Megatron-
style training (40-50 % MFU), inference prefill (~55 %), vLLM decoding (~75-80 %
of HBM bandwidth) and NCCL collectives (~70-80 % of link bandwidth). They are
not tuned to any RLHF measurement. A profile (``rlhfc profile``) taken on a
device replaces them with measured ones (see :mod:`rlhfc.cost.profile`).

``cpu`` is special: its numbers depend on the machine, so a profile of this host
supplies them; without one the defaults below are a deliberately rough
guess for one modern x86 core (they are labelled ``uncalibrated`` in
``rlhfc explain``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlhfc.ir.devices import DEVICE_MEMORY

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One device kind. Rates are per device; times in seconds, sizes in bytes.

    ``peak_flops``: dense bf16 FLOP/s (cpu: float32 FLOP/s of one core).
    ``hbm_bw``: memory bandwidth (B/s). ``memory``: capacity (bytes).
    ``intra_bw`` / ``inter_bw``: per-device bandwidth to a device of the same
    node (NVLink, one direction) / of another node (its NIC). ``host_bw``: to host
    memory (PCIe), for offload/onload. ``host_mem_bw``: the share of its host's memory bandwidth one device's
    offloaded optimizer step gets (a two-socket server's few hundred GB/s over its 8 devices). ``latency``: start-up time of one
    collective or transfer. ``train_eff``/``infer_eff``: fraction of
    ``peak_flops`` reached by training / forward kernels; ``mem_eff``: of
    ``hbm_bw``; ``net_eff``: of link bandwidths. ``layer_overhead``: fixed
    time per layer per forward call (kernel launches); ``step_overhead``: fixed
    time per generated token step (scheduler and sampling); ``bytes_per_param``:
    weight/activation element size of the backend (bf16 on GPUs; float32 on
    CPU, the torch backend's default). ``flash``: attention does not
    materialise the s x s score matrix.
    """

    name: str
    peak_flops: float
    hbm_bw: float
    memory: float
    intra_bw: float
    inter_bw: float
    host_bw: float
    host_mem_bw: float = 40e9
    latency: float = 10e-6
    train_eff: float = 0.45
    infer_eff: float = 0.55
    mem_eff: float = 0.8
    net_eff: float = 0.75
    layer_overhead: float = 20e-6
    step_overhead: float = 1.5e-3
    bytes_per_param: int = 2
    flash: bool = True
    source: str = "catalog"
    #: measured speed-up over one thread for 1..n threads (cpu only; from a profile)
    thread_speedup: tuple = field(default=(1.0,))
    #: memory-bound op kinds that run at another fraction of ``hbm_bw`` than a copy, ``((kind, fraction), ...)``
    #: (rlhfc.passes.recompute_trace.op_kind): what the recompute pass prices a recomputed op at
    kind_eff: tuple = field(default=())
    #: what a recomputation pays beyond its ops' work (rlhfc.passes.recompute_prices): s/byte of a fresh output
    #: by allocation size ``((bytes, s/byte), ...)``, and a checkpoint's cost per block and per aten call its
    #: selective policy dispatches (cpu; a profile measures them)
    fresh_s_per_byte: tuple = field(default=())
    ckpt_region_s: float = 0.0
    ckpt_op_s: float = 0.0
    #: the forward op times a profile measured on a program's own blocks at their training shapes, and what a
    #: selective checkpoint's call cost there: ``((model key, rows, seq, ((op key, CPU s), ...), s a call), ...)``,
    #: what the recompute pass prices that model's replay with (rlhfc.passes.recompute_prices.measured_ops)
    block_ops: tuple = field(default=())

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    def speedup(self, threads: int) -> float:
        """Throughput of ``threads`` threads relative to one (cpu), from the profile's probe."""
        return table_speedup(self.thread_speedup, threads)


def table_speedup(table, threads: int) -> float:
    """``table[threads - 1]``: a measured speed-up over one thread; beyond the table no further gain."""
    table = table or (1.0,)
    threads = max(1, int(threads))
    return float(table[min(threads, len(table)) - 1])


#: Published figures (see module docstring). A100: 312 TFLOP/s bf16; 40GB 1.555 TB/s, 80GB 2.039 TB/s;
#: NVLink3 600 GB/s total (300 GB/s each way); 200 Gb/s HDR per GPU; PCIe4 x16 32 GB/s.
#: H100 SXM: 989 TFLOP/s, 3.35 TB/s, NVLink4 900 GB/s (450 each way), 400 Gb/s NDR per GPU, PCIe5 64 GB/s.
#: H200: same compute as H100, 141 GB at 4.8 TB/s.
CATALOG: dict[str, DeviceSpec] = {
    "A100-40GB": DeviceSpec("A100-40GB", 312e12, 1.555e12, DEVICE_MEMORY["A100-40GB"], 300 * GB, 25 * GB, 32 * GB),
    "A100-80GB": DeviceSpec("A100-80GB", 312e12, 2.039e12, DEVICE_MEMORY["A100-80GB"], 300 * GB, 25 * GB, 32 * GB),
    "H100-80GB": DeviceSpec("H100-80GB", 989e12, 3.35e12, DEVICE_MEMORY["H100-80GB"], 450 * GB, 50 * GB, 64 * GB,
                            train_eff=0.40, infer_eff=0.50),
    "H200": DeviceSpec("H200", 989e12, 4.8e12, DEVICE_MEMORY["H200"], 450 * GB, 50 * GB, 64 * GB,
                       train_eff=0.40, infer_eff=0.50),
    # One CPU core, uncalibrated: ~50 GFLOP/s float32 (AVX2 FMA), ~8 GB/s of memory bandwidth per core;
    # the torch backend pays ~0.2 ms of Python/dispatch per layer call and ~1 ms per sampled token step.
    "cpu": DeviceSpec("cpu", 50e9, 8 * GB, DEVICE_MEMORY["cpu"], 8 * GB, 1 * GB, 8 * GB, latency=50e-6,
                      train_eff=0.5, infer_eff=0.5, mem_eff=1.0, net_eff=1.0, layer_overhead=2e-4,
                      step_overhead=1e-3, bytes_per_param=4, flash=False, source="uncalibrated",
                      # softmax's exponentials: ~0.3 of the copy bandwidth on a 2-core EPYC VM (a profile measures it)
                      kind_eff=(("softmax", 0.3),),
                      # a recompute's extra costs, as `rlhfc profile` measures them there: the checkpoint's
                      # dispatch; no fresh-output page faults (a CPU worker keeps freed memory for reuse:
                      # rlhfc.runtime.worker.allocator; with RLHFC_RETAIN_MEMORY=0 a profile measures them)
                      ckpt_region_s=1e-3, ckpt_op_s=3e-5),
}


def own_block(key: str, rc: dict) -> tuple:
    """A :attr:`DeviceSpec.block_ops` entry from a profile model's ``recompute`` section: ``(model key, rows,
    seq, ((op key, CPU s), ...), s per selective-checkpoint call or None)`` (profiles before that probe lack it)."""
    op_s = rc.get("ckpt_op_s")
    return (key, int(rc["rows"]), int(rc["seq"]), tuple(sorted((str(k), float(v)) for k, v in rc["op_s"].items())),
            None if op_s is None else float(op_s))


def device_spec(kind: str, profile=None) -> DeviceSpec:
    """The spec of device ``kind``, with measured rates from ``profile`` when it was taken on that kind.

    A profile of a CPU host supplies the cpu FLOP/s, bandwidth and thread
    scaling; a profile taken on a GPU replaces that GPU kind's efficiencies by
    the measured fractions of its peaks.
    """
    if kind not in CATALOG:
        raise KeyError(f"unknown device kind {kind!r}; known: {', '.join(CATALOG)}")
    spec = CATALOG[kind]
    if profile is None or profile.device_kind != kind:
        return spec
    host = profile.host
    if kind == "cpu":
        flops = host.get("matmul_flops_1") or spec.peak_flops
        bw = float(host.get("copy_bw") or spec.hbm_bw)
        kinds = host.get("kind_bw") or {}
        rc = host.get("recompute") or {}
        return replace(spec, peak_flops=float(flops), hbm_bw=bw, train_eff=1.0, infer_eff=1.0, mem_eff=1.0,
                       fresh_s_per_byte=tuple(tuple(map(float, p)) for p in rc.get("fresh_s_per_byte", ()))
                       or spec.fresh_s_per_byte, ckpt_region_s=float(rc.get("ckpt_region_s", spec.ckpt_region_s)),
                       ckpt_op_s=float(rc.get("ckpt_op_s", spec.ckpt_op_s)),
                       block_ops=tuple(own_block(key, m["recompute"]) for key, m in sorted(profile.models.items())
                                       if (m.get("recompute") or {}).get("op_s")),
                       kind_eff=tuple(sorted((k, float(v) / bw) for k, v in kinds.items())) or spec.kind_eff,
                       thread_speedup=tuple(float(x) for x in host.get("thread_speedup", (1.0,))),
                       source=f"profile {profile.path or ''}".strip())
    flops, bw = host.get("matmul_flops"), host.get("copy_bw")
    changes = {"source": f"profile {profile.path or ''}".strip()}
    if flops:
        ratio = float(flops) / spec.peak_flops
        changes.update(train_eff=min(1.0, ratio * 0.8), infer_eff=min(1.0, ratio))
    if bw:
        changes["mem_eff"] = min(1.0, float(bw) / spec.hbm_bw)
    return replace(spec, **changes)
