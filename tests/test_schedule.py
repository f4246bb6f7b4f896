"""One schedule, two readers: the generated ``main.py`` and the simulator run the stages in the order,
with the awaits and the streaming, that :func:`rlhfc.ir.schedule.build_schedule` says.

``main.py``'s ``step`` is executed against a recording job and recording workers (no Ray, no models):
every launch is logged with the set of stages the driver had already waited for at that moment. The
simulator's tasks must respect the same order: a stage starts only after everything the driver awaited
before launching it has ended, and exactly the schedule's stream consumers run in chunks.
"""

from __future__ import annotations

import os

import pytest

from rlhfc.codegen import PythonEmitter
from rlhfc.cost import CostConfig, simulate
from rlhfc.frontend import load_file
from rlhfc.ir.schedule import build_schedule
from rlhfc.passes import PassManager, parse_pipeline
from rlhfc.passes.pipelines import PIPELINES

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXAMPLES = ["ppo_tiny", "grpo_tiny", "ppo_7b", "ppo_70b"]
#: each -O level, plus partial pipelines whose plans the levels never produce
PIPES = {level: ",".join(p if p != "placement" else "placement{candidates=40}" for p in passes)
         for level, passes in PIPELINES.items()}
PIPES.update({"stream-only": "dce,stream", "parallelize-only": "dce,parallelize",
              "overcommit-no-stream": "dce,overcommit"})


class _Future:
    def __init__(self, rec, worker: str, method: str):
        self.stage: str | None = None
        rec.launches.append((self, worker, method, frozenset(rec.awaited)))


class _Worker:
    def __init__(self, rec, name: str):
        self._rec, self._name = rec, name

    def __getattr__(self, method: str):
        rec, name = self._rec, self._name
        return type("Method", (), {"remote": staticmethod(lambda *a, **k: _Future(rec, name, method))})()


class _Workers:
    def __init__(self, rec):
        self._rec = rec

    def __getattr__(self, name: str):
        return _Worker(self._rec, name)


class _Job:
    """Records what the generated step launches and awaits, stage by stage."""

    def __init__(self, module):
        self.m = module
        self.value_to_stage = {v.name: s.name for s in module.graph.stages for v in s.outputs}
        self.launches: list = []        # (future or stage name, worker, method, awaited-at-launch)
        self.awaited: set[str] = set()

    def _bind(self, fut, stage: str) -> None:
        if isinstance(fut, _Future):
            fut.stage = stage

    def _results(self, stage: str):
        n = len(self.m.graph.stage(stage).outputs)
        return tuple(object() for _ in range(n)) if n > 1 else object()

    def next_prompts(self, data: str, batch: int):
        stage = next(s.name for s in self.m.graph.stages if s.op == "load" and s.target == data)
        self.launches.append((stage, "driver", "load", frozenset(self.awaited)))
        self.awaited.add(stage)
        return object()

    def get(self, stage: str, fut):
        self._bind(fut, stage)
        self.awaited.add(stage)
        return object()

    def wait(self, futures: dict):
        for value, fut in futures.items():
            self._bind(fut, self.value_to_stage[value])
            self.awaited.add(self.value_to_stage[value])
        return [object() for _ in futures]

    def compute(self, stage: str, fn, /, *args, **kwargs):
        assert callable(fn)
        self.launches.append((stage, "driver", "compute", frozenset(self.awaited)))
        self.awaited.add(stage)
        return self._results(stage)

    def sync(self, stage: str, src, dst, **kwargs):
        self.launches.append((stage, "driver", "sync", frozenset(self.awaited)))
        self.awaited.add(stage)
        return object()

    def stream(self, stage: str, launch, /, *, prompts=None, data=None, batch=None, consumers=None, overcommit=None):
        if data is not None:   # an overcommitted generate draws its own prompts
            load = next(s.name for s in self.m.graph.stages if s.op == "load" and s.target == data)
            self.launches.append((load, "driver", "load", frozenset(self.awaited)))
        self._bind(launch(prompts, []), stage)
        out = [object()]
        for value, start in (consumers or {}).items():
            self._bind(start(object()), self.value_to_stage[value])
            out.append(object())
        self.awaited.update(self._launched_names())
        return out

    def ahead(self, stage: str, launch, /, *, data, batch, staleness):
        """An asynchronous generate draws its prompts and launches its generation (the step awaits it)."""
        load = next(s.name for s in self.m.graph.stages if s.op == "load" and s.target == data)
        self.launches.append((load, "driver", "load", frozenset(self.awaited)))
        self._bind(launch(object()), stage)
        self.awaited.update(self._launched_names())
        return object()

    def _launched_names(self) -> set[str]:
        return {x.stage if isinstance(x, _Future) else x for x, *_ in self.launches}


def _compile(name: str, pipe: str):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        module, _, _ = load_file(f"examples/{name}.rlhf")
        return PassManager(parse_pipeline(PIPES[pipe])).run(module)
    finally:
        os.chdir(cwd)


def _trace(module) -> list[tuple[str, frozenset]]:
    """Run the generated step function against the recording job: (stage, awaited at launch) in order."""
    code = PythonEmitter(module, source=None, opt_level=None, passes=[]).emit()
    scope: dict = {"__name__": "rlhfc_job_under_test"}
    exec(compile(code, "main.py", "exec"), scope)
    job = _Job(module)
    results = scope["step"](job, _Workers(job))
    for value, out in results.items():   # futures left for the end of the step
        if isinstance(out, _Future) and out.stage is None:
            out.stage = job.value_to_stage[value]
    trace = []
    for x, _worker, _method, awaited in job.launches:
        stage = x.stage if isinstance(x, _Future) else x
        assert stage is not None, "a launched call was never awaited nor returned"
        trace.append((stage, awaited))
    return trace


