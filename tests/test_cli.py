"""The compiler commands of the CLI, run in-process: check, compile (--emit ir, -O spellings for jobs), passes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rlhfc.cli import main
from rlhfc.ir import parse_ir, print_module
from rlhfc.passes import PIPELINES, registered_passes

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))
PLUGIN = str(ROOT / "examples" / "custom_pass.py")
TINY = str(ROOT / "examples" / "ppo_tiny.rlhf")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_check_examples(capsys, path):
    code, out, err = run(capsys, "check", str(path))
    assert code == 0, err
    assert re.search(r": ok \(\d+ models, \d+ stages\)", err)


@pytest.mark.parametrize("level", ["0", "1", "2", "3"])
def test_compile_levels_to_stdout_and_file(capsys, tmp_path, level):
    code, out, err = run(capsys, "compile", TINY, f"-O{level}")
    assert code == 0, err
    assert out.startswith("module @ppo_tiny ") and print_module(parse_ir(out)) == out
    target = tmp_path / "out.rlir"
    code, out2, err = run(capsys, "compile", TINY, f"-O{level}", "-o", str(target))
    assert code == 0, err
    assert out2 == "" and target.read_text() == out


def test_compile_rlir_input(capsys, tmp_path):
    first = tmp_path / "tiny.rlir"
    assert run(capsys, "compile", TINY, "-O0", "-o", str(first))[0] == 0
    code, out, err = run(capsys, "compile", str(first), "-O0")
    assert code == 0, err
    assert out == first.read_text()
    code, out, err = run(capsys, "compile", str(first), "-O2")
    assert code == 0 and out == run(capsys, "compile", TINY, "-O2")[1]
    assert run(capsys, "check", str(first))[0] == 0


def test_compile_bad_rlir_gives_a_located_diagnostic(capsys, tmp_path):
    good = tmp_path / "good.rlir"
    assert run(capsys, "compile", TINY, "-O0", "-o", str(good))[0] == 0
    bad = tmp_path / "bad.rlir"
    bad.write_text(good.read_text().replace("forward.values @critic(%roll)", "forward.values @critic(%rol)"))
    code, out, err = run(capsys, "compile", str(bad))
    assert code == 2 and out == ""
    assert re.search(rf"{re.escape(str(bad))}:\d+:\d+: error: use of undefined value %rol", err)
    assert "^" in err and "hint: did you mean 'roll'?" in err


def test_compile_passes(capsys):
    code, out, err = run(capsys, "compile", TINY, "--passes", "dce")
    assert code == 0, err
    assert out == run(capsys, "compile", TINY, "-O1")[1]
    code, out, err = run(capsys, "compile", TINY, "--passes", "")
    assert code == 0 and out == run(capsys, "compile", TINY, "-O0")[1]


def test_compile_with_plugin_file(capsys):
    code, out, err = run(capsys, "compile", TINY, "--plugin", PLUGIN, "--passes", "clamp-generation{max_new_tokens=8}")
    assert code == 0, err
    assert "max_new_tokens = 8," in out and "max_new_tokens = 24" not in out


def test_compile_with_plugin_module(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    code, out, err = run(capsys, "compile", TINY, "--plugin", "custom_pass",
                         "--passes", "dce,clamp-generation{max_new_tokens=4}")
    assert code == 0, err
    assert "max_new_tokens = 4," in out


def test_bad_emit(capsys):
    code, out, err = run(capsys, "compile", TINY, "--emit", "asm")
    assert code == 2
    assert "error: unknown --emit 'asm'" in err and "hint: use --emit ir or --emit job" in err


def test_unknown_pass(capsys):
    code, out, err = run(capsys, "compile", TINY, "--passes", "dce,dcee")
    assert code == 2 and out == ""
    assert "error: unknown pass 'dcee'" in err and "hint: did you mean 'dce'?" in err


def test_bad_pass_option(capsys):
    code, out, err = run(capsys, "compile", TINY, "--plugin", PLUGIN, "--passes", "clamp-generation{max_new_token=8}")
    assert code == 2
    assert "pass clamp-generation has no option 'max_new_token'" in err and "did you mean 'max_new_tokens'?" in err


def test_unknown_level(capsys):
    code, out, err = run(capsys, "compile", TINY, "-O9")
    assert code == 2 and "unknown optimisation level '9'" in err


@pytest.mark.parametrize("spelling", ["o1", "O1", "1"])
def test_level_spellings_name_the_same_level_for_a_job(capsys, tmp_path, spelling):
    # every -O spelling goes through rlhfc.ir.plan.opt_level: `-O o1 --emit job` once failed with KeyError 'Oo1'
    job = tmp_path / "job"
    code, out, err = run(capsys, "compile", TINY, "-O", spelling, "--emit", "job", "-o", str(job))
    assert code == 0, err
    assert "internal error" not in err
    assert {"main.py", "plan.json", "ir.rlir"} <= {p.name for p in job.iterdir()}
    plan = json.loads((job / "plan.json").read_text())
    assert plan["opt_level"] == "O1" and plan["passes"] == PIPELINES["O1"]
    assert "at -O1 (passes: dce)" in (job / "main.py").read_text()
    code, ir, err = run(capsys, "compile", TINY, "-O", spelling, "--emit", "ir")
    assert code == 0, err
    assert ir == run(capsys, "compile", TINY, "-O1")[1]


@pytest.mark.parametrize("emit", ["ir", "job"])
def test_out_of_range_level_is_a_clean_error(capsys, tmp_path, emit):
    code, out, err = run(capsys, "compile", TINY, "-O", "7", "--emit", emit, "-o", str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert "rlhfc: error: unknown optimisation level '7'" in err and "hint: levels: O0, O1, O2, O3" in err
    assert "Traceback" not in err and "internal error" not in err
    assert not (tmp_path / "out").exists()


def test_placement_choices_come_from_the_plan(capsys):
    from rlhfc.ir.plan import PLACEMENTS

    code, out, err = run(capsys, "compile", TINY, "--placement", "scatter")
    assert code == 2 and "unknown --placement 'scatter'" in err
    assert f"hint: strategies: {', '.join(PLACEMENTS)}" in err


def test_print_after(capsys):
    code, out, err = run(capsys, "compile", TINY, "--plugin", PLUGIN,
                         "--passes", "dce,clamp-generation{max_new_tokens=8}", "--print-after-all")
    assert code == 0
    assert err.count("// ----- IR after ") == 2
    assert "// ----- IR after dce -----\nmodule @ppo_tiny {" in err
    assert "// ----- IR after clamp-generation{max_new_tokens=8} -----" in err
    code, out, err = run(capsys, "compile", TINY, "--plugin", PLUGIN,
                         "--passes", "dce,clamp-generation{max_new_tokens=8}", "--print-after", "clamp-generation")
    assert code == 0 and err.count("// ----- IR after ") == 1
    assert err.split("-----\n", 1)[1] == out            # the IR after the last pass is the output
    code, out, err = run(capsys, "compile", TINY, "--print-after", "nope")
    assert code == 2 and "unknown pass 'nope'" in err


def test_passes_lists_every_pass(capsys):
    code, out, err = run(capsys, "passes", "--plugin", PLUGIN)
    assert code == 0, err
    for name, cls in registered_passes().items():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert cls.description in line
        tag = ("[exact up to rounding;" if cls.rounding else "[exact;") if cls.exact else "[changes training;"
        assert tag in line
        levels = [lvl for lvl, names in PIPELINES.items() if name in names]
        assert (", ".join(levels) if levels else "by name only") in line
        for opt, kind, default, _doc in cls.option_help():
            assert f"    {opt}: {kind} = {default}" in out
    assert "    max_new_tokens: int = 16  — the longest response" in out


def test_check_reports_verifier_errors_in_rlir(capsys, tmp_path):
    good = tmp_path / "good.rlir"
    assert run(capsys, "compile", TINY, "-O0", "-o", str(good))[0] == 0
    bad = tmp_path / "frozen.rlir"
    bad.write_text(good.read_text().replace('head = "value", trainable = true', 'head = "value", trainable = false'))
    code, out, err = run(capsys, "check", str(bad))
    assert code == 2
    assert re.search(rf"{re.escape(str(bad))}:\d+:5: error: stage %critic_train \(train\): model @critic is frozen", err)
    assert "hint: mark it trainable" in err


def test_missing_file(capsys):
    code, out, err = run(capsys, "check", "no/such/file.rlhf")
    assert code == 2 and "no such file" in err


def test_cli_modules_import_one_way():
    """rlhfc.cli's layers: app <- load <- optimise <- {compile, explain}; no module imports a later one."""
    import ast

    import rlhfc.cli

    below = {"app": set(), "load": {"app"}, "optimise": {"app", "load"}, "compile": {"app", "load", "optimise"},
             "explain": {"app", "load", "optimise"}}
    folder = Path(rlhfc.cli.__file__).parent
    for name, allowed in below.items():
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        used = {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                and (n.level == 1 or n.module.startswith("rlhfc.cli"))}
        assert used <= allowed, (name, used - allowed)


