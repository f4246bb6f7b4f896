"""Sandboxed environments (rlhfc.runtime.rollout.sandbox.EnvSandbox): one process holds an environment's
instances, confined as a tool's call is (its own folder, no network, no processes, memory and time limits);
whatever goes wrong in a call is an error naming it, and the generating worker stops the run naming the
environment (AgentLoop's EnvError), never a hung or crashed worker."""

from __future__ import annotations

import os
import time

import pytest

from rlhfc.runtime.rollout.agent import AgentLoop, EnvError
from rlhfc.runtime.rollout.decoding import FinishedSample
from rlhfc.runtime.rollout import sandbox
from rlhfc.runtime.rollout.sandbox import EnvCallError, EnvSandbox, EnvSpec

GAME = '''
import os, socket, subprocess


class Game:
    made = 0

    def __init__(self):
        Game.made += 1
        self.n = 0

    def reset(self, record):
        self.n = 0
        return "start " + record["prompt"]

    def step(self, action):
        self.n += 1
        if action == "boom":
            raise ValueError("bad move")
        if action == "net":
            socket.create_connection(("example.com", 80))
        if action == "spawn":
            subprocess.run(["true"])
        if action == "write":
            open("/tmp/../" + os.path.basename(os.getcwd()) + "-outside", "w")
        if action == "hang":
            import time
            time.sleep(60)
        if action == "deaf":
            import signal, time
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            time.sleep(60)
        if action == "mem":
            x = bytearray(1 << 31)
        if action == "die":
            os._exit(3)
        if action == "where":
            return (os.getcwd(), 0, True)
        return ("obs %d" % self.n, 0.5 * self.n, self.n >= 2)
'''


@pytest.fixture
def box(tmp_path):
    (tmp_path / "game.py").write_text(GAME)
    b = EnvSandbox(EnvSpec("game", str(tmp_path / "game.py"), "Game", timeout=2, memory_mb=128),
                   root=str(tmp_path / "run"))
    yield b
    b.close()


def test_instances_keep_their_own_state_in_one_process(box):
    a, b = box.new(), box.new()
    assert a.reset({"prompt": "p"}) == "start p"
    assert a.step("x") == ("obs 1", 0.5, False)
    assert b.reset({"prompt": "q"}) == "start q" and b.step("x") == ("obs 1", 0.5, False)
    assert a.step("y") == ("obs 2", 1.0, True)
    pid = box._live.proc.pid
    box.clear()
    assert box.new().step("x") == ("obs 1", 0.5, False) and box._live.proc.pid == pid


@pytest.mark.parametrize("action, kind, says", [
    ("boom", "ValueError", "ValueError: bad move"),
    ("net", "SandboxRefusal", "network access is not allowed"),
    ("spawn", "SandboxRefusal", "starting a process is not allowed"),
    ("write", "SandboxRefusal", "writing outside the tool's folder is not allowed"),
    ("mem", "MemoryError", "out of memory (128 MB)"),
    ("die", "ProcessDied", "the environment's process died in step() (exit status 3)"),
])
def test_what_goes_wrong_in_a_call_comes_back_named(box, action, kind, says):
    h = box.new()
    h.reset({"prompt": "z"})
    with pytest.raises(EnvCallError) as exc:
        h.step(action)
    assert exc.value.kind == kind and says in str(exc.value)
    fresh = box.new()   # a process that died is started again; one that raised goes on
    assert fresh.step("x") == ("obs 1", 0.5, False)


def test_a_call_past_its_time_fails_and_a_silent_process_is_killed_and_started_again(box, monkeypatch):
    h = box.new()
    t0 = time.perf_counter()
    with pytest.raises(EnvCallError) as exc:
        h.step("hang")   # SIGALRM in the process ends the call; the process goes on
    assert exc.value.kind == "TimeoutError" and str(exc.value) == "step() timed out after 2 s"
    assert time.perf_counter() - t0 < 10 and h.step("x") == ("obs 2", 1.0, True)
    monkeypatch.setattr(sandbox, "ANSWER_GRACE", 1.0)
    with pytest.raises(EnvCallError) as exc:
        h.step("deaf")   # ignores SIGALRM: past its time and the grace, the process is killed
    assert exc.value.kind == "TimeoutError" and "no answer within 3 s (its process was killed)" in str(exc.value)
    with pytest.raises(EnvCallError, match="restarted"):
        h.step("x")   # its instance went with the process
    assert box.new().step("x") == ("obs 1", 0.5, False)


def test_a_batch_runs_its_calls_in_order_in_one_exchange_and_fails_only_the_failing_ones(box):
    a, b = box.new(), box.new()
    out = box.batch([(a, "reset", {"prompt": "p"}), (b, "reset", {"prompt": "q"}), (a, "step", "boom"),
                     (b, "step", "x"), (a, "step", "x")])
    assert out[:2] == ["start p", "start q"] and out[3] == ["obs 1", 0.5, False] and out[4] == ["obs 2", 1.0, True]
    assert isinstance(out[2], EnvCallError) and str(out[2]) == "ValueError: bad move"


def test_it_works_in_a_folder_of_its_own_under_the_run_folder_removed_at_close(box, tmp_path):
    where, _, _ = box.new().step("where")
    assert where.startswith(str(tmp_path / "run")) and os.path.isdir(where)
    proc = box._live.proc
    proc.stdin.close()   # its caller gone (a killed worker): at EOF it removes its own folder
    proc.wait(10)
    assert proc.returncode == 0 and not os.path.exists(where)
    box.close()
    assert not os.listdir(tmp_path / "run")

    again = EnvSandbox(box.spec, root=str(tmp_path / "run"))
    where, _, _ = again.new().step("where")
    again.close()   # closed: its folder and log go
    assert not os.path.exists(where) and not os.listdir(tmp_path / "run")


def test_a_class_that_does_not_load_is_an_error_naming_it(tmp_path):
    (tmp_path / "broken.py").write_text("raise ImportError('no such thing')\n")
    box = EnvSandbox(EnvSpec("game", str(tmp_path / "broken.py"), "Game"))
    try:
        with pytest.raises(EnvCallError, match="cannot load class 'Game' from .*broken.py: importing it raised "
                                               "ImportError: no such thing"):
            box.new()
    finally:
        box.close()


def _one_turn(rows, *, budgets, resumed, row_keys):
    for i, row in enumerate(rows):
        yield FinishedSample(i, tuple(row), (5,), True, 0, (), 1.0)


def test_the_agent_loop_stops_naming_the_environment_and_the_prompt(tmp_path):
    (tmp_path / "game.py").write_text(GAME.replace('return "start " + record["prompt"]', 'return ""').replace(
        'if action == "boom":', 'if action == "e":'))
    box = EnvSandbox(EnvSpec("game", str(tmp_path / "game.py"), "Game", timeout=1))
    tok = type("T", (), {"decode": staticmethod(lambda ids, keep_special=False: "e"),
                         "encode": staticmethod(lambda text: [7] * len(text))})()
    loop = AgentLoop({}, max_turns=2, turn_tokens=1, env=box.new, env_name="game")
    try:
        with pytest.raises(EnvError) as exc:
            loop.run(_one_turn, [[1]], width=4, keys=[0], tokenizer=tok, want_logprobs=False,
                     records=[{"prompt": "key7"}])
        assert str(exc.value) == "environment 'game' failed in step() for prompt 'key7': ValueError: bad move"
    finally:
        box.close()
