"""Mixed trainers in one job: the actor as two FSDP2 ranks, the critic as two tensor-parallel and the
reference as two pipeline-parallel megatron-core ranks, the reward model as one process — seven
processes on ``cpu:4`` — train like the job with every model in one process: the same sampled tokens
and every metric of the first two steps within 1e-3 relative."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline
from rlhfc.runtime.job import run_job

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

HERE = os.path.dirname(__file__)
TIMING = {"step_time_s", "samples_per_s", "wait_s"}
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the layouts the plan runs: (trainer, dp, tp, pp) per model
LAYOUTS = {"actor": ("fsdp", 2, 1, 1), "critic": ("megatron", 1, 2, 1), "ref": ("megatron", 1, 1, 2),
           "reward": ("torch", 1, 1, 1)}


def _job(tmp_path, name: str, layouts: dict | None) -> str:
    module, _, _ = load_file(os.path.join(HERE, "mixed_layouts.rlhf"))
    module = PassManager(parse_pipeline(",".join(PIPELINES["O1"]))).run(module)
    job = str(tmp_path / name)
    emit_job(module, job, source_path="mixed_layouts.rlhf", opt_level="O1", passes=PIPELINES["O1"])
    path = os.path.join(job, "plan.json")
    plan = json.load(open(path))
    for w in plan["placement"]["workers"].values():
        trainer, dp, tp, pp = (layouts or {}).get(w["model"], ("torch", 1, 1, 1))
        w.update(trainer=trainer, dp=dp, tp=tp, pp=pp, ranks=dp * tp * pp)
    json.dump(plan, open(path, "w"), indent=1)
    return job


def _rows(job: str, out: str, sizes: dict) -> list[dict]:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"m_{os.path.basename(job)}", os.path.join(job, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def step(job, w):   # records how many ranks each model's group runs
        sizes.update({name: group.size for name, group in job.workers.items()})
        return mod.step(job, w)

    return [{k: v for k, v in r.items() if k not in TIMING and not isinstance(v, dict)}
            for r in run_job(job, step, out=out, progress=False)]


def test_mixed_trainers_train_like_one_process_each(tmp_path):
    sizes_one, sizes = {}, {}
    one = _rows(_job(tmp_path, "one", None), str(tmp_path / "run_one"), sizes_one)
    mixed = _rows(_job(tmp_path, "mixed", LAYOUTS), str(tmp_path / "run_mixed"), sizes)
    assert set(sizes_one.values()) == {1}
    assert sizes == {"actor": 2, "critic": 2, "ref": 2, "reward": 1}
    assert [r["step"] for r in mixed] == [0, 1]
    for a, b in zip(one, mixed):
        assert a.keys() == b.keys()
        assert a["response_len_mean"] == b["response_len_mean"]   # the same sampled tokens
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (k, a, b)
