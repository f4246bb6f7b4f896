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

    .venv/bin/python benchmarks/overlap.py [--rounds 3] [--steps 12] [--warmup 2] [--json out.json]

The levels and TRL run in rounds (O0, O1, O2, O3, TRL, then again), so slow and
fast spells of a shared machine hit every level alike; each figure is the median
over rounds, with its range, and each round also measures how much two busy
cores deliver over one (``benchmarks/cores.py``), the ceiling of any overlap.

Targets on 2 cores: -O2 >= 1.6x -O0, -O3 >= 2x -O0, -O2 >= 3x TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from statistics import median

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
PROGRAM = os.path.join(ROOT, "benchmarks", "overlap.rlhf")

from rlhfc.frontend import load_file  # noqa: E402
from rlhfc.passes import PassManager, pipeline_for  # noqa: E402
from rlhfc.runtime.job import Job  # noqa: E402
from jobrun import run_compiled  # noqa: E402

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


def passes_for(level: str) -> list:
    """The passes of an -O level, or of ``O3-sync``: -O3 without ``async_rollout`` (its generate overcommitted
    instead of run ahead, what -O3 compiles for a program stating ``staleness = 0``)."""
    if level == "O3-sync":
        return [p for p in pipeline_for("O3") if p.name != "async_rollout"]
    return pipeline_for(level)


def run_level(level: str, steps: int, warmup: int, work: str, program: str = PROGRAM) -> dict:
    module, _, _ = load_file(program)
    module = PassManager(passes_for(level)).run(module)
    run = run_compiled(module, level, program, work, warmup=warmup, steps=steps, probe=_cpu)
    measured, wall = run["rows"], run["wall"]
    cpu = run["probe"][1] - run["probe"][0]
    samples = sum(r["samples"] for r in measured)
    waits: dict[str, float] = {}
    for r in measured:
        for k, v in r["wait_s"].items():
            waits[k] = waits.get(k, 0.0) + v / len(measured)
    return {"level": level, "samples_per_s": samples / wall, "step_s": wall / len(measured),
            "utilisation": cpu / (wall * (os.cpu_count() or 1)), "wait_s": waits,
            "reward_last": measured[-1]["reward_mean"], "response_len_mean":
            sum(r["response_len_mean"] for r in measured) / len(measured),
            "carried": sum(r.get("carried", 0) for r in measured), "staleness_mean": sum(r.get("staleness_mean", 0.0) for r in measured) / len(measured),
            "module": module}


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



def _cpu_name() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (every level, then TRL), interleaved in time")
    ap.add_argument("--levels", default="O0,O1,O2,O3")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--program", default=PROGRAM, help="another program (TRL's peer is sized for overlap.rlhf: "
                                                      "use --no-trl)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from cores import core_scaling

    levels = args.levels.split(",")
    runs: dict[str, list[dict]] = {lv: [] for lv in levels}
    trl_runs: list[dict] = []
    scaling: list[float] = []
    work = tempfile.mkdtemp(prefix="rlhfc-overlap-")
    try:
        for rnd in range(args.rounds):
            scaling.append(core_scaling())
            for lv in levels:
                runs[lv].append(run_level(lv, args.steps, args.warmup, os.path.join(work, f"r{rnd}"), args.program))
            if not args.no_trl:
                from trl_peer import run_trl_ppo

                trl_runs.append(run_trl_ppo(layers=2, hidden=64, heads=4, vocab=16, max_seq=128, batch=16,
                                            max_new_tokens=96, prompt_min_len=4, prompt_max_len=12,
                                            steps=args.steps, minibatches=2, epochs=1, lr=1e-4, seed=0, threads=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def sps(r: dict) -> float:
        return r["samples_per_s"]

    med = {lv: median([sps(r) for r in rs]) for lv, rs in runs.items()}
    base = med.get("O0") or next(iter(med.values()))
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores; program: {os.path.relpath(args.program, ROOT)}; "
          f"{args.rounds} rounds x {args.steps - args.warmup} measured steps after {args.warmup} warm-up")
    print(f"two busy cores deliver {median(scaling):.2f}x one core's throughput here "
          f"(per round: {', '.join(f'{x:.2f}' for x in scaling)}): the ceiling of any overlap")
    print(f"{'level':<7} {'samples/s':>10} {'(min-max)':>13} {'vs O0':>7} {'step s':>8} {'core util':>10} "
          f"{'resp len':>9} {'carried':>8} {'stale':>6}")
    for lv, rs in runs.items():
        mid = sorted(rs, key=sps)[len(rs) // 2]
        print(f"{lv:<7} {med[lv]:>10.1f} {min(map(sps, rs)):>6.1f}-{max(map(sps, rs)):<6.1f} "
              f"{med[lv] / base:>6.2f}x {mid['step_s']:>8.3f} {mid['utilisation']:>9.0%} "
              f"{mid['response_len_mean']:>9.1f} {mid['carried']:>8} {mid['staleness_mean']:>6.2f}")
    if "O0" in runs and len(levels) > 1:
        for lv in levels[1:]:
            per = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs["O0"], runs[lv])]
            print(f"  {lv}/O0 per round: {', '.join(f'{x:.2f}x' for x in per)}")
    o0_mid = sorted(runs["O0"], key=sps)[len(runs["O0"]) // 2] if "O0" in runs else None
    bound = 0.0
    if o0_mid is not None:
        stage_s = {}
        graph_values = o0_mid["module"].graph.values()
        for k, v in o0_mid["wait_s"].items():   # -O0 waits are the stage times (one stage at a time)
            stage_s[graph_values[k].name if k in graph_values else k] = v
        bound = critical_path(o0_mid["module"], stage_s)
    out = {"machine": _cpu_name(), "cores": os.cpu_count(), "core_scaling": scaling, "rounds": args.rounds,
           "median_samples_per_s": med,
           "levels": {lv: [{k: v for k, v in r.items() if k != "module"} for r in rs] for lv, rs in runs.items()},
           "critical_path_s": bound}
    if "O2" in runs and bound:
        o2_step = sorted(runs["O2"], key=sps)[len(runs["O2"]) // 2]["step_s"]
        print(f"critical-path bound of a step (longest chain of -O0 stage times): {bound:.3f} s; "
              f"-O2 step {o2_step:.3f} s = {o2_step / bound:.2f}x the bound")
    if trl_runs:
        trl_sps = [t.get("steady_samples_per_s") or t["samples_per_s"] for t in trl_runs]
        out["trl"] = [{k: v for k, v in t.items() if k != "per_step_s"} for t in trl_runs]
        print(f"TRL {trl_runs[0]['versions']['trl']} PPO: {median(trl_sps):.1f} samples/s median (steady; "
              f"per round {', '.join(f'{x:.1f}' for x in trl_sps)}); mean generated length "
              f"{trl_runs[0].get('mean_generated_len', float('nan')):.1f}")
        if "O2" in runs:
            per = [o["samples_per_s"] / t for o, t in zip(runs["O2"], trl_sps)]
            print(f"-O2 / TRL = {med['O2'] / median(trl_sps):.2f}x (per round: "
                  f"{', '.join(f'{x:.2f}x' for x in per)})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
