"""Bad-input tests: every program in tests/bad/ must fail with exactly the diagnostics it lists.

A bad program is a small complete ``.rlhf`` file with one deliberate mistake and, in
comments, the diagnostics it must produce::

    # CHECK: 14:30: error: argument 1 of gae() ('rewards') must be ...
    # HINT: a SeqFloat comes from

A CHECK matches a rendered diagnostic line ``FILE:LINE:COL: error: MESSAGE``; a HINT
is a substring of one of the ``hint:`` lines. ``rlhfc check`` must exit 2, print
each error with its source line, a caret under the column and a hint, report no
error the file does not list, and never print a Python traceback. Programs in
tests/warn/ list warnings the same way and must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfc.cli import main

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BAD = sorted((TESTS / "bad").glob("*.rlhf"))
WARN = sorted((TESTS / "warn").glob("*.rlhf"))

_HEADER = re.compile(r"^(?P<file>.+?):(?P<line>\d+):(?P<col>\d+): (?P<sev>error|warning|note): (?P<msg>.*)$")


def _expectations(path: Path) -> tuple[list[str], list[str]]:
    checks, hints = [], []
    for line in _source(path):
        if line.startswith("# CHECK:"):
            checks.append(line[len("# CHECK:"):].strip())
        elif line.startswith("# HINT:"):
            hints.append(line[len("# HINT:"):].strip())
    return checks, hints


def _source(path: Path) -> list[str]:
    """The file's lines as the compiler shows them (a byte that is not UTF-8 reads as U+FFFD)."""
    return path.read_bytes().decode("utf-8-sig", "replace").splitlines()


def _blocks(output: str) -> list[list[str]]:
    """Split rendered diagnostics into blocks: header line, then its source/caret/hint lines."""
    blocks: list[list[str]] = []
    for line in output.splitlines():
        if _HEADER.match(line) or line.startswith("rlhfc: "):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
    return blocks


def _run_check(path: Path, capsys) -> tuple[int, str, str]:
    rel = os.path.relpath(path)
    rc = main(["check", rel])
    captured = capsys.readouterr()
    return rc, rel, captured.err + captured.out


def _assert_rendered(path: Path, rel: str, output: str, severity: str) -> list[list[str]]:
    """Every diagnostic of ``severity`` has a location, its source line, a caret at its column and a hint."""
    assert "Traceback" not in output, output
    assert "internal error" not in output, output
    source = _source(path)
    blocks = [b for b in _blocks(output) if f" {severity}: " in b[0]]
    for block in blocks:
        m = _HEADER.match(block[0])
        assert m, f"diagnostic without a location:\n{block[0]}"
        assert m["file"] == rel, block[0]
        line, col = int(m["line"]), int(m["col"])
        assert 1 <= line <= len(source), block[0]
        assert len(block) >= 3, "\n".join(block)
        assert block[1] == "  " + source[line - 1].expandtabs(1), "\n".join(block)
        assert block[2] == "  " + " " * (col - 1) + "^", "\n".join(block)
        assert col <= len(source[line - 1]) + 1, "caret past the end of the line:\n" + "\n".join(block)
        assert any(x.startswith("  hint: ") and len(x) > len("  hint: ") for x in block[3:]), \
            "no hint:\n" + "\n".join(block)
    return blocks


def test_enough_programs():
    assert len(BAD) >= 35
    assert len(WARN) >= 3
    for path in BAD + WARN:
        checks, _ = _expectations(path)
        assert checks, f"{path.name} lists no CHECK line"


@pytest.fixture(autouse=True)
def _in_repo_root(monkeypatch, megatron_installed):
    """Programs are checked from the repository root, as with megatron-core installed (the megatron
    layout checks hold either way; the missing-install diagnostic is tested in test_layouts.py)."""
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_program(path: Path, capsys):
    checks, hints = _expectations(path)
    rc, rel, output = _run_check(path, capsys)
    assert rc == 2, output
    blocks = _assert_rendered(path, rel, output, "error")
    headers = [b[0] for b in blocks]
    for check in checks:
        assert f"{rel}:{check}" in headers, f"missing diagnostic\n  {rel}:{check}\ngot:\n{output}"
    wanted_errors = [c for c in checks if re.match(r"\d+:\d+: error: ", c)]
    assert len(headers) == len(wanted_errors), f"unexpected extra errors:\n{output}"
    hint_lines = [x for b in blocks for x in b if x.startswith("  hint: ")]
    for hint in hints:
        assert any(hint in x for x in hint_lines), f"no hint containing {hint!r}:\n{output}"


