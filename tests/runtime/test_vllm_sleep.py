"""The vLLM engine's sleep mode on CUDA (issue #15): a co-located engine frees its KV cache (and offloads its
weights) after each generate call while the trainer trains, and wakes up before the next refit and generate.

vLLM's sleep mode needs CUDA, which this machine has not: these tests check the engine's control path on a
stand-in for ``vllm.LLM`` (no vLLM needed); on CPU the path is a no-op.
"""

from __future__ import annotations

from types import SimpleNamespace

from rlhfc.runtime.rollout.vllm import VllmEngine, VllmRollout


class FakeLLM:
    def __init__(self, calls: list):
        self.calls = calls

    def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True


def _engine(device: str, calls: list) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)   # no vLLM start: the sleep/wake bookkeeping only
    engine.name, engine.llm, engine.version, engine.device = "actor", FakeLLM(calls), 0, device
    engine.sleeps, engine.asleep = device.startswith("cuda"), False
    return engine


def test_a_cuda_engine_sleeps_once_after_a_call_and_wakes_once_before_the_next():
    calls: list = []
    engine = _engine("cuda", calls)
    assert engine.wake_up() == 0.0 and calls == []           # awake: nothing to do
    engine.sleep()
    engine.sleep()                                            # already asleep
    assert calls == [("sleep", 1)] and engine.asleep
    engine.wake_up()
    assert calls == [("sleep", 1), ("wake_up", None)] and not engine.asleep


def test_a_cpu_engine_never_sleeps():
    calls: list = []
    engine = _engine("cpu", calls)
    engine.sleep()
    engine.wake_up()
    assert calls == [] and not engine.asleep


def test_the_worker_wakes_its_engine_before_the_refit_and_the_generate():
    calls: list = []
    engine = _engine("cuda", calls)
    engine.asleep = True   # slept after the last generate
    engine.refit = lambda model, version, mb: calls.append(("refit", version)) or {"refit_s": 0.1}
    engine.stream = lambda rows, budgets, **kw: calls.append(("stream", kw["seed"])) or iter(())
    worker = SimpleNamespace(version=3, model=None, engine_stats={})
    rollout = VllmRollout(worker, {"engine": "vllm"})
    rollout.engine = engine
    list(rollout.stream(None, [[1, 2]], 4, eos_id=0, pad_id=0, temperature=1.0, top_p=1.0, row_keys=[5]))
    assert [c[0] for c in calls] == ["wake_up", "refit", "stream"]
    assert "engine_wake_s" in worker.engine_stats and worker.engine_stats["refit_s"] == 0.1
