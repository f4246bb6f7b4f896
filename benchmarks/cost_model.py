"""Cost-model accuracy on this machine: predicted vs measured stage and step times of the tiny examples.

    python benchmarks/cost_model.py                 # profile this CPU and measure 13 configurations (~1-2 min)
    python benchmarks/cost_model.py --profile P     # reuse a profile from `rlhfc profile`
    python benchmarks/cost_model.py --scale         # also print the cluster-scale predictions (docs/benchmarks.md)
    python benchmarks/cost_model.py --in-job        # prediction inside real jobs, outside the profiled points

``--in-job`` (:func:`in_job`) is the check of *prediction*: after one ``rlhfc profile`` of ``ppo_tiny``,
it runs configurations that lie outside every profiled point (other batch sizes, response lengths and a
model width the profile never measured) as real jobs (``rlhfc run --trace``: Ray workers, the job's own
threads, -O2 overlap and streaming), and compares each stage's measured spans and each step with the
prediction for the job's own plan (what ``rlhfc compare`` prints); the summary also gives the error against
each stage's fastest measured step, the convention of the profile's points. The in-process accuracy run above
stays: there every configuration lies inside the profile's grid, so it checks interpolation.

What is measured: the two tiny examples are compiled at -O1 (no overlap: the
job runs one stage after another) with other batch sizes and response lengths
(``EXAMPLES``) and learning rate 0 (a train step costs the same, but the
policy, and so the length of its responses, does not drift over the ~100
steps the benchmark runs). A step runs *in-process* as the job's driver runs it, stage by
stage in IR order, through the runtime's own
:class:`~rlhfc.runtime.worker.base.ModelWorker` (generate / logprobs / values /
score / train) and ``rlhfc.runtime.ops`` (driver-side stages), with as many
torch threads as the job's workers would run (one per whole core of a worker's
share: 1 when four models share two cores). Ray is not involved, so its
per-call overhead is in neither number.

What is predicted: :func:`rlhfc.cost.simulate` on the same IR with the profile
(``rlhfc.calibrate.run_profile``, what ``rlhfc profile`` runs) and no dispatch
overhead. The error is predicted / measured - 1; the run passes when every
configuration's step-time error is under 20 %.

Shared machines: another tenant's load can make this CPU 1.5x slower for tens
of seconds. So the benchmark runs ``--rounds`` rounds, each one profiling pass
(``--steps`` timings per point) followed by ``--steps`` steps of every configuration, and keeps
at every profile point and for every configuration the fastest time over the
rounds: profile and measurements sample the same spell of machine states, and
the least-disturbed runs are compared. The measured step time is the sum of
its stages' fastest times (the job runs them one after another; glue between
stages is negligible), so a stage is treated exactly like a profile point.
With ``--profile`` only the measurements are repeated.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as `rlhfc profile` measures (see rlhfc/calibrate.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rlhfc.calibrate import measure_compute, run_profile  # noqa: E402
from rlhfc.cost import CostConfig, load_profile, simulate  # noqa: E402
from rlhfc.cost.profile import cpu_name, merge_profiles  # noqa: E402
from rlhfc.frontend import compile_source  # noqa: E402
from rlhfc.passes import PassManager, parse_pipeline  # noqa: E402

#: (batch, max_new_tokens) per example; GRPO samples n = 4 responses per prompt
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
    text = re.sub(r"lr = [0-9.eE+-]+", "lr = 0.0", text)   # same work per step, but the policy (and so its
    module, _ = compile_source(text, path)                  # response lengths) stays the same over the rounds
    return PassManager(parse_pipeline("dce")).run(module)


class InProcessJob:
    """The job's models as in-process workers; runs one step stage by stage and times each stage."""

    def __init__(self, module):
        from rlhfc.codegen.plan import build_plan
        from rlhfc.runtime.data.prompts import prompt_source_from_spec
        from rlhfc.runtime.worker.base import ModelWorker

        plan = build_plan(module, source=None, opt_level="O1", passes=["dce"])
        # as many torch threads as the job's workers get (one per whole core of their share of the
        # cores: 1 when four models share two); in one process the setting is global
        threads = min(w.threads for w in plan.placement.workers.values())
        self.workers = {name: ModelWorker(name, m.spec.as_dict(), m.init.as_dict(), 0, threads, "cpu")
                        for name, m in plan.models.items() if module.graph.stages_on(name)}
        self.data = {name: prompt_source_from_spec(d.as_spec()) for name, d in plan.data.items()}

    def step(self, module) -> dict[str, float]:
        """Run one step of ``module``; seconds per stage."""
        from rlhfc.runtime import compute as ops

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
                if kind == "ppo_clip":   # the driver passes the sampling temperature, as the emitter does
                    producer = module.graph.producer(s.inputs[1])
                    attrs["temperature"] = float(producer.attrs.get("temperature", 1.0))
                out = getattr(ops, kind)(*args, **attrs)
            times[s.name] = time.perf_counter() - t0
            for v, x in zip(s.outputs, out if len(s.outputs) > 1 else (out,)):
                values[v.name] = x
        return times


