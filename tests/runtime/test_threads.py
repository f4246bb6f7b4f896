"""Cores follow the work: a worker call with ``threads=N`` runs on N torch threads, then the worker goes
back to its own count (``rlhfc.runtime.worker.stages``)."""

from __future__ import annotations

import torch

from rlhfc.runtime.worker.stages import stage_call


class _Worker:
    threads = 2

    @stage_call
    def forward(self, x):
        return x, torch.get_num_threads()

    @stage_call
    def stream(self, n):
        for i in range(n):
            yield i, torch.get_num_threads()


def test_a_call_runs_with_the_threads_it_asks_for_and_restores_the_workers_own():
    w = _Worker()
    torch.set_num_threads(2)
    assert w.forward(7) == (7, 2)
    assert w.forward(7, threads=1) == (7, 1)
    assert torch.get_num_threads() == 2
    assert [t for _, t in w.stream(3, threads=1)] == [1, 1, 1]    # a streaming generator holds them
    assert torch.get_num_threads() == 2
    assert [t for _, t in w.stream(2)] == [2, 2]


def test_the_threads_come_back_when_the_call_fails():
    class Failing(_Worker):
        @stage_call
        def boom(self):
            raise RuntimeError("x")

    torch.set_num_threads(2)
    try:
        Failing().boom(threads=1)
    except RuntimeError:
        pass
    assert torch.get_num_threads() == 2


def test_ray_sees_the_threads_keyword():
    """Ray checks a call's keywords against the unwrapped method's signature."""
    import inspect

    from rlhfc.runtime.worker.base import ModelWorker

    for name in ("generate", "generate_chunks", "logprobs", "values", "score", "train"):
        assert "threads" in inspect.signature(inspect.unwrap(getattr(ModelWorker, name))).parameters
