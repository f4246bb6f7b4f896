"""``rlhfc compare RUNDIR`` on a recorded run folder (tests/data/run_tiny_ppo: tiny_ppo -O2, 4 steps,
--trace), and its errors on bad run folders. No Ray: the run was recorded once."""

from __future__ import annotations

import json
import os
import shutil
import statistics

from rlhfc.cli import main

RUN = os.path.join(os.path.dirname(__file__), "..", "data", "run_tiny_ppo")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compare_prints_predicted_vs_measured_per_stage_and_step(capsys):
    code, out, err = run(capsys, "compare", RUN, "--no-profile")
    assert code == 0, err
    assert out.startswith("tiny_ppo: predicted (@local: 1 x 2 cpu") and "median over steps 1-3" in out
    for stage in ("roll", "ref_logp", "values", "scores", "actor_train", "critic_train", "adv"):
        assert any(line.split()[:1] == [stage] and line.rstrip().endswith("%") for line in out.splitlines()), stage
    assert "per step: predicted" in out and "step 0:" in out and "step 3:" in out
    assert "median |error| over the stages on workers:" in out


def test_compare_json_measures_each_stage_as_the_sum_of_its_spans(capsys):
    code, out, err = run(capsys, "compare", RUN, "--no-profile", "--json")
    assert code == 0, err
    result = json.loads(out)
    with open(os.path.join(RUN, "trace.json")) as fh:
        spans = [e for e in json.load(fh)["traceEvents"] if e["ph"] == "X"]
    by_stage = {r["stage"]: r for r in result["stages"]}
    for stage in ("roll", "ref_logp", "actor_train"):
        per_step = [sum(e["dur"] for e in spans if e["args"].get("stage") == stage and e["cat"] != "wait"
                        and e["args"]["step"] == k) / 1e6 for k in (1, 2, 3)]
        row = by_stage[stage]
        assert abs(row["measured_s"] - statistics.median(per_step)) < 1e-9
        assert row["predicted_s"] > 0
        assert abs(row["error"] - (row["predicted_s"] - row["measured_s"]) / row["measured_s"]) < 1e-9
    steps = {e["args"]["step"]: e["dur"] / 1e6 for e in spans if e["cat"] == "step"}
    assert [r["step"] for r in result["step"]["per_step"]] == [0, 1, 2, 3]
    assert abs(result["step"]["measured_s"] - statistics.median([steps[1], steps[2], steps[3]])) < 1e-9
    assert result["source"] == "trace" and result["steps_used"] == [1, 2, 3]
    # the prediction is explain's for the same plan
    code, out, _ = run(capsys, "explain", _ir_file(RUN), "--passes", "", "--no-profile", "--format", "json")
    assert code == 0
    assert abs(json.loads(out)["predicted_step_time_s"] - result["step"]["predicted_s"]) < 1e-12


def _ir_file(run_dir: str) -> str:
    """The run's plan as an .rlir file (explain with --passes "" prices it as compiled)."""
    import tempfile

    with open(os.path.join(run_dir, "job", "plan.json")) as fh:
        ir = json.load(fh)["ir"]
    path = os.path.join(tempfile.mkdtemp(), "plan.rlir")
    with open(path, "w") as fh:
        fh.write(ir)
    return path


def test_compare_falls_back_to_metrics_and_says_so(capsys, tmp_path):
    shutil.copytree(os.path.join(RUN, "job"), tmp_path / "job")
    shutil.copy(os.path.join(RUN, "metrics.jsonl"), tmp_path / "metrics.jsonl")
    code, out, err = run(capsys, "compare", str(tmp_path), "--no-profile")
    assert code == 0, err
    assert "(metrics, median over steps 1-3" in out and "run with --trace" in out


def test_compare_bad_run_folders_are_errors_with_hints(capsys, tmp_path):
    code, _, err = run(capsys, "compare", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err and "hint:" in err and "Traceback" not in err
    code, _, err = run(capsys, "compare", str(tmp_path))
    assert code == 2 and "no trace.json and no metrics.jsonl" in err and "--trace" in err
    (tmp_path / "trace.json").write_text("{not json")
    code, _, err = run(capsys, "compare", str(tmp_path))
    assert code == 2 and "is not a readable trace" in err and "hint:" in err
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [], "otherData": {"kind": "measured"}}))
    code, _, err = run(capsys, "compare", str(tmp_path), "--job", os.path.join(RUN, "job"))
    assert code == 2 and "no completed step" in err and "hint:" in err
    shutil.copy(os.path.join(RUN, "trace.json"), tmp_path / "trace.json")
    code, _, err = run(capsys, "compare", str(tmp_path))   # a measured trace, but no job folder
    assert code == 2 and "no plan.json" in err and "--job" in err
    code, _, err = run(capsys, "compare", str(tmp_path), "--job", os.path.join(RUN, "job"), "--no-profile")
    assert code == 0, err
    predicted = json.loads(open(os.path.join(RUN, "trace.json")).read())
    predicted["otherData"]["kind"] = "predicted"
    (tmp_path / "trace.json").write_text(json.dumps(predicted))
    code, _, err = run(capsys, "compare", str(tmp_path), "--job", os.path.join(RUN, "job"))
    assert code == 2 and "predicted timeline" in err