def profile_pass(modules: dict, reps: int, quick: bool):
    """One `rlhfc profile` pass over the examples' model shapes and driver-side ops."""
    prof = run_profile(modules["ppo_tiny"], quick=quick, reps=reps, pause=0.0)   # steps run back to back here
    for mod in modules.values():
        ops = sorted({s.op for s in mod.graph.stages if s.op.startswith("compute.")} - set(prof.compute))
        if ops:
            prof.compute.update(measure_compute(ops, mod.cluster.per_node, reps=reps))
    return prof


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def accuracy(args) -> list[float]:
    import torch

    base = {name: program(name, *EXAMPLES[name][0]) for name in EXAMPLES}
    configs = [(name, b, t) for name, cs in EXAMPLES.items() for b, t in cs[: args.limit or None]]
    modules = {c: program(*c) for c in configs}
    print(f"machine: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; load average before: {_loadavg()}")
    jobs = {name: InProcessJob(base[name]) for name in EXAMPLES}
    for c, module in modules.items():
        jobs[c[0]].step(module)   # warm-up
    prof = load_profile(args.profile) if args.profile else None
    best: dict = {}
    t0 = time.time()
    for r in range(args.rounds):
        if not args.profile:
            p = profile_pass(base, args.steps, args.quick)   # as many tries per point as per stage
            prof = p if prof is None else merge_profiles(prof, p)
        for c, module in modules.items():
            for _ in range(args.steps):
                times = jobs[c[0]].step(module)
                best[c] = {k: min(v, best.get(c, times)[k]) for k, v in times.items()}
        print(f"  round {r + 1}/{args.rounds}: {'profiled, ' if not args.profile else ''}measured "
              f"{len(modules)} configurations x {args.steps} steps ({time.time() - t0:.0f} s)", flush=True)
    if not args.profile:
        path = args.save_profile or os.path.join(tempfile.mkdtemp(prefix="rlhfc-bench-"), "profile.json")
        prof.save(path)
        print(f"  profile: {path}")
    errors = []
    print()
    print(f"{'config':<24} {'predicted':>9} {'measured':>9} {'error':>7}   per stage, predicted/measured ms")
    for c, module in modules.items():
        name, batch, max_new = c
        stage_times = best[c]
        measured = sum(stage_times.values())
        result = simulate(module, CostConfig(profile=prof, dispatch_s=0.0), steps=2)
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


# ------------------------------------------------------------------------------ cluster scale (catalog rates)

PPO_70B = open(os.path.join(ROOT, "examples", "ppo_70b.rlhf"), encoding="utf-8").read()

#: OpenRLHF's 70B run (technical report, Tables 2, 3, 5): LLaMA-2 70B actor, critic, reference and reward on
#: 32 A800-80GB (4 nodes x 8), 1024 prompts per PPO step, one epoch; prompt and generation at most 1024 tokens
#: (the launch scripts' prompt_max_len / generate_max_len); train batch 128 (8 optimizer steps).
OPENRLHF_70B = """
cluster a800 { gpu = "A100-80GB"; nodes = 4; gpus_per_node = 8 }
model actor  = llama(size = 70B) trainable
model ref    = copy(actor) frozen
model critic = llama(size = 70B) head = value trainable
model reward = llama(size = 70B) head = score frozen
data prompts = synthetic(count = 100000, min_len = 64, max_len = 1023)
pipeline ppo(batch = 1024) {
  roll     = actor.generate(prompts, max_new_tokens = 1024)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp)
  actor.train(ppo_clip(roll, logp, adv), lr = 5e-7, minibatches = 8)
  critic.train(value_loss(roll, values, ret), lr = 9e-6, minibatches = 8)
}
run { steps = 100 }
"""

