"""Parallel layouts on this CPU: predicted vs measured stage times and communication volume.

For each layout (dp × tp × pp) one model runs as megatron-core ranks over gloo — the ``megatron``
trainer's worker, spawned as the runtime spawns it but with ``torch.multiprocessing`` instead of Ray —
and the benchmark times, per layout (median of ``--rounds`` interleaved rounds):

- ``forward``: the log-probs of a rollout (``batch`` rows of ``prompt + response`` tokens);
- ``train``: one PPO optimizer step on the same rollout (one minibatch).

Communication is counted on every rank by wrapping ``torch.distributed``'s collectives and point-to-point
calls (bytes each rank sends into them: an all-reduce of n bytes counts n) during the timed calls; the
table shows the busiest rank (megatron binds ``all_gather_into_tensor`` at import, so the vocabulary-parallel
logits gather escapes the count). The prediction is rlhfc's cost model for the same stage and layout
(``CostModel.stage_cost`` under ``run { trainer = megatron }``: the formulas see the layout's dp, tp and pp
as processes of one core each, from an ``rlhfc profile`` of the same program at one thread taken first);
its communication volume is the formulas' own: two all-reduces of the activations per layer forward (four
in training) and one for the input embedding within a tensor-parallel group, the logits gather, the
activations once per stage boundary (twice in training), and the gradients once over data-parallel ranks.

Processes may outnumber cores (a 4-rank layout on 2 cores): that is measured as it is and printed
with the machine's core count. Run: ``python benchmarks/parallel.py [--rounds 3] [--quick] [--no-profile]``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

#: the model and workload (a llama a few layers deep; every layout divides heads, kv heads, ffn, vocab)
SPEC = {"arch": "llama", "layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 384, "vocab": 256,
        "max_seq": 160, "head": "lm", "source": None}
BATCH, PROMPT, RESPONSE = 16, 16, 48
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)]
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
               "_reduce_scatter_base", "broadcast", "isend", "irecv", "send", "recv", "all_gather")


def _rollout():
    from rlhfc.runtime.data.values import Rollout
    from rlhfc.runtime.rollout.generation import FinishedSample, collate

    g = torch.Generator().manual_seed(0)
    samples = [FinishedSample(i, tuple([1] + torch.randint(3, SPEC["vocab"], (PROMPT - 1,), generator=g).tolist()),
                              tuple(torch.randint(3, SPEC["vocab"], (RESPONSE,), generator=g).tolist()), False,
                              RESPONSE - 1) for i in range(BATCH)]
    batch = collate(samples, 0, response_width=RESPONSE)
    return Rollout(batch, ["p"] * BATCH, ["r"] * BATCH, "actor", 0, f"char:{SPEC['vocab']}", list(range(BATCH)))


def _count_bytes():
    """Wrap torch.distributed's communication calls; returns the counter dict they add to."""
    import torch.distributed as dist

    counter = {"bytes": 0}

    def wrap(fn):
        def counted(*args, **kwargs):
            tensors = [a for a in list(args[:2]) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            if tensors:
                counter["bytes"] += tensors[0].numel() * tensors[0].element_size()
            return fn(*args, **kwargs)
        return counted

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(getattr(dist, name)))
    return counter


def _rank(rank, world, store, layout, rounds, queue):
    try:
        torch.set_num_threads(1)
        counter = _count_bytes()
        from rlhfc.runtime.data.values import PolicyLossInput
        from rlhfc.runtime.worker.base import ModelWorker

        dp, tp, pp = layout
        worker = ModelWorker("actor", SPEC, {"kind": "random"}, seed=1, trainer="megatron", rank=rank, world=world,
                             store=store, tp=tp, pp=pp)
        roll = _rollout()
        loss = PolicyLossInput(roll, torch.full(roll.mask.shape, -5.0), torch.ones(roll.mask.shape) * roll.mask,
                               None, clip=0.2, entropy_coef=0.0, kl_coef=0.0, estimator="k3", temperature=1.0)
        out = {"forward": [], "train": [], "forward_bytes": 0, "train_bytes": 0}
        worker.logprobs(roll)   # warm-up: the first forward, and the optimizer's creation
        worker.train(loss, lr=1e-4, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
        for _ in range(rounds):
            for kind, call in (("forward", lambda: worker.logprobs(roll)),
                               ("train", lambda: worker.train(loss, lr=1e-4, epochs=1, minibatches=1,
                                                              max_grad_norm=1.0, weight_decay=0.0))):
                import torch.distributed as dist

                dist.barrier()
                before = counter["bytes"]
                t0 = time.perf_counter()
                call()
                dist.barrier()
                out[kind].append(time.perf_counter() - t0)
                out[kind + "_bytes"] = counter["bytes"] - before
        queue.put((rank, pickle.dumps(out)))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))


