"""Placement strategies side by side: predicted (cluster scale) and measured (this CPU).

For each example and each strategy (flatten, interleave, separate, search) the
program is compiled with ``dce,unpad,parallelize,stream,placement{strategy=S},realloc``
and the simulator predicts its step time (3 unrolled steps, the cost model's
catalog rates — nothing tuned to the papers). Printed: step time, speed-up over
flatten, whether memory fits, and how long the placement pass took.

With ``--measure`` it also trains ``examples/ppo_tiny.rlhf`` on this CPU under
each strategy (same steps, seed), in ``--rounds`` interleaved rounds (every
strategy once per round, each round starting with the next strategy, so slow
spells of a shared machine and the first run's warm-up hit all alike), and
compares the median measured ordering with the predicted one. Differences
within 3 % count as ties, in the prediction and in the measurement alike: the
orders agree when no pair is separated one way by the model and the other way
by the measurement. A strategy that chose the same plan as another (``search``
often returns one of the three) is measured once.

With ``--search-rate`` it only times the placement search on ``examples/ppo_70b.rlhf`` at -O2 (every
candidate placed, run through ``recompute`` and ``realloc`` and simulated, as the compile emits it):
candidate plans priced, wall and CPU seconds, candidates per second — cold (the first search of the
process: each trained model's block traced once, torch and transformers imported — unless the trace cache
``<cache>/traces`` already holds them or they ship with rlhfc (the size presets' blocks under the pinned torch
and transformers: ``rlhfc/passes/traces``), which the line says; ``RLHFC_CACHE_DIR=$(mktemp -d)`` starts with
an empty cache)
and warm (the same search again).

    .venv/bin/python benchmarks/placement.py [--measure] [--rounds 3] [--steps 12]
    .venv/bin/python benchmarks/placement.py --search-rate [--candidates 1000] [--rounds 5]

With ``--rounds R`` (R > 1) the search-rate check runs in R fresh processes one after another and prints the
medians and ranges of the cold and warm seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhfc.codegen import emit_job  # noqa: E402
from rlhfc.cost import memory_issues, simulate  # noqa: E402
from rlhfc.frontend import load_file  # noqa: E402
from rlhfc.ir import CompileError  # noqa: E402
from rlhfc.ir.plan import STRATEGIES  # noqa: E402
from rlhfc.passes import PassManager, parse_pipeline  # noqa: E402


def compiled(path: str, strategy: str):
    passes = f"dce,unpad,parallelize,stream,placement{{strategy={strategy}}},realloc"
    module, _, _ = load_file(path)
    t0 = time.perf_counter()
    try:
        module = PassManager(parse_pipeline(passes)).run(module)
    except CompileError as exc:
        return None, passes, time.perf_counter() - t0, exc.diagnostics[0].message
    return module, passes, time.perf_counter() - t0, None


def predict(path: str) -> dict:
    out = {}
    for strategy in (s for s in STRATEGIES if not s.startswith("baseline:")):   # baselines: benchmarks/baselines.py
        module, passes, secs, err = compiled(path, strategy)
        if module is None:
            out[strategy] = {"error": err, "compile_s": secs}
            continue
        sim = simulate(module, steps=3)
        out[strategy] = {"step_s": sim.step_time_s, "fits": not memory_issues(module), "compile_s": secs,
                         "module": module, "passes": passes}
    return out


def measure(strategies: dict, steps: int, rounds: int = 1) -> dict[str, list[float]]:
    """samples/s of each strategy per round (rounds interleave the strategies in time)."""
    from rlhfc.runtime.job import run_job

    work = tempfile.mkdtemp(prefix="rlhfc-placement-")
    res: dict[str, list[float]] = {}
    try:
        names = [k for k, r in strategies.items() if "module" in r]
        for rnd in range(rounds):
            for strategy in names[rnd % len(names):] + names[:rnd % len(names)]:   # each round starts elsewhere
                r = strategies[strategy]
                job = os.path.join(work, f"{strategy}{rnd}")
                emit_job(r["module"], job, source_path="examples/ppo_tiny.rlhf", opt_level="custom",
                         passes=r["passes"].split(","))
                rows = run_job(job, out=os.path.join(work, f"run_{strategy}{rnd}"), steps=steps,
                               progress=False)[2:]
                res.setdefault(strategy, []).append(sum(x["samples"] for x in rows) /
                                                    sum(x["step_time_s"] for x in rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res



def order_agrees(predicted_s: dict[str, float], measured_sps: dict[str, float], tie: float = 0.03) -> bool:
    """True when no pair of strategies is ordered one way by the prediction and the other way by the
    measurement, each side counting differences within ``tie`` as ties (faster prediction = more
    samples/s)."""
    names = list(measured_sps)
    for a in names:
        for b in names:
            if predicted_s[a] < predicted_s[b] * (1 - tie) and measured_sps[a] < measured_sps[b] * (1 - tie):
                return False
    return True


def plan_of(module) -> tuple:
    """Where each model stage runs: (stage, mesh, parallel) for every stage with a mesh."""
    return tuple((s.name, tuple(sorted(s.annotations["mesh"].items())),
                  tuple(sorted(s.annotations.get("parallel", {}).items())))
                 for s in module.graph.stages if "mesh" in s.annotations)


def search_rates(candidates: int, rounds: int) -> int:
    """:func:`search_rate` in ``rounds`` fresh processes, one after another; the medians and ranges of the
    cold and warm seconds (a shared VM's speed drifts by tens of percent within minutes)."""
    import json
    import subprocess

    seconds: dict[str, list[float]] = {"cold": [], "warm": []}
    for k in range(rounds):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--search-rate", "--candidates",
                              str(candidates), "--json"], capture_output=True, text=True, check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        for label in seconds:
            seconds[label].append(got[label])
        print(f"round {k + 1}: cold {got['cold']:.1f} s, warm {got['warm']:.1f} s, best {got['best']:.2f} s/step",
              flush=True)
    for label, xs in seconds.items():
        print(f"{label}: median {median(xs):.1f} s for {candidates} candidates ({candidates / median(xs):.0f}/s), "
              f"range {min(xs):.1f}-{max(xs):.1f} s over {rounds} processes")
    return 0


