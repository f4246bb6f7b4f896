"""Multi-turn, tool-using rollouts benchmark (issue #38): the worked examples at -O0, -O2 and -O3, measured.

Programs: ``examples/agent_tiny.rlhf`` (GRPO, 144 trajectories a step, an environment answering a look-up) and
``tests/e2e/agent_tool.rlhf`` (PPO with a critic, 16 trajectories of up to 4 one-token turns, a sandboxed tool
between them). Reports per program and level, over the measured steps (after warm-up; medians over interleaved
rounds, with the range): samples/s, trajectory tokens/s (the policy's and the appended ones), the policy's
tokens/s, turns per trajectory, tool calls a step, and the share of the step spent waiting for tools. Tools run
between turns while no row of the batch decodes, so none of their latency is hidden behind decoding (0 %): the
share is what overlapping them with other rows' decoding (continuous batching across turns) could win at most.

    .venv/bin/python benchmarks/agents.py [--rounds 3] [--steps 10] [--warmup 2] [--json out.json]

No peer runs beside it yet: TRL's GRPOTrainer calls tools through a chat template with a response parser
(Qwen 3's, Llama 3's ...), which the worked examples' character tokenizer has not; an equal-work comparison needs
the task on a seeded Hugging Face folder on both sides (docs/benchmarks.md says so).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from jobrun import run_compiled  # noqa: E402

from rlhfc.frontend import load_file  # noqa: E402
from rlhfc.passes import PIPELINES, PassManager, parse_pipeline  # noqa: E402

PROGRAMS = {"agent_tiny (env, GRPO)": os.path.join(ROOT, "examples", "agent_tiny.rlhf"),
            "agent_tool (tool, PPO)": os.path.join(ROOT, "tests", "e2e", "agent_tool.rlhf")}


def run_one(path: str, level: str, work: str, *, steps: int, warmup: int) -> dict:
    module, _, _ = load_file(path)
    module = PassManager(parse_pipeline(",".join(PIPELINES[level]))).run(module)
    got = run_compiled(module, level, path, work, warmup=warmup, steps=warmup + steps)
    rows, wall = got["rows"], got["wall"]
    samples = sum(r["samples"] for r in rows)
    tokens = sum(r["samples"] * r["response_len_mean"] for r in rows)
    tool_tokens = sum(r.get("tool_tokens", 0.0) for r in rows)
    return {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
            "policy_tokens_per_s": (tokens - tool_tokens) / wall,
            "turns_mean": median(r.get("turns_mean", 1.0) for r in rows),
            "tool_calls": median(r.get("tool_calls", 0.0) for r in rows),
            "tool_share": sum(r.get("tool_s", 0.0) for r in rows) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--levels", default="O0,O2,O3")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    levels = args.levels.split(",")
    results: dict = {}
    work = tempfile.mkdtemp(prefix="rlhfc-agents-")
    try:
        for r in range(args.rounds):
            for i, (name, path) in enumerate(PROGRAMS.items()):
                for level in levels:
                    got = run_one(path, level, os.path.join(work, f"{r}_{i}_{level}"),
                                  steps=args.steps, warmup=args.warmup)
                    results.setdefault(name, {}).setdefault(level, []).append(got)
                    print(f"round {r} {name} -{level}: {got['samples_per_s']:.1f} samples/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.rounds} rounds of "
          f"{args.steps} steps after {args.warmup} warm-up, medians (range)")
    summary: dict = {}
    for name, by_level in results.items():
        for level, runs in by_level.items():
            sps = [x["samples_per_s"] for x in runs]
            row = {k: median(x[k] for x in runs) for k in runs[0]}
            summary.setdefault(name, {})[level] = row
            print(f"{name:24s} -{level}: {row['samples_per_s']:6.1f} samples/s ({min(sps):.1f}-{max(sps):.1f}), "
                  f"{row['tokens_per_s']:6.0f} tokens/s ({row['policy_tokens_per_s']:.0f} the policy's), "
                  f"{row['turns_mean']:.2f} turns, {row['tool_calls']:.0f} tool calls a step, "
                  f"{100 * row['tool_share']:.1f} % of the step waiting for tools (0 % hidden)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
