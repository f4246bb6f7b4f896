"""Predicted step time of rlhfc's plan and of each baseline's (DeepSpeed-Chat, OpenRLHF, verl, NeMo-Aligner)
at the configurations the papers report, with catalog rates only (no profile, no constant tuned to a paper).

    python benchmarks/baselines.py            # every configuration (a few minutes on 2 cores)
    python benchmarks/baselines.py --quick    # the 7B one only
    python benchmarks/baselines.py --openrlhf # dschat and openrlhf at OpenRLHF's published configurations
    python benchmarks/baselines.py --dschat   # dschat at DeepSpeed-Chat's own published configurations

Prints, per configuration, each plan's predicted seconds per step and its ratio to rlhfc's (baseline /
rlhfc: how much faster rlhfc's plan is predicted to be), and verl's ratio to the others (HybridFlow's own
comparison). docs/benchmarks.md ("Baselines") sets these beside the published figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhfc.cli.load import load  # noqa: E402
from rlhfc.cli.optimise import optimise  # noqa: E402
from rlhfc.cost import simulate  # noqa: E402
from rlhfc.cost.baselines import SYSTEMS  # noqa: E402

PROGRAM = """
cluster c {{ gpu = "{gpu}"; nodes = {nodes}; gpus_per_node = 8 }}
model actor  = {actor} trainable
model critic = {critic} head = value trainable
model ref    = copy(actor) frozen
model reward = {critic} head = score frozen
data prompts = synthetic(count = 100000, min_len = {prompt}, max_len = {prompt})
pipeline ppo(batch = {batch}) {{
  roll     = actor.generate(prompts, max_new_tokens = {response}, temperature = 1.0)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, gamma = 1.0, lam = 0.95, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv, clip = 0.2), lr = 1e-6, epochs = 1, minibatches = {minibatches})
  critic.train(value_loss(roll, values, ret, clip = 0.2), lr = 5e-6, epochs = 1, minibatches = {minibatches})
}}
run {{ steps = 10; seed = 0; optimize = O2 }}
"""

#: (name, settings): HybridFlow's PPO workload (all four models one size, 1024-token prompts and responses,
#: 1024 prompts a step, A100-80GB); ReaL's largest (4 x 70B on 128 H100s); the repository's two examples'
#: shapes (7B on one A100 node; 70B actor with 7B critic/reward on 16 H100 nodes)
CONFIGS = [
    ("hybridflow-7B-16xA100", dict(gpu="A100-80GB", nodes=2, actor="7B", critic="7B", prompt=1024,
                                   response=1024, batch=1024, minibatches=8)),
    ("hybridflow-13B-32xA100", dict(gpu="A100-80GB", nodes=4, actor="13B", critic="13B", prompt=1024,
                                    response=1024, batch=1024, minibatches=8)),
    ("hybridflow-70B-128xA100", dict(gpu="A100-80GB", nodes=16, actor="70B", critic="70B", prompt=1024,
                                     response=1024, batch=1024, minibatches=8)),
    ("real-4x70B-128xH100", dict(gpu="H100-80GB", nodes=16, actor="70B", critic="70B", prompt=1024,
                                 response=1024, batch=512, minibatches=8)),
]


#: OpenRLHF's README table (A800, 1024 prompts, one PPO epoch): seconds of DeepSpeed-Chat (Hybrid Engine) and of
#: OpenRLHF, priced here on A100-80GB with 1024-token prompts and responses (``--openrlhf``)
OPENRLHF_PUBLISHED = [
    ("7B-16", dict(gpu="A100-80GB", nodes=2, actor="7B", critic="7B"), 855.09, 471.11),
    ("13B-32", dict(gpu="A100-80GB", nodes=4, actor="13B", critic="13B"), 1528.93, 608.93),
    ("34B-32", dict(gpu="A100-80GB", nodes=4, actor="34B", critic="34B"), 3634.98, 1526.4),
    ("70B-32", dict(gpu="A100-80GB", nodes=4, actor="70B", critic="70B"), 10407.0, 4488.53),
]


#: DeepSpeed-Chat's step-3 (PPO) program as its blog measured it (blogs/deepspeed-chat/README.md in DeepSpeed,
#: Tables 1 and 2): :data:`PROGRAM` with an OPT actor (and its frozen copy), OPT-350M critic and reward, 1024
#: prompts of 256 tokens a step, 256 generated, one update a step; 131.9k prompts in all. OPT is GPT-2's layer
#: shape (plain MLP of 4h, learned positions, tied head) at OPT's published sizes.

def llama_program(cfg: dict, **more) -> str:
    """:data:`PROGRAM` with llama models of the configuration's sizes (``actor``, ``critic``)."""
    return PROGRAM.format(**{**cfg, **more, "actor": f"llama(size = {cfg['actor']})",
                             "critic": f"llama(size = {cfg['critic']})"})


