"""Device kinds a cluster may name, with their memory capacity.

This is the part of the hardware catalog the IR itself needs (to reject an
unknown device and to check memory); FLOP/s and bandwidths live in
``rlhfc.cost``. Capacities are the published HBM sizes in bytes.
"""

from __future__ import annotations

GiB = 1024**3
GB = 1000**3

#: device kind -> memory bytes per device. ``cpu`` capacity is a nominal host share.
DEVICE_MEMORY: dict[str, int] = {
    "cpu": 16 * GiB,
    "A100-40GB": 40 * GB,
    "A100-80GB": 80 * GB,
    "H100-80GB": 80 * GB,
    "H200": 141 * GB,
}

GPU_KINDS = tuple(k for k in DEVICE_MEMORY if k != "cpu")
