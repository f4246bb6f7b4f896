"""Weight sync: the time to move a model's weights from one layout to another (parameter reallocation).

Each destination device needs the shard of the weights its (tensor rank,
pipeline stage) holds in the new layout. It takes every piece from the nearest
source device that holds it in the old layout (itself, then a device of its
node over NVLink, then another node over the network); a device that already
holds its piece receives nothing. Receivers work in parallel, so the transfer
takes the slowest receiver's time (ReaL: bytes / bandwidth per destination, max
over ranks) plus a fixed start-up per transfer (ReaL measured ~0.03 s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import DeviceSpec
from rlhfc.ir.plan import Layout

RESHARD_SETUP_S = 0.03


@dataclass(frozen=True)
class Shard:
    device: int
    layers: tuple[float, float]   # fraction of the layers [lo, hi)
    cols: tuple[float, float]     # fraction of each layer's tensor-parallel split [lo, hi)


def shards(layout: Layout) -> list[Shard]:
    """Which part of the weights each device of ``layout`` holds (device order: dp outer, pp, tp inner)."""
    out = []
    for i, d in enumerate(layout.devices):
        tp_rank = i % layout.tp
        pp_rank = (i // layout.tp) % layout.pp
        out.append(Shard(d, (pp_rank / layout.pp, (pp_rank + 1) / layout.pp),
                         (tp_rank / layout.tp, (tp_rank + 1) / layout.tp)))
    return out


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def sync_time(weight_bytes: float, src: Layout, dst: Layout, spec: DeviceSpec, per_node: int) -> float:
    """Seconds to move a model of ``weight_bytes`` from layout ``src`` to ``dst`` (0 when they are the same)."""
    if src.same_placement(dst):
        return 0.0
    intra = spec.intra_bw * spec.net_eff
    inter = spec.inter_bw * spec.net_eff
    key = (weight_bytes, src, dst, intra, inter, per_node)
    if key not in _SYNC_CACHE:   # a pure function of its arguments; placement searches ask for the same pairs
        if len(_SYNC_CACHE) > 65536:
            _SYNC_CACHE.clear()
        _SYNC_CACHE[key] = _sync_time(weight_bytes, src, dst, intra, inter, per_node)
    return _SYNC_CACHE[key]


_SYNC_CACHE: dict = {}


def _sync_time(weight_bytes: float, src: Layout, dst: Layout, intra: float, inter: float, per_node: int) -> float:
    cells: dict[tuple, list[int]] = {}
    for sh in shards(src):
        cells.setdefault((sh.layers, sh.cols), []).append(sh.device)
    # the source pieces each destination piece overlaps, found once per piece (the devices of a data-parallel
    # layout share a piece): (fraction, holders, the holders' nodes) in ``cells``' order, so the sums below add
    # the same terms in the same order as a pass over every cell would
    parts: dict[tuple, list] = {}
    worst = 0.0
    for want in shards(dst):
        over = parts.get((want.layers, want.cols))
        if over is None:
            over = parts[(want.layers, want.cols)] = [
                (part, set(holders), {h // per_node for h in holders}) for (layers, cols), holders in cells.items()
                if (part := _overlap(want.layers, layers) * _overlap(want.cols, cols)) > 0]
        seconds = 0.0
        node = want.device // per_node
        for part, holders, nodes in over:
            if want.device in holders:
                continue
            seconds += weight_bytes * part / (intra if node in nodes else inter)
        worst = max(worst, seconds)
    return RESHARD_SETUP_S + worst


def host_copy_time(nbytes: float, spec: DeviceSpec) -> float:
    """Offload/onload of ``nbytes`` per device over the host link (all devices in parallel)."""
    return nbytes / (spec.host_bw * spec.net_eff)


def reshard_time(weight_bytes: float, held: float, bucket_mb: float, layout: Layout, spec: DeviceSpec,
                 per_node: int) -> float:
    """Seconds for a worker group on ``layout`` to gather full copies of a model of ``weight_bytes`` on every
    rank, each rank holding the fraction ``held`` (1/(tp·pp) of tensor/pipeline pieces, 1/ranks of FSDP
    shards): all-gathers in buckets of ``bucket_mb`` MiB, each rank receiving the ``1 - held`` it lacks
    (ring all-gather: every byte it lacks crosses its link once), over the node's links or the network."""
    lacking = weight_bytes * max(0.0, 1.0 - held)
    if lacking <= 0:
        return 0.0
    bw = (spec.inter_bw if len(layout.nodes(per_node)) > 1 else spec.intra_bw) * spec.net_eff
    buckets = math.ceil(weight_bytes * held / (bucket_mb * 2 ** 20))
    return buckets * spec.latency + lacking / bw


def refit_time(nbytes: float, bucket_mb: int, spec: DeviceSpec) -> float:
    """The vLLM engine's refit (``run { rollout = vllm }``): the generating worker copies ``nbytes`` of weights
    into the engine in its own process, in buckets of ``bucket_mb`` MiB — one read and one write of each byte
    at the device's memory bandwidth, plus a start-up per bucket. The bytes' part only: the cost model adds vLLM's
    per-layer re-processing (:meth:`rlhfc.cost.model.CostModel.refit_seconds`)."""
    buckets = max(1.0, -(-nbytes // (max(1, bucket_mb) * 2**20)))
    return buckets * spec.latency + 2 * nbytes / (spec.hbm_bw * spec.mem_eff)