@pytest.mark.parametrize("pipe", list(PIPES))
@pytest.mark.parametrize("name", EXAMPLES)
def test_main_py_and_the_simulator_follow_the_schedule(name, pipe):
    module = _compile(name, pipe)
    sched = build_schedule(module)

    # main.py: every stage launched once, in schedule order, after exactly what the schedule says
    trace = _trace(module)
    launched = [stage for stage, _ in trace]
    assert sorted(launched) == sorted(e.name for e in sched.entries)
    assert launched == [e.name for e in sched.launch_order()]
    for stage, awaited in trace:
        assert awaited == sched[stage].after, f"{name} {pipe}: %{stage} launched after {sorted(awaited)}"

    # the simulator: nothing starts before what the driver awaited when launching it; streams agree
    result = simulate(module, CostConfig(dispatch_s=0.0), steps=2)
    tasks = {t.stage: t for t in result.step_tasks(1)}
    for e in sched.entries:
        for before in e.after:
            assert tasks[before].end <= tasks[e.name].start + 1e-9, \
                f"{name} {pipe}: simulated %{e.name} starts before %{before} ends"
        chunked = bool(tasks[e.name].chunks)
        assert chunked == (e.source is not None), f"{name} {pipe}: %{e.name} chunked={chunked} in the simulator"


def test_stream_pass_alone_prices_the_actor_logprobs_whole_after_the_stream():
    """The bug this schedule removes: with only ``stream``, %logp (the generating model's own forward) is
    not a stream consumer; the simulator used to price it in chunks while main.py ran it afterwards."""
    module = _compile("ppo_tiny", "stream-only")
    sched = build_schedule(module)
    assert sched["logp"].kind == "remote" and sched["logp"].source is None
    assert set(sched["roll"].consumers) == {"ref_logp", "values", "scores"}
    r = simulate(module, CostConfig(dispatch_s=0.0), steps=2)
    logp = next(t for t in r.step_tasks(1) if t.stage == "logp")
    roll = next(t for t in r.step_tasks(1) if t.stage == "roll")
    assert not logp.chunks and logp.start >= roll.end - 1e-9


def test_a_plugin_op_compiles_with_its_emit_rule(tmp_path, monkeypatch):
    """An op registered with an emit rule (``Emit("compute", "module:function")``) is compiled into main.py,
    which imports its module and calls the function; default rules call the runtime's own functions."""
    from rlhfc.ir import Attr, Emit, Operand, OpSpec, Stage, Value, ValueType, ops, register_op, verify
    from rlhfc.runtime import compute

    (tmp_path / "my_bonus.py").write_text("def length_bonus(rollout, *, scale):\n    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = register_op(OpSpec("compute.length_bonus", (Operand("rollout", ("Rollout",)),),
                              (Attr("scale", "float", 1.0, min=0.0),), ("SeqFloat",),
                              emit=Emit("compute", "my_bonus:length_bonus")))
    try:
        module = _compile("ppo_tiny", "O0")
        g = module.graph
        g.insert(g.stages.index(g.stage("scores")) + 1,
                 Stage(spec.op, None, [g.values()["roll"]], [Value("bonus", ValueType("SeqFloat", 16))], {"scale": 0.5}))
        verify(module)
        code = PythonEmitter(module, source=None, opt_level=None, passes=[]).emit()
        assert "import my_bonus as _my_bonus" in code
        assert "bonus = job.compute('bonus', _my_bonus.length_bonus, roll, scale=0.5)" in code
        scope: dict = {"__name__": "rlhfc_job_under_test"}
        exec(compile(code, "main.py", "exec"), scope)
        job = _Job(module)
        called = {}
        job.compute = lambda stage, fn, /, *a, **k: called.setdefault(stage, fn) and job._results(stage)
        scope["step"](job, _Workers(job))
        import my_bonus

        assert called["bonus"] is my_bonus.length_bonus and called["adv"] is compute.gae
    finally:
        ops._OPS.pop("compute.length_bonus", None)


def test_an_emit_rule_must_name_a_function():
    from rlhfc.ir import Emit, Operand, OpSpec, get_op, register_op

    with pytest.raises(ValueError, match="module:function"):
        register_op(OpSpec("compute.nowhere", (Operand("rollout", ("Rollout",)),), (), ("SeqFloat",),
                           emit=Emit("compute", "no_function_here")))
    assert get_op("compute.nowhere") is None


def test_a_stage_without_a_mesh_runs_on_its_model_home_mesh_everywhere():
    """Cost model, simulator workers and the runtime placement agree where an unannotated stage runs: on its
    model's home mesh (its train stage's), not on the whole cluster."""
    from rlhfc.codegen.plan import placement
    from rlhfc.cost import CostModel
    from rlhfc.ir import plan

    module = _compile("ppo_tiny", "O0")
    module.graph.stage("actor_train").annotations["mesh"] = {"first": 1, "count": 1}
    roll = module.graph.stage("roll")
    assert plan.stage_mesh(module, roll) == plan.Mesh(1, 1)
    assert CostModel(module).layout(roll).devices == range(1, 2)
    run = placement(module).workers
    assert run["actor"].mesh == (1, 1) and not any(k.startswith("actor_at") for k in run)
    assert plan.stage_worker(module, roll) == "actor"
    sim = plan.workers(module)
    assert {w.name for w in sim.values()} == set(run)
