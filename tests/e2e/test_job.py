"""End to end: compile a tiny PPO program, train it on a local Ray, resume, fail, rerun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhfc.cli import main as cli
from rlhfc.runtime.job import JobError, run_job

from .conftest import HERE
from .conftest import TINY_PPO as PROGRAM
from .conftest import metrics as _metrics
from .conftest import untimed as _strip

pytestmark = pytest.mark.e2e


def _samples(run_dir):
    with open(os.path.join(run_dir, "samples.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_ppo_job):
    tmp = tmp_path_factory.mktemp("full")
    job_dir = tiny_ppo_job
    out = str(tmp / "run")
    run_job(job_dir, out=out, progress=False)
    return job_dir, out


def test_run_writes_metrics_checkpoints_and_tensorboard(full_run):
    _, out = full_run
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        for key in ("reward_mean", "kl", "policy_loss", "value_loss", "step_time_s", "samples_per_s"):
            assert isinstance(r[key], (int, float)), key
        assert r["samples"] == 4 and r["step_time_s"] > 0
    assert [r["gen_version"] for r in rows] == [0, 1, 2, 3]  # each step generates with the newest actor
    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert ckpts == ["latest", "step_2", "step_4"]
    for model in ("actor", "critic", "ref", "reward"):
        folder = os.path.join(out, "checkpoints", "step_4", model)
        assert os.path.getsize(os.path.join(folder, "weights.safetensors")) > 1000
        assert os.path.isfile(os.path.join(folder, "state.safetensors"))
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out))
    samples = _samples(out)                                   # run { log_samples } defaults to 4: the batch
    assert [(r["step"], r["row"]) for r in samples] == [(s, i) for s in range(4) for i in range(4)]
    rewards = [r["reward"] for r in samples]
    assert all(isinstance(x, float) for x in rewards) and all(r["prompt"] and "scores" in r for r in samples)
    assert abs(sum(rewards[:4]) / 4 - rows[0]["reward_mean"]) < 1e-6   # the reward the metrics average


def test_same_seed_same_metrics_and_resume_matches_uninterrupted(full_run, tmp_path):
    job_dir, full_out = full_run
    out = str(tmp_path / "resumed")
    first = run_job(job_dir, out=out, steps=2, progress=False)
    assert _strip(first) == _strip(_metrics(full_out))[:2]          # deterministic run to run
    run_job(job_dir, out=out, resume=True, progress=False)           # continues from step_2 to 4
    assert _strip(_metrics(out)) == _strip(_metrics(full_out))       # bitwise-equal metrics on CPU
    assert _samples(out) == _samples(full_out)                       # no sample lost or written twice


def test_export_of_the_trained_policy_gives_its_logprobs_and_plot_draws_the_run(full_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhfc.runtime.models.build import build_model, load_weights

    job_dir, out = full_run
    assert cli(["export", out, "--job", job_dir, "-o", str(tmp_path / "hf")]) == 0
    with open(os.path.join(job_dir, "plan.json")) as fh:
        spec = json.load(fh)["models"]["actor"]["spec"]
    trained = build_model(spec)
    load_weights(trained, os.path.join(out, "checkpoints", "step_4", "actor", "weights.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    ids = torch.tensor([[1, 10, 7, 14, 14, 17, 3, 5, 2], [1, 20, 21, 22, 23, 24, 25, 26, 27]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        want = torch.log_softmax(trained.forward_logits(ids, mask), -1)   # the trainer's forward
        got = torch.log_softmax(hf(ids).logits.float(), -1)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert cli(["plot", out, "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_existing_run_is_never_overwritten(full_run):
    job_dir, out = full_run
    before = _metrics(out)
    with pytest.raises(JobError, match="already holds checkpoints") as exc:
        run_job(job_dir, out=out, progress=False)
    assert "--resume" in exc.value.hint
    assert _metrics(out) == before


def test_dead_worker_names_stage_and_last_checkpoint(tmp_path, tiny_ppo_job):
    import ray

    from rlhfc.runtime import job as job_mod

    job_dir = tiny_ppo_job
    spec = __import__("importlib.util").util.spec_from_file_location("tiny_main", os.path.join(job_dir, "main.py"))
    mod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = {"n": 0}

    def step_then_crash(job, w):
        calls["n"] += 1
        if calls["n"] == 3:  # step 2, after the step_2 checkpoint: the critic's process dies
            w.critic.kill()   # w.critic is a WorkerGroup: kill its ranks' processes
        return mod.step(job, w)

    out = str(tmp_path / "run")
    with pytest.raises(JobError) as exc:
        run_job(job_dir, step_fn=step_then_crash, out=out, progress=False)
    # the critic shares its process with the other three models (run { processes = shared }, the default): the
    # step's first stage finds it dead, and the message says which models the process hosted
    assert exc.value.message.startswith("stage %roll (generate on model 'actor') failed: its worker died ("), \
        exc.value.message
    assert exc.value.message.endswith("; its process hosted actor, ref, critic, reward)"), exc.value.message
    assert "step_2" in exc.value.hint and "--resume" in exc.value.hint
    assert [r["step"] for r in _metrics(out)] == [0, 1]                       # nothing written is lost
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_2", "actor", "weights.safetensors"))
    assert not ray.is_initialized()
    del job_mod


BLOCKER = '''
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[:2] in (["rlhfc", m] for m in ("frontend", "ir", "passes", "codegen", "cli", "cost")):
            raise ImportError("the runtime must not import compiler code: " + name)
        return None
sys.meta_path.insert(0, _Block())
'''


def test_job_main_runs_with_runtime_only(tmp_path, tiny_ppo_job):
    job_dir = tiny_ppo_job
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=str(site), RAY_AUTH_MODE="disabled")
    out = str(tmp_path / "run")
    proc = subprocess.run([sys.executable, os.path.join(job_dir, "main.py"), "--steps", "1", "--out", out,
                           "--no-progress"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in _metrics(out)] == [0]


def test_cli_run_compiles_and_trains(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli(["run", PROGRAM, "-O1", "--steps", "2", "--no-progress", "--trace"]) == 0
    assert [r["step"] for r in _metrics("runs/tiny_ppo")] == [0, 1]
    assert os.path.isfile("runs/tiny_ppo/job/main.py")
    check_measured_trace("runs/tiny_ppo", steps=2)
    # a second run never reuses the first one's folder; --resume continues the newest
    assert cli(["run", PROGRAM, "--steps", "1", "--no-progress"]) == 0
    assert os.path.isfile("runs/tiny_ppo-1/metrics.jsonl")
    assert cli(["run", PROGRAM, "--steps", "2", "--resume", "--no-progress"]) == 0
    assert [r["step"] for r in _metrics("runs/tiny_ppo-1")] == [0, 1]


def check_measured_trace(run_dir: str, steps: int) -> None:
    """``run --trace`` wrote valid Chrome trace JSON: a track per worker (named as plan.json's workers, one
    thread per rank), the driver's steps, and per step one span (or one per chunk) of every stage on the
    worker that runs it, with its rows and tokens, inside the step's span."""
    with open(os.path.join(run_dir, "trace.json")) as fh:
        trace = json.load(fh)
    with open(os.path.join(run_dir, "job", "plan.json")) as fh:
        plan = json.load(fh)
    events = trace["traceEvents"]
    assert trace["otherData"]["kind"] == "measured" and trace["otherData"]["module"] == plan["module"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs[1] == "driver"
    workers = {name: pid for pid, name in procs.items()}
    assert set(workers) >= {f"worker {w}" for w in plan["placement"]["workers"]}
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and {"pid", "tid", "ts", "name", "cat"} <= set(e) for e in spans)
    step_spans = {e["args"]["step"]: e for e in spans if e["cat"] == "step"}
    assert sorted(step_spans) == list(range(steps))
    for e in spans:
        assert (e["pid"], e["tid"]) in threads, e   # every span is on a named track
    for stage in plan["graph"]["stages"]:
        if stage["op"].split(".")[0] not in ("generate", "forward", "train"):
            continue
        for k in range(steps):
            mine = [e for e in spans if e["args"].get("stage") == stage["name"] and e["args"]["step"] == k
                    and e["pid"] >= 10]
            assert mine, (stage["name"], k)
            step = step_spans[k]
            for e in mine:
                assert procs[e["pid"]].startswith("worker ")
                assert e["args"]["rows"] > 0 and e["args"]["tokens"] > 0
                assert step["ts"] - 1e3 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e3