#: Baidu's article: a 10B model (here a LLaMA-shaped 10.2B: 40 layers, width 4608), all four models of
#: that size, 16 x A100-80GB. Batch and lengths are not given: 512 prompts, and three length settings.
BAIDU_10B = """
cluster a100 { gpu = "A100-80GB"; nodes = 2; gpus_per_node = 8 }
model actor  = llama(layers = 40, hidden = 4608, heads = 32, vocab = 32000, max_seq = 2048) trainable
model ref    = copy(actor) frozen
model critic = like(actor) head = value trainable
model reward = like(actor) head = score frozen
data prompts = synthetic(count = 100000, min_len = 256, max_len = 767)
pipeline ppo(batch = 512) {
  roll     = actor.generate(prompts, max_new_tokens = 512)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-6, minibatches = 4)
  critic.train(value_loss(roll, values, ret), lr = 5e-6, minibatches = 4)
}
run { steps = 100 }
"""


def _annotated(text: str, plan: dict, name: str = "<plan>"):
    """Compile ``text`` at -O1 and write ``plan`` ({stage: annotations}) onto its stages, as a placement pass
    would; the verifier checks the annotations."""
    from rlhfc.ir import verify

    module, _ = compile_source(text, name)
    module = PassManager(parse_pipeline("dce")).run(module)
    for stage, ann in plan.items():
        module.graph.stage(stage).annotations.update(ann)
    verify(module)
    return module


def _mesh(first, count, dp, tp, pp=1, **extra):
    return {"mesh": {"first": first, "count": count}, "parallel": {"dp": dp, "tp": tp, "pp": pp}, **extra}


#: ppo_70b (16 x 8 H100): the same 3D layout for every call (a Megatron-style heuristic plan) ...
PLAN_70B_HEURISTIC = {
    "roll": _mesh(0, 128, 4, 8, 4), "logp": _mesh(0, 128, 4, 8, 4), "ref_logp": _mesh(0, 128, 4, 8, 4),
    "values": _mesh(0, 128, 4, 8, 4), "scores": _mesh(0, 128, 4, 8, 4),
    "actor_train": _mesh(0, 128, 4, 8, 4, microbatches=8, recompute="selective"),
    "critic_train": _mesh(0, 128, 4, 8, 4, microbatches=8, recompute="selective"),
}
#: ... and a ReaL-style plan: every call gets its own layout (weights reallocated between them), the 7B
#: critic and reward run beside the 70B reference on separate devices.
PLAN_70B_REAL = {
    "roll": _mesh(0, 128, 16, 8, 1),
    "logp": _mesh(0, 128, 16, 8, 1, overlap=1),
    "ref_logp": _mesh(0, 64, 8, 8, 1, overlap=2), "values": _mesh(64, 32, 16, 2, 1, overlap=2),
    "scores": _mesh(96, 32, 16, 2, 1, overlap=2),
    "actor_train": _mesh(0, 96, 3, 8, 4, microbatches=16, recompute="selective", overlap=3),
    "critic_train": _mesh(96, 32, 16, 2, 1, microbatches=4, overlap=3),
}
#: OpenRLHF's placement (its Table 3): vLLM engines DP=4 x TP=4 on 16 GPUs fed micro-batches of 4 prompts;
#: actor, critic, reference and reward on 4 GPUs each (ZeRO-3 there; tensor parallel 4 here); the four
#: forwards run concurrently, and so do the two trainings.
PLAN_OPENRLHF = {
    "roll": _mesh(0, 16, 4, 4, 1, microbatches=64),   # 256 prompts per engine, 4 at a time (MBS = 4)
    "logp": _mesh(16, 4, 1, 4, overlap=1), "ref_logp": _mesh(20, 4, 1, 4, overlap=1),
    "values": _mesh(24, 4, 1, 4, overlap=1), "scores": _mesh(28, 4, 1, 4, overlap=1),
    "actor_train": _mesh(16, 4, 1, 4, microbatches=16, recompute="full", overlap=2),
    "critic_train": _mesh(24, 4, 1, 4, microbatches=16, recompute="full", overlap=2),
}
#: Baidu-like: every model on all 16 GPUs, tp 8 inside a node, the forwards one after another.
PLAN_BAIDU = {name: _mesh(0, 16, 2, 8, 1) for name in ("roll", "logp", "ref_logp", "values", "scores")}
PLAN_BAIDU.update(actor_train=_mesh(0, 16, 2, 8, 1, microbatches=8, recompute="selective"),
                  critic_train=_mesh(0, 16, 2, 8, 1, microbatches=8, recompute="selective"))


