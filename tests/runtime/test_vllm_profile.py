"""``rlhfc profile`` measures the vLLM engine (issue #15): on a head-size-64 tiny llama it records generate
points with the rows' own tokens, a refit point and the engine's limits, and fits a rate the cost model
prices; a head-size-16 model is recorded as one vLLM cannot run, with the reason, without starting an
engine. Skipped where vLLM is not installed; marked ``slow`` (left out by ``-m "not slow"``): vLLM's import and one engine
start take 25-80 s on the shared 2-core machine, too much for the default CI run's budget."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")


@pytest.mark.slow
def test_profile_records_vllm_speed_and_refit_on_a_head_size_64_model():
    from rlhfc.calibrate.vllm_engine import measure_vllm
    from rlhfc.cost.engine import vllm_features

    saved = dict(os.environ)
    spec = dict(arch="llama", layers=1, hidden=64, heads=1, kv_heads=1, ffn=128, vocab=64, max_seq=64, head="lm",
                source=None)
    small = measure_vllm(dict(spec, hidden=64, heads=4), 1, quick=True, reps=1)
    assert small == {"unsupported": "vLLM cannot run its head size 16 (hidden 64 / heads 4)"}
    entry = measure_vllm(spec, 1, quick=True, reps=1, copy_bw=1e10)
    assert dict(os.environ) == saved   # the engine's TMPDIR and caches do not leak into the process
    points = entry["points"]["generate"]
    assert len(points) == 8 and all(0 < steps <= B * steps and steps <= tokens <= B * steps and sec > 0
                                    for B, P, steps, tokens, sec in points)
    fit = entry["fit"]["generate"]
    predicted = [sum(c * f for c, f in zip(fit, vllm_features(*p[:4]))) for p in points]
    assert all(0.2 < pr / p[4] < 5 for pr, p in zip(predicted, points))   # the fit follows the measurements
    (nbytes, layers, sec), = entry["points"]["refit"]
    assert layers == 1 and nbytes > 0 and sec > 0 and entry["fit"]["refit_layer_s"] >= 0
    assert entry["max_num_seqs"] >= 1 and entry["engine_start_s"] > 0
