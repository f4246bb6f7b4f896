"""Which workers share a process (rlhfc.ir.schedule.shared_processes; the runtime's side: tests/runtime/test_host.py).

On a CPU cluster the one-process workers on the same cores with the same threads whose stages never run at the
same time share one, unless their engine or trainer keeps process-wide state, a model keeps dropout, or a
collective weight sync joins two of them; ``run { processes = own }`` and GPU clusters keep a process per worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import pytest

from rlhfc.codegen.plan import placement
from rlhfc.contract import engines
from rlhfc.frontend import load_file
from rlhfc.ir import plan, print_module
from rlhfc.ir.schedule import concurrent_workers, shared_processes
from rlhfc.passes import PassManager, pipeline_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "e2e", "tiny_ppo.rlhf")


def _program(path: str, level: str):
    module, _, _ = load_file(path)
    return PassManager(pipeline_for(level)).run(module)


def _module(level: str = "O0", run: str = "run { steps = 4; seed = 3; checkpoint_every = 2 }"):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny.rlhf")
        with open(path, "w") as fh:
            fh.write(open(TINY).read().replace("run { steps = 4; seed = 3; checkpoint_every = 2 }", run))
        module, _, _ = load_file(path)
    return PassManager(pipeline_for(level)).run(module) if level != "O0" else module


def _shared(module) -> dict[str, str | None]:
    return {name: w.process for name, w in placement(module).workers.items()}


def test_colocated_models_share_one_process_at_O0_and_O1():
    """The driver awaits every stage before the next: no two models' stages run at the same time."""
    for level in ("O0", "O1"):
        assert set(_shared(_module(level)).values()) == {"actor+ref+critic+reward"}, level


def test_models_whose_stages_run_at_the_same_time_keep_apart():
    """-O2 streams tiny_ppo's forwards beside its generation and trains actor and critic together: every pair of
    its models runs at the same time somewhere, so each keeps its own process (one interpreter each). The
    README's ppo_tiny at -O2 runs the actor's and the reference's stages apart: they share one."""
    assert set(_shared(_module("O2")).values()) == {None}
    module = _program(os.path.join(ROOT, "examples", "ppo_tiny.rlhf"), "O2")
    together = concurrent_workers(module)
    assert frozenset(("actor", "ref")) not in together and frozenset(("actor", "critic")) in together
    assert _shared(module) == {"actor": "actor+ref", "ref": "actor+ref", "critic": None, "reward": None}


def test_workers_on_other_cores_keep_apart():
    module = _module("O0")
    placed = plan.workers(module)
    key = {w.name: k for k, w in placed.items()}
    placed[key["reward"]] = dataclasses.replace(placed[key["reward"]], cores=(1,), threads=1)
    shared = shared_processes(module, placed)
    assert key["reward"] not in shared and set(shared.values()) == {"actor+ref+critic"}


def test_processes_own_keeps_a_process_per_worker_and_prints_in_the_ir():
    module = _module("O1", "run { steps = 4; seed = 3; processes = own }")
    assert set(_shared(module).values()) == {None}
    assert 'processes = "own"' in print_module(module)
    assert "processes" not in print_module(_module("O2"))   # the default is not printed


def test_what_keeps_a_worker_in_a_process_of_its_own(monkeypatch):
    module = _module("O0")
    placed = plan.workers(module)
    key = {w.name: k for k, w in placed.items()}

    # dropout draws from the process's random generator
    monkeypatch.setattr(module.models["ref"], "dropout", True)
    assert set(shared_processes(module, placed)) == {key["actor"], key["critic"], key["reward"]}
    monkeypatch.setattr(module.models["ref"], "dropout", False)

    # an engine whose traits do not allow it (a runtime of its own, as vLLM's)
    own = dataclasses.replace(engines.rollout_traits("torch"), name="own-runtime", shares_process=False)
    monkeypatch.setitem(engines._ROLLOUT, own.name, own)
    monkeypatch.setattr(module.run, "rollout", own.name)
    assert set(shared_processes(module, placed)) == {key["ref"], key["critic"], key["reward"]}   # the actor generates
    monkeypatch.setattr(module.run, "rollout", "torch")

    # a multi-rank group
    placed2 = dict(placed)
    placed2[key["critic"]] = dataclasses.replace(placed[key["critic"]], ranks=2, dp=2)
    assert key["critic"] not in shared_processes(module, placed2)

    # a GPU cluster
    monkeypatch.setattr(module.cluster, "device", "A100-80GB")
    assert shared_processes(module, placed) == {}


@pytest.mark.parametrize("transport,apart", [("collective", True), ("object_store", False)])
def test_a_collective_weight_sync_keeps_its_pair_apart(transport, apart):
    module = _module("O0")
    stage = next(s for s in module.graph.stages if s.op == "generate")
    fake = dataclasses.replace(stage, op="sync", attrs={"to_first": 0, "to_count": 1, "transport": transport})
    module.graph.stages.append(fake)   # only read by shared_processes(): a sync of the actor's weights
    placed = {k: w for k, w in plan.workers(module).items()}
    shared = shared_processes(module, placed)
    assert (all(k[0] != "actor" for k in shared)) is apart


def test_explain_says_which_workers_share_a_process(tmp_path, capsys):
    from rlhfc.cli import main as cli

    program = os.path.join(ROOT, "examples", "ppo_tiny.rlhf")
    assert cli(["explain", program, "-O2"]) == 0
    text = capsys.readouterr().out
    assert "  actor: dp1 tp1 pp1 · torch · 1 process shared with ref (devices 0-1)" in text
    assert "  critic: dp1 tp1 pp1 · torch · 1 process (devices 0-1)" in text
    assert cli(["explain", program, "-O2", "--format", "json", "-o", str(tmp_path / "e.json")]) == 0
    rows = {r["worker"]: r for r in json.loads((tmp_path / "e.json").read_text())["workers"]}
    assert rows["critic"]["process"] is None and rows["ref"]["process"] == "actor+ref"
