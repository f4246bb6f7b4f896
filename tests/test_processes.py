"""Which workers share a process (rlhfc.codegen.plan.processes; the runtime's side: tests/runtime/test_host.py).

On a CPU cluster the one-process workers on the same cores with the same threads share one, unless their
engine or trainer keeps process-wide state, a model keeps dropout, or a collective weight sync joins two of
them; ``run { processes = own }`` and GPU clusters keep a process per worker.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest

from rlhfc.codegen.plan import placement, processes
from rlhfc.contract import engines
from rlhfc.frontend import load_file
from rlhfc.ir import plan, print_module
from rlhfc.passes import PassManager, pipeline_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "e2e", "tiny_ppo.rlhf")


def _module(level: str = "O0", run: str = "run { steps = 4; seed = 3; checkpoint_every = 2 }"):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny.rlhf")
        with open(path, "w") as fh:
            fh.write(open(TINY).read().replace("run { steps = 4; seed = 3; checkpoint_every = 2 }", run))
        module, _, _ = load_file(path)
    return PassManager(pipeline_for(level)).run(module) if level != "O0" else module


def _shared(module) -> dict[str, str | None]:
    return {name: w.process for name, w in placement(module).workers.items()}


def test_colocated_models_share_one_process_at_O0_and_O2():
    for level in ("O0", "O2"):
        assert set(_shared(_module(level)).values()) == {"actor+ref+critic+reward"}, level


def test_workers_on_other_cores_keep_apart():
    """-O3 gives the actor core 0 (one thread) and the three forward models core 1: two processes."""
    module = _module("O3")
    cores = {name: w.cores for name, w in placement(module).workers.items()}
    assert cores["actor"] != cores["ref"]
    shared = _shared(module)
    assert shared["actor"] is None and {shared[m] for m in ("ref", "critic", "reward")} == {"ref+critic+reward"}


def test_processes_own_keeps_a_process_per_worker_and_prints_in_the_ir():
    module = _module("O2", "run { steps = 4; seed = 3; processes = own }")
    assert set(_shared(module).values()) == {None}
    assert 'processes = "own"' in print_module(module)
    assert "processes" not in print_module(_module("O2"))   # the default is not printed


def test_what_keeps_a_worker_in_a_process_of_its_own(monkeypatch):
    module = _module("O0")
    placed = plan.workers(module)
    key = {w.name: k for k, w in placed.items()}

    # dropout draws from the process's random generator
    monkeypatch.setattr(module.models["ref"], "dropout", True)
    assert set(processes(module, placed)) == {key["actor"], key["critic"], key["reward"]}
    monkeypatch.setattr(module.models["ref"], "dropout", False)

    # an engine whose traits do not allow it (a runtime of its own, as vLLM's)
    own = dataclasses.replace(engines.rollout_traits("torch"), name="own-runtime", shares_process=False)
    monkeypatch.setitem(engines._ROLLOUT, own.name, own)
    monkeypatch.setattr(module.run, "rollout", own.name)
    assert set(processes(module, placed)) == {key["ref"], key["critic"], key["reward"]}   # the actor generates
    monkeypatch.setattr(module.run, "rollout", "torch")

    # a multi-rank group
    placed2 = dict(placed)
    placed2[key["critic"]] = dataclasses.replace(placed[key["critic"]], ranks=2, dp=2)
    assert key["critic"] not in processes(module, placed2)

    # a GPU cluster
    monkeypatch.setattr(module.cluster, "device", "A100-80GB")
    assert processes(module, placed) == {}


@pytest.mark.parametrize("transport,apart", [("collective", True), ("object_store", False)])
def test_a_collective_weight_sync_keeps_its_pair_apart(transport, apart):
    module = _module("O0")
    stage = next(s for s in module.graph.stages if s.op == "generate")
    fake = dataclasses.replace(stage, op="sync", attrs={"to_first": 0, "to_count": 1, "transport": transport})
    module.graph.stages.append(fake)   # only read by processes(): a sync of the actor's weights
    placed = {k: w for k, w in plan.workers(module).items()}
    shared = processes(module, placed)
    assert (all(k[0] != "actor" for k in shared)) is apart


def test_explain_says_which_workers_share_a_process(tmp_path, capsys):
    from rlhfc.cli import main as cli

    assert cli(["explain", TINY, "-O3"]) == 0
    text = capsys.readouterr().out
    assert "  actor: dp1 tp1 pp1 · torch · 1 process (device 0)" in text
    assert "  ref: dp1 tp1 pp1 · torch · 1 process shared with critic, reward (device 1)" in text
    assert cli(["explain", TINY, "-O3", "--format", "json", "-o", str(tmp_path / "e.json")]) == 0
    rows = {r["worker"]: r for r in __import__("json").loads((tmp_path / "e.json").read_text())["workers"]}
    assert rows["actor"]["process"] is None and rows["critic"]["process"] == "ref+critic+reward"