def _summary(label: str, module, config: CostConfig) -> dict:
    from rlhfc.cost import memory_issues

    r = simulate(module, config, steps=3)
    peak = max(d.peak_memory_bytes for d in r.devices) / 2 ** 30
    cap = r.devices[0].capacity_bytes / 2 ** 30
    stages = {s: r.costs[s].time_s for s in r.costs if r.costs[s].layout is not None}
    issues = memory_issues(module, config)
    print(f"{label}: predicted step {r.step_time_s:.0f} s; peak memory {peak:.1f} of {cap:.1f} GiB per device"
          f"{'' if not issues else ' (DOES NOT FIT: ' + issues[0].message + ')'}")
    print("    " + "  ".join(f"{s} {t:.1f}s" for s, t in stages.items())
          + (f"  reallocation {sum(r.sync_s.values()):.1f}s" if r.sync_s else ""))
    return {"step": r.step_time_s, "stages": stages, "sync": sum(r.sync_s.values()), "peak": peak,
            "fits": not issues}


def scale() -> dict:
    """Cluster-scale predictions beside published figures (catalog rates, no tuning; docs/benchmarks.md)."""
    out = {}
    print("== examples/ppo_70b.rlhf on 16 x 8 H100-80GB (1024 prompts of 129-1025 tokens, 1024 new tokens)")
    cfg = CostConfig(dispatch_s=0.01)
    out["default"] = _summary("  default plan (every stage dp128)", _annotated(PPO_70B, {}), cfg)
    out["heuristic"] = _summary("  Megatron-style heuristic (tp8 pp4 dp4 for every call)",
                                _annotated(PPO_70B, PLAN_70B_HEURISTIC), cfg)
    out["real"] = _summary("  ReaL-style per-call layouts", _annotated(PPO_70B, PLAN_70B_REAL), cfg)
    print(f"  ReaL-style vs heuristic: {out['heuristic']['step'] / out['real']['step']:.2f}x "
          "(ReaL reports +26% on average over Megatron-based heuristic plans, +81% for long context, and up "
          "to 3.58x over DeepSpeed-Chat / OpenRLHF)")
    print()
    print("== OpenRLHF 70B: 4 x 70B models, 32 A800-80GB, 1024 prompts, <= 1024 + 1024 tokens (their Table 5)")
    lt = CostConfig(dispatch_s=0.01, response_lengths="lognormal:0.25:1.0")
    o = _summary("  OpenRLHF placement", _annotated(OPENRLHF_70B, PLAN_OPENRLHF), lt)
    forwards = max(o["stages"][s] for s in ("logp", "ref_logp", "values", "scores"))
    train = max(o["stages"]["actor_train"], o["stages"]["critic_train"])
    print("    published: generation 2252.8 s, weight sync 111.7 s, logits+reward 323.4 s, training 1800.7 s, "
          "total 4488.5 s")
    print(f"    predicted: generation {o['stages']['roll']:.1f} s, weight sync {o['sync']:.1f} s, "
          f"logits+reward {forwards:.1f} s, training {train:.1f} s, total {o['step']:.1f} s")
    out["openrlhf"] = o
    print()
    print("== Baidu: 4 x 10B models, 16 x A100-80GB (0.012 -> 0.054 samples/GPU/s published)")
    out["baidu"] = {}
    for length in (512, 1024, 2048):
        text = BAIDU_10B.replace("min_len = 256, max_len = 767",
                                 f"min_len = {length // 2}, max_len = {length * 3 // 2 - 1}")
        text = text.replace("max_new_tokens = 512", f"max_new_tokens = {length}").replace(
            "max_seq = 2048", f"max_seq = {4 * length}")
        b = _summary(f"  all on 16 GPUs, tp8, prompts ~{length} + up to {length} new tokens",
                     _annotated(text, PLAN_BAIDU), lt)
        print(f"    predicted {512 / b['step'] / 16:.3f} samples/GPU/s (512 prompts per step)")
        out["baidu"][length] = b
    return out


