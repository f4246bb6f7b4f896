"""``rlhfc explain`` in its five formats, and the HTML page in a headless browser."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from rlhfc.cli import main
from rlhfc.cost import CostConfig
from rlhfc.explain import build_report, render

from .helpers import EXAMPLES, annotate, example, have_chromium

TINY = str(EXAMPLES / "ppo_tiny.rlhf")
BIG = str(EXAMPLES / "ppo_70b.rlhf")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_text_has_passes_placement_gantt_and_bottleneck(capsys):
    code, out, err = run(capsys, "explain", TINY, "-O1", "--no-profile")
    assert code == 0, err
    assert out.startswith("rlhfc explain: module @ppo_tiny at -O1 (passes: dce)")
    assert re.search(r"predicted step time: [\d.]+ ms", out)
    assert "-- after dce: no change" in out
    assert "== Placement" in out and re.search(r"%roll\s+generate\s+@actor\s+0-1 \(node 0\)\s+2 threads", out)
    gantt = out.split("== Predicted timeline")[1].split("==")[0]
    assert re.search(r"%roll\s+\|#+\s*\|", gantt) and "dev 0-1" in gantt
    assert "== Bottleneck" in out and "uncalibrated" in out


def test_text_shows_what_each_pass_changed(capsys):
    plugin = str(EXAMPLES / "custom_pass.py")
    code, out, err = run(capsys, "explain", TINY, "--plugin", plugin, "--passes",
                         "dce,clamp-generation{max_new_tokens=8}", "--no-profile")
    assert code == 0, err
    assert "-- after clamp-generation{max_new_tokens=8}: 1 line(s) added, 1 removed" in out
    assert re.search(r"^- .*max_new_tokens = 24", out, re.M) and re.search(r"^\+ .*max_new_tokens = 8", out, re.M)


def test_json_fields(capsys, tmp_path):
    target = tmp_path / "x.json"
    code, out, err = run(capsys, "explain", BIG, "-O1", "--format", "json", "-o", str(target))
    assert code == 0 and out == "" and f"wrote {target}" in err
    data = json.loads(target.read_text())
    assert data["predicted_step_time_s"] > 0 and data["steps_simulated"] == 3
    stages = {s["name"]: s for s in data["stages"]}
    roll = stages["roll"]
    assert roll["placement"] == {"mesh": {"first": 0, "count": 128}, "nodes": list(range(16))}
    assert roll["parallel"] == {"dp": 128, "tp": 1, "pp": 1}
    assert 0 <= roll["start_s"] < roll["end_s"] <= data["predicted_step_time_s"] + 1e-9
    assert stages["adv"]["placement"] == "driver" and stages["adv"]["parallel"] is None
    assert len(data["devices"]) == 128 and all(d["peak_memory_bytes"] > 0 for d in data["devices"])
    assert data["memory_ok"] is False and data["diagnostics"][0]["message"].startswith("stage %")
    # the memory overflow is also a diagnostic on stderr
    assert "error: stage %actor_train needs" in err and "hint:" in err


def test_strict_exits_2_on_overflow(capsys):
    code, out, err = run(capsys, "explain", BIG, "-O1", "--strict")
    assert code == 2 and "but it has 74.5 GiB" in err


def test_dot_is_graphviz(capsys):
    code, out, err = run(capsys, "explain", TINY, "-O1", "--format", "dot", "--no-profile")
    assert code == 0, err
    assert out.startswith('digraph "ppo_tiny" {') and out.rstrip().endswith("}")
    assert '"roll" -> "logp" [label="%roll"];' in out
    assert '"actor_train" -> "roll" [style=dashed' in out and "[+1]" in out
    assert out.count("{") == out.count("}")


def test_dot_clusters_overlap_groups():
    m = annotate(example("ppo_tiny"), {"logp": {"overlap": 1}, "ref_logp": {"overlap": 1}})
    text = render(build_report(m, config=CostConfig()), "dot")
    assert "subgraph cluster_overlap_1 {" in text


def test_bad_options_are_diagnostics(capsys):
    code, _, err = run(capsys, "explain", TINY, "--format", "pdf")
    assert code == 2 and "unknown --format 'pdf'" in err
    code, _, err = run(capsys, "explain", TINY, "--response-lengths", "zipf")
    assert code == 2 and "bad --response-lengths" in err
    code, _, err = run(capsys, "explain", TINY, "--profile", "/nonexistent/p.json")
    assert code == 2 and "cannot read profile" in err


def _html(tmp_path, capsys, path=TINY) -> str:
    target = tmp_path / "page.html"
    code, _, err = run(capsys, "explain", path, "-O1", "--format", "html", "-o", str(target), "--no-profile")
    assert code == 0, err
    return str(target)


def test_html_is_self_contained(tmp_path, capsys):
    text = open(_html(tmp_path, capsys), encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>") and "</html>" in text
    assert text.count("<svg") == 4 and 'data-check="graph"' in text and 'data-check="timeline"' in text
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", text)      # nothing fetched from the network
    assert "@import" not in text and "url(http" not in text


def _chromium(tmp_path, *args) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    cmd = ["/usr/bin/chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90,
                          env={**os.environ, "HOME": str(tmp_path)})


@pytest.mark.skipif(not have_chromium(), reason="needs Debian's chromium (/usr/bin/chromium)")
def test_html_renders_in_a_headless_browser(tmp_path, capsys):
    page = _html(tmp_path, capsys)
    dom = _chromium(tmp_path, "--dump-dom", f"file://{page}")
    assert dom.returncode == 0, dom.stderr[-2000:]
    check = re.search(r'<pre id="render-check">([^<]*)</pre>', dom.stdout)
    assert check, dom.stdout[-2000:]
    drawn = dict((name, (int(n), int(w), int(h))) for name, n, w, h in
                 re.findall(r"(\w+):(\d+):(\d+)x(\d+)", check.group(1)))
    assert set(drawn) == {"graph", "timeline", "devices", "memory"}, check.group(1)
    assert drawn["graph"][0] == 11                                  # one box per stage
    assert drawn["timeline"][0] >= 33                              # 11 stages x 3 simulated steps
    assert all(w > 100 and h > 10 for _, w, h in drawn.values())
    shot = tmp_path / "page.png"
    res = _chromium(tmp_path, "--window-size=1200,1600", f"--screenshot={shot}", f"file://{page}")
    assert res.returncode == 0 and shot.exists() and shot.stat().st_size > 20_000


def test_trace_is_the_predicted_timeline_in_the_measured_layout(capsys, tmp_path):
    """--format trace: valid Chrome trace JSON with the driver's steps, a track per worker of the plan (as
    plan.json orders them) and per sync stage, one span per simulated task (one per chunk where it streams),
    with rows and tokens; the track numbers are the runtime's (rlhfc.runtime.worker.trace)."""
    from rlhfc.runtime.worker import trace as measured
    from rlhfc.explain import trace as predicted

    assert (predicted.DRIVER_PID, predicted.SYNC_PID, predicted.WORKER_PID0, predicted.STEPS_TID,
            predicted.DRIVER_TID) == (measured.DRIVER_PID, measured.SYNC_PID, measured.WORKER_PID0,
                                      measured.STEPS_TID, measured.DRIVER_TID)
    out = tmp_path / "predicted.json"
    passes = "dce,parallelize,stream{chunk=4},placement{strategy=separate},realloc"
    code, _, err = run(capsys, "explain", TINY, "--passes", passes, "--no-profile", "--format", "trace",
                       "-o", str(out))
    assert code == 0, err
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    assert trace["otherData"]["kind"] == "predicted" and trace["otherData"]["steps"] == 3
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs[1] == "driver" and procs[2] == "syncs"
    assert sorted(v for p, v in procs.items() if p >= 10) == sorted(
        ["worker actor", "worker actor_at_0_1", "worker critic", "worker ref", "worker reward"])
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["args"]["step"] for e in spans if e["cat"] == "step"] == [0, 1, 2]
    sync = [e for e in spans if e["pid"] == 2]
    assert sync and all(e["cat"] == "sync" for e in sync)
    roll = [e for e in spans if e["name"] == "roll"]
    assert len(roll) == 3 and procs[roll[0]["pid"]] == "worker actor_at_0_1"
    chunks = [e for e in spans if e["name"] == "ref_logp" and e["args"]["step"] == 2]
    assert len(chunks) == 4 and sum(e["args"]["rows"] for e in chunks) == 16   # batch 16 in chunks of 4
    assert all(e["args"]["tokens"] > 0 for e in chunks)
    adv = [e for e in spans if e["name"] == "adv"]
    assert all((e["pid"], e["tid"]) == (1, 2) for e in adv)
    names = {e["name"] for e in spans if e["args"].get("step") == 2 and e["cat"] != "step"}
    assert names >= {"roll", "logp", "ref_logp", "values", "scores", "adv", "ppo_clip", "value_loss",
                     "actor_train", "critic_train"} and {e["name"] for e in sync} <= names