def dschat_program(gpu: str, nodes: int, actor: str) -> str:
    return PROGRAM.format(gpu=gpu, nodes=nodes, actor=f"gpt2({OPT[actor]})", critic=f"gpt2({OPT['350M']})",
                          prompt=256, response=256, batch=1024, minibatches=1)


#: OPT's published shapes (Zhang et al. 2022, Table 1), as gpt2(...) fields
OPT = {
    "350M": "layers = 24, hidden = 1024, heads = 16, ffn = 4096, vocab = 50272, max_seq = 2048",
    "6.7B": "layers = 32, hidden = 4096, heads = 32, ffn = 16384, vocab = 50272, max_seq = 2048",
    "13B": "layers = 40, hidden = 5120, heads = 40, ffn = 20480, vocab = 50272, max_seq = 2048",
    "30B": "layers = 48, hidden = 7168, heads = 56, ffn = 28672, vocab = 50272, max_seq = 2048",
    "66B": "layers = 64, hidden = 9216, heads = 72, ffn = 36864, vocab = 50272, max_seq = 2048",
}

#: DeepSpeed-Chat's published step-3 hours (its blog's Tables 1 and 2: 131.9k prompts, 1024 a step, so 128.8
#: steps): (label, gpu, nodes, actor size, hours)
DSCHAT_PUBLISHED = [
    ("6.7B-8xA100-40G", "A100-40GB", 1, "6.7B", 5.7),
    ("13B-8xA100-40G", "A100-40GB", 1, "13B", 10.8),
    ("30B-8xA100-40G", "A100-40GB", 1, "30B", 1.85 * 24),
    ("6.7B-8xA100-80G", "A100-80GB", 1, "6.7B", 4.1),
    ("13B-8xA100-80G", "A100-80GB", 1, "13B", 9.0),
    ("30B-8xA100-80G", "A100-80GB", 1, "30B", 18.0),
    ("66B-8xA100-80G", "A100-80GB", 1, "66B", 2.1 * 24),
    ("13B-64xA100-80G", "A100-80GB", 8, "13B", 1.25),
    ("30B-64xA100-80G", "A100-80GB", 8, "30B", 4.0),
    ("66B-64xA100-80G", "A100-80GB", 8, "66B", 7.5),
]
DSCHAT_STEPS = 131_900 / 1024

#: DeepSpeed-Chat's blog, Figure 6 (its best GPU count per size; A100s): per GPU, TFLOP/s of the generation
#: phase (experience making: the generate and the four forwards) and of the training phase, counted as its
#: dschat/utils/perf.py counts them — generation: one actor forward over prompt and answer per row;
#: training: 8 N per token (checkpointing) for actor and critic. (size, GPUs, generation, training)
DSCHAT_FIGURE6 = [("6.7B", 8, 32.9, 100.7), ("13B", 8, 33.0, 97.3)]


