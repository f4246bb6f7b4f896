"""RLHFuse benchmark (issue #39), the part built so far: the fused actor/critic training schedule at RLHFuse's
model sizes, predicted.

For each LLaMA actor/critic pair of RLHFuse's evaluation sizes (13B, 33B, 65B), both trained with an 8-stage
pipeline on the same 8 A100-80GB GPUs (tensor parallelism inside a node is left out: it scales both models'
stage times alike), 16 micro-batches of 4 sequences × 1024 tokens each: per-stage forward time from the
FLOPs (2 · params / stages · tokens) at 312 TFLOP/s and 50 % efficiency, backward twice that, one activation
hop between stages over NVLink (300 GB/s, 10 µs). Prints the two pipelines one after the other (1F1B each),
the fused schedule the search found (:func:`rlhfc.cost.fused_schedule.search`), its lower bound and gap, the
gain, and the seconds the search took. No constant here is tuned to the paper's figures; its stage sizes,
micro-batch counts and the paper's own training-stage gains are not restated here (RLHFuse reports up to 3.7×
end to end, generation fusion included).

    .venv/bin/python benchmarks/rlhfuse.py [--iterations 4000] [--json out.json]

Not yet measured (the runtime does not execute a fused schedule, nor migrate a generation's tail): the CPU
job with and without the passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhfc.cost.fused_schedule import Pipeline, render, search  # noqa: E402

#: LLaMA sizes: parameters and hidden width
LLAMA = {"13B": (13.0e9, 5120), "33B": (32.5e9, 6656), "65B": (65.2e9, 8192)}
PAIRS = [("13B", "13B"), ("33B", "13B"), ("33B", "33B"), ("65B", "33B"), ("65B", "65B")]
STAGES, MICRO, SEQS, TOKENS = 8, 16, 4, 1024
FLOPS, EFFICIENCY, LINK, LATENCY = 312e12, 0.5, 300e9, 10e-6


def pipeline(name: str, size: str) -> tuple[Pipeline, float]:
    params, hidden = LLAMA[size]
    tokens = SEQS * TOKENS
    forward = 2.0 * params / STAGES * tokens / (FLOPS * EFFICIENCY)
    hop = LATENCY + tokens * hidden * 2 / LINK
    return Pipeline(name, MICRO, forward, 2.0 * forward), hop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draw", action="store_true", help="print each fused schedule")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {STAGES} stages, "
          f"{MICRO} micro-batches of {SEQS}x{TOKENS} tokens per model")
    print(f"{'actor':>6} {'critic':>6} {'unfused s':>10} {'fused s':>8} {'bound s':>8} {'gap':>6} {'gain':>6} "
          f"{'search s':>9}")
    out = []
    for a, c in PAIRS:
        actor, hop_a = pipeline("actor", a)
        critic, hop_c = pipeline("critic", c)
        fused = search(STAGES, actor, critic, hop=max(hop_a, hop_c), iterations=args.iterations, seed=args.seed,
                       time_limit_s=60.0)
        row = {"actor": a, "critic": c, "unfused_s": fused.unfused, "fused_s": fused.makespan,
               "lower_bound_s": fused.lower_bound, "critical_path_s": fused.critical_path,
               "busiest_device_s": fused.busiest_device, "gap": fused.gap, "gain": fused.gain,
               "search_s": fused.seconds, "iterations": fused.iterations}
        out.append(row)
        print(f"{a:>6} {c:>6} {fused.unfused:>10.2f} {fused.makespan:>8.2f} {fused.lower_bound:>8.2f} "
              f"{fused.gap:>6.1%} {fused.gain:>5.2f}x {fused.seconds:>9.1f}")
        if args.draw:
            print("\n".join(render(fused)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
