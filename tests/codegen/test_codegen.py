"""Codegen: the generated driver of every example matches its golden file, and plans are sane.

Regenerate the golden files with ``UPDATE_GOLDEN=1 pytest tests/codegen``.
"""

from __future__ import annotations

import ast
import json
import os

import pytest

from rlhfc.codegen import emit_job
from rlhfc.frontend import load_file
from rlhfc.passes import PassManager, pipeline_for
from rlhfc.passes.overcommit import Overcommit

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
EXAMPLES = ["ppo_tiny", "grpo_tiny", "ppo_7b", "ppo_70b"]


def _emit(name: str, tmp_path) -> str:
    rel = f"examples/{name}.rlhf"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        module, _, _ = load_file(rel)
        module = PassManager(pipeline_for("O2")).run(module)
        emit_job(module, str(tmp_path), source_path=rel, opt_level="O2", passes=["dce"])
    finally:
        os.chdir(cwd)
    return str(tmp_path)


@pytest.mark.parametrize("name", EXAMPLES)
def test_generated_driver_matches_golden(name, tmp_path):
    job = _emit(name, tmp_path)
    with open(os.path.join(job, "main.py")) as fh:
        code = fh.read()
    ast.parse(code)  # valid Python
    golden = os.path.join(GOLDEN, f"{name}.main.py")
    if os.environ.get("UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(golden, "w") as fh:
            fh.write(code)
    with open(golden) as fh:
        assert code == fh.read(), f"generated driver for {name} changed; UPDATE_GOLDEN=1 to accept"


def test_driver_imports_only_the_runtime(tmp_path):
    tree = ast.parse(open(os.path.join(_emit("ppo_tiny", tmp_path), "main.py")).read())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert {m for m in imported if m.startswith("rlhfc")} == {"rlhfc.runtime", "rlhfc.runtime.job"}


def test_plan_has_models_placement_metrics_and_the_ir(tmp_path):
    job = _emit("ppo_tiny", tmp_path)
    plan = json.load(open(os.path.join(job, "plan.json")))
    assert set(plan["models"]) == {"actor", "critic", "ref", "reward"}
    assert plan["models"]["ref"]["init"]["kind"] == "copy" and plan["models"]["ref"]["init"]["source_model"] == "actor"
    assert plan["placement"]["bundles"] == [{"CPU": 2.0}]
    assert sum(w["num_cpus"] for w in plan["placement"]["workers"].values()) == pytest.approx(2.0)
    assert plan["metrics"] == {"rollout": "roll", "reward": "scores", "kl": ["logp", "ref_logp"],
                               "policy_train": "actor_train", "value_train": "critic_train"}
    assert plan["ir"] == open(os.path.join(job, "ir.rlir")).read()
    assert os.path.isfile(os.path.join(job, "source.rlhf"))


def test_gpu_plan_reserves_gpus_per_node(tmp_path):
    plan = json.load(open(os.path.join(_emit("ppo_70b", tmp_path), "plan.json")))
    assert len(plan["placement"]["bundles"]) == 16
    assert plan["placement"]["bundles"][0] == {"CPU": 8.0, "GPU": 8.0}


def test_hygienic_names():
    from rlhfc.codegen import py_name

    assert py_name("values") == "values"
    assert py_name("lambda") == "lambda_"
    assert py_name("job") == "job_"
    assert py_name("len") == "len_"


def test_a_streamed_generate_with_no_consumer_unpacks_the_rollout(tmp_path):
    """job.stream returns [rollout, *consumer results]: with no stage consuming the chunks (here the actor's
    own logprobs, which cannot run on the worker while it generates) the driver unpacks the one rollout."""
    program = tmp_path / "oc.rlhf"
    program.write_text("""
cluster local { devices = cpu:2 }
model actor = llama(layers = 1, hidden = 32, heads = 2, vocab = 16, max_seq = 32) trainable
data prompts = synthetic(count = 64, min_len = 3, max_len = 6)
pipeline rpp(batch = 8) {
  roll   = actor.generate(prompts, max_new_tokens = 16)
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores, method = reinforce_pp)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3)
}
""")
    module, _, _ = load_file(str(program))
    # -O3's synchronous overcommit, named (a program's own generate would run ahead under -O3's async_rollout;
    # -O3 overcommits only where it is predicted 5 % faster)
    passes = [Overcommit() if p.name == "overcommit" else p for p in pipeline_for("O3") if p.name != "async_rollout"]
    module = PassManager(passes).run(module)
    emit_job(module, str(tmp_path / "job"), source_path=str(program), opt_level="O3", passes=["dce"])
    code = open(tmp_path / "job" / "main.py").read()
    ast.parse(code)
    assert "    roll, = job.stream(\n" in code and "overcommit=" in code