def measure(layout, rounds: int) -> dict:
    import torch.multiprocessing as mp

    from rlhfc.runtime.train.backend import open_store

    world = layout[0] * layout[1] * layout[2]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = open_store()
    procs = [ctx.Process(target=_rank, args=(r, world, store, layout, rounds, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    parsed = {}
    for r, res in results.items():
        if isinstance(res, str):
            raise RuntimeError(f"layout {layout} rank {r} failed:\n{res}")
        parsed[r] = pickle.loads(res)
    # the barrier makes every rank's time the step's; take rank 0's rounds, and the busiest rank's bytes
    return {"forward": statistics.median(parsed[0]["forward"]), "train": statistics.median(parsed[0]["train"]),
            "forward_bytes": max(p["forward_bytes"] for p in parsed.values()),
            "train_bytes": max(p["train_bytes"] for p in parsed.values())}


def predict(layout, profile=None) -> dict:
    """The cost model's stage times for the same model, workload and layout (the ``megatron`` trainer's
    ranks: the formulas see dp, tp and pp as processes), and the formulas' bytes."""
    from rlhfc.cost.model import CostConfig, CostModel
    from rlhfc.ir.plan import Layout

    module = _module()
    cm = CostModel(module, CostConfig(profile=profile, dispatch_s=0.0))
    s = SPEC
    dp, tp, pp = layout
    lay = Layout(0, dp * tp * pp, dp=dp, tp=tp, pp=pp)   # megatron cuts its own pipeline micro-batches
    fwd = next(st for st in module.graph.stages if st.op.startswith("forward") and st.target == "actor")
    train = next(st for st in module.graph.stages if st.op.startswith("train") and st.target == "actor")
    rows = BATCH / dp
    seq = PROMPT + RESPONSE
    act = rows * seq * s["hidden"] * 4
    boundary = (pp - 1) * act           # each boundary carries every row's activations once
    ar = 2 * (tp - 1) / tp * act if tp > 1 else 0.0
    logits = rows * seq * s["vocab"] * 4 / tp if tp > 1 else 0.0   # the last stage's vocab-parallel all-gather
    params = sum(p.numel() for p in _params())
    return {"forward": cm.stage_cost(fwd, lay).time_s, "train": cm.stage_cost(train, lay).time_s,
            "forward_bytes": ((s["layers"] / pp) * 2 + 1) * ar + boundary + logits,
            "train_bytes": ((s["layers"] / pp) * 4 + 1) * ar + 2 * boundary + logits
            + (2 * (dp - 1) / dp * 4 * params / (tp * pp) if dp > 1 else 0.0)}


PROGRAM = """cluster local {{ devices = cpu:4 }}
model actor = llama(layers = {s[layers]}, hidden = {s[hidden]}, heads = {s[heads]}, kv_heads = {s[kv_heads]}, ffn = {s[ffn]}, vocab = {s[vocab]}, max_seq = {s[max_seq]}) trainable
model critic = like(actor) head = value trainable
model ref = copy(actor) frozen
model reward = like(actor) head = score frozen
data prompts = synthetic(count = 64, min_len = {P1}, max_len = {P1})
pipeline p(batch = {BATCH}) {{
  roll = actor.generate(prompts, max_new_tokens = {RESPONSE})
  logp = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values = critic.values(roll)
  scores = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-4, minibatches = 1)
  critic.train(value_loss(roll, values, ret), lr = 1e-4, minibatches = 1)
}}
run {{ trainer = megatron }}
"""


def _module():
    from rlhfc.frontend import compile_source

    s = SPEC
    text = PROGRAM.format(s=s, BATCH=BATCH, P1=PROMPT - 1, RESPONSE=RESPONSE)
    return compile_source(text, "parallel_bench.rlhf")[0]


def _profile(quick: bool):
    """Profile this machine for the benchmark's model at one thread (a group's rank runs on one core):
    ``rlhfc profile`` of the same program, into a temporary file."""
    import subprocess
    import tempfile

    from rlhfc.cost import load_profile

    folder = tempfile.mkdtemp(prefix="rlhfc-parallel-")
    prog, out = os.path.join(folder, "bench.rlhf"), os.path.join(folder, "profile.json")
    with open(prog, "w") as fh:
        fh.write(PROGRAM.format(s=SPEC, BATCH=BATCH, P1=PROMPT - 1, RESPONSE=RESPONSE))
    cmd = [sys.executable, "-m", "rlhfc.cli", "profile", prog, "--threads", "1", "-o", out] + (["--quick"] if quick else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return load_profile(out)


def _params():
    from rlhfc.runtime.models.build import build_model

    return build_model(SPEC, seed=0).parameters()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="two-rank layouts only, one round")
    ap.add_argument("--no-profile", action="store_true", help="predict with the analytical formulas only")
    args = ap.parse_args(argv)
    profile = None if args.no_profile else _profile(args.quick)
    layouts = [lay for lay in LAYOUTS if not args.quick or lay[0] * lay[1] * lay[2] <= 2]
    rounds = 1 if args.quick else args.rounds
    print(f"model {SPEC['arch']} {SPEC['layers']}x{SPEC['hidden']} (vocab {SPEC['vocab']}), batch {BATCH} x "
          f"{PROMPT}+{RESPONSE} tokens; {os.cpu_count()} cores; gloo; median of {rounds} rounds")
    print(f"{'layout':<10} {'ranks':>5} | {'fwd meas':>9} {'fwd pred':>9} | {'train meas':>10} {'train pred':>10} |"
          f" {'fwd MB meas':>11} {'pred':>7} | {'train MB meas':>13} {'pred':>7}")
    for layout in layouts:
        m, p = measure(layout, rounds), predict(layout, profile)
        name = "dp{}·tp{}·pp{}".format(*layout)
        print(f"{name:<10} {layout[0] * layout[1] * layout[2]:>5} | {m['forward']:>8.3f}s {p['forward']:>8.3f}s | "
              f"{m['train']:>9.3f}s {p['train']:>9.3f}s | {m['forward_bytes'] / 1e6:>11.2f} "
              f"{p['forward_bytes'] / 1e6:>7.2f} | {m['train_bytes'] / 1e6:>13.2f} {p['train_bytes'] / 1e6:>7.2f}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
