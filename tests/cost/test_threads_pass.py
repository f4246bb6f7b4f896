"""The ``threads`` pass: a CPU stage runs on fewer torch threads where the profile measured that faster, the
job's generated call says so, and the simulator prices the same count."""

from __future__ import annotations

import pytest

from rlhfc.codegen import PythonEmitter
from rlhfc.cost import CostConfig, simulate
from rlhfc.ir import CompileError, VerificationError, parse_ir, print_module, verify
from rlhfc.ir.schedule import stage_threads
from rlhfc.passes import PassManager, parse_pipeline

from .helpers import example
from .test_thread_scaling import _points, _profile


def _o2(profile_path: str | None):
    """ppo_tiny at -O2 on its own 2-core node, priced (and thread-marked) with ``profile_path``."""
    module = example("ppo_tiny")
    spec = "parallelize,placement,realloc,threads" + (f"{{profile={profile_path}}}" if profile_path else "")
    return PassManager(parse_pipeline(spec)).run(module)


def _grid(gen: float) -> dict:
    """Forward/train points as test_thread_scaling's, and a generate grid (B x P x T) of ``gen`` x a decode
    time linear in its steps and rows."""
    out = _points(1.0)
    out["generate"] = [[b, p, t, gen * (2e-3 + t * (4e-4 + 2e-6 * b * (p + t / 2)))]
                       for b in (4, 16, 64) for p in (6, 16) for t in (8, 40)]
    return out


def _saved(tmp_path, one_gen: float):
    """A profile whose 1-thread points equal the 2-thread ones but for generation, ``one_gen`` x as long."""
    path = tmp_path / "profile.json"
    _profile(_grid(1.0), _grid(one_gen)).save(str(path))
    return str(path)


def test_a_stage_measured_faster_on_one_thread_runs_on_one(tmp_path):
    """Generation 30 % faster on 1 thread than on the node's 2: the generate stage is marked threads = 1
    (canonical text, round trip), stage_threads gives it 1, the job's call says threads=1; the forwards and
    trains, no faster on 1 thread, keep their counts."""
    module = _o2(_saved(tmp_path, 0.7))
    roll = module.graph.stage("roll")
    assert roll.annotations["threads"] == 1
    assert "threads = 1" in print_module(module)
    assert parse_ir(print_module(module)).graph.stage("roll").annotations["threads"] == 1
    assert stage_threads(module)["roll"] == 1
    assert all("threads" not in s.annotations for s in module.graph.stages if s.op != "generate")
    code = PythonEmitter(module, source=None, opt_level="O2", passes=["threads"]).emit()
    line = next(ln for ln in code.splitlines() if ".generate.remote(" in ln)
    assert "threads=1" in line


def test_nothing_changes_without_a_measured_gain(tmp_path):
    """No profile, a profile where one thread is slower, or a gain under MIN_GAIN: no mark, same prices."""
    from rlhfc.passes.threads import MIN_GAIN

    plain = _o2(None)
    for module in (plain, _o2(_saved(tmp_path, 1.3)), _o2(_saved(tmp_path, 1 / (1 + MIN_GAIN / 2)))):
        assert all("threads" not in s.annotations for s in module.graph.stages)
        assert stage_threads(module) == stage_threads(plain)


def test_the_simulator_prices_the_marked_count(tmp_path):
    """The marked plan's generate is priced at its 1-thread time: 0.7 x the unmarked plan's."""
    path = _saved(tmp_path, 0.7)
    from rlhfc.cost import load_profile

    config = CostConfig(profile=load_profile(path))
    marked = simulate(_o2(path), config, steps=1)
    unmarked = simulate(PassManager(parse_pipeline("parallelize,placement,realloc")).run(example("ppo_tiny")),
                        config, steps=1)
    busy = next(t.busy for t in marked.tasks if t.stage == "roll")
    before = next(t.busy for t in unmarked.tasks if t.stage == "roll")
    assert busy == pytest.approx(0.7 * before, rel=0.05)


def test_a_bad_threads_annotation_is_a_located_error():
    module = _o2(None)
    text = print_module(module).replace("annot {mesh", "annot {threads = 0, mesh", 1)
    with pytest.raises((CompileError, VerificationError)) as err:
        verify(parse_ir(text))
    assert "stage %roll: threads must be a positive integer, got int 0" in str(err.value)
