"""The ``fuse_training`` pass on the IR (its runtime end to end: tests/e2e/test_fused_run.py; the executor:
tests/runtime/test_fused_train.py): which train stages it fuses, what it writes, where it does nothing, the
verifier's errors for a malformed mark, the plan's reversed stages, the price and explain's drawing."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.cost import CostModel
from rlhfc.cost.fused_pairs import micro_batches
from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, plan
from rlhfc.passes import PassManager, parse_pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "e2e", "tiny_fused.rlhf")


def _module(edit=lambda t: t, passes: str = "O2"):
    module, _ = compile_source(edit(open(PROGRAM).read()), PROGRAM)
    from rlhfc.passes import PIPELINES

    names = PIPELINES[passes] if passes in PIPELINES else passes.split(";")
    return PassManager(parse_pipeline(",".join(names))).run(module)


def _trains(module):
    return [s for s in module.graph.stages if s.op == "train"]


def test_two_pipeline_trainings_on_the_same_devices_fuse_with_the_second_in_reverse():
    module = _module()
    actor, critic = _trains(module)
    fa, fc = plan.fused(actor), plan.fused(critic)
    assert (fa.role, fa.partner, fc.role, fc.partner) == (0, "critic_train", 1, "actor_train")
    assert fa.orders == fc.orders and fa.gain == fc.gain > 1.0
    orders = fa.device_orders()
    assert len(orders) == 2 and all(len(o) == 2 * 2 * micro_batches(8, 2) for o in orders)   # 4 micro-batches
    assert micro_batches(8, 2) == 4 and micro_batches(6, 2) == 3 and micro_batches(7, 2) == 1
    again = PassManager(parse_pipeline("fuse_training")).run(module)   # idempotent
    assert plan.fused(_trains(again)[0]) == fa


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("model critic = like(actor) head = value layout(pp = 2)", "model critic = like(actor) head = value layout(tp = 2)"),
    lambda t: t.replace("value_loss(roll, values, ret), lr = 1e-3, minibatches = 1", "value_loss(roll, values, ret), lr = 1e-3, minibatches = 2"),
    lambda t: t.replace("; trainer = megatron", "; trainer = auto").replace(" layout(pp = 2)", ""),
], ids=["critic_not_pipelined", "other_minibatches", "one_process"])
def test_where_two_schedules_cannot_pair_the_pass_changes_nothing(edit):
    assert all(plan.fused(s) is None for s in _trains(_module(edit)))


def test_a_malformed_mark_is_a_located_error():
    from rlhfc.ir.verifier import verify

    module = _module(passes="dce")
    actor = _trains(module)[0]
    actor.annotations["fused"] = {"role": 2, "with": "critic_train", "orders": ["0F0"]}
    with pytest.raises(CompileError) as exc:
        verify(module)
    assert "fused must be {role = 0 | 1" in str(exc.value) and "tiny_fused.rlhf:18" in str(exc.value)
    actor.annotations["fused"] = {"role": 0, "with": "critic_train", "orders": ["0F0 2X1"]}
    with pytest.raises(CompileError):
        verify(module)
    roll = next(s for s in module.graph.stages if s.op == "generate")
    del actor.annotations["fused"]
    roll.annotations["fused"] = {"role": 0, "with": "x", "orders": ["0F0"]}
    with pytest.raises(CompileError) as exc:
        verify(module)
    assert "'fused' applies to train stages only" in str(exc.value)


def test_the_plan_reverses_the_second_models_stages_and_the_job_passes_the_order(tmp_path):
    from rlhfc.codegen import emit_job

    module = _module()
    emit_job(module, str(tmp_path / "job"), source_path=PROGRAM, opt_level="O2", passes=[])
    workers = json.load(open(tmp_path / "job" / "plan.json"))["placement"]["workers"]
    assert workers["critic"]["reversed_stages"] and not workers["actor"]["reversed_stages"]
    code = open(tmp_path / "job" / "main.py").read()
    assert "fused=job.fused(0, [" in code and "fused=job.fused(1, [" in code


def test_on_gpus_the_pair_is_priced_at_the_searched_gain_and_explain_draws_it(capsys):
    from rlhfc.passes import PIPELINES

    def gpu(t):
        return t.replace("cluster local { devices = cpu:2 }", 'cluster gpus { gpu = "H100-80GB"; gpus_per_node = 2 }')

    fused = _module(gpu)
    plain = _module(gpu, passes=";".join(p for p in PIPELINES["O2"] if p != "fuse_training"))
    f = plan.fused(_trains(fused)[0])
    if f is None:
        pytest.skip("the GPU plan did not place both trainings in two stages on the same devices")
    cf, cp = CostModel(fused).stage_cost(_trains(fused)[0]), CostModel(plain).stage_cost(_trains(plain)[0])
    assert cf.time_s == pytest.approx(cp.time_s / f.gain, rel=1e-6)
    cpu = _module()
    assert CostModel(cpu).fused_gain(_trains(cpu)[0]) is None   # the CPU simulator shares the cores instead
    from rlhfc.cli import main

    assert main(["explain", PROGRAM, "-O2"]) == 0
    out = capsys.readouterr().out
    assert "train as one fused pipeline schedule (fuse_training, RLHFuse) on 2 devices" in out
    assert "device  0 |" in out and "device  1 |" in out
