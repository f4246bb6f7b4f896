"""RLHFuse benchmark (issue #39): the fused actor/critic training schedule at RLHFuse's model sizes, predicted
(the default); both passes measured on this CPU (``--cpu``); a migrated tail's KV move against a re-prefill
(``--move``).

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

``--cpu``: the ``tail_migrate`` and ``fuse_training`` passes measured on this machine. tail_migrate: A PPO program whose policy (and its reference
copy) generate on two FSDP ranks (``layout(dp = 2)``), 64-token responses of a random policy (a long tail: each
token ends a response with probability about 1/vocab), streamed in chunks of 4 to the reference and critic
forwards: the job with and without the pass, in interleaved rounds, each round a fresh job (1 warm-up step, then
``--steps``), medians of samples/s and generated tokens/s; beside them, explain's note (where the length law
puts the tail's start) and the simulator's predicted step with and without the pass (it runs the tail on one
rank's core, the other free for the forwards). fuse_training: a PPO program whose actor and critic train in two
megatron-core pipeline stages on the same two cores, fused and unfused, measured the same way, beside explain's
searched schedule (its predicted gain is a GPU figure: the CPU simulator shares the cores instead).

    .venv/bin/python benchmarks/rlhfuse.py --cpu [--rounds 3] [--steps 6] [--json out.json]

``--move``: how a migrated tail is best continued on the torch engine, measured: R rows of P prompt + L response
tokens continued for their next token, by a re-prefill of their P + L tokens (``move = prefill``) or from their KV
caches (``move = kv``: one decode step over their last token, after the caches crossed two process boundaries —
rank to driver to rank, timed as two pickle round trips, what Ray's object store does to a tensor at least),
medians of ``--rounds`` × 5 repeats, at the tail program's shape and at wider ones.

    .venv/bin/python benchmarks/rlhfuse.py --move [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

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


TAIL_PROGRAM = """
cluster local { devices = cpu:2 }
model actor  = llama(layers = 2, hidden = 128, heads = 2, vocab = 64, max_seq = 96) layout(dp = 2) trainable
model critic = llama(layers = 2, hidden = 128, heads = 2, vocab = 64, max_seq = 96) head = value trainable
model ref    = copy(actor) frozen
data prompts = synthetic(count = 4096, min_len = 4, max_len = 12)
pipeline ppo(batch = 32) {
  roll     = actor.generate(prompts, max_new_tokens = 64)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3, minibatches = 2)
  critic.train(value_loss(roll, values, ret), lr = 1e-3, minibatches = 2)
}
run { steps = 7; seed = 0; checkpoint_every = 100 }
"""
TAIL_PASSES = ["dce", "unpad", "reuse_logprobs", "parallelize", "stream{chunk=4}", "placement", "tail_migrate",
               "recompute", "offload", "realloc", "threads"]


FUSED_PROGRAM = """
cluster local { devices = cpu:2 }
model actor  = llama(layers = 4, hidden = 128, heads = 2, vocab = 64, max_seq = 64) layout(pp = 2) trainable
model critic = like(actor) head = value layout(pp = 2) trainable
model ref    = copy(actor) layout(dp = 1) frozen
data prompts = synthetic(count = 4096, min_len = 4, max_len = 12)
pipeline ppo(batch = 16) {
  roll     = actor.generate(prompts, max_new_tokens = 32)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3, minibatches = 1)
  critic.train(value_loss(roll, values, ret), lr = 1e-3, minibatches = 1)
}
run { steps = 7; seed = 0; checkpoint_every = 100; trainer = megatron }
"""
FUSED_PASSES = ["dce", "parallelize", "placement{strategy=flatten}", "fuse_training"]


def measure(program: str, variants: dict[str, list[str]], rounds: int, steps: int, notes) -> dict:
    """Each variant's job (its passes) in interleaved rounds, a fresh job a round (1 warm-up step, then ``steps``);
    medians of samples/s and generated tokens/s; ``notes(module, sim)``: explain's notes on the first variant,
    beside the simulator's predicted step of each."""
    import statistics
    import tempfile

    from jobrun import run_compiled

    from rlhfc.cost import simulate
    from rlhfc.frontend import compile_source
    from rlhfc.passes import PassManager, parse_pipeline

    work = tempfile.mkdtemp(prefix="rlhfuse-")
    source = os.path.join(work, "program.rlhf")
    with open(source, "w") as fh:
        fh.write(program.replace("steps = 7", f"steps = {steps + 1}"))
    modules = {}
    for name, passes in variants.items():
        module, _ = compile_source(open(source).read(), source)
        modules[name] = PassManager(parse_pipeline(",".join(passes))).run(module)
    first = next(iter(variants))
    sims = {name: simulate(m) for name, m in modules.items()}
    predicted = {"notes": notes(modules[first], sims[first]), "step_s": {n: s.step_time_s for n, s in sims.items()}}
    measured: dict = {name: [] for name in variants}
    for r in range(rounds):
        for name in (variants if r % 2 == 0 else reversed(list(variants))):
            res = run_compiled(modules[name], f"O2-{name}-{r}", source, os.path.join(work, f"{name}{r}"), warmup=1)
            rows = res["rows"]
            samples = sum(x["samples"] for x in rows)
            tokens = sum(x["response_len_mean"] * x["samples"] for x in rows)
            measured[name].append({"samples_per_s": samples / res["wall"], "tokens_per_s": tokens / res["wall"],
                                   "step_s": res["wall"] / len(rows), "response_len": tokens / samples})
            print(f"round {r} {name:>12}: {measured[name][-1]['samples_per_s']:.2f} samples/s, "
                  f"{measured[name][-1]['tokens_per_s']:.1f} tokens/s, step {measured[name][-1]['step_s']:.2f} s",
                  flush=True)
    med = {name: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for name, ms in measured.items()}
    names = list(variants)
    return {"predicted": predicted, "measured": measured, "median": med,
            "gain": med[names[0]]["samples_per_s"] / med[names[1]]["samples_per_s"]}


