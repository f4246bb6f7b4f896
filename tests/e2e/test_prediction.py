"""Prediction, not interpolation: the cost model with a profile of this machine predicts a configuration
outside the profiled points (another batch size and response length than any point of the profile's grid),
measured through the real runtime (Ray workers, the job's own threads, -O2 overlap and streaming), per stage
and per step. The bound is generous: a stage's time in a job varies by tens of percent on 2 cores. On a
machine other processes load (the trace records the load average) only the upper bound is asserted and the
test is skipped with the figures; benchmarks/cost_model.py --in-job measures the figures docs/benchmarks.md
reports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from rlhfc.codegen import emit_job
from rlhfc.cost import CostConfig, load_profile, simulate
from rlhfc.cost.model import CostModel
from rlhfc.explain.compare import compare, measured_from_trace
from rlhfc.frontend import compile_source
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline
from rlhfc.runtime.job import run_job

HERE = os.path.dirname(__file__)
PROGRAM = os.path.join(HERE, "tiny_ppo.rlhf")

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


def _grid_points(prof) -> tuple[set, set]:
    """Every batch size and sequence length the profile measured (forward, train and generate points)."""
    batches, lengths = set(), set()
    for entry in prof.models.values():
        for prim, pts in entry["points"].items():
            if prim == "optimizer":
                continue
            for p in pts:
                batches.add(int(p[0]))
                lengths.update(int(x) for x in (p[1:3] if prim == "generate" else p[1:2]))
    return batches, lengths


def test_out_of_grid_configuration_is_predicted_per_stage_and_step_through_ray(tmp_path):
    # `rlhfc profile` in its own process, as a user runs it (idle OpenMP threads must sleep: it sets that
    # before torch starts, which this test process has already started)
    path = str(tmp_path / "profile.json")
    proc = subprocess.run([sys.executable, "-m", "rlhfc.cli", "profile", PROGRAM, "--quick", "-o", path],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prof = load_profile(path)
    # the workers share 2 cores: each model is also timed on the 1 thread a stage gets beside others
    assert all(prof.thread_counts(k) == [1, 2] for k in prof.models), {k: prof.thread_counts(k) for k in prof.models}
    batches, lengths = _grid_points(prof)
    text = open(PROGRAM).read()
    text = re.sub(r"ppo\(batch = 4\)", "ppo(batch = 10)", text)
    text = re.sub(r"max_new_tokens = 6", "max_new_tokens = 14", text)
    module, _ = compile_source(text, PROGRAM)
    module = PassManager(parse_pipeline(",".join(PIPELINES["O2"]))).run(module)
    assert 10 not in batches and 14 not in lengths and 14 // 2 not in batches   # outside the grid
    job_dir, out = str(tmp_path / "job"), str(tmp_path / "run")
    emit_job(module, job_dir, source_path=PROGRAM, opt_level="O2", passes=list(PIPELINES["O2"]))
    run_job(job_dir, steps=4, out=out, progress=False, trace=True)
    with open(os.path.join(out, "trace.json")) as fh:
        measured = measured_from_trace(json.load(fh))
    config = CostConfig(profile=prof)
    sim = simulate(module, config, steps=3)
    result = compare(sim, module, measured, CostModel(module, config).dispatch)
    on_workers = [r for r in result["stages"] if r["op"].split(".")[0] in ("generate", "forward", "train")]
    table = "\n".join(f"{r['stage']}: predicted {r['predicted_s'] * 1e3:.1f} ms, measured "
                      f"{r['measured_s'] * 1e3:.1f} ms" for r in on_workers if r["measured_s"])
    assert len(on_workers) >= 5 and all(r["measured_s"] and r["predicted_s"] for r in on_workers), table
    # other processes only slow the measured side, so over-pricing is the error to bound: the median stage is
    # priced at most 1.5x its measurement (the host's matmul probe once priced every 1-thread stage at 2.3x) and
    # none above 3x (a forward of 2 ms measured at 2.2 against 4.6 predicted on CI's machine: at that size a
    # stage is a few Ray and thread hand-offs, whose time varies by 2x from run to run)
    ratios = sorted(r["predicted_s"] / r["measured_s"] for r in on_workers)
    assert ratios[len(ratios) // 2] < 1.5 and ratios[-1] < 3, table
    load, cores = result["load1"], os.cpu_count() or 1
    if load is not None and load > 2 * cores + 1:
        pytest.skip(f"the machine was loaded (load average {load:.1f} on {cores} cores, the job's own processes "
                    f"add about 2-3): its stages got a fraction of the cores the profile measured with, so only the "
                    f"upper bound holds; the lower bounds need an unloaded machine\n{table}")
    # the median stage within 50 %; none off by 5x (the catalog roofline is off by 10x on these shapes)
    assert result["median_abs_stage_error"] < 0.5, table
    assert all(0.2 < r["predicted_s"] / r["measured_s"] for r in on_workers), table
    step = result["step"]   # the step adds Ray's own overhead between stages, priced at 2 ms a call
    assert 1 / 3 < step["predicted_s"] / step["measured_s"] < 3, (step, table)
