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
compares the median measured ordering with the predicted one. Strategies whose
predictions are within 3 % of each other count as tied: the measured order
agrees when every pair the model separates is measured in the same order.

    .venv/bin/python benchmarks/placement.py [--measure] [--rounds 3] [--steps 12]
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
from rlhfc.passes import PassManager, parse_pipeline  # noqa: E402

STRATEGIES = ("flatten", "interleave", "separate", "search")


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
    for strategy in STRATEGIES:
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
    """True when every pair of strategies whose predicted step times differ by more than ``tie``
    is measured in the same order (faster prediction = more samples/s)."""
    names = list(measured_sps)
    for a in names:
        for b in names:
            if predicted_s[a] < predicted_s[b] * (1 - tie) and not measured_sps[a] > measured_sps[b]:
                return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure", action="store_true", help="also train ppo_tiny under each strategy here")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
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
            runs = measure(res, args.steps, args.rounds)
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
            print(f"measured order agrees with the prediction (ties within 3 %): {'yes' if agree else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