#: (label, layers, hidden, heads, rows, prompt tokens, response tokens so far) of the --move measurement
MOVE_SHAPES = [("tail program", 2, 128, 2, 8, 10, 40), ("tail program, long", 2, 128, 2, 8, 10, 80),
               ("4 x 512", 4, 512, 8, 8, 10, 40), ("4 x 512, long", 4, 512, 8, 8, 64, 192),
               ("8 x 1024", 8, 1024, 16, 8, 64, 192)]


def measure_move(rounds: int) -> list[dict]:
    """Seconds to continue a migrated tail for one token, by re-prefill and from moved KV caches (see the
    module docstring), per shape of :data:`MOVE_SHAPES`; the KV bytes moved beside them."""
    import pickle
    import statistics
    import time

    import torch

    from rlhfc.runtime.models.build import build_model
    from rlhfc.runtime.rollout.decoding import PartialSample, generate_stream

    out = []
    for label, layers, hidden, heads, rows, p_len, r_len in MOVE_SHAPES:
        spec = {"arch": "llama", "layers": layers, "hidden": hidden, "heads": heads, "vocab": 64,
                "max_seq": p_len + r_len + 8}
        model = build_model(spec, seed=0)
        prompts = [[1] + [3 + (i + j) % 50 for j in range(p_len - 1)] for i in range(rows)]
        keys = list(range(7, 7 + rows))
        # rows that decode r_len tokens and stop there, holding their caches (no EOS: eos_id out of vocab)
        # (a last row of budget r_len finishing stops the call with the others at r_len tokens too)
        stopped = [s for s in generate_stream(model, prompts + [[1]], r_len + 1, eos_id=999, pad_id=0,
                                              row_keys=keys + [0], budgets=[r_len + 1] * rows + [r_len],
                                              stop_after=1, carry_kv=True) if isinstance(s, PartialSample)]
        assert len(stopped) == rows and all(len(s.response_ids) == r_len for s in stopped)
        inputs = [list(s.prompt_ids) + list(s.response_ids) for s in stopped]
        kw = dict(eos_id=999, pad_id=0, row_keys=keys, budgets=[1] * rows, resumed=[r_len] * rows)
        nbytes = len(pickle.dumps([s.state for s in stopped]))
        times: dict = {"prefill": [], "kv": []}
        for _ in range(rounds * 5):
            t = time.perf_counter()
            list(generate_stream(model, inputs, r_len + 1, **kw))
            times["prefill"].append(time.perf_counter() - t)
            t = time.perf_counter()
            states = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps([s.state for s in stopped]))))
            list(generate_stream(model, inputs, r_len + 1, states=states, **kw))
            times["kv"].append(time.perf_counter() - t)
        row = {"shape": label, "layers": layers, "hidden": hidden, "rows": rows, "prompt": p_len, "response": r_len,
               "kv_bytes": nbytes, "threads": torch.get_num_threads(),
               **{f"{k}_s": statistics.median(v) for k, v in times.items()}}
        out.append(row)
        print(f"{label:>20}: {rows} rows x ({p_len} + {r_len}) tokens, KV {nbytes / 1e6:.2f} MB: re-prefill "
              f"{row['prefill_s'] * 1e3:.2f} ms, KV move {row['kv_s'] * 1e3:.2f} ms "
              f"(x{row['prefill_s'] / row['kv_s']:.2f})", flush=True)
    return out


def report(title: str, out: dict) -> None:
    print(f"== {title}")
    for line in out["predicted"]["notes"]:
        print("predicted:", line.splitlines()[0])
    print("predicted step: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in out["predicted"]["step_s"].items()))
    for name, m in out["median"].items():
        print(f"median {name:>12}: {m['samples_per_s']:.2f} samples/s, {m['tokens_per_s']:.1f} tokens/s, "
              f"step {m['step_s']:.2f} s, mean response {m['response_len']:.1f} tokens")
    print(f"measured gain: x{out['gain']:.2f} samples/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draw", action="store_true", help="print each fused schedule")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu", action="store_true", help="measure tail_migrate on this machine (see the docstring)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--move", action="store_true", help="measure a migrated tail's KV move against a re-prefill")
    args = ap.parse_args(argv)
    if args.move:
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
        out = measure_move(args.rounds)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return 0
    if args.cpu:
        from rlhfc.explain.report import fused_notes, tail_notes

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
        out = {"tail_migrate": measure(TAIL_PROGRAM, {"tail_migrate": TAIL_PASSES,
                                                      "without": [p for p in TAIL_PASSES if p != "tail_migrate"]},
                                       args.rounds, args.steps, tail_notes)}
        report("tail_migrate (dp2 FSDP generation, streamed)", out["tail_migrate"])
        out["fuse_training"] = measure(FUSED_PROGRAM, {"fused": FUSED_PASSES, "unfused": FUSED_PASSES[:-1]},
                                       args.rounds, args.steps, lambda m, sim: fused_notes(m))
        report("fuse_training (megatron pp2 actor and critic on the same 2 cores)", out["fuse_training"])
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
        return 0
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
