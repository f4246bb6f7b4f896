"""Weight transfer between two copies of a model (realloc's sync): both transports give exact copies."""

from __future__ import annotations

import threading

import pytest
import torch

from rlhfc.runtime.worker.base import ModelWorker


def _pair(make_spec, arch: str):
    spec = make_spec(arch, hidden=256, ffn=512)        # ~2 M parameters: several 1 MiB buckets
    src = ModelWorker("actor", spec, {"kind": "random"}, seed=1)
    dst = ModelWorker("actor", spec, {"kind": "random"}, seed=2)
    with torch.no_grad():
        for p in src.model.parameters():
            p.add_(0.5)                                  # the "trained" weights differ from dst's
    src.version = 7
    return src, dst


def _same(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_collective_broadcast_gives_exact_copies_in_buckets(make_spec, arch):
    src, dst = _pair(make_spec, arch)
    assert not _same(src, dst)
    host, port = src.sync_open("sync_test")
    joined = []
    t = threading.Thread(target=lambda: joined.append(dst.sync_join("sync_test", 1, host, port, "gloo")))
    t.start()
    src.sync_join("sync_test", 0, host, port, "gloo")
    t.join(60)
    assert joined == ["gloo"]
    got = []
    t = threading.Thread(target=lambda: got.append(dst.sync_recv("sync_test", 1)))
    t.start()
    version, nbytes, buckets = src.sync_send("sync_test", 1)
    t.join(60)
    assert got == [buckets] and buckets >= 3
    assert version == 7 and nbytes == sum(v.numel() * v.element_size() for v in src.model.state_dict().values())
    assert _same(src, dst)
    # the group stays: a second transfer after more "training" reuses it
    with torch.no_grad():
        next(src.model.parameters()).mul_(2.0)
    t = threading.Thread(target=lambda: dst.sync_recv("sync_test", 1))
    t.start()
    src.sync_send("sync_test", 1)
    t.join(60)
    assert _same(src, dst)


def test_object_store_buckets_give_exact_copies(make_spec):
    from rlhfc.runtime.driver.cluster import import_ray

    ray = import_ray()   # the environment a job's driver starts Ray with (no token authentication)
    src, dst = _pair(make_spec, "llama")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        refs, version, nbytes = src.sync_export(1)
        assert len(refs) >= 3 and version == 7
        for r in refs:
            dst.sync_import(ray.get(r))
    finally:
        ray.shutdown()
    assert _same(src, dst)


def test_unknown_backend_is_refused(make_spec):
    src, _ = _pair(make_spec, "llama")
    host, port = src.sync_open("bad")
    with pytest.raises(ValueError, match="unknown collective backend"):
        src.sync_join("bad", 0, host, port, "mpi")
