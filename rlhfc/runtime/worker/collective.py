"""Collective weight transfer (a ``sync`` stage with ``transport = "collective"``), a part of every worker.

The sender and the receiver of a sync stage form a two-rank process group of their own (NCCL between GPUs,
gloo on CPU) and the sender broadcasts its weights in flat buckets, cut the same way at both ends (both
build the same model). The worker provides ``version``, ``_stores``, ``_groups`` and ``_state_items()``.
"""

from __future__ import annotations

import torch

#: how long a collective rendezvous or transfer may wait for the other rank (seconds)
GROUP_TIMEOUT_S = 300


class CollectiveSync:
    """The collective side of :class:`rlhfc.runtime.worker.base.ModelWorker`."""

    def sync_open(self, key: str) -> tuple[str, int]:
        """Start the rendezvous store of group ``key`` here (the sender's side): (host, port)."""
        from datetime import timedelta

        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, 2, True, timeout=timedelta(seconds=GROUP_TIMEOUT_S),
                              wait_for_workers=False)
        self._stores[key] = store
        return host, int(store.port)

    def sync_join(self, key: str, rank: int, host: str, port: int, backend: str) -> str:
        """Join the two-rank group ``key`` (rank 0 sends, rank 1 receives); blocks until both are in."""
        from datetime import timedelta

        import torch.distributed as dist

        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        store = self._stores[key] if rank == 0 else \
            dist.TCPStore(host, int(port), 2, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"rlhfc/{key}", store)
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(prefixed, int(rank), 2)
        elif backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, int(rank), 2, timeout)
        else:
            raise ValueError(f"unknown collective backend {backend!r} (nccl or gloo)")
        self._groups[key] = (group, store)   # the store must outlive the group
        return backend

    def _buckets(self, bucket_mb: int) -> list[list[tuple[str, torch.Tensor]]]:
        """The state dict cut into buckets of one dtype and about ``bucket_mb`` MiB, in state-dict order
        (both ends build the same model, so they cut it the same way)."""
        limit = max(1, int(bucket_mb)) * 2**20
        out: list[list[tuple[str, torch.Tensor]]] = []
        size = 0
        for name, tensor in self._state_items():
            if not out or size >= limit or out[-1][0][1].dtype != tensor.dtype:
                out.append([])
                size = 0
            out[-1].append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        return out

    def _broadcast(self, key: str, flat: torch.Tensor) -> None:
        import torch.distributed as dist

        group = self._groups[key][0]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([flat], opts).wait()

    def sync_send(self, key: str, bucket_mb: int) -> tuple[int, int, int]:
        """Broadcast the weights to the other rank of group ``key``: (version, bytes, buckets)."""
        total = 0
        buckets = self._buckets(bucket_mb)
        with torch.no_grad():
            for bucket in buckets:
                flat = torch.cat([t.detach().reshape(-1) for _, t in bucket])
                self._broadcast(key, flat)
                total += flat.numel() * flat.element_size()
        return self.version, total, len(buckets)

    def sync_recv(self, key: str, bucket_mb: int) -> int:
        """Receive the weights broadcast by rank 0 of group ``key`` into this worker's model (exact copies)."""
        buckets = self._buckets(bucket_mb)
        with torch.no_grad():
            for bucket in buckets:
                flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=bucket[0][1].dtype,
                                   device=bucket[0][1].device)
                self._broadcast(key, flat)
                at = 0
                for _, t in bucket:
                    t.copy_(flat[at:at + t.numel()].view_as(t))
                    at += t.numel()
        return len(buckets)
