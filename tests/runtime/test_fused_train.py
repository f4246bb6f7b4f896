"""Fused pipeline training (RLHFuse, :mod:`rlhfc.runtime.train.fused`) on real megatron-core ranks over gloo: an
actor (stages on devices 0 → 1) and a critic (1 → 0), two pipeline stages each, train one step with their
schedules interleaved in a searched order (:func:`rlhfc.cost.fused_schedule.device_orders`). Each model trains
bit for bit as it does unfused (the same operations in the same order on its ranks), and on every device the
operations ran in the order given, the two models' interleaved."""

from __future__ import annotations

import pytest
import torch

from rlhfc.cost.fused_schedule import Pipeline, device_orders, search, stage_sequence
from rlhfc.runtime.train.backend import open_store
from rlhfc.runtime.worker.base import ModelWorker

from spawned import run_spawned   # tests/runtime/spawned.py
from test_megatron import PROMPTS, SEED, _loss, _spec   # the layout tests' rollout, losses and specs

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

TRAIN = dict(lr=1e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
MICRO = 4   # megatron's micro-batches for 8 rows on 2 stages (the largest count up to 2·pp dividing the rows)


def _rank(role: str, rank: int, store, spec: dict, roll, fused: dict | None):
    torch.set_num_threads(1)
    worker = ModelWorker(role, spec, {"kind": "random"}, seed=SEED, trainer="megatron", rank=rank, world=2,
                         store=store, pp=2)
    metrics = worker.train(_loss(spec["head"], roll), **TRAIN, fused=fused)
    log = list(getattr(worker.backend, "last_log", []))
    return metrics, worker.get_weights(), log


def _run(specs: dict, roll, fused: dict | None) -> dict:
    stores = {role: open_store() for role in specs}
    calls = [(_rank, (role, r, stores[role], specs[role], roll,
                      dict(fused, model=m) if fused else None))
             for m, role in enumerate(specs) for r in range(2)]
    out = run_spawned(calls, what="rank")
    return {role: out[2 * m: 2 * m + 2] for m, role in enumerate(specs)}


def test_fused_actor_and_critic_train_bitwise_as_unfused_in_the_searched_order(make_spec):
    import torch.distributed as dist

    specs = {"actor": _spec(make_spec, "llama", "lm"), "critic": _spec(make_spec, "llama", "value")}
    roll = ModelWorker("gen", make_spec("llama"), {"kind": "random"}, seed=3).generate(
        PROMPTS, max_new_tokens=6, temperature=1.0, top_p=1.0)
    schedule = search(2, Pipeline("actor", MICRO, 1.0, 2.0), Pipeline("critic", MICRO, 1.0, 2.0), iterations=500)
    orders, _ = device_orders(schedule)
    for d, order in enumerate(orders):   # each model's own operations in its rank's 1F1B order, interleaved
        for m in (0, 1):
            assert [op[1:] for op in order if op[0] == m] == stage_sequence(d if m == 0 else 1 - d, 2, MICRO)
        assert len({m for m, _, _ in order[:len(order) // 2]}) == 2
    host, port = open_store()
    server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    fused = _run(specs, roll, {"store": (host, port), "orders": orders, "key": "step0"})
    plain = _run(specs, roll, None)
    for role in specs:
        for r in range(2):
            assert fused[role][r][0] == plain[role][r][0]             # the metrics, bit for bit
        got, want = fused[role][0][1], plain[role][0][1]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)   # the weights
    for d, order in enumerate(orders):   # what ran on each device, by start time: the order given
        ran = sorted((t0, m, kind, j) for m, role in enumerate(specs)
                     for rank in range(2) if (rank if m == 0 else 1 - rank) == d
                     for kind, j, _, t0, _ in fused[role][rank][2])
        assert [(m, kind, j) for _, m, kind, j in ran] == [tuple(op) for op in order]
    del server