# -- usage mistakes: click's usual usage errors, exit 2 (typer ships its own click) ---------------------------
@pytest.mark.parametrize("argv,says", [
    (["compile", TINY, "-02"], "No such option: -0"),
    (["compile", TINY, "--bogus"], "No such option: --bogus"),
    (["run", TINY, "--steps", "abc"], "Invalid value for '--steps'"),
    (["check"], "Missing argument"),
    (["explain"], "Missing argument"),
    (["frobnicate"], "No such command"),
], ids=["zero-for-O", "unknown-option", "steps-not-int", "missing-arg", "missing-arg-explain", "no-command"])
def test_usage_mistakes_are_usage_errors(capsys, argv, says):
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert says in err and "Usage: rlhfc" in err and "--help" in err
    assert "internal error" not in err and "Traceback" not in err


def test_zero_for_letter_o_gets_a_hint(capsys):
    code, out, err = run(capsys, "compile", TINY, "-02")
    assert code == 2 and "hint: the optimisation level is -O2 (the letter O), not -02 (zero)" in err


def test_no_arguments_prints_help(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "run" in out + err and "internal error" not in err


def test_version(capsys):
    import rlhfc

    code, out, err = run(capsys, "--version")
    assert code == 0, err
    assert out.strip() == f"rlhfc {rlhfc.__version__}"


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_run_refuses_steps_below_one(capsys, tmp_path, monkeypatch, steps):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "run", TINY, "--steps", steps, "--no-progress")
    assert code == 2, err
    assert f"Invalid value for '--steps': {steps} is not a number of steps" in err
    assert "hint: --steps is the total number of steps to train, at least 1" in err
    assert not (tmp_path / "runs").exists()   # refused before anything was compiled or started


