"""Hardening of a run: resume refuses a checkpoint of another program, a truncated metrics line and a second
TensorBoard session do not break resume, Ctrl-C stops cleanly, a worker dying in a checkpoint write keeps the
previous checkpoint. The e2e tests train 2-3 steps of a tiny program; the others need no Ray."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import rlhfc
from rlhfc.cli import main as cli
from rlhfc.contract.plan import Plan, load_plan
from rlhfc.runtime.driver import checkpoint
from rlhfc.runtime.driver.metrics import MetricsLog
from rlhfc.runtime.job import JobError, run_job

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TINY = HERE / "tiny_ppo.rlhf"
GRPO = ROOT / "examples" / "grpo_tiny.rlhf"
RLHFC = Path(sys.executable).parent / "rlhfc"
#: exec a command with SIGINT's default disposition
SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


def _program(tmp_path: Path, name: str, steps: int, every: int, old: str = "", new: str = "") -> Path:
    """tiny_ppo.rlhf with its own steps / checkpoint_every (and one more text substitution)."""
    text = TINY.read_text().replace("run { steps = 4; seed = 3; checkpoint_every = 2 }",
                                    f"run {{ steps = {steps}; seed = 3; checkpoint_every = {every} }}")
    path = tmp_path / f"{name}.rlhf"
    path.write_text(text.replace(old, new) if old else text)
    return path


def _job(tmp_path: Path, program: Path, name: str, level: str = "O1") -> Path:
    job = tmp_path / name
    assert cli(["compile", str(program), f"-{level}", "--emit", "job", "-o", str(job)]) == 0
    return job


def _plan(job: Path) -> Plan:
    return load_plan(str(job / "plan.json"))


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _fake_run(tmp_path: Path, job: Path, step: int = 2) -> Path:
    """A run folder of ``job`` (its job/ and a step_K checkpoint with the manifest a run would write)."""
    out = tmp_path / "run"
    (out / "job").mkdir(parents=True)
    for f in job.iterdir():
        (out / "job" / f.name).write_bytes(f.read_bytes())
    plan = _plan(job)
    ckpt = out / "checkpoints" / f"step_{step}"
    for worker in plan.placement.workers:
        (ckpt / worker).mkdir(parents=True)
    (ckpt / "job.json").write_text(json.dumps({"step": step, "data": {}, "module": plan.module,
                                               "manifest": checkpoint.manifest(plan, step)}))
    (out / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return out


# -- the manifest ---------------------------------------------------------------------------------------------
def test_manifest_names_models_shapes_and_algorithm(tmp_path):
    ppo = checkpoint.manifest(_plan(_job(tmp_path, TINY, "ppo")), 4)
    assert ppo["step"] == 4 and ppo["rlhfc_version"] and ppo["program"].startswith("sha256:")
    assert ppo["models"]["actor"]["hidden"] == 32 and ppo["models"]["reward"]["arch"] == "gpt2"
    assert ppo["algorithm"] == {"train": {"actor": ["compute.ppo_clip"], "critic": ["compute.value_loss"]},
                                "advantages": ["compute.gae"]}
    grpo = checkpoint.manifest(_plan(_job(tmp_path, GRPO, "grpo")), 4)
    assert grpo["algorithm"] == {"train": {"actor": ["compute.ppo_clip"]}, "advantages": ["compute.group_advantages"]}
    # optimisations do not change the algorithm (-O3 adds compute.sample_logprobs, streams, overcommits)
    assert checkpoint.manifest(_plan(_job(tmp_path, TINY, "ppo3", "O3")), 4)["algorithm"] == ppo["algorithm"]


@pytest.mark.parametrize("other,says", [
    ("grpo", ["model 'critic' is in the checkpoint but not in the program",
              "model 'reward' is in the checkpoint but not in the program",
              "advantages: compute.gae in the checkpoint, compute.group_advantages in the program"]),
    ("wider", ["model 'actor' has other shapes (hidden 32 -> 64", "model 'critic' has other shapes"]),
])
def test_cli_resume_refuses_a_checkpoint_of_another_program(tmp_path, capsys, other, says):
    out = _fake_run(tmp_path, _job(tmp_path, TINY, "ppo"))
    before = {p.name: p.read_bytes() for p in (out / "job").iterdir()}
    program = GRPO if other == "grpo" else _program(tmp_path, "wider", 4, 2, "hidden = 32, heads = 2, vocab = 64, "
                                                    "max_seq = 32) trainable", "hidden = 64, heads = 2, vocab = 64, "
                                                    "max_seq = 32) trainable")
    code = cli(["run", str(program), "--out", str(out), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"rlhfc: error: --resume: checkpoint {out}/checkpoints/step_2 was written by 'tiny_ppo'" in err
    for text in says:
        assert text in err
    assert "hint: resume it with the program (or job) that wrote it" in err
    assert f"the job that wrote it is {out}/job" in err
    assert {p.name: p.read_bytes() for p in (out / "job").iterdir()} == before   # the run's job is kept
    assert not (out / ".job.new").exists()


def test_job_resume_refuses_a_checkpoint_of_another_program_before_starting_ray(tmp_path, capsys):
    import ray

    out = _fake_run(tmp_path, _job(tmp_path, TINY, "ppo"))
    grpo = _job(tmp_path, GRPO, "grpo")
    with pytest.raises(checkpoint.CheckpointMismatch, match="compute.group_advantages in the program"):
        run_job(str(grpo), out=str(out), resume=True, progress=False)
    assert not ray.is_initialized()
    from rlhfc.runtime.job import main as job_main

    assert job_main(str(grpo / "main.py"), ["--out", str(out), "--resume", "--no-progress"]) == 2
    assert "error: --resume: checkpoint" in capsys.readouterr().err


def test_resume_check_accepts_another_level_and_notes_versions(tmp_path):
    out = _fake_run(tmp_path, _job(tmp_path, TINY, "ppo"))
    ckpt = str(out / "checkpoints" / "step_2")
    assert checkpoint.check_resume(ckpt, _plan(_job(tmp_path, TINY, "ppo1"))) == []
    checkpoint.check_resume(ckpt, _plan(_job(tmp_path, TINY, "ppo3", "O3")))     # another -O level: accepted
    edited = _program(tmp_path, "edited", 4, 2, "critic.train(value_loss(roll, values, ret), lr = 1e-3",
                      "critic.train(value_loss(roll, values, ret), lr = 5e-4")
    notes = checkpoint.check_resume(ckpt, _plan(_job(tmp_path, edited, "edited")))
    assert notes == ["the program changed since checkpoint step_2 (same models and algorithm); "
                     "resuming with this job"]
    meta = json.loads((out / "checkpoints" / "step_2" / "job.json").read_text())
    meta["manifest"]["rlhfc_version"] = "0.0.1"
    (out / "checkpoints" / "step_2" / "job.json").write_text(json.dumps(meta))
    notes = checkpoint.check_resume(ckpt, _plan(out / "job"))
    assert notes == [f"checkpoint step_2 was written by rlhfc 0.0.1, this is rlhfc {rlhfc.__version__}"]
    del meta["manifest"]
    (out / "checkpoints" / "step_2" / "job.json").write_text(json.dumps(meta))
    assert "has no manifest" in checkpoint.check_resume(ckpt, _plan(out / "job"))[0]


# -- metrics.jsonl and TensorBoard on resume ------------------------------------------------------------------
def _scalars(folder: Path) -> Counter:
    """(tag, step) -> how many events of all TensorBoard files in ``folder`` hold it."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter = Counter()
    for path in folder.glob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                seen[(value.tag, event.step)] += 1
    return seen


