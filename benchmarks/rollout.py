"""The vLLM rollout engine, measured (issue #15): generation speed inside rlhfc against standalone vLLM and
against rlhfc's torch decode loop, and refit time against model size.

A llama of ``--layers`` x ``--hidden`` (head size 64, vocab 96: random weights emit EOS with probability
about 1/96 a token, so response lengths are long-tailed, geometric up to ``--max-new`` tokens) generates
``--prompts`` responses at temperature 1, six ways, in one process:

- ``rlhfc vllm``: a model worker with ``rollout = vllm`` (``ModelWorker.generate``: per-request outputs of the
  engine's step loop, one seed per call, sampled-token log-probs, the rollout built from them), and
  ``rlhfc loop, no lp`` the engine's step loop alone (``VllmEngine.stream``, one seed, no log-probs);
- ``standalone vllm``: ``vllm.LLM.generate`` on the same engine and the same token ids (no rlhfc code),
  ``standalone lp`` the same asking for the sampled tokens' log-probs, and ``standalone seeded`` with a
  seed per request (what rlhfc did before one seed per call); every run but ``standalone seeded`` and
  ``rlhfc torch`` samples the very tokens of the round's ``rlhfc vllm`` call (its seed: the default generator
  seeded as rlhfc seeds its call's), which the table checks;
- ``rlhfc torch``: a model worker with the torch decode loop (``slots`` = all rows).

Each runs once to warm up, then ``--repeat`` rounds time them in turn; the table gives generated tokens/s
(median over rounds) and the integration cost of rlhfc's vLLM path against standalone vLLM on the same
tokens (median over rounds of the time ratio). Then the refit: for each hidden size of
``--refit-hidden`` an engine starts and the worker's weights are loaded into it in 64 MiB buckets
(median of ``--repeat``), against the bytes moved and the cost model's predictions: the bytes alone
(:func:`rlhfc.cost.sync.refit_time`, what the cost model priced before it had a per-layer term) and the
catalog's refit (:func:`rlhfc.cost.engine.predict_refit`: the bytes plus vLLM's per-layer re-processing; a
profile measures that term). ``--refit-only`` skips the generation table.

    python benchmarks/rollout.py [--layers 4] [--hidden 256] [--prompts 32] [--max-new 256] [--repeat 3]
                                 [--refit-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def _spec(layers: int, hidden: int) -> dict:
    return dict(arch="llama", layers=layers, hidden=hidden, heads=hidden // 64, vocab=96, max_seq=1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--refit-hidden", default="256,512,1024")
    ap.add_argument("--refit-only", action="store_true", help="only the refit table")
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="rlhfc-rollout-bench-")
    prompts = [f"prompt {i} " + "abc" * (i % 5) for i in range(args.prompts)]
    if not args.refit_only:
        generation(args, folder, prompts)
    refits(args, folder, prompts)


def generation(args, folder: str, prompts: list[str]) -> None:
    """The generation table: rlhfc's vLLM path, standalone vLLM (plain and seeded), rlhfc's torch loop."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rlhfc.runtime.worker.base import ModelWorker

    spec = _spec(args.layers, args.hidden)
    w_vllm = ModelWorker("actor", spec, {"kind": "random"}, 0, threads=args.threads,
                         rollout={"engine": "vllm", "folder": folder})
    w_torch = ModelWorker("actor", spec, {"kind": "random"}, 0, threads=args.threads)
    kw = dict(max_new_tokens=args.max_new, temperature=1.0, top_p=1.0, unpad=True)

    from rlhfc.runtime.rollout.vllm import batch_seed

    call: dict = {}   # the seed and tokens of this round's rlhfc call: the same-seed runs sample the same tokens

    def rlhfc_vllm() -> int:
        g = torch.Generator()
        g.set_state(w_vllm.sample_gen.get_state())
        base = int(torch.randint(0, 2**62, (1,), generator=g))   # the draw the worker's call makes (its row keys)
        call["seed"] = batch_seed(range(base, base + len(prompts)))
        roll = w_vllm.generate(prompts, **kw)
        call["tokens"] = roll.batch.response_token_lists()
        return int(roll.batch.response_lengths.sum())

    rlhfc_vllm()   # starts the engine
    ids = [w_vllm.tokenizer.encode(p, add_bos=True) for p in prompts]
    llm = w_vllm.engine.llm
    same: dict[str, bool] = {}

    def standalone(name: str, seeded: bool = False, logprobs: bool = False) -> int:
        params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_new, seed=1000 + i if seeded else None,
                                 stop_token_ids=[w_vllm.tokenizer.eos_id], detokenize=False,
                                 logprobs=0 if logprobs else None) for i in range(len(ids))]
        if not seeded:
            torch.manual_seed(call["seed"])   # the default generator as rlhfc's call seeded its own
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        if not seeded:
            same[name] = same.get(name, True) and [list(o.outputs[0].token_ids) for o in outs] == call["tokens"]
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def rlhfc_loop() -> int:
        got = sorted(w_vllm.engine.stream(ids, [args.max_new] * len(ids), eos_id=w_vllm.tokenizer.eos_id,
                                          temperature=1.0, top_p=1.0, seed=call["seed"]), key=lambda x: x.index)
        same["rlhfc loop, no lp"] = same.get("rlhfc loop, no lp", True) and \
            [list(x.response_ids) for x in got] == call["tokens"]
        return sum(len(x.response_ids) for x in got)

    def rlhfc_torch() -> int:
        return int(w_torch.generate(prompts, **kw).batch.response_lengths.sum())

    params = sum(p.numel() for p in w_vllm.model.parameters())
    print(f"model: llama {args.layers} x {args.hidden} (head 64), {params / 1e6:.1f}M params; {args.prompts} "
          f"prompts, up to {args.max_new} new tokens, temperature 1; torch threads {args.threads}")
    runs = (("rlhfc vllm", rlhfc_vllm), ("standalone vllm", lambda: standalone("standalone vllm")),
            ("rlhfc loop, no lp", rlhfc_loop), ("standalone lp", lambda: standalone("standalone lp", logprobs=True)),
            ("standalone seeded", lambda: standalone("seeded", seeded=True)), ("rlhfc torch", rlhfc_torch))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    tokens: dict[str, list[int]] = {name: [] for name, _ in runs}
    for name, fn in runs:   # warm-up
        fn()
    same.clear()
    for _ in range(args.repeat):   # rounds interleave the engines, so a machine's load drift hits all of them
        for name, fn in runs:
            torch.set_num_threads(args.threads)
            start = time.perf_counter()
            tokens[name].append(fn())
            times[name].append(time.perf_counter() - start)
    print(f"{'engine':<18} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}  same tokens as rlhfc vllm")
    rates = {}
    for name, _ in runs:   # the median over rounds of each round's tokens / seconds
        rates[name] = statistics.median(n / t for n, t in zip(tokens[name], times[name]))
        print(f"{name:<18} {statistics.median(tokens[name]):>7.0f} {statistics.median(times[name]):>8.3f} "
              f"{rates[name]:>9.0f}  {'yes' if same.get(name) else '-' if name not in same else 'NO'}")
    ratio = statistics.median(a / b for a, b in zip(times["standalone vllm"], times["rlhfc vllm"]))
    print(f"integration cost (1 - standalone seconds / rlhfc seconds, same tokens, median of rounds): {1 - ratio:+.1%}")
    print(f"vllm / torch tokens/s: {rates['rlhfc vllm'] / rates['rlhfc torch']:.2f}x")
    w_vllm.engine.shutdown()


