"""End-to-end runs behind the docs' claims that the other e2e tests do not reach.

- Streaming with several chunks per step: each consumer's forward runs on a chunk's rows and the results
  are merged back in batch order; the step samples -O0's token ids and its metrics agree within the
  rounding tolerance (batched kernels may round a row differently over fewer rows), with and without
  ``unpad``.
- ``overcommit`` (-O3's, on a generate that does not run ahead) trains with carried samples, every step on
  exactly ``batch`` samples, its throughput counts those, and samples.jsonl records the weights version of
  every token of a carried sample.
- Resume at -O2 and with overcommit: the resumed run's metrics *and checkpoint weights and optimizer state*
  are the uninterrupted run's, bit for bit (the carried samples are part of the checkpoint).
"""

from __future__ import annotations

import json
import math
import os

import pytest
from safetensors.torch import load_file as load_safetensors

from rlhfc.passes import PIPELINES
from rlhfc.runtime.job import run_job

from .conftest import HERE, compile_job, metrics, untimed
from .conftest import TINY_PPO as PROGRAM              # batch 4, max_new_tokens 6

TAIL = os.path.join(HERE, "tiny_ppo_tail.rlhf")        # batch 8, long-tailed lengths up to 48 tokens
MODELS = ("actor", "critic", "ref", "reward")
#: -O3 without asynchronous rollout: what -O3 compiles for a program stating ``run { staleness = 0 }``
OVERCOMMIT = ["overcommit" if p.startswith("overcommit") else p for p in PIPELINES["O3"]
              if not p.startswith("async_rollout")]

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("shared_ray")]


def _job(tmp, program: str, passes: list[str], tag: str) -> str:
    return compile_job(program, str(tmp / f"job_{tag}"), level=None, passes=passes)


def _strip(rows):
    return untimed(rows, layout=True)


_metrics = metrics


def _close(a, b, rel=1e-4, abs_=1e-6) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel, abs_) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return b == pytest.approx(a, rel=rel, abs=abs_)
    return a == b


def _checkpoint_tensors(out: str, step: int) -> dict[str, dict]:
    """Every model's weights and state (optimizer moments, RNG states) of checkpoint ``step_{step}``."""
    root = os.path.join(out, "checkpoints", f"step_{step}")
    return {m: {f: load_safetensors(os.path.join(root, m, f)) for f in ("weights.safetensors", "state.safetensors")}
            for m in MODELS}


def _assert_same_tensors(a: dict, b: dict) -> None:
    for model in a:
        for f in a[model]:
            ta, tb = a[model][f], b[model][f]
            assert ta.keys() == tb.keys(), (model, f)
            bad = [k for k in ta if not (ta[k].shape == tb[k].shape and bool((ta[k] == tb[k]).all()))]
            assert not bad, f"{model}/{f}: {bad[:5]} differ"


def _stream_passes(chunk: int, rounding: bool) -> list[str]:
    passes = [p for p in PIPELINES["O2"] if rounding or p not in ("unpad", "reuse_logprobs")]
    return [f"stream{{chunk={chunk}}}" if p == "stream" else p for p in passes]


# ----------------------------------------------------------------------------- streaming, several chunks