def test_trim_drops_a_partial_last_line_and_tensorboard_is_not_duplicated(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLog(str(tmp_path))
    log.open_tensorboard()
    for step in range(4):
        log.write({"step": step, "reward_mean": 0.1 * step, "kl": float("nan"), "wait_s": {"roll": 0.1}})
    log.close()
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "reward_me')      # a crash mid-write
    resumed = MetricsLog(str(tmp_path))
    kept, notes = resumed.trim(2)
    assert [r["step"] for r in kept] == [0, 1] and kept[0]["kl"] is None
    assert len(notes) == 1 and "dropped the partial last line" in notes[0] and "reward_me" in notes[0]
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    resumed.open_tensorboard(replay=kept)
    for step in (2, 3):
        resumed.write({"step": step, "reward_mean": 1.0 + step})
    resumed.close()
    seen = _scalars(tmp_path)
    assert {k: v for k, v in seen.items() if k[0] == "reward_mean"} == {("reward_mean", s): 1 for s in range(4)}
    assert max(seen.values()) == 1


def test_trim_keeps_a_complete_last_row_without_its_newline(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}')
    kept, notes = MetricsLog(str(tmp_path)).trim(5)
    assert [r["step"] for r in kept] == [0, 1] and notes == []
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'


# -- end to end -----------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_ctrl_c_keeps_the_last_checkpoint_and_resume_continues(tmp_path):
    program = _program(tmp_path, "long", 1000, 1)
    out = tmp_path / "run"
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    # in its own process group, as a terminal's foreground job: Ctrl-C reaches the driver and Ray's processes;
    # SIGINT handled by default even when this test runs in the background (where the shell ignores it)
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_DEFAULT, str(RLHFC), "run", str(program), "--out", str(out),
                             "--no-progress"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not ((out / "checkpoints" / "latest").is_file() and (out / "metrics.jsonl").is_file()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "rlhfc: interrupted: stopped at step" in err and "Ray is shut down" in err and "Traceback" not in err
    latest = (out / "checkpoints" / "latest").read_text().strip()
    folder = out / "checkpoints" / latest
    assert f"the last complete checkpoint, {folder}, is kept as latest; resume with:" in err
    assert json.loads((folder / "job.json").read_text())["manifest"]["step"] == int(latest[5:])
    for model in ("actor", "critic", "ref", "reward"):
        assert (folder / model / "weights.safetensors").stat().st_size > 1000
    command = shlex.split(err.split("resume with:\n", 1)[1].splitlines()[0])
    assert command == ["rlhfc", "run", str(program), "--out", str(out), "--resume", "--no-progress"]
    done = int(latest[5:])
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 99, "rew')          # and a crash cut the last metrics line
    resumed = subprocess.run([str(RLHFC), *command[1:], "--steps", str(done + 1)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "dropped the partial last line" in resumed.stderr
    assert [r["step"] for r in _rows(out)] == list(range(done + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{done + 1}"
    seen = _scalars(out)
    assert {s for (tag, s) in seen if tag == "reward_mean"} == set(range(done + 1)) and max(seen.values()) == 1


@pytest.mark.e2e
def test_worker_dying_in_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    import importlib.util

    import ray

    # a process per model (run { processes = own }): here the critic's process dies, not the one it shares
    job = _job(tmp_path, _program(tmp_path, "every", 3, 1, "checkpoint_every = 1 }",
                                  "checkpoint_every = 1; processes = own }"), "job")
    spec = importlib.util.spec_from_file_location("every_main", job / "main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = {"n": 0}

    class KillThenSave:
        """The critic's ``save``: its process dies as the checkpoint write reaches it."""

        def __init__(self, group):
            self.group, self.save = group, group.ranks[0].save

        def remote(self, path):
            self.group.kill()
            for _ in range(600):   # ray.kill is asynchronous: on a loaded machine a save sent at once could
                try:               # still reach the process and succeed; send it once the process is gone
                    ray.get(self.group.ranks[0].ready.remote(), timeout=30)
                    time.sleep(0.05)
                except ray.exceptions.RayActorError:
                    break
            return self.save.remote(path)

    def step(job_, w):
        calls["n"] += 1
        values = job_.resolve(mod.step(job_, w))
        if calls["n"] == 2:   # step 1, after step_1 was saved: the write of step_2 loses the critic
            w.critic.save = KillThenSave(w.critic)
        return values

    out = tmp_path / "run"
    with pytest.raises(JobError) as exc:
        run_job(str(job), step_fn=step, out=str(out), progress=False)
    assert exc.value.message.startswith("stage %checkpoint (writing checkpoints/step_2: worker 'critic') failed: "
                                        "its worker died")
    assert f"last good checkpoint: {out}/checkpoints/step_1" in exc.value.hint and "--resume" in exc.value.hint
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_1"]
    manifest = json.loads((out / "checkpoints" / "step_1" / "job.json").read_text())["manifest"]
    assert manifest["step"] == 1 and manifest["workers"] == ["actor", "critic", "ref", "reward"]
    assert [r["step"] for r in _rows(out)] == [0, 1]
    assert not ray.is_initialized()
