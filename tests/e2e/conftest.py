"""Shared set-up of the end-to-end tests: the metrics that vary from run to run (and so are left out when two
runs are compared), compiling a program into a job folder, reading a run's metrics, a compiled tiny PPO
job shared by the tests of a module, and one local Ray for the jobs of a module (``shared_ray``)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.ir import Module
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
#: the smallest 4-model PPO program
TINY_PPO = os.path.join(HERE, "tiny_ppo.rlhf")

#: the metrics of a step that are timings: two runs of the same training differ in them
TIMING = frozenset({"step_time_s", "samples_per_s", "wait_s", "pad_eff_generate", "pad_eff_forward", "tool_s"})
#: the metrics that are facts of the layout (processes per model): equal training on another layout differs
LAYOUT = frozenset({"ranks"})


def compile_job(program: str | Module, out: str, *, level: str | None = "O0", passes: list[str] | None = None,
                source: str | None = None) -> str:
    """Compile ``program`` (a path, or a loaded module) into the job folder ``out``: the passes of -O ``level``
    or the given ``passes`` (then the plan says ``custom`` unless ``level`` is given); returns ``out``."""
    module = load_file(program)[0] if isinstance(program, str) else program
    passes = list(PIPELINES[level] if passes is None else passes)
    if passes:
        module = PassManager(parse_pipeline(",".join(passes))).run(module)
    emit_job(module, out, source_path=source or (program if isinstance(program, str) else None),
             opt_level=level or "custom", passes=passes)
    return out


def close(a, b, rel=1e-4, abs_=1e-6) -> bool:
    """``a`` and ``b`` equal, their floats within ``rel`` (or ``abs_``): the -O2 passes that reorder float sums
    (docs/claims.md) agree with -O0 to a relative 1e-4."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k], rel, abs_) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y, rel, abs_) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return b == pytest.approx(a, rel=rel, abs=abs_)
    return a == b


def metrics(run_dir: str) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def untimed(rows: list[dict], *, layout: bool = False) -> list[dict]:
    """The rows without their timings (and with ``layout``, without the layout's facts)."""
    drop = TIMING | LAYOUT if layout else TIMING
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


@pytest.fixture(scope="module")
def tiny_ppo_job(tmp_path_factory) -> str:
    """The tiny PPO program compiled at -O0, once per test module (runs write to their own folders)."""
    return compile_job(TINY_PPO, str(tmp_path_factory.mktemp("tiny_ppo") / "job"))


def job_step(job_dir: str):
    """The generated ``step`` function of a compiled job (its ``main.py``, imported under its own name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"job_{abs(hash(job_dir))}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.step


def recording(step, samples: list):
    """``step`` that also appends, each step, the rollout it sampled as [(prompt, response token ids)] in batch
    order to ``samples`` — what "the same sampled tokens" compares, row by row."""

    def recorded(job, w):
        values = step(job, w)
        name = job.plan.metrics.rollout
        roll = job.resolve({name: values[name]})[name]
        b = roll.batch
        samples.append([(p, tuple(b.responses[i, :int(n)].tolist()))
                        for i, (p, n) in enumerate(zip(roll.prompts, b.response_lengths))])
        return values

    return recorded


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray for every job of a test module (opted into with ``pytestmark =
    pytest.mark.usefixtures("shared_ray")``): each job connects to it instead of starting and stopping its own
    (about 6-8 s a job on 2 cores), and gives back its workers and placement group when it ends
    (:meth:`rlhfc.runtime.driver.cluster.Cluster.shutdown`). Stopped at the module's end. Modules that check a
    job's own Ray (its temporary folder, its shutdown) or connect to another cluster do not use it."""
    from rlhfc.runtime.driver.cluster import import_ray
    from rlhfc.runtime.driver.hygiene import check_worker_code, remove_ray_temp

    ray = import_ray()   # the environment a job's own Ray gets
    if ray.is_initialized():
        yield
        return
    tmp = tempfile.mkdtemp(prefix="rlhfc-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    # as many CPUs as any test's plan reserves (a job's own Ray takes max(cores, the plan's CPUs))
    ray.init(num_cpus=max(os.cpu_count() or 1, 16), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", _temp_dir=tmp)
    try:
        check_worker_code(ray, same_machine=True)
        yield
    finally:
        ray.shutdown()
        remove_ray_temp(tmp)