def _tokens(job_dir: str, samples: list):
    """The job's own step function, also recording each step's sampled token ids, in batch order."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"job_{abs(hash(job_dir))}", os.path.join(job_dir, "main.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def step(job, w):
        values = mod.step(job, w)
        name = job.plan.metrics.rollout
        roll = job.resolve({name: values[name]})[name]
        b = roll.batch
        samples.append([(p, b.responses[i, :int(n)].tolist()) for i, (p, n) in
                        enumerate(zip(roll.prompts, b.response_lengths))])
        return values

    return step


@pytest.mark.slow
@pytest.mark.parametrize("program,chunk,rounding", [(PROGRAM, 1, False), (TAIL, 2, True)],
                         ids=["4_chunks_of_1", "4_chunks_of_2_unpad"])
def test_streaming_in_several_chunks_trains_like_O0_within_rounding(tmp_path, program, chunk, rounding):
    """Batch 4 in chunks of 1 (the -O2 passes but ``unpad`` and ``reuse_logprobs``), and the long-tailed
    batch 8 in chunks of 2 with all of -O2 (each chunk cut to its own longest response): four chunks per
    step, each handed to ref, critic and reward on its own. 3 steps: -O0's token ids every step, metrics
    within a relative 1e-4."""
    stream = _job(tmp_path, program, _stream_passes(chunk, rounding), "stream")
    code = open(os.path.join(stream, "main.py")).read()
    assert f"generate_chunks.remote(prompts, carry=carry, chunk={chunk}," in code and f"batch = {4 * chunk}" in code
    assert ("unpad=True" in code) == rounding
    o0 = _job(tmp_path, program, [], "o0")
    tokens_s, tokens_0 = [], []
    rows_s = _strip(run_job(stream, _tokens(stream, tokens_s), out=str(tmp_path / "run_s"), steps=3, progress=False))
    rows_0 = _strip(run_job(o0, _tokens(o0, tokens_0), out=str(tmp_path / "run_0"), steps=3, progress=False))
    assert len(tokens_0) == 3 and tokens_s == tokens_0
    if rounding:
        assert [r["response_len_max"] for r in rows_0] != [48.0] * 3       # chunks really were cut
    for a, b in zip(rows_0, rows_s):
        assert _close(a, b), f"step {a['step']}: " + ", ".join(
            f"{k} {a[k]!r} vs {b.get(k)!r}" for k in a if not _close(a[k], b.get(k)))


# ----------------------------------------------------------------------------- overcommit


def test_overcommit_trains_with_carried_samples_on_exactly_batch_samples_a_step(tmp_path):
    """The long-tailed program with -O3's overcommit for 6 steps: samples carried over, every step trains on
    exactly 8, samples/s is those 8 over the step's time, and the policy and critic train (finite losses).
    samples.jsonl gives every sample's tokens their weights versions: runs covering the response, the last
    run the step's generating weights, a carried sample's first run older."""
    job = _job(tmp_path, TAIL, OVERCOMMIT, "oc")
    out = str(tmp_path / "run")
    rows = run_job(job, out=out, steps=6, progress=False)
    assert [r["samples"] for r in rows] == [8] * 6
    assert sum(r["carried"] for r in rows) > 0 and any(r["carry_next"] > 0 for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 1
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(8 / r["step_time_s"])
        assert all(math.isfinite(r[k]) for k in ("reward_mean", "policy_loss", "value_loss", "kl"))
        assert r["overcommit_delta"] >= 0
    samples = [json.loads(x) for x in open(os.path.join(out, "samples.jsonl"))]
    assert samples and all(sum(n for _, n in s["versions"]) == s["response_tokens"] for s in samples)
    assert all(s["versions"][-1][0] == s["step"] for s in samples)      # finished by the step's weights
    assert all(v < w for s in samples for (v, _), (w, _) in zip(s["versions"], s["versions"][1:]))


# ----------------------------------------------------------------------------- resume at -O2 and with overcommit


@pytest.mark.slow
@pytest.mark.parametrize("level,program", [("O2", PROGRAM), ("overcommit", TAIL)], ids=["O2", "overcommit"])
def test_resume_gives_the_uninterrupted_runs_metrics_and_weights(tmp_path, level, program):
    """4 steps straight vs 2 steps + resume to 4: the same metric rows, and the step-4 checkpoints hold
    the same bits (weights, AdamW moments, RNG states) for every model."""
    job = _job(tmp_path, program, OVERCOMMIT if level == "overcommit" else PIPELINES[level], level)
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_job(job, out=full, steps=4, progress=False)
    run_job(job, out=part, steps=2, progress=False)
    if level == "overcommit":   # the interruption falls while samples are carried over: they are checkpointed
        meta = json.load(open(os.path.join(part, "checkpoints", "step_2", "job.json")))
        assert any(state["carry"] for state in meta["overcommit"].values())
    run_job(job, out=part, steps=4, resume=True, progress=False)
    assert _strip(_metrics(part)) == _strip(_metrics(full))
    _assert_same_tensors(_checkpoint_tensors(part, 4), _checkpoint_tensors(full, 4))