@pytest.fixture
def tiny_job(tmp_path):
    job = tmp_path / "job"
    assert main(["compile", TINY, "-O1", "--emit", "job", "-o", str(job)]) == 0
    return job


@pytest.mark.parametrize("steps", ["-1", "0", "abc"])
def test_job_main_refuses_bad_steps(capsys, tiny_job, steps):
    from rlhfc.runtime.job import main as job_main

    with pytest.raises(SystemExit) as exc:
        job_main(str(tiny_job / "main.py"), ["--steps", steps, "--out", str(tiny_job.parent / "run")])
    assert exc.value.code == 2
    assert "argument --steps" in capsys.readouterr().err
    assert not (tiny_job.parent / "run").exists()


# -- never write over an earlier run --------------------------------------------------------------------------
def _earlier_run(folder: Path, checkpoint: bool = True) -> dict[str, str]:
    """A run folder as an earlier run leaves it; returns its files' contents."""
    files = {"job/main.py": "# the earlier run's job\n", "job/plan.json": "{}\n",
             "metrics.jsonl": '{"step": 0, "reward_mean": 0.5}\n{"step": 1, "reward_mean": 0.6}\n'}
    if checkpoint:
        files.update({"checkpoints/step_2/job.json": '{"step": 2}', "checkpoints/latest": "step_2\n"})
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return files


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def test_run_out_existing_run_is_refused_and_untouched(capsys, tmp_path):
    prior = tmp_path / "run"
    files = _earlier_run(prior)
    code, out, err = run(capsys, "run", TINY, "--out", str(prior), "--steps", "3", "--no-progress")
    assert code == 2, err
    assert f"run folder {prior} already holds checkpoints (latest: step_2)" in err
    assert "nothing was overwritten" in err
    assert f"hint: continue it with: rlhfc run {TINY} --steps 3 --out {prior} --resume --no-progress" in err
    assert "another folder (--out)" in err
    assert _contents(prior) == files      # job folder, metrics and checkpoints as they were


def test_run_out_existing_run_without_checkpoint_is_refused(capsys, tmp_path, tiny_job):
    prior = tmp_path / "run"
    files = _earlier_run(prior, checkpoint=False)
    for argv in (["run", TINY, "--out", str(prior)], ["run", str(tiny_job), "--out", str(prior)]):
        code, out, err = run(capsys, *argv, "--no-progress")
        assert code == 2, err
        assert f"run folder {prior} already holds a run" in err and "metrics.jsonl" in err
        assert "hint: it has no checkpoint to resume: choose another folder with --out" in err
        assert _contents(prior) == files


# -- Ctrl-C in python job/main.py -----------------------------------------------------------------------------
def test_job_main_ctrl_c_prints_the_resume_command(capsys, tiny_job, monkeypatch):
    import shlex
    import sys

    from rlhfc.runtime import job as job_mod

    out = tiny_job.parent / "run"
    ckpt = out / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    (ckpt / "job.json").write_text('{"step": 2}')
    (out / "checkpoints" / "latest").write_text("step_2\n")

    def interrupted(self, step_fn):
        self.step, self.current_stage = 2, "values"
        raise KeyboardInterrupt

    monkeypatch.setattr(job_mod.Job, "run", interrupted)
    code = job_mod.main(str(tiny_job / "main.py"), ["--out", str(out), "--steps", "5", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130
    assert "interrupted: stopped at step 2 (stage %values); Ray is shut down" in err
    assert f"the last complete checkpoint, {ckpt}, is kept as latest; resume with:" in err
    command = shlex.join([sys.executable, str(tiny_job / "main.py"), "--resume", "--out", str(out), "--steps", "5"])
    assert f"    {command}\n" in err
