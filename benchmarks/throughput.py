"""Throughput sweep: rlhfc -O0 / -O2 / -O3 against TRL 1.12's PPO and GRPO on the same work, tiny to compute-bound.

Each point of the sweep is one PPO job — four GPT-2 models of the point's size (policy, value, reference,
a neural reward model), random weights, a small vocabulary so response lengths are geometric with a long
tail up to ``max_new_tokens`` — run by rlhfc at each level and by TRL's ``PPOTrainer``
(``benchmarks/trl_peer.py``) on the same models, batch, lengths and minibatches. The ``grpo-*`` points are a
GRPO program (one trained model, groups of ``n``, rlhfc's ``vowel_count`` rule, no reference) against TRL's
``GRPOTrainer`` with the same policy, prompts, groups, rule and optimizer steps per generation round;
``grpo-chat`` puts a chat template in the shared tokenizer and makes each prompt a user turn on both sides. TRL runs at 1 and at 2
torch threads and the faster counts. Levels and TRL alternate within each round, so slow and fast spells
of a shared machine hit all of them; figures are medians over rounds.

Printed per point: samples/s (only the samples a step trains on), -O2/TRL, -O3/TRL, -O0/TRL (the
runtime's share of a gain) and -O2/-O0 (the passes' share); then each side's mean generated response
length and generated tokens/s, and rlhfc's measured padding efficiency (generation; forwards) per level;
then where each side's step goes (generation, forwards, training, transfers, driver, idle; TRL's
phases — ``benchmarks/step_profile.py``; ``--no-profile`` leaves it out); last, each target and by how
much it is met or missed. By default both sides train at lr 0: every
gradient and optimizer update is computed, but both policies stay at their random start, so both
generate the same length distribution and samples/s compares the same work (``--lr 1e-4`` lets each
drift with its own random reward model, as earlier sweeps did).

    .venv/bin/python benchmarks/throughput.py [--rounds 3] [--points tiny,mid,wide,20m] [--lr 0] [--json out.json]

Targets (docs/benchmarks.md): -O2 >= 2x TRL PPO at every point, -O3 >= 2.5x, -O2 >= 1.6x -O0 at the
compute-bound points.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from statistics import median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

#: the sweep: model size, vocabulary (EOS probability 1/vocab per token for a random policy), lengths, batch
POINTS = {
    "tiny": dict(layers=2, hidden=64, heads=4, vocab=16, max_new_tokens=64, batch=16, minibatches=2, steps=8),
    "mid": dict(layers=4, hidden=128, heads=4, vocab=24, max_new_tokens=128, batch=16, minibatches=2, steps=6),
    "wide": dict(layers=6, hidden=256, heads=8, vocab=32, max_new_tokens=128, batch=32, minibatches=4, steps=4),
    "20m": dict(layers=7, hidden=512, heads=8, vocab=32, max_new_tokens=96, batch=16, minibatches=2, steps=3),
    # GRPO (one trained model, groups of n, a rule reward) against TRL's GRPOTrainer: always on equal work
    "grpo-mid": dict(algo="grpo", layers=4, hidden=128, heads=4, vocab=24, max_new_tokens=128, batch=8, n=8,
                     minibatches=2, steps=4),
    "grpo-wide": dict(algo="grpo", layers=6, hidden=256, heads=8, vocab=32, max_new_tokens=128, batch=8, n=4,
                      minibatches=2, steps=3),
    # grpo-mid with a chat template in the tokenizer: each prompt a user turn (generate(..., chat = true))
    "grpo-chat": dict(algo="grpo", chat=True, layers=4, hidden=128, heads=4, vocab=24, max_new_tokens=128, batch=8,
                      n=8, minibatches=2, steps=4),
}
#: the points whose step is dominated by model compute rather than per-call overheads (the -O2/-O0 target)
COMPUTE_BOUND = ("wide", "20m")
PROMPT_MIN, PROMPT_MAX = 4, 12
WARMUP = 1

PROGRAM = """cluster local {{ devices = cpu:2 }}
model actor  = gpt2(layers = {layers}, hidden = {hidden}, heads = {heads}, vocab = {vocab}, max_seq = {max_seq}) trainable
model critic = like(actor) head = value trainable
model ref    = copy(actor) frozen
model reward = gpt2(layers = {layers}, hidden = {hidden}, heads = {heads}, vocab = {vocab}, max_seq = {max_seq}) head = score frozen
data prompts = synthetic(count = 4096, min_len = {pmin}, max_len = {pmax})
pipeline ppo(batch = {batch}) {{
  roll     = actor.generate(prompts, max_new_tokens = {max_new_tokens}, temperature = 1.0)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv, clip = 0.2), lr = {lr}, epochs = 1, minibatches = {minibatches})
  critic.train(value_loss(roll, values, ret, clip = 0.2), lr = {lr}, epochs = 1, minibatches = {minibatches})
}}
run {{ steps = {steps}; seed = 0; checkpoint_every = 0 }}
"""

#: ``--equal-work``: the models from the point's shared folder (TRL loads the same policy weights and tokenizer;
#: the value and reward models are its trunk with a score head each side initialises), prompts from a file
SHARED = PROGRAM.replace(
    "model actor  = gpt2(layers = {layers}, hidden = {hidden}, heads = {heads}, vocab = {vocab}, max_seq = {max_seq}) "
    "trainable\nmodel critic = like(actor) head = value trainable",
    'model actor  = hf("{folder}") trainable\nmodel critic = hf("{folder}") head = value trainable').replace(
    "model reward = gpt2(layers = {layers}, hidden = {hidden}, heads = {heads}, vocab = {vocab}, max_seq = {max_seq}) "
    "head = score frozen", 'model reward = hf("{folder}") head = score frozen').replace(
    "data prompts = synthetic(count = 4096, min_len = {pmin}, max_len = {pmax})", 'data prompts = jsonl("{prompts}")')
assert SHARED.count("hf(") == 3 and "jsonl(" in SHARED

#: a GRPO point: the policy from the point's shared folder, no reference (TRL's GRPOTrainer default beta = 0),
#: rlhfc's vowel_count rule on both sides
GRPO = """cluster local {{ devices = cpu:2 }}
model actor = hf("{folder}") trainable
data prompts = jsonl("{prompts}")
pipeline grpo(batch = {batch}) {{
  roll   = actor.generate(prompts, n = {n}, max_new_tokens = {max_new_tokens}, temperature = 1.0{chat})
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, logp, adv, clip = 0.2), lr = {lr}, epochs = 1, minibatches = {minibatches})
}}
run {{ steps = {steps}; seed = 0; checkpoint_every = 0 }}
"""


def _max_seq(p: dict) -> int:
    return 1 + PROMPT_MAX + p["max_new_tokens"] + 8


def shared_start(point: dict, work: str) -> dict:
    """The equal-work start of a point: its folder (a seeded random GPT-2 policy and the character tokenizer,
    saved with save_pretrained) and its prompts (a JSON-lines file, and the same texts for TRL)."""
    from trl_peer import prompt_texts, save_shared_folder

    os.makedirs(work, exist_ok=True)
    folder = os.path.join(work, "shared_model")
    if not os.path.isdir(folder):
        save_shared_folder(folder, layers=point["layers"], hidden=point["hidden"], heads=point["heads"],
                           vocab=point["vocab"], max_seq=_max_seq(point), seed=0, chat=bool(point.get("chat")))
    texts = prompt_texts(n=point["batch"] * (point["steps"] + WARMUP), vocab=point["vocab"], min_len=PROMPT_MIN,
                         max_len=PROMPT_MAX, seed=0)
    prompts = os.path.join(work, "prompts.jsonl")
    with open(prompts, "w") as fh:
        fh.writelines(json.dumps({"prompt": t}) + "\n" for t in texts)
    return {"folder": folder, "prompts": prompts, "texts": texts}


def run_rlhfc(point: dict, level: str, work: str, lr: float, shared: dict | None = None, profile: bool = True) -> dict:
    from jobrun import run_compiled
    from step_profile import trace_split

    from rlhfc.frontend import compile_source
    from rlhfc.passes import PassManager, pipeline_for

    path = os.path.join(work, f"point_{level}.rlhf")
    template, extra = (SHARED, {"folder": shared["folder"], "prompts": shared["prompts"]}) if shared else (PROGRAM, {})
    if point.get("algo") == "grpo":
        template = GRPO
    text = template.format(max_seq=_max_seq(point), pmin=PROMPT_MIN, pmax=PROMPT_MAX, steps=point["steps"] + WARMUP,
                           lr=lr, chat=", chat = true" if point.get("chat") else "", **extra,
                           **{k: v for k, v in point.items() if k not in ("steps", "algo", "chat")})
    module, _ = compile_source(text, path)
    module = PassManager(pipeline_for(level)).run(module)
    run = run_compiled(module, level, path, work, warmup=WARMUP, trace=profile)
    measured, wall, first = run["rows"], run["wall"], run.get("first")
    samples = sum(r["samples"] for r in measured)
    tokens = sum(r["samples"] * r["response_len_mean"] for r in measured)
    eff = {k: median(r[k] for r in measured) for k in ("pad_eff_generate", "pad_eff_forward")
           if all(k in r for r in measured)}
    out = {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "step_s": wall / len(measured),
           "response_len_mean": tokens / max(samples, 1), **eff}
    if first is not None and "response_len_std" in first:   # the first step's lengths: equal work starts equal
        out["first_len"] = (first["response_len_mean"], first["response_len_std"] / first["samples"] ** 0.5)
    if profile:
        out["phases"] = trace_split(run["trace"], skip=WARMUP)
    return out


def run_trl(point: dict, lr: float, shared: dict | None = None, profile: bool = True) -> dict:
    from statistics import mean, stdev

    from trl_peer import run_trl_grpo, run_trl_ppo

    best = None
    for threads in (1, 2):
        if point.get("algo") == "grpo":
            r = run_trl_grpo(folder=shared["folder"], texts=shared["texts"], batch=point["batch"], n=point["n"],
                             max_new_tokens=point["max_new_tokens"], steps=point["steps"] + WARMUP,
                             minibatches=point["minibatches"], lr=lr, seed=0, threads=threads, phases=profile,
                             chat=bool(point.get("chat")))
        else:
            r = run_trl_ppo(layers=point["layers"], hidden=point["hidden"], heads=point["heads"], vocab=point["vocab"],
                            max_seq=_max_seq(point), batch=point["batch"], max_new_tokens=point["max_new_tokens"],
                            prompt_min_len=PROMPT_MIN, prompt_max_len=PROMPT_MAX, steps=point["steps"] + WARMUP,
                            minibatches=point["minibatches"], epochs=1, lr=lr, seed=0, threads=threads,
                            folder=shared["folder"] if shared else None, texts=shared["texts"] if shared else None,
                            phases=profile)
        sps = r.get("steady_samples_per_s") or r["samples_per_s"]
        # TRL's own mean_response_len stops at the first <pad> a row samples; the tokens it generated run to
        # <eos> or the cap (mean_generated_len): that is the work, and what rlhfc's response length counts
        generated = r.get("mean_generated_len") or float("nan")
        res = {"samples_per_s": sps, "tokens_per_s": sps * generated, "threads": threads,
               "response_len_mean": generated, "phases": r.get("phases")}
        lens = r.get("first_step_generated_lens") or []
        if len(lens) > 1:
            res["first_len"] = (mean(lens), stdev(lens) / len(lens) ** 0.5)
        if best is None or sps > best["samples_per_s"]:
            best = res
    return best


def _params(point: dict) -> float:
    h, L, V = point["hidden"], point["layers"], point["vocab"]
    return L * 12 * h * h + (V + _max_seq(point)) * h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--levels", default="O0,O2,O3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--own-init", action="store_true",
                    help="each side builds its own random models and prompts (earlier sweeps); by default both load "
                         "the same saved policy, tokenizer and prompts (equal work)")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-phase profile of both sides (rlhfc runs without --trace, TRL without timers)")
    ap.add_argument("--lr", type=float, default=0.0,
                    help="learning rate of both sides; 0 (default) keeps both policies at their random start, so "
                         "both generate the same length distribution every step (every gradient and optimizer "
                         "update is still computed); 1e-4 lets each drift with its own random reward")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from cores import core_scaling
    from overlap import _cpu_name
    from step_profile import RLHFC_ORDER, TRL_GRPO_ORDER, TRL_ORDER, format_split

    levels = args.levels.split(",")
    points = args.points.split(",")
    results: dict = {p: {lv: [] for lv in levels + ["TRL"]} for p in points}
    work = tempfile.mkdtemp(prefix="rlhfc-throughput-")
    scaling = []
    try:
        for rnd in range(args.rounds):
            scaling.append(core_scaling())
            for name in points:
                own = args.own_init and POINTS[name].get("algo") != "grpo"   # GRPO points: equal work only
                shared = None if own else shared_start(POINTS[name], os.path.join(work, f"shared_{name}"))
                for lv in levels:
                    results[name][lv].append(run_rlhfc(POINTS[name], lv, os.path.join(work, f"r{rnd}_{name}"),
                                                       args.lr, shared, profile=not args.no_profile))
                results[name]["TRL"].append(run_trl(POINTS[name], args.lr, shared, profile=not args.no_profile))
                print(f"round {rnd + 1}: {name} done", file=sys.stderr, flush=True)
                if args.json:   # what is measured so far survives an interrupted sweep
                    with open(args.json + ".partial", "w") as fh:
                        json.dump(results, fh, default=str)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores (two busy cores deliver {median(scaling):.2f}x one); "
          f"{args.rounds} rounds, medians; {WARMUP} warm-up step per run")
    head = f"{'point':<9} {'params':>7} {'T':>4} {'B':>3} | " + " ".join(f"{lv + ' s/s':>9}" for lv in levels + ["TRL"])
    print(head + " | " + " ".join(f"{lv + '/TRL':>8}" for lv in levels)
          + f" | {'O2/O0':>6} | {'len O2':>6} {'len TRL':>7} | {'tok/s O2':>8} {'tok/s TRL':>9} {'ratio':>6}")
    summary = {}
    for name in points:
        p = POINTS[name]
        med = {lv: median(r["samples_per_s"] for r in results[name][lv]) for lv in levels + ["TRL"]}
        tok = median(r["tokens_per_s"] for r in results[name]["O2"]) if "O2" in levels else float("nan")
        tok_trl = median(r["tokens_per_s"] for r in results[name]["TRL"])
        rl = median(r["response_len_mean"] for r in results[name]["O2" if "O2" in levels else levels[0]])
        rl_trl = median(r["response_len_mean"] for r in results[name]["TRL"])
        ratios = {lv: med[lv] / med["TRL"] for lv in levels}
        o2o0 = med["O2"] / med["O0"] if {"O2", "O0"} <= set(levels) else float("nan")
        print(f"{name:<9} {_params(p) / 1e6:>6.1f}M {p['max_new_tokens']:>4} {p['batch'] * p.get('n', 1):>3} | "
              + " ".join(f"{med[lv]:>9.2f}" for lv in levels + ["TRL"]) + " | "
              + " ".join(f"{ratios[lv]:>7.2f}x" for lv in levels)
              + f" | {o2o0:>5.2f}x | {rl:>6.1f} {rl_trl:>7.1f} | {tok:>8.1f} {tok_trl:>9.1f} {tok / tok_trl:>5.2f}x")
        eff = {lv: {k: median(r[k] for r in results[name][lv]) for k in ("pad_eff_generate", "pad_eff_forward")
                    if all(k in r for r in results[name][lv])} for lv in levels}
        summary[name] = {"median_samples_per_s": med, "ratios_to_trl": ratios, "O2_over_O0": o2o0,
                         "trl_threads": [r["threads"] for r in results[name]["TRL"]], "padding_efficiency": eff}
    print("first step's mean response length ± its standard error (round 1; equal work starts within ~1 SE):")
    for name in points:
        firsts = {lv: results[name][lv][0].get("first_len") for lv in levels + ["TRL"]}
        print(f"  {name:<9} " + "  ".join(f"{lv}: {f[0]:.1f} ± {f[1]:.1f}" for lv, f in firsts.items() if f))
    print("padding efficiency (useful / computed tokens, medians; generation, forwards):")
    for name in points:
        eff = summary[name]["padding_efficiency"]
        print(f"  {name:<9} " + "  ".join(
            f"-{lv}: {e.get('pad_eff_generate', float('nan')):.2f}, {e.get('pad_eff_forward', float('nan')):.2f}"
            for lv, e in eff.items()))
    if not args.no_profile:
        print("where a step goes (seconds per step, medians over rounds; share of the step; rlhfc's families may "
              "overlap, idle = no span running: dispatch and driver Python; benchmarks/step_profile.py):")
        for name in points:
            for lv in levels + ["TRL"]:
                runs = [r["phases"] for r in results[name][lv] if r.get("phases")]
                if not runs:
                    continue
                split = {k: median(r[k] for r in runs) for k in runs[0]}
                summary[name].setdefault("phases", {})[lv] = split
                trl_order = TRL_GRPO_ORDER if POINTS[name].get("algo") == "grpo" else TRL_ORDER
                print(f"  {name:<9} {lv:<4} step {split['step']:.2f} s: "
                      + format_split(split, trl_order if lv == "TRL" else RLHFC_ORDER))
    print("targets:")
    for name in points:
        r, o = summary[name]["ratios_to_trl"], summary[name]["O2_over_O0"]
        checks = [("-O2 >= 2x TRL", r.get("O2"), 2.0), ("-O3 >= 2.5x TRL", r.get("O3"), 2.5)]
        if name in COMPUTE_BOUND:
            checks.append(("-O2 >= 1.6x -O0", o, 1.6))
        print(f"  {name:<9} " + "; ".join(
            f"{what}: {got:.2f}x {'met' if got >= want else f'MISSED by {want - got:.2f}x'}"
            for what, got, want in checks if got is not None and got == got))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": _cpu_name(), "cores": os.cpu_count(), "core_scaling": scaling,
                       "points": POINTS, "summary": summary, "runs": results}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