@pytest.mark.parametrize("path", WARN, ids=[p.stem for p in WARN])
def test_warning_program(path: Path, capsys):
    checks, hints = _expectations(path)
    rc, rel, output = _run_check(path, capsys)
    assert rc == 0, output
    blocks = _assert_rendered(path, rel, output, "warning")
    headers = [b[0] for b in blocks]
    for check in checks:
        assert f"{rel}:{check}" in headers, f"missing diagnostic\n  {rel}:{check}\ngot:\n{output}"
    assert len(headers) == len(checks), f"unexpected extra warnings:\n{output}"
    hint_lines = [x for b in blocks for x in b if x.startswith("  hint: ")]
    for hint in hints:
        assert any(hint in x for x in hint_lines), f"no hint containing {hint!r}:\n{output}"
    assert "error:" not in output


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.rlhf")), ids=lambda p: p.stem)
def test_examples_check_clean(path: Path, capsys):
    rc, _, output = _run_check(path, capsys)
    assert rc == 0, output
    assert "error:" not in output and "warning:" not in output, output


def test_exact_rendering(tmp_path, capsys):
    program = tmp_path / "prog.rlhf"
    program.write_text(
        "model actor = llama(layers = 2, hidden = 64, heads = 4, vocab = 96) trainable\n"
        "model reward = llama(layers = 2, hidden = 64, heads = 4, vocab = 96) head = score frozen\n"
        "data prompts = synthetic(count = 64)\n"
        "pipeline ppo(batch = 4) {\n"
        "  roll = actor.generate(prompts)\n"
        "  scores = reward.score(roll)\n"
        "  adv = group_advantages(scores, roll)\n"
        "}\n")
    rc = main(["check", str(program)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (
        f"{program}:7:26: error: argument 1 of group_advantages() ('rollout') must be Rollout, "
        "got 'scores' of type SeqFloat\n"
        "    adv = group_advantages(scores, roll)\n"
        "                           ^\n"
        "  hint: a Rollout comes from MODEL.generate(prompts)\n")


def test_syntax_error_exact_rendering(tmp_path, capsys):
    program = tmp_path / "prog.rlhf"
    program.write_text(
        "data prompts = synthetic(count = 64)\n"
        "pipeline ppo(batch = 4) {\n"
        "  roll = actor.generate(prompts\n"
        "  logp = actor.logprobs(roll)\n"
        "}\n")
    rc = main(["check", str(program)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (
        f"{program}:4:3: error: unexpected 'logp'\n"
        "    logp = actor.logprobs(roll)\n"
        "    ^\n"
        "  hint: the '(' at line 3, column 24 is not closed (add ')'); "
        "expected '(', ')', ',', '.', '='\n")


def test_rlir_bad_shape_points_into_the_rlir_file(tmp_path, capsys):
    from rlhfc.frontend import load_file
    from rlhfc.ir import print_module

    module, _, _ = load_file(str(ROOT / "examples" / "ppo_tiny.rlhf"))
    text = print_module(module)          # keeps loc(...) of the .rlhf source: the diagnostic must not use it
    line_no, line = next((i + 1, x) for i, x in enumerate(text.splitlines()) if x.startswith("  model @reward "))
    bad = line.replace("arch = \"llama\"", "arch = \"gpt2\"").replace("kv_heads = 4", "kv_heads = 2")
    path = tmp_path / "bad.rlir"
    path.write_text(text.replace(line, bad))
    rc = main(["check", str(path)])
    err = capsys.readouterr().err
    assert rc == 2
    col = bad.index("kv_heads = 2") + 1
    assert err == (
        f"{path}:{line_no}:{col}: error: gpt2 has no grouped-query attention: kv_heads (2) must equal heads (4)\n"
        f"  {bad}\n"
        f"  {' ' * (col - 1)}^\n"
        "  hint: drop kv_heads for gpt2 models, or use llama\n")


def _cli_commands() -> list[list[str]]:
    commands = [[sys.executable, "-m", "rlhfc.cli"]]
    script = Path(sys.executable).parent / "rlhfc"
    if script.exists():
        commands.append([str(script)])
    return commands


@pytest.mark.parametrize("command", _cli_commands(), ids=lambda c: Path(c[-1]).name)
def test_real_process_exits_2_without_traceback(command):
    bad = os.path.relpath(TESTS / "bad" / "type_rollout_for_seqfloat.rlhf", ROOT)
    proc = subprocess.run(command + ["check", bad], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RLHFC_DEBUG": ""})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"{bad}:" in proc.stderr and ": error: argument 1 of gae() ('rewards')" in proc.stderr
    assert "  hint: " in proc.stderr


def test_missing_file_is_a_diagnostic(capsys):
    rc = main(["check", "tests/bad/does_not_exist.rlhf"])
    output = capsys.readouterr().err
    assert rc == 2
    assert "error: no such file" in output and "hint:" in output and "Traceback" not in output


# -- rule() modules: the program's folder, rlhfc's built-in rewards, or an allowed installed module ------
_GRPO = """model actor = llama(layers = 2, hidden = 64, heads = 4, vocab = 96, max_seq = 64) trainable
data prompts = synthetic(count = 64, min_len = 4, max_len = 12)
pipeline grpo(batch = 8) {
  roll   = actor.generate(prompts, n = 4, max_new_tokens = 16)
  logp   = actor.logprobs(roll)
  scores = rule("RULE", roll)
  actor.train(ppo_clip(roll, logp, group_advantages(roll, scores)), lr = 1e-3, minibatches = 2)
}
"""


def test_rule_from_the_programs_folder_and_from_an_allowed_module(tmp_path, monkeypatch, capsys):
    from rlhfc.codegen.plan import build_plan
    from rlhfc.frontend import load_file
    from rlhfc.ir import parse_ir, print_module, verify

    (tmp_path / "my_rewards.py").write_text("def exact(prompt, response):\n    return float(prompt == response)\n")
    program = tmp_path / "prog.rlhf"
    program.write_text(_GRPO.replace("RULE", "my_rewards:exact"))
    assert main(["check", str(program)]) == 0, capsys.readouterr().err     # no PYTHONPATH needed
    module, _, _ = load_file(str(program))
    assert "reward_modules" not in print_module(module)                      # printed only when set
    plan = build_plan(module, source=str(program), opt_level="O0", passes=[])
    assert plan.program_dir == str(tmp_path) and plan.run.reward_modules == ()
    assert plan.data["prompts"].as_spec()["fit"] == [{"model": "actor", "tokenizer": {"source": None, "vocab": 96},
                                                      "max_seq": 64, "max_new_tokens": 16}]

    site = tmp_path / "site"
    site.mkdir()
    (site / "team_rewards_xyz.py").write_text("def score(prompt, response):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    allowed = tmp_path / "allowed.rlhf"
    allowed.write_text(_GRPO.replace("RULE", "team_rewards_xyz:score"))
    assert main(["check", str(allowed)]) == 2
    assert 'reward_modules = ["team_rewards_xyz"]' in capsys.readouterr().err   # the hint says how to allow it
    allowed.write_text(_GRPO.replace("RULE", "team_rewards_xyz:score") +
                       'run { steps = 2; reward_modules = ["team_rewards_xyz",] }\n')
    assert main(["check", str(allowed)]) == 0, capsys.readouterr().err
    module, _, _ = load_file(str(allowed))
    text = print_module(module)
    assert 'reward_modules = ["team_rewards_xyz"]' in text
    again = parse_ir(text, "allowed.rlir")
    verify(again)
    assert again.run.reward_modules == ["team_rewards_xyz"] and print_module(again) == text
    assert build_plan(module, source=str(allowed), opt_level="O0", passes=[]).run.reward_modules == \
        ("team_rewards_xyz",)


def test_checking_a_rule_runs_none_of_its_code(tmp_path, capsys):
    marker = tmp_path / "ran"
    (tmp_path / "my_rewards.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef exact(prompt, response):\n    return 1.0\n")
    program = tmp_path / "prog.rlhf"
    program.write_text(_GRPO.replace("RULE", "my_rewards:exact"))
    assert main(["check", str(program)]) == 0, capsys.readouterr().err
    assert not marker.exists()
