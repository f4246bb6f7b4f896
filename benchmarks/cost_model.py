"""Cost-model accuracy on this machine: predicted vs measured stage and step times of the tiny examples.

    python benchmarks/cost_model.py                 # profile this CPU, then measure 13 configurations
    python benchmarks/cost_model.py --profile P     # reuse a profile from `rlhfc profile`
    python benchmarks/cost_model.py --scale         # also print the cluster-scale predictions (docs/benchmarks.md)

What is measured: the examples are compiled at -O1 (no overlap, so the job runs
one stage after another) with other batch sizes and response lengths, and each
step runs *in-process* exactly as the job's driver would, stage by stage in IR
order, through the runtime's own :class:`~rlhfc.runtime.worker.ModelWorker`
(generate / logprobs / values / score / train) and ``rlhfc.runtime.ops``
(driver-side stages), with torch threads = the cluster's CPUs per node. Ray
is not involved (its per-call overhead is not part of either number). The
measured step time is the median of ``--steps`` steps after one warm-up step.

What is predicted: :func:`rlhfc.cost.simulate` on the same IR with the profile
(``rlhfc profile`` run first, in this process, unless ``--profile`` is given)
and no dispatch overhead. The error is predicted / measured - 1.
The run passes when every configuration's step-time error is under 20 %.

On a shared machine other tenants' load changes how fast this CPU runs from
one second to the next; profiling right before measuring (the default) keeps
the two under the same conditions, and ``uptime``'s load average is printed
before and after so a noisy run can be recognised.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as `rlhfc profile` measures (see rlhfc/cost/profile.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhfc.cost import CostConfig, load_profile, run_profile, simulate  # noqa: E402
from rlhfc.cost.profile import measure_compute  # noqa: E402
from rlhfc.frontend import compile_source  # noqa: E402
from rlhfc.passes import PassManager, parse_pipeline  # noqa: E402

EXAMPLES = {
    "ppo_tiny": [(8, 12), (8, 40), (16, 12), (16, 24), (16, 40), (32, 12), (32, 24), (32, 40), (48, 24)],
    "grpo_tiny": [(4, 16), (8, 16), (8, 32), (16, 24)],
}


def program(name: str, batch: int, max_new: int):
    """The example with another batch size and max_new_tokens, compiled at -O1."""
    path = os.path.join(ROOT, "examples", f"{name}.rlhf")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    text = re.sub(r"\(batch = \d+\)", f"(batch = {batch})", text, count=1)
    text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {max_new}", text)
    module, _ = compile_source(text, path)
    return PassManager(parse_pipeline("dce")).run(module)


class InProcessJob:
    """The job's models as in-process workers; runs one step stage by stage and times each stage."""

    def __init__(self, module):
        from rlhfc.codegen.plan import build_plan
        from rlhfc.runtime.data import prompt_source_from_spec
        from rlhfc.runtime.worker import ModelWorker

        plan = build_plan(module, source=None, opt_level="O1", passes=["dce"])
        threads = module.cluster.per_node
        self.workers = {name: ModelWorker(name, m["spec"], m["init"], 0, threads, "cpu")
                        for name, m in plan["models"].items() if module.graph.stages_on(name)}
        self.data = {name: prompt_source_from_spec(spec) for name, spec in plan["data"].items()}

    def step(self, module) -> dict[str, float]:
        from rlhfc.runtime import ops

        values: dict = {}
        times: dict[str, float] = {}
        for s in module.graph.stages:
            args = [values[v.name] for v in s.inputs]
            t0 = time.perf_counter()
            family, _, kind = s.op.partition(".")
            if s.op == "load":
                out = self.data[s.target].next_batch(s.attrs["batch"])
            elif family == "generate":
                out = self.workers[s.target].generate(*args, **s.attrs)
            elif family == "forward":
                out = getattr(self.workers[s.target], kind)(*args, **s.attrs)
            elif family == "train":
                out = self.workers[s.target].train(*args, **s.attrs)
            else:
                attrs = dict(s.attrs)
                if kind == "ppo_clip":
                    producer = module.graph.producer(s.inputs[1])
                    attrs["temperature"] = float(producer.attrs.get("temperature", 1.0))
                out = getattr(ops, kind)(*args, **attrs)
            times[s.name] = time.perf_counter() - t0
            outs = out if len(s.outputs) > 1 else (out,)
            for v, x in zip(s.outputs, outs):
                values[v.name] = x
        return times