def refits(args, folder: str, prompts: list[str]) -> None:
    """The refit table: measured against the bytes-only and the per-layer predictions (catalog CPU)."""
    from rlhfc.cost.engine import predict_refit
    from rlhfc.cost.hardware import device_spec
    from rlhfc.cost.sync import refit_time
    from rlhfc.runtime.worker.base import ModelWorker

    spec = device_spec("cpu")
    print(f"\n{'hidden':>6} {'params':>8} {'MiB':>7} {'buckets':>7} {'refit s':>8} {'GB/s':>6} {'bytes-only s':>12} "
          f"{'predicted s':>11}")
    for hidden in (int(h) for h in args.refit_hidden.split(",") if h):   # --refit-hidden "": none
        w = ModelWorker("actor", _spec(args.layers, hidden), {"kind": "random"}, 0, threads=args.threads,
                        rollout={"engine": "vllm", "folder": os.path.join(folder, f"h{hidden}")})
        w.generate(prompts[:1], max_new_tokens=1, temperature=1.0, top_p=1.0)   # start the engine
        runs = [w.rollout_engine.engine.refit(w.model, i + 1, 64) for i in range(args.repeat)]
        s = statistics.median(r["refit_s"] for r in runs)
        mb, n = runs[0]["refit_mb"], int(runs[0]["refit_buckets"])
        print(f"{hidden:>6} {sum(p.numel() for p in w.model.parameters()) / 1e6:>7.1f}M {mb:>7.1f} {n:>7} "
              f"{s:>8.4f} {mb / 1024 / s:>6.2f} {refit_time(mb * 2**20, 64, spec):>12.4f} "
              f"{predict_refit(mb * 2**20, args.layers, 64, spec):>11.4f}")
        w.rollout_engine.engine.shutdown()


if __name__ == "__main__":
    main()