def dschat_table() -> None:
    """The dschat plan (and rlhfc's) at DeepSpeed-Chat's own published configurations, beside the seconds a
    step its blog's hours give."""
    print(f"{'configuration':<18}{'rlhfc':>9}{'dschat':>9}{'published':>11}  dschat vs published")
    for label, gpu, nodes, actor, hours in DSCHAT_PUBLISHED:
        text = dschat_program(gpu, nodes, actor)
        t = {n: predict(text, None if n == "rlhfc" else f"baseline:{n}") for n in ("rlhfc", "dschat")}
        pub = hours * 3600 / DSCHAT_STEPS
        print(f"{label:<18}{t['rlhfc']:>8.0f}s{t['dschat']:>8.0f}s{pub:>10.0f}s  {(t['dschat'] / pub - 1) * 100:>+8.0f} %",
              flush=True)
    print("\nphases of the dschat plan beside the seconds Figure 6's rates give (A100-80GB):")
    for size, gpus, gen_rate, train_rate in DSCHAT_FIGURE6:
        text = dschat_program("A100-80GB", gpus // 8, size)
        costs = plan_of(text, "baseline:dschat").costs
        gen = sum(costs[k].time_s for k in ("roll", "logp", "ref_logp", "values", "scores"))
        train = costs["actor_train"].time_s + costs["critic_train"].time_s
        gen_pub = costs["roll"].flops / (gen_rate * 1e12 * gpus)
        train_pub = (costs["actor_train"].flops + costs["critic_train"].flops) / (train_rate * 1e12 * gpus)
        print(f"{size:>5} on {gpus}: generation phase {gen:5.1f} s vs {gen_pub:5.1f} s ({(gen / gen_pub - 1) * 100:+.0f} %), "
              f"training {train:5.1f} s vs {train_pub:5.1f} s ({(train / train_pub - 1) * 100:+.0f} %); the two phases "
              f"by Figure 6: {gen_pub + train_pub:.0f} s", flush=True)


def openrlhf_table() -> None:
    """The dschat and openrlhf plans at OpenRLHF's published configurations, beside its measured seconds."""
    print(f"{'configuration':<10}{'rlhfc':>9}{'dschat':>9}{'openrlhf':>10}  openrlhf vs published  dschat/openrlhf "
          "predicted vs published")
    for label, cfg, ds_pub, orl_pub in OPENRLHF_PUBLISHED:
        text = llama_program(cfg, prompt=1024, response=1024, batch=1024, minibatches=8)
        t = {n: predict(text, None if n == "rlhfc" else f"baseline:{n}") for n in ("rlhfc", "dschat", "openrlhf")}
        ratio, pub = t["dschat"] / t["openrlhf"], ds_pub / orl_pub
        print(f"{label:<10}{t['rlhfc']:>8.0f}s{t['dschat']:>8.0f}s{t['openrlhf']:>9.0f}s  "
              f"{(t['openrlhf'] / orl_pub - 1) * 100:>+20.0f} %  {ratio:.2f}x vs {pub:.2f}x ({(ratio / pub - 1) * 100:+.0f} %)")


def plan_of(text: str, placement: str | None, steps: int = 1):
    """The simulation of ``text`` compiled at its -O level with ``placement``."""
    with tempfile.NamedTemporaryFile("w", suffix=".rlhf", delete=False) as fh:
        fh.write(text)
    try:
        module, _ = load(fh.name, [])
        done = optimise(module, None, None, placement=placement, memory_check=False)
        return simulate(done.module, steps=steps)
    finally:
        os.unlink(fh.name)


def predict(text: str, placement: str | None) -> float:
    return plan_of(text, placement, steps=3).step_time_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--openrlhf", action="store_true", help="OpenRLHF's published configurations instead")
    ap.add_argument("--dschat", action="store_true", help="DeepSpeed-Chat's published configurations instead")
    args = ap.parse_args()
    if args.dschat:
        dschat_table()
        return
    if args.openrlhf:
        openrlhf_table()
        return
    configs = CONFIGS[:1] if args.quick else CONFIGS
    names = ["rlhfc"] + [f"baseline:{b}" for b in SYSTEMS]
    print(f"{'configuration':<26}" + "".join(f"{n:>18}" for n in names) + "   verl vs dschat/openrlhf/nemo")
    for label, cfg in configs:
        t0 = time.perf_counter()
        text = llama_program(cfg)
        times = {n: predict(text, None if n == "rlhfc" else n) for n in names}
        base = times["rlhfc"]
        cells = "".join(f"{times[n]:>9.1f}s {times[n] / base:>5.2f}x " for n in names)
        verl = times["baseline:verl"]
        vs = "/".join(f"{times[f'baseline:{b}'] / verl:.2f}" for b in ("dschat", "openrlhf", "nemo"))
        print(f"{label:<26}{cells}  {vs}   ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
