"""Overlap benchmark (issue: parallelize / stream / overcommit): -O0..-O3 side by side, and TRL's PPO.

Runs ``benchmarks/overlap.rlhf`` (four tiny GPT-2 models, a neural reward model,
geometric — long-tailed — response lengths) at -O0, -O1, -O2 and -O3 in turn in
this one process on the local CPU, then TRL 1.12's PPO trainer
(``trl.experimental.ppo``) on the same model sizes, batch and lengths
(``benchmarks/trl_peer.py``). Prints, per level: samples/s over the measured
steps (after warm-up), the ratio to -O0, and core utilisation = busy
core-seconds of the driver and all model workers ÷ (wall × cores); then the
ratio of -O2 to TRL, and the gap of -O2 to the step's critical-path bound (the
longest dependency chain of the -O0 stage times: what infinite parallelism
could reach without changing the stages).

    .venv/bin/python benchmarks/overlap.py [--steps 12] [--warmup 2] [--json out.json]

Targets on 2 cores: -O2 >= 1.6x -O0, -O3 >= 2x -O0, -O2 >= 3x TRL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROGRAM = os.path.join(ROOT, "benchmarks", "overlap.rlhf")

from rlhfc.codegen import emit_job  # noqa: E402
from rlhfc.frontend import load_file  # noqa: E402
from rlhfc.passes import PIPELINES, PassManager, pipeline_for  # noqa: E402
from rlhfc.runtime.job import Job  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return 0.0


def _cpu(job: Job) -> float:
    t = os.times()
    return t.user + t.system + sum(_proc_cpu(w["pid"]) for w in job.worker_info.values())


def run_level(level: str, steps: int, warmup: int, work: str) -> dict:
    module, _, _ = load_file(PROGRAM)
    module = PassManager(pipeline_for(level)).run(module)
    job_dir = os.path.join(work, f"job_{level}")
    emit_job(module, job_dir, source_path=PROGRAM, opt_level=level, passes=PIPELINES[level])
    spec = importlib.util.spec_from_file_location(f"bench_{level}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    marks: dict = {}

    def step(job, w):
        if marks.get("calls", 0) == warmup:
            marks["t0"], marks["cpu0"] = time.perf_counter(), _cpu(job)
        marks["calls"] = marks.get("calls", 0) + 1
        return mod.step(job, w)

    job = Job(job_dir, out=os.path.join(work, f"run_{level}"), steps=steps, progress=False)
    try:
        rows = job.run(step)
        wall, cpu = time.perf_counter() - marks["t0"], _cpu(job) - marks["cpu0"]
    finally:
        job.shutdown()
    measured = rows[warmup:]
    samples = sum(r["samples"] for r in measured)
    waits: dict[str, float] = {}
    for r in measured:
        for k, v in r["wait_s"].items():
            waits[k] = waits.get(k, 0.0) + v / len(measured)
    return {"level": level, "samples_per_s": samples / wall, "step_s": wall / len(measured),
            "utilisation": cpu / (wall * (os.cpu_count() or 1)), "wait_s": waits,
            "reward_last": measured[-1]["reward_mean"], "response_len_mean":
            sum(r["response_len_mean"] for r in measured) / len(measured),
            "carried": sum(r.get("carried", 0) for r in measured), "module": module}


def critical_path(module, stage_s: dict[str, float]) -> float:
    """Longest chain of stage times through the data dependencies (the -O0 stage times)."""
    g = nx.DiGraph()
    for s in module.graph.stages:
        g.add_node(s.name, w=stage_s.get(s.name, 0.0))
        for p in module.graph.predecessors(s):
            g.add_edge(p.name, s.name)
    best: dict[str, float] = {}
    for n in nx.topological_sort(g):
        best[n] = g.nodes[n]["w"] + max((best[p] for p in g.predecessors(n)), default=0.0)
    return max(best.values(), default=0.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--levels", default="O0,O1,O2,O3")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = tempfile.mkdtemp(prefix="rlhfc-overlap-")
    try:
        results = [run_level(lv, args.steps, args.warmup, work) for lv in args.levels.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = next(r for r in results if r["level"] == "O0")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {cpu}, {os.cpu_count()} cores; program: benchmarks/overlap.rlhf; "
          f"{args.steps - args.warmup} measured steps after {args.warmup} warm-up")
    print(f"{'level':<6} {'samples/s':>10} {'vs O0':>7} {'step s':>8} {'core util':>10} {'resp len':>9} {'carried':>8}")
    for r in results:
        print(f"{r['level']:<6} {r['samples_per_s']:>10.1f} {r['samples_per_s'] / base['samples_per_s']:>6.2f}x "
              f"{r['step_s']:>8.3f} {r['utilisation']:>9.0%} {r['response_len_mean']:>9.1f} {r['carried']:>8}")
    stage_s = {}
    for k, v in base["wait_s"].items():   # -O0 waits are the stage times (one stage at a time)
        stage_s[base["module"].graph.values()[k].name if k in base["module"].graph.values() else k] = v
    bound = critical_path(base["module"], stage_s)
    o2 = next((r for r in results if r["level"] == "O2"), None)
    out = {"machine": cpu, "cores": os.cpu_count(), "levels": {r["level"]: {k: v for k, v in r.items()
                                                                          if k != "module"} for r in results},
           "critical_path_s": bound}
    if o2:
        print(f"critical-path bound of a step (from -O0 stage times): {bound:.3f} s; -O2 step {o2['step_s']:.3f} s "
              f"= {o2['step_s'] / bound:.2f}x the bound")
    if not args.no_trl:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from trl_peer import run_trl_ppo

        trl = run_trl_ppo(layers=2, hidden=64, heads=4, vocab=16, max_seq=128, batch=16, max_new_tokens=96,
                          prompt_min_len=4, prompt_max_len=12, steps=args.steps, minibatches=2, epochs=1, lr=1e-4,
                          seed=0, threads=1)
        trl_sps = trl.get("steady_samples_per_s") or trl["samples_per_s"]
        out["trl"] = {k: v for k, v in trl.items() if k != "per_step_s"}
        print(f"TRL {trl['versions']['trl']} PPO: {trl_sps:.1f} samples/s (steady); mean generated length "
              f"{trl.get('mean_generated_len', float('nan')):.1f}")
        if o2:
            print(f"-O2 / TRL = {o2['samples_per_s'] / trl_sps:.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
