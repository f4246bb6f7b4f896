"""End to end: a reward that turns NaN stops the run with an error naming the stage, the rule and the sample,
exits non-zero, and leaves the last good checkpoint as the latest (the NaN step is never checkpointed). The
rule module sits beside the program and is found without PYTHONPATH."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhfc.cli import main as cli
from rlhfc.runtime.data.prompts import SyntheticPrompts
from rlhfc.runtime.driver import checkpoint

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.e2e


def test_nan_reward_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    text = (HERE / "tiny_ppo.rlhf").read_text()
    text = text.replace('model reward = gpt2(layers = 1, hidden = 32, heads = 2, vocab = 64, max_seq = 32) head = '
                        'score frozen\n', "")
    text = text.replace("scores   = reward.score(roll)", 'scores   = rule("nan_rule:reward", roll)')
    text = text.replace("run { steps = 4; seed = 3; checkpoint_every = 2 }", "run { steps = 2; seed = 3; "
                        "checkpoint_every = 1 }")
    assert 'rule("nan_rule:reward", roll)' in text and "model reward" not in text
    program = tmp_path / "nan.rlhf"
    program.write_text(text)
    prompts = SyntheticPrompts(64, 3, 6, seed=0).prompts   # the program's data: batch 4, in order
    second = sorted(set(prompts[4:8]) - set(prompts[:4]))
    assert prompts[4] in second
    (tmp_path / "nan_rule.py").write_text(
        f"SECOND = {second!r}\n\n\ndef reward(prompt, response):\n"
        "    return float('nan') if prompt in SECOND else 0.5\n")
    out = tmp_path / "run"
    code = cli(["run", str(program), "-O1", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err
    assert "stage %scores" in err and "the reward of nan_rule:reward is NaN for sample" in err, err
    assert f"for sample 0 (prompt {prompts[4]!r})" in err, err
    latest = checkpoint.latest_checkpoint(str(out / "checkpoints"))
    assert latest is not None and os.path.basename(latest) == "step_1"
    assert not (out / "checkpoints" / "step_2").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [0]