def measure(job: InProcessJob, module, steps: int) -> tuple[float, dict[str, float]]:
    job.step(module)  # warm-up
    runs = [job.step(module) for _ in range(steps)]
    totals = [sum(r.values()) for r in runs]
    k = totals.index(sorted(totals)[len(totals) // 2])
    return statistics.median(totals), runs[k]


def get_profile(args, modules: dict):
    if args.profile:
        return load_profile(args.profile)
    t0 = time.time()
    prof = run_profile(modules["ppo_tiny"], quick=args.quick, log=lambda m: print("  " + m, flush=True))
    for name, mod in modules.items():
        ops = sorted({s.op for s in mod.graph.stages if s.op.startswith("compute.")} - set(prof.compute))
        if ops:
            prof.compute.update(measure_compute(ops, mod.cluster.per_node))
    path = args.save_profile or os.path.join(tempfile.mkdtemp(prefix="rlhfc-bench-"), "profile.json")
    prof.save(path)
    print(f"  profiled in {time.time() - t0:.0f} s -> {path}", flush=True)
    return prof


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def accuracy(args) -> list[float]:
    import torch

    base = {name: program(name, *EXAMPLES[name][0]) for name in EXAMPLES}
    print(f"machine: {_cpu()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; load average before: {_loadavg()}")
    print("profiling (rlhfc profile) ...", flush=True)
    prof = get_profile(args, base)
    errors = []
    print()
    print(f"{'config':<24} {'predicted':>9} {'measured':>9} {'error':>7}   per stage, predicted/measured ms")
    for name, configs in EXAMPLES.items():
        job = InProcessJob(base[name])
        for batch, max_new in configs[: args.limit or None]:
            module = program(name, batch, max_new)
            result = simulate(module, CostConfig(profile=prof, dispatch_s=0.0), steps=2)
            measured, stage_times = measure(job, module, args.steps)
            err = result.step_time_s / measured - 1
            errors.append(err)
            per_stage = "  ".join(f"{s}:{fmt_ms(result.costs[s].time_s)}/{fmt_ms(t)}"
                                  for s, t in stage_times.items() if t > 5e-4 or result.costs[s].time_s > 5e-4)
            label = f"{name} B={batch} T={max_new}"
            print(f"{label:<24} {fmt_ms(result.step_time_s):>7}ms {fmt_ms(measured):>7}ms {err * 100:>+6.1f}%   "
                  f"{per_stage}", flush=True)
    abs_err = sorted(abs(e) for e in errors)
    print()
    print(f"step-time error over {len(errors)} configurations: median {statistics.median(abs_err) * 100:.1f}%, "
          f"max {abs_err[-1] * 100:.1f}%  ->  {'PASS' if abs_err[-1] < 0.20 else 'FAIL'} (every error < 20%)")
    print(f"load average (1/5/15 min) after the run: {_loadavg()}")
    return errors


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _cpu() -> str:
    from rlhfc.cost.profile import cpu_name

    return cpu_name()


def scale() -> None:
    """Cluster-scale predictions beside published figures (catalog rates only; see docs/benchmarks.md)."""
    print("(scale predictions: not yet)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="use this profile instead of profiling first")
    ap.add_argument("--save-profile", help="where to save the profile taken first")
    ap.add_argument("--quick", action="store_true", help="a quicker, coarser profile")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after a warm-up)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N configurations of each example")
    ap.add_argument("--scale", action="store_true", help="also print the cluster-scale predictions")
    ap.add_argument("--scale-only", action="store_true", help="only the cluster-scale predictions")
    args = ap.parse_args(argv)
    t0 = time.time()
    ok = True
    if not args.scale_only:
        errors = accuracy(args)
        ok = max(abs(e) for e in errors) < 0.20
    if args.scale or args.scale_only:
        print()
        scale()
    print(f"\n(total {time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
