"""Multi-turn, tool-using rollouts inside jobs (issue #38).

- A job whose generate calls a sandboxed tool (tests/e2e/agent_tool.rlhf, PPO with a critic): the same
  trajectories (token ids) and metrics at -O0 and -O2 (within -O2's stated 1e-4), a resumed run
  equal to the uninterrupted one (within 1e-4; bit for bit when run alone), the calls' working folders inside the run folder.
- A tool that keeps killing its sandbox from the third step on stops the job with a located error naming the
  tool, the checkpoint before it kept; resumed once the tool behaves, the run equals the uninterrupted one.
- Per-turn rewards (``env_turn_rewards`` through ``kl_penalty`` into ``gae``) from an environment that rewards only
  its last step train as the summed ``env_reward`` does (the same token ids; bit for bit alone).
- The worked example (examples/agent_tiny.rlhf with GRPO, examples/agent_tiny_ppo.rlhf with PPO) learns to use
  its environment, seeds 0-2: the reward and the look-up rate (policy turns per trajectory) of the last 5 steps
  above the first 5 by more than 3 standard errors; each trajectory's reward is what the environment's rules
  give for its tokens.
"""

from __future__ import annotations

import os
import shutil
import statistics

import pytest

from rlhfc.passes import PIPELINES
from rlhfc.runtime.job import JobError, run_job

from .conftest import HERE, close, compile_job, job_step, metrics, recording, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("shared_ray")]

ROOT = os.path.dirname(os.path.dirname(HERE))
TOOL = os.path.join(HERE, "agent_tool.rlhf")


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    """agent_tool.rlhf at -O0 and -O2 (4 steps each), their sampled token ids per step."""
    out = {}
    for level in ("O0", "O2"):
        base = tmp_path_factory.mktemp(f"agent_{level}")
        job = compile_job(TOOL, str(base / "job"), level=level)
        samples: list = []
        rows = run_job(job, recording(job_step(job), samples), out=str(base / "run"), progress=False)
        out[level] = (job, str(base / "run"), rows, samples)
    return out


def test_a_tool_using_job_trains_the_same_at_O0_and_O2(tool_runs):
    _, run0, rows0, samples0 = tool_runs["O0"]
    _, run2, rows2, samples2 = tool_runs["O2"]
    assert samples0 == samples2                              # the same trajectories, token id for token id
    assert close(untimed(rows0), untimed(rows2)), (rows0, rows2)   # -O2's unpad/reuse_logprobs: within 1e-4
    assert sum(r["tool_calls"] for r in rows0) > 0 and all(r["tool_errors"] == 0 for r in rows0)
    assert all(r["tool_tokens"] == 2 * r["tool_calls"] or r["tool_tokens"] < 2 * r["tool_calls"] for r in rows0)
    assert all(r["turns_mean"] >= 1 for r in rows0)
    with open(os.path.join(run0, "samples.jsonl")) as fh:   # samples show who said what
        logged = [__import__("json").loads(line) for line in fh]
    assert logged and all("".join(text for _, text in r["turns"]) == r["response"] for r in logged)
    assert all(who in ("policy", "a") for r in logged for who, _ in r["turns"])
    assert any(who == "a" for r in logged for who, _ in r["turns"])
    for run in (run0, run2):   # each call's folder lived under the run folder, and was removed after it
        tools = os.path.join(run, "tools")
        assert os.path.isdir(tools)
        assert not any(name.startswith("call") for _, dirs, _ in os.walk(tools) for name in dirs)


def _spans(trace: dict, name: str) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("name") == name and e.get("args", {}).get("stage") == name]


