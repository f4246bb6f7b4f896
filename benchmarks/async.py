"""Asynchronous rollout benchmark (issue #37): staleness 1 and 2 against synchronous training, measured.

Each program runs with generation on its own core (``placement{strategy=separate}``: a generating copy of the
policy, weights synced after every train step) and the other models and training on the other, at staleness
0 (synchronous: the sync is awaited, generation waits for training), 1 and 2 (``async_rollout{staleness=K}``:
generation of the next steps runs while this one trains). Reports per program and staleness: samples/s and
response tokens/s over the measured steps (after warm-up; median over interleaved rounds, with the range), the
ratio to staleness 0, the mean reward over the measured steps (the same prompts in the same order at every
staleness) and the step's mean staleness. ``--proximal recompute,loglinear`` also runs each staleness > 0 with A-3PO's interpolation
(``async_rollout{proximal = loglinear}``: no proximal forward) beside decoupled PPO's recomputed one.

Programs: ``benchmarks/overlap.rlhf`` (four 2-layer width-64 GPT-2s, geometric response lengths up to 96
tokens: long-tailed, overhead-bound) and the same pipeline with width 256 and 4 layers (compute-bound).

    .venv/bin/python benchmarks/async.py [--rounds 2] [--steps 10] [--warmup 2] [--proximal recompute,loglinear]
                                         [--json out.json]

Target (docs/benchmarks.md): staleness 1 >= 1.5x staleness 0 where generation and training take comparable
time, with the reward within noise. The cost model does not price asynchronous rollout yet (the simulator's
step is synchronous), so no prediction is printed beside the measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from statistics import mean, median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OVERLAP = os.path.join(ROOT, "benchmarks", "overlap.rlhf")

from rlhfc.codegen import emit_job  # noqa: E402
from rlhfc.frontend import compile_source  # noqa: E402
from rlhfc.passes import PassManager, parse_pipeline  # noqa: E402
from rlhfc.runtime.job import Job  # noqa: E402

SEPARATE = ["dce", "parallelize", "placement{strategy=separate}", "realloc"]


def programs() -> dict[str, str]:
    tiny = open(OVERLAP).read()
    wide = re.sub(r"layers = 2, hidden = 64", "layers = 4, hidden = 256", tiny)
    return {"gpt2-2x64": tiny, "gpt2-4x256": wide}


def run_one(text: str, staleness: int, work: str, *, steps: int, warmup: int, proximal: str = "recompute") -> dict:
    module, _ = compile_source(text, OVERLAP)
    passes = SEPARATE + ([f"async_rollout{{staleness={staleness},proximal={proximal}}}"] if staleness else [])
    module = PassManager(parse_pipeline(",".join(passes))).run(module)
    job_dir = os.path.join(work, f"job_{staleness}_{time.time_ns()}")
    emit_job(module, job_dir, source_path=OVERLAP, opt_level="custom", passes=passes)
    spec = importlib.util.spec_from_file_location(f"bench_async_{time.time_ns()}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    marks: dict = {"calls": 0}

    def step(job, w):
        if marks["calls"] == warmup:
            marks["t0"] = time.perf_counter()
        marks["calls"] += 1
        return mod.step(job, w)

    job = Job(job_dir, out=os.path.join(job_dir, "run"), steps=warmup + steps, progress=False)
    try:
        rows = job.run(step)[warmup:]
        wall = time.perf_counter() - marks["t0"]
    finally:
        job.shutdown()
    samples = sum(r["samples"] for r in rows)
    tokens = sum(r["samples"] * r["response_len_mean"] for r in rows)
    return {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "reward": mean(r["reward_mean"] for r in rows),
            "staleness_mean": mean(r.get("staleness_mean", 0.0) for r in rows),
            "response_len_mean": mean(r["response_len_mean"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--proximal", default="recompute", help="for staleness > 0: recompute, loglinear, or both")
    ap.add_argument("--only", default="", help="run only the programs whose name contains this")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.staleness.split(",")]
    levels = [(k, p) for k in ks for p in (args.proximal.split(",") if k else ["recompute"])]
    work = tempfile.mkdtemp(prefix="rlhfc-async-")
    results: dict = {}
    try:
        for r in range(args.rounds):
            for name, text in programs().items():
                if args.only and args.only not in name:
                    continue
                for k, prox in levels:
                    got = run_one(text, k, work, steps=args.steps, warmup=args.warmup, proximal=prox)
                    key = str(k) if prox == "recompute" else f"{k} {prox}"
                    results.setdefault(name, {}).setdefault(key, []).append(got)
                    print(f"round {r} {name} staleness {key}: {got['samples_per_s']:.1f} samples/s, "
                          f"{got['tokens_per_s']:.0f} tokens/s, reward {got['reward']:+.3f}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup} warm-up, medians (range)")
    summary: dict = {}
    for name, by_k in results.items():
        first = next(iter(by_k))
        base = median(x["samples_per_s"] for x in by_k[first])
        for k, runs in by_k.items():
            sps = [x["samples_per_s"] for x in runs]
            tps = [x["tokens_per_s"] for x in runs]
            row = {"samples_per_s": median(sps), "tokens_per_s": median(tps), "ratio": median(sps) / base,
                   "reward": median(x["reward"] for x in runs), "staleness_mean": median(x["staleness_mean"] for x in runs),
                   "response_len_mean": median(x["response_len_mean"] for x in runs)}
            summary.setdefault(name, {})[k] = row
            print(f"{name:12s} staleness {k}: {row['samples_per_s']:6.1f} samples/s ({min(sps):.1f}-{max(sps):.1f}), "
                  f"{row['tokens_per_s']:7.0f} tokens/s, x{row['ratio']:.2f} vs staleness {first}, reward "
                  f"{row['reward']:+.3f}, response {row['response_len_mean']:.1f} tokens, staleness "
                  f"{row['staleness_mean']:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