#: (label, example, batch, max_new_tokens, -O level, hidden width or None): none on a profiled point
IN_JOB = [
    ("ppo B=12 T=20 -O2", "ppo_tiny", 12, 20, "O2", None),
    ("ppo B=24 T=30 -O2", "ppo_tiny", 24, 30, "O2", None),
    ("ppo B=12 T=20 -O0", "ppo_tiny", 12, 20, "O0", None),
    ("ppo h=96 B=12 T=20 -O2", "ppo_tiny", 12, 20, "O2", 96),
    ("grpo B=6x4 T=20 -O2", "grpo_tiny", 6, 20, "O2", None),
]


def _profile_grid(prof) -> str:
    parts = []
    for key, entry in prof.models.items():
        pts = entry["points"]
        f = sorted({(int(p[0]), int(p[1])) for p in pts.get("forward", [])})
        g = sorted({(int(p[0]), int(p[1])) for p in pts.get("generate", [])})
        parts.append(f"{key}: forward B x S {sorted({b for b, _ in f})} x {sorted({x for _, x in f})}"
                     + (f", generate B x P {sorted({b for b, _ in g})} x {sorted({x for _, x in g})} (T measured)"
                        if g else "")
                     + (f", train B {sorted({int(p[0]) for p in pts.get('train', [])})}" if pts.get("train") else ""))
    return "; ".join(parts)