def test_streamed_trajectories_reach_the_forwards_as_they_end_and_train_as_unstreamed(tool_runs, tmp_path):
    """-O2 with ``stream{chunk=4}``: the batch of 16 trajectories goes to the reference and critic forwards in
    chunks as trajectories end (those that answered at an early turn first), while the others call the tool and
    decode on; the same trajectories, token id for token id, as -O0 and -O2, the metrics within 1e-4 of -O2's (a
    chunk's forward over fewer rows may round differently). The measured trace shows the forwards' chunks, the
    first starting before the generate ends."""
    passes = ["stream{chunk=4}" if p == "stream" else p for p in PIPELINES["O2"]]
    job = compile_job(TOOL, str(tmp_path / "job"), level=None, passes=passes)
    code = open(os.path.join(job, "main.py")).read()
    assert "generate_chunks.remote(prompts, carry=carry, chunk=4," in code and "tools=" in code
    samples: list = []
    rows = run_job(job, recording(job_step(job), samples), out=str(tmp_path / "run"), progress=False, trace=True)
    assert samples == tool_runs["O0"][3]
    assert close(untimed(rows), untimed(tool_runs["O2"][2])), (rows, tool_runs["O2"][2])
    with open(os.path.join(tmp_path, "run", "trace.json")) as fh:
        trace = __import__("json").load(fh)
    gens, refs = _spans(trace, "traj"), _spans(trace, "ref_logp")
    assert len(gens) == 4 and len(refs) > len(gens)             # several chunks a step
    assert sum(1 for a, _ in refs if any(g0 < a < g1 for g0, g1 in gens)) >= 1   # a forward while generating


def test_a_resumed_tool_using_run_equals_the_uninterrupted_one(tool_runs, tmp_path):
    job, run0, rows0, _ = tool_runs["O0"]
    out = str(tmp_path / "resumed")
    run_job(job, out=out, steps=2, progress=False)
    run_job(job, out=out, resume=True, progress=False)
    # within 1e-4: run alone (three fresh runs, with and without recording, and a resume after an -O2 run, in one
    # process) the runs are bit for bit equal, but in a shuffled run of the e2e modules, after the asynchronous-
    # rollout tests, this comparison differed at ~1e-8 (cause not found: some state earlier jobs leave in the
    # test process; the session note lists it)
    assert close(untimed(metrics(out)), untimed(rows0)), (metrics(out), rows0)


KILLER = """import ctypes, os

def bee(text):
    if os.path.exists({trigger!r}):   # from the step the test chooses on: kill the sandbox's server, every call
        ctypes.CDLL(None).kill(os.getppid(), 9)
    return "bc"
"""


def test_a_tool_that_keeps_killing_its_sandbox_stops_the_run_and_keeps_the_checkpoint(tool_runs, tmp_path):
    """ctypes goes below the sandbox's audit hooks: the tool kills the process that forks its calls. The sandbox
    restarts it twice, then the job stops at that step's generate, naming the tool; step 2's checkpoint stays
    latest, and the run resumed from it (the tool fixed) trains as the uninterrupted run."""
    _, _, rows0, _ = tool_runs["O0"]
    folder = tmp_path / "program"
    folder.mkdir()
    trigger = tmp_path / "kill-from-now-on"
    (folder / "agent_tools.py").write_text(KILLER.format(trigger=str(trigger)))
    shutil.copy(TOOL, folder / "agent_tool.rlhf")
    job = compile_job(str(folder / "agent_tool.rlhf"), str(tmp_path / "job"), level="O0")
    step, calls = job_step(job), []

    def armed(job_, w):
        calls.append(len(calls))
        if len(calls) == 3:   # steps 0 and 1 trained and checkpointed (checkpoint_every = 2)
            trigger.write_text("")
        return step(job_, w)

    out = tmp_path / "run"
    with pytest.raises(JobError) as err:
        run_job(job, armed, out=str(out), progress=False)
    message, hint = err.value.message, err.value.hint
    assert message.startswith("stage %traj (generate on model 'actor') failed: ToolSandboxError: tool 'a' keeps "
                              "killing its sandbox: the sandbox process died 3 times during one call"), message
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_2'}" in hint and "--resume" in hint, hint
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert [r["step"] for r in metrics(str(out))] == [0, 1]
    assert (out / "errors.log").is_file()
    trigger.unlink()   # the tool fixed: the run goes on from step 2 as if nothing had happened
    run_job(job, out=str(out), resume=True, progress=False)
    assert close(untimed(metrics(str(out))), untimed(rows0)), (metrics(str(out)), rows0)


def _copy_example(program: str, seed: int, folder) -> str:
    """The example with ``seed``, beside copies of its environment and data (a program's modules and data are
    looked up in its own folder)."""
    os.makedirs(folder, exist_ok=True)
    for name in ("agent_lookup.py", "agent_tiny.jsonl"):
        shutil.copy(os.path.join(ROOT, "examples", name), folder)
    text = open(os.path.join(ROOT, "examples", program)).read()
    assert "seed = 0;" in text
    path = os.path.join(folder, program)
    with open(path, "w") as fh:
        fh.write(text.replace("seed = 0;", f"seed = {seed};"))
    return path


