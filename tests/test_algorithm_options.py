"""The algorithm options in the IR: defaults stay out of the IR, the runtime agrees on them, and the
schedule's length comes from the run."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import all_ops
from rlhfc.ir.printer import print_module
from rlhfc.runtime import compute
from rlhfc.runtime.worker.base import ModelWorker

ROOT = Path(__file__).resolve().parent.parent
GRPO = (ROOT / "examples" / "grpo_tiny.rlhf").read_text()


def _runtime_function(op: str):
    if op in ("train", "generate"):
        return getattr(ModelWorker, op)
    return getattr(compute, op.split(".", 1)[1])


@pytest.mark.parametrize("op", sorted(op for op, spec in all_ops().items() if any(a.omit_default for a in spec.attrs)))
def test_omitted_defaults_are_the_runtime_defaults(op):
    """A stage leaves out an option at its default, so the function the job calls must default to it too."""
    params = inspect.signature(_runtime_function(op)).parameters
    for a in all_ops()[op].attrs:
        if a.omit_default:
            assert a.name in params and params[a.name].default == a.default, (op, a.name)


def test_options_at_their_defaults_leave_the_ir_unchanged():
    plain, _ = compile_source(GRPO, "grpo.rlhf")
    spelled = GRPO.replace("kl_coef = 0.02)", "kl_coef = 0.02, loss_agg = token_mean, ratio = token)").replace(
        "minibatches = 2)", "minibatches = 2, lr_schedule = constant, warmup_steps = 0)").replace(
        "method = grpo)", "method = grpo, filter_groups = false)")
    assert spelled != GRPO
    module, _ = compile_source(spelled, "grpo.rlhf")
    strip = lambda text: "\n".join(line.split(" loc(")[0] for line in text.splitlines())  # noqa: E731
    assert strip(print_module(module)) == strip(print_module(plain))
    clip = module.graph.stage("ppo_clip")
    assert sorted(clip.attrs) == ["clip", "entropy_coef", "estimator", "kl_coef"]


def test_a_schedule_spans_the_runs_steps():
    src = GRPO.replace("minibatches = 2)", "minibatches = 2, lr_schedule = linear)")
    module, _ = compile_source(src, "grpo.rlhf")
    train = next(s for s in module.graph.stages if s.op == "train")
    assert train.attrs["lr_schedule"] == "linear" and train.attrs["total_steps"] == 40
    text = print_module(module)
    assert 'lr_schedule = "linear", total_steps = 40}' in text


def test_micro_batch_reaches_the_workers_train_call():
    from rlhfc.codegen.emitter import PythonEmitter

    module, _ = compile_source(GRPO.replace("minibatches = 2)", "minibatches = 2, micro_batch = 4)"), "grpo.rlhf")
    train = next(s for s in module.graph.stages if s.op == "train")
    assert train.attrs["micro_batch"] == 4
    code = PythonEmitter(module, source=None, opt_level="O0", passes=[]).emit()
    assert "micro_batch=4" in next(line for line in code.splitlines() if ".train.remote(" in line)
    plain, _ = compile_source(GRPO, "grpo.rlhf")
    assert "micro_batch" not in next(s for s in plain.graph.stages if s.op == "train").attrs