def in_job(args) -> dict:
    """Per stage and per step, predicted vs measured inside real jobs (see the module docstring)."""
    import json
    import subprocess

    import torch

    from rlhfc.cost.model import CostModel
    from rlhfc.explain.compare import WORKER_FAMILIES, compare, measured_from_trace
    from rlhfc.ir import parse_ir

    work = args.reprice or tempfile.mkdtemp(prefix="rlhfc-injob-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli = [sys.executable, "-m", "rlhfc.cli"]
    print(f"machine: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}; "
          f"load average before: {_loadavg()}; runs and profile in {work}")
    if args.profile:
        path = args.profile
    elif args.reprice:   # the runs of an earlier --in-job, priced again by this version of the cost model
        path = os.path.join(work, "profile.json")
        print(f"re-pricing the runs in {work} (measured then; predicted now)")
    else:
        path = os.path.join(work, "profile.json")
        t0 = time.time()
        subprocess.run(cli + ["profile", os.path.join(ROOT, "examples", "ppo_tiny.rlhf"), "-o", path], env=env,
                       check=True, capture_output=True)
        print(f"rlhfc profile examples/ppo_tiny.rlhf: {time.time() - t0:.0f} s")
    prof = load_profile(path)
    print(f"profiled points: {_profile_grid(prof)}")
    for key in prof.models:   # what the profile measured beside the grid (rlhfc/cost/threads.py, train_call)
        sp = {p: prof.thread_speedup(key, p) for p in ("generate", "forward", "train")}
        call = prof.models[key]["fit"].get("train_call")
        print(f"  {key}: T(1 thread) / T({prof.model_threads(key)}), median over the grid: "
              + ", ".join(f"{p} {t[-1]:.2f}" for p, t in sp.items() if t)
              + (f"; train: {call * 1e3:.1f} ms of the {prof.models[key]['fit']['train'][0] * 1e3:.1f} ms intercept "
                 "paid once per call" if call is not None else "")
              + (f"; generate: kept log-probs +{prof.models[key]['fit']['generate_logprobs'] * 100:.1f} %, "
                 f"{prof.models[key]['fit']['generate_chunk'] * 1e3:.2f} ms per streamed chunk"
                 if "generate_chunk" in prof.models[key]["fit"] else ""))
    rows, per_stage, fastest = [], {"O2": [], "O0": []}, {"O2": [], "O0": []}
    for label, name, batch, max_new, level, hidden in IN_JOB:
        with open(os.path.join(ROOT, "examples", f"{name}.rlhf"), encoding="utf-8") as fh:
            text = fh.read()
        text = re.sub(r"\((batch) = \d+\)", f"(batch = {batch})", text, count=1)
        text = re.sub(r"max_new_tokens = \d+", f"max_new_tokens = {max_new}", text)
        text = re.sub(r"lr = [0-9.eE+-]+", "lr = 0.0", text)
        text = re.sub(r"run \{[^}]*\}", "run { steps = 50; seed = 0; checkpoint_every = 0 }", text)
        if hidden:
            text = re.sub(r"hidden = \d+", f"hidden = {hidden}", text)
        prog = os.path.join(work, f"{re.sub('[^a-z0-9]+', '_', label.lower())}.rlhf")
        with open(prog, "w", encoding="utf-8") as fh:
            fh.write(text)
        out = prog[:-5]
        t0 = time.time()
        if not args.reprice:
            subprocess.run(cli + ["run", prog, f"-{level}", "--steps", str(args.job_steps), "--out", out, "--trace",
                                  "--no-progress", "--profile", path], env=env, check=True, capture_output=True)
        with open(os.path.join(out, "job", "plan.json"), encoding="utf-8") as fh:
            module = parse_ir(json.load(fh)["ir"])
        with open(os.path.join(out, "trace.json"), encoding="utf-8") as fh:
            measured = measured_from_trace(json.load(fh))
        config = CostConfig(profile=prof)
        result = compare(simulate(module, config, steps=3), module, measured, CostModel(module, config).dispatch)
        stages = [r for r in result["stages"] if r["op"].split(".")[0] in WORKER_FAMILIES and r["error"] is not None]
        per_stage[level] += [r["error"] for r in stages]
        # beside the medians: each stage's fastest measured step (the least-disturbed one; the profile's points
        # were the fastest of their repetitions until session 10, the median since)
        used = {str(k) for k in result["steps_used"]}
        fastest[level] += [r["predicted_s"] / min(v for k, v in r["per_step"].items() if k in used) - 1
                           for r in stages]
        st = result["step"]
        rows.append({"config": label, "step_predicted_s": st["predicted_s"], "step_measured_s": st["measured_s"],
                     "step_error": st["error"], "stages": {r["stage"]: [r["predicted_s"], r["measured_s"], r["error"]]
                                                           for r in stages}})
        load = "n/a" if result["load1"] is None else f"{result['load1']:.1f}"
        print(f"\n{label} ({time.time() - t0:.0f} s; steps {result['steps_used'][0]}-{result['steps_used'][-1]} "
              f"measured, medians; load average {load}): step predicted {fmt_ms(st['predicted_s'])} ms, measured "
              f"{fmt_ms(st['measured_s'])} ms ({st['error'] * 100:+.1f} %)")
        print("  " + "  ".join(f"{r['stage']} {fmt_ms(r['predicted_s'])}/{fmt_ms(r['measured_s'])} "
                               f"({r['error'] * 100:+.0f}%)" for r in stages), flush=True)
    print()
    for level, errs in per_stage.items():
        if errs:
            signed = statistics.median(errs)
            print(f"-{level}: per-stage error over {len(errs)} stages in jobs: median |error| "
                  f"{statistics.median(abs(e) for e in errs) * 100:.1f} %, median signed {signed * 100:+.1f} %; "
                  f"against each stage's fastest step: "
                  f"{statistics.median(abs(e) for e in fastest[level]) * 100:.1f} % "
                  f"({statistics.median(fastest[level]) * 100:+.1f} %)")
    steps = [abs(r["step_error"]) for r in rows]
    print(f"per-step error over {len(rows)} configurations: median |error| {statistics.median(steps) * 100:.1f} %, "
          f"max {max(steps) * 100:.1f} %")
    print(f"load average (1/5/15 min) after the run: {_loadavg()}")
    return {"rows": rows, "per_stage": per_stage}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", help="use this profile instead of profiling in rounds")
    ap.add_argument("--save-profile", help="where to save the merged profile")
    ap.add_argument("--quick", action="store_true", help="a coarser profile grid")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of (profile pass, --steps steps of every "
                    "configuration); times are the fastest over the rounds")
    ap.add_argument("--steps", type=int, default=2, help="steps of every configuration per round")
    ap.add_argument("--limit", type=int, default=0, help="only the first N configurations of each example")
    ap.add_argument("--scale", action="store_true", help="also print the cluster-scale predictions")
    ap.add_argument("--scale-only", action="store_true", help="only the cluster-scale predictions")
    ap.add_argument("--in-job", action="store_true", help="only the prediction inside real jobs (Ray, --trace) "
                    "of configurations outside the profiled points")
    ap.add_argument("--job-steps", type=int, default=6, help="--in-job: steps per job (the first is warm-up)")
    ap.add_argument("--reprice", help="--in-job: price the runs an earlier --in-job left in this folder again "
                    "(its profile.json and run folders) instead of profiling and running")
    args = ap.parse_args(argv)
    t0 = time.time()
    ok = True
    if args.in_job:
        in_job(args)
        print(f"\n(total {time.time() - t0:.0f} s)")
        return 0
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