def _gain(rows, key):
    first, last = [r[key] for r in rows[:5]], [r[key] for r in rows[-5:]]
    se = (statistics.variance(first) / 5 + statistics.variance(last) / 5) ** 0.5
    return statistics.mean(last) - statistics.mean(first), se, first, last


def _env_reward(trajectory: str, answer: str) -> float:
    """What examples/agent_lookup.py gives a trajectory's text: "?", the value, an answer."""
    if not trajectory.startswith("?") or len(trajectory) < 3:
        return 0.0
    given = trajectory[2:]
    return 1.0 if given == answer else 0.05 if len(given) == 1 and given.isdigit() else 0.0


def test_per_turn_rewards_of_a_last_step_reward_train_as_the_summed_reward(tmp_path):
    """examples/agent_tiny_ppo.rlhf (its environment rewards the answer, never the look-up) for 3 steps, with
    ``env_reward`` into gae and with ``env_turn_rewards`` -> ``kl_penalty`` -> ``gae``: the same token ids and the
    same metrics (the reward lands on the same token either way: bit for bit alone, within 1e-4 asserted)."""
    summed = _copy_example("agent_tiny_ppo.rlhf", 0, tmp_path / "summed")
    text = open(summed).read()
    old = ("  scores   = env_reward(traj)\n"
           "  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.0)")
    assert old in text
    per_turn = _copy_example("agent_tiny_ppo.rlhf", 0, tmp_path / "per_turn")
    with open(per_turn, "w") as fh:
        fh.write(text.replace(old, "  rewards  = env_turn_rewards(traj)\n"
                                   "  tok      = kl_penalty(rewards, logp, ref_logp, coef = 0.0)\n"
                                   "  adv, ret = gae(tok, values, gamma = 1.0, lam = 0.95)"))
    runs = {}
    for name, path in (("summed", summed), ("per_turn", per_turn)):
        job = compile_job(path, str(tmp_path / name / "job"), level="O2")
        samples: list = []
        rows = run_job(job, recording(job_step(job), samples), out=str(tmp_path / name / "run"), steps=3,
                       progress=False)
        runs[name] = (untimed(rows), samples)
    assert runs["per_turn"][1] == runs["summed"][1]   # the same token ids
    # the same metrics: bit for bit when run alone; held to 1e-4, as the resume above, against the ~1e-8 drift a
    # job in the shuffled test process once showed after other jobs
    assert close(runs["per_turn"][0], runs["summed"][0]), (runs["per_turn"][0], runs["summed"][0])
    with open(tmp_path / "per_turn" / "run" / "samples.jsonl") as fh:
        logged = [__import__("json").loads(line) for line in fh]
    assert all(sum(r for _, r in row["env_turn_rewards"]) == pytest.approx(row["env_reward"]) for row in logged)


LEARN_STEPS = 60


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("program", ["agent_tiny.rlhf", "agent_tiny_ppo.rlhf"], ids=["grpo", "ppo"])
def test_the_worked_example_learns_to_look_up(program, seed, tmp_path):
    path = _copy_example(program, seed, tmp_path / "program")
    job = compile_job(path, str(tmp_path / "job"), level="O2")
    seen: list = []
    step = job_step(job)

    def recorded(job_, w):
        values = step(job_, w)
        roll = job_.resolve({"traj": values["traj"]})["traj"]
        seen.append(roll)
        return values

    # 60 of the example's 100 steps: the slowest seed looks up nearly always by step 50
    rows = run_job(job, recorded, out=str(tmp_path / "run"), steps=LEARN_STEPS, progress=False)
    for key in ("reward_mean", "turns_mean"):
        gain, se, first, last = _gain(rows, key)
        assert gain > 3 * se, f"{key}: first 5 {first}, last 5 {last}: gain {gain:.3f} not above 3 SE ({se:.3f})"
    assert statistics.mean(r["turns_mean"] for r in rows[-5:]) > 1.8   # it looks up nearly always
    final = seen[-1]
    for row, (text, fields) in enumerate(zip(final.responses, final.fields)):
        assert fields["@env_reward"] == pytest.approx(_env_reward(text, fields["answer"])), (text, fields)
        ids = final.batch.response_token_lists()[row]
        mask = final.batch.response_mask[row, :len(ids)].tolist()
        assert mask == ([1, 0, 1] if text.startswith("?") and len(ids) == 3 else [1] * len(ids))
