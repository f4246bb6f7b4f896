"""The vLLM rollout engine, measured (issue #15): generation speed inside rlhfc against standalone vLLM and
against rlhfc's torch decode loop, and refit time against model size.

A llama of ``--layers`` x ``--hidden`` (head size 64, vocab 96: random weights emit EOS with probability
about 1/96 a token, so response lengths are long-tailed, geometric up to ``--max-new`` tokens) generates
``--prompts`` responses at temperature 1, three ways, in one process:

- ``rlhfc vllm``: a model worker with ``rollout = vllm`` (``ModelWorker.generate``: per-request outputs of the
  engine's step loop, per-row seeds, sampled-token log-probs, the rollout built from them);
- ``standalone vllm``: ``vllm.LLM.generate`` on the same engine and the same token ids (no rlhfc code), and
  ``standalone seeded`` the same with a seed per request (as rlhfc seeds each row);
- ``rlhfc torch``: a model worker with the torch decode loop (``slots`` = all rows).

Each runs once to warm up, then ``--repeat`` rounds time them in turn; the table gives generated tokens/s
(tokens of the last round over the median seconds; sampled lengths differ between engines) and the
integration cost of rlhfc's vLLM path against standalone vLLM. Then the refit: for each hidden size of
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

    from rlhfc.runtime.worker import ModelWorker

    spec = _spec(args.layers, args.hidden)
    w_vllm = ModelWorker("actor", spec, {"kind": "random"}, 0, threads=args.threads,
                         rollout={"engine": "vllm", "folder": folder})
    w_torch = ModelWorker("actor", spec, {"kind": "random"}, 0, threads=args.threads)
    kw = dict(max_new_tokens=args.max_new, temperature=1.0, top_p=1.0, unpad=True)

    def rlhfc_vllm() -> int:
        return int(w_vllm.generate(prompts, **kw).batch.response_lengths.sum())

    rlhfc_vllm()   # starts the engine
    ids = [w_vllm.tokenizer.encode(p, add_bos=True) for p in prompts]
    llm = w_vllm.engine.llm

    def standalone(seeded: bool = False) -> int:
        params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_new, seed=1000 + i if seeded else None,
                                 stop_token_ids=[w_vllm.tokenizer.eos_id], detokenize=False) for i in range(len(ids))]
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def rlhfc_torch() -> int:
        return int(w_torch.generate(prompts, **kw).batch.response_lengths.sum())

    params = sum(p.numel() for p in w_vllm.model.parameters())
    print(f"model: llama {args.layers} x {args.hidden} (head 64), {params / 1e6:.1f}M params; {args.prompts} "
          f"prompts, up to {args.max_new} new tokens, temperature 1; torch threads {args.threads}")
    print(f"{'engine':<16} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    runs = (("rlhfc vllm", rlhfc_vllm), ("standalone vllm", standalone),
            ("standalone seeded", lambda: standalone(True)), ("rlhfc torch", rlhfc_torch))
    times: dict[str, list[float]] = {name: [] for name, _ in runs}
    tokens: dict[str, int] = {}
    for name, fn in runs:   # warm-up
        fn()
    for _ in range(args.repeat):   # rounds interleave the engines, so a machine's load drift hits all three
        for name, fn in runs:
            torch.set_num_threads(args.threads)
            start = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - start)
    rates = {}
    for name, _ in runs:
        seconds = statistics.median(times[name])
        rates[name] = tokens[name] / seconds
        print(f"{name:<16} {tokens[name]:>7} {seconds:>8.3f} {rates[name]:>9.0f}")
    print(f"integration cost (1 - rlhfc vllm / standalone vllm): {1 - rates['rlhfc vllm'] / rates['standalone vllm']:+.1%}")
    print(f"vllm / torch tokens/s: {rates['rlhfc vllm'] / rates['rlhfc torch']:.2f}x")
    w_vllm.engine.shutdown()


def refits(args, folder: str, prompts: list[str]) -> None:
    """The refit table: measured against the bytes-only and the per-layer predictions (catalog CPU)."""
    from rlhfc.cost.engine import predict_refit
    from rlhfc.cost.hardware import device_spec
    from rlhfc.cost.sync import refit_time
    from rlhfc.runtime.worker import ModelWorker

    spec = device_spec("cpu")
    print(f"\n{'hidden':>6} {'params':>8} {'MiB':>7} {'buckets':>7} {'refit s':>8} {'GB/s':>6} {'bytes-only s':>12} "
          f"{'predicted s':>11}")
    for hidden in (int(h) for h in args.refit_hidden.split(",")):
        w = ModelWorker("actor", _spec(args.layers, hidden), {"kind": "random"}, 0, threads=args.threads,
                        rollout={"engine": "vllm", "folder": os.path.join(folder, f"h{hidden}")})
        w.generate(prompts[:1], max_new_tokens=1, temperature=1.0, top_p=1.0)   # start the engine
        runs = [w.engine.refit(w.model, i + 1, 64) for i in range(args.repeat)]
        s = statistics.median(r["refit_s"] for r in runs)
        mb, n = runs[0]["refit_mb"], int(runs[0]["refit_buckets"])
        print(f"{hidden:>6} {sum(p.numel() for p in w.model.parameters()) / 1e6:>7.1f}M {mb:>7.1f} {n:>7} "
              f"{s:>8.4f} {mb / 1024 / s:>6.2f} {refit_time(mb * 2**20, 64, spec):>12.4f} "
              f"{predict_refit(mb * 2**20, args.layers, 64, spec):>11.4f}")
        w.engine.shutdown()


if __name__ == "__main__":
    main()