def search_rate(candidates: int, as_json: bool = False) -> int:
    """Candidate plans per second of the placement search on ppo_70b at -O2 (cold, then warm)."""
    import json

    from rlhfc.passes.pipelines import PIPELINES

    upstream = PIPELINES["O2"][:PIPELINES["O2"].index("placement")]
    downstream = PIPELINES["O2"][PIPELINES["O2"].index("placement") + 1:]
    module, _, _ = load_file(os.path.join(ROOT, "examples/ppo_70b.rlhf"))
    module = PassManager(parse_pipeline(",".join(upstream))).run(module)
    pipeline = ",".join([f"placement{{candidates={candidates}}}"] + downstream)
    print(f"placement search on examples/ppo_70b.rlhf at -O2 ({pipeline}); {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    walls = {}
    for label in ("cold", "warm"):
        torch_before = "torch" in sys.modules
        wall, cpu = time.perf_counter(), time.process_time()
        done = PassManager(parse_pipeline(pipeline)).run(module.clone())
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        r = done.search_report
        walls[label] = wall
        if label == "cold":
            label += " (torch imported and blocks traced)" if not torch_before and "torch" in sys.modules else \
                " (blocks from the trace cache or the traces shipped with rlhfc; torch not imported)" if "torch" not in sys.modules else ""
        print(f"{label}: {r.candidates} candidates ({r.proposals} proposals, {r.restarts} restarts) in "
              f"{wall:.1f} s wall, {cpu:.1f} s CPU: {r.candidates / wall:.0f} candidates/s "
              f"({r.candidates / cpu:.0f} per CPU second); best {r.best_s:.2f} s/step, strategies "
              + ", ".join(f"{k} {v:.2f}" for k, v in r.seeds.items()))
    if as_json:
        print(json.dumps({**walls, "best": r.best_s}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", action="store_true", help="also train ppo_tiny under each strategy here")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--search-rate", action="store_true", help="only time the placement search on ppo_70b")
    ap.add_argument("--candidates", type=int, default=1000, help="the search's budget for --search-rate")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.search_rate:
        if args.rounds > 1 and not args.json:
            return search_rates(args.candidates, args.rounds)
        return search_rate(args.candidates, args.json)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for ex in ("examples/ppo_70b.rlhf", "examples/ppo_7b.rlhf", "examples/ppo_tiny.rlhf"):
        res = predict(os.path.join(ROOT, ex))
        base = res["flatten"].get("step_s")
        print(f"\n{ex}")
        print(f"{'strategy':<11} {'step s':>10} {'vs flatten':>11} {'fits':>5} {'placement took':>15}")
        for s, r in res.items():
            if "error" in r:
                print(f"{s:<11} {'—':>10} {'—':>11} {'no':>5} {r['compile_s']:>14.1f}s  ({r['error'][:60]})")
                continue
            ratio = f"{base / r['step_s']:.2f}x" if base else "—"
            print(f"{s:<11} {r['step_s']:>10.3f} {ratio:>11} {'yes' if r['fits'] else 'no':>5} "
                  f"{r['compile_s']:>14.1f}s")
        if ex.endswith("ppo_tiny.rlhf") and args.measure:
            sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
            from cores import core_scaling

            scale = core_scaling()
            # a strategy whose plan equals an earlier one's is that plan: measure it once (identical
            # jobs measured twice differ only by the machine's noise)
            same: dict[str, str] = {}
            for name, r in res.items():
                if "module" in r:
                    twin = next((o for o in res if o != name and o not in same and "module" in res[o]
                                 and list(res).index(o) < list(res).index(name)
                                 and plan_of(res[o]["module"]) == plan_of(r["module"])), None)
                    if twin:
                        same[name] = twin
            runs = measure({k: v for k, v in res.items() if k not in same}, args.steps, args.rounds)
            for name, twin in same.items():
                runs[name] = runs[twin]
                print(f"{name} chose the same plan as {twin}: measured once")
            measured = {s: median(v) for s, v in runs.items()}
            pred_order = sorted(measured, key=lambda s: res[s]["step_s"])
            meas_order = sorted(measured, key=lambda s: -measured[s])
            print(f"two busy cores deliver {scale:.2f}x one core's throughput here")
            print(f"measured on this CPU (samples/s, median of {args.rounds} rounds [min-max]): " +
                  ", ".join(f"{s} {measured[s]:.1f} [{min(runs[s]):.1f}-{max(runs[s]):.1f}]" for s in meas_order))
            print(f"predicted order (fastest first): {pred_order}; measured order: {meas_order}")
            flat = measured.get("flatten")
            if flat:
                print("measured vs flatten: " + ", ".join(f"{s} {measured[s] / flat:.2f}x" for s in meas_order))
            agree = order_agrees({s: res[s]["step_s"] for s in measured}, measured)
            print("measured order agrees with the prediction (no pair reversed; differences within 3 % are "
                  f"ties on both sides): {'yes' if agree else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