def test_cli_run_on_gpu_plan_without_gpus_is_a_clear_error(tmp_path, capsys):
    code = cli(["run", os.path.join(HERE, "..", "..", "examples", "ppo_7b.rlhf"), "--out", str(tmp_path / "r"),
                "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the plan needs 8 GPU (A100-80GB)" in err and "hint:" in err and "Traceback" not in err


def test_a_gpu_plan_fails_before_its_data_is_built_unless_it_runs_on_a_cluster(tmp_path, monkeypatch):
    """The local-GPU check comes first: the job never builds its prompts (a large synthetic source took a
    minute) nor starts Ray; with --ray-address the cluster's own check decides (after connecting)."""
    import torch

    from rlhfc.runtime import job as job_mod

    from .conftest import compile_job

    src = tmp_path / "gpu.rlhf"
    with open(PROGRAM) as fh:
        text = fh.read()
    assert "cluster local { devices = cpu:2 }" in text
    src.write_text(text.replace("cluster local { devices = cpu:2 }",
                                'cluster c { gpu = "A100-80GB"; nodes = 1; gpus_per_node = 1 }'))
    job_dir = compile_job(str(src), str(tmp_path / "job"))
    built = []
    real = job_mod.prompt_source_from_spec
    monkeypatch.setattr(job_mod, "prompt_source_from_spec", lambda spec: built.append(spec) or real(spec))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(JobError, match=r"the plan needs 1 GPU \(A100-80GB\) but this machine has 0"):
        job_mod.Job(job_dir, out=str(tmp_path / "run"))
    assert built == [] and not os.path.exists(tmp_path / "run")
    job_mod.Job(job_dir, out=str(tmp_path / "run"), ray_address="ray://elsewhere:10001")   # no local check
    assert built   # it went on to build its data
