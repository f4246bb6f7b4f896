"""Calibration: NNLS fits, profile files, merging, and a real (small) measurement through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlhfc.cli import main
from rlhfc.cost import CostConfig, CostModel, Profile, ProfileError, load_profile, model_key
from rlhfc.cost.profile import (default_profile_path, find_default_profile, fit_relative, forward_features,
                                generate_features, merge_profiles, nnls, refit)

from .helpers import example

MICRO = """
cluster local { devices = cpu:1 }
model actor  = llama(layers = 1, hidden = 16, heads = 2, vocab = 32, max_seq = 48) trainable
model critic = like(actor) head = value trainable
data prompts = synthetic(count = 64, min_len = 3, max_len = 6)
pipeline ppo(batch = 4) {
  roll   = actor.generate(prompts, max_new_tokens = 6)
  logp   = actor.logprobs(roll)
  values = critic.values(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_fraction", roll)
  adv, ret = gae(scores, values)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3)
  critic.train(value_loss(roll, values, ret), lr = 1e-3)
}
"""


def test_nnls_matches_least_squares_and_stays_non_negative():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, size=(30, 4))
    x = np.array([0.5, 0.0, 2.0, 1.0])
    got = nnls(a, a @ x)
    np.testing.assert_allclose(got, x, atol=1e-9)
    b = a @ np.array([1.0, -3.0, 0.5, 0.0])              # the unconstrained optimum has a negative entry
    got = nnls(a, b)
    assert (got >= 0).all()
    assert np.linalg.norm(a @ got - b) <= np.linalg.norm(a @ np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None) - b)


def test_fits_recover_known_costs():
    coef = [2e-3, 1e-6, 1.5e-3, 2e-5, 3e-8]
    pts = [(b, p, t) for b in (4, 16, 48) for p in (6, 16) for t in (8, 40)]
    secs = [float(np.dot(generate_features(*x), coef)) for x in pts]
    np.testing.assert_allclose(fit_relative([generate_features(*x) for x in pts], secs), coef, rtol=1e-6)
    fcoef = [4e-3, 7e-6, 2e-9]
    fpts = [(b, s) for b in (4, 16, 48) for s in (16, 40, 64)]
    got = fit_relative([forward_features(*x) for x in fpts], [float(np.dot(forward_features(*x), fcoef)) for x in fpts])
    np.testing.assert_allclose(got, fcoef, rtol=1e-6)


def test_profile_round_trip_merge_and_errors(tmp_path):
    entry = refit({"spec": {}, "threads": 2, "points": {"forward": [[4, 16, 0.010], [16, 64, 0.030], [8, 32, 0.02]],
                                                        "optimizer": [0.003]}})
    slow = refit(json.loads(json.dumps(entry)))
    slow["points"]["forward"] = [[b, s, t * 1.5] for b, s, t in slow["points"]["forward"]]
    a = Profile("cpu", "cpu x", 2, {"matmul_flops_1": 1e10}, {"k": entry})
    b = Profile("cpu", "cpu x", 2, {"matmul_flops_1": 2e10}, {"k": refit(slow)})
    a.models["k"]["recompute"] = {"rows": 1, "seq": 64, "op_s": {"mm.default#0": 1e-4}}   # its block's replay times
    merged = merge_profiles(b, a)
    assert [p[2] for p in merged.models["k"]["points"]["forward"]] == [0.010, 0.030, 0.02]
    assert merged.host["matmul_flops_1"] == 2e10 and merged.models["k"]["recompute"] == a.models["k"]["recompute"]
    path = str(tmp_path / "p.json")
    merged.save(path)
    again = load_profile(path)
    assert again.models == merged.models and again.path == path and again.fit("k", "optimizer") == 0.003
    (tmp_path / "bad.json").write_text("{\"format\": 99}")
    with pytest.raises(ProfileError, match="format 99"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))


def test_default_location_follows_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFC_CACHE_DIR", str(tmp_path))
    path = default_profile_path("cpu", "AMD EPYC 7B13")
    assert path == str(tmp_path / "profile-amd-epyc-7b13.json")
    assert find_default_profile("cpu") is None


def test_profile_command_measures_and_explain_uses_it(tmp_path, capsys):
    src = tmp_path / "micro.rlhf"
    src.write_text(MICRO)
    out = tmp_path / "prof.json"
    code = main(["profile", str(src), "--quick", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    prof = load_profile(str(out))
    assert prof.device_kind == "cpu" and prof.threads == 1
    keys = set(prof.models)
    assert {k.rsplit("-", 1)[1] for k in keys} == {"lm", "value"}
    lm = next(v for k, v in prof.models.items() if k.endswith("-lm"))
    assert set(lm["fit"]) == {"generate", "forward", "train", "optimizer", "forward_grid", "train_grid", "train_call",
                              "generate_logprobs", "generate_chunk"}
    assert 0.0 <= lm["fit"]["generate_logprobs"] < 0.5 and 0.0 <= lm["fit"]["generate_chunk"] < 0.05
    assert 0.0 <= lm["fit"]["train_call"] <= lm["fit"]["train"][0] and "at_threads" not in lm   # 1 thread only
    grid = lm["fit"]["forward_grid"]
    assert len(grid["ratio"]) == len(grid["B"]) and all(len(r) == len(grid["S"]) for r in grid["ratio"])
    assert all(len(lm["fit"][k]) in (3, 5) for k in ("generate", "forward", "train"))
    assert "compute.gae" in prof.compute and "compute.rule" in prof.compute
    assert prof.host["matmul_flops_1"] > 1e8 and prof.host["thread_speedup"][0] == 1.0
    rc = prof.host["recompute"]              # what a recompute pays beyond its ops: measured, not assumed
    assert [int(n) for n, _ in rc["fresh_s_per_byte"]] == [2 ** 25]
    # measured as a CPU worker runs: with the allocator keeping freed memory (rlhfc.runtime.worker.allocator), where a
    # fresh 32 MiB output costs next to nothing beyond writing it (glibc's default: ~0.3 ns a byte of faults)
    assert prof.host["allocator"] == "retain" and rc["fresh_s_per_byte"][0][1] < 1e-10
    assert rc["ckpt_op_s"] > 0 and rc["ckpt_region_s"] >= 0 and all(r >= 0 for _, r in rc["fresh_s_per_byte"])
    # each trained model's own block, timed op by op at the micro-batch its stage trains at
    for v in prof.models.values():
        own = v["recompute"]
        assert own["rows"] >= 1 and 2 <= own["seq"] <= 48 and len(own["op_s"]) > 10
        assert any(k.startswith("mm.default#") for k in own["op_s"]) and all(t >= 0 for t in own["op_s"].values())
        assert 0 < own["ckpt_op_s"] < 1e-3           # a selective checkpoint's call, on that block at that shape
        # taken in rounds spread over the profile (first, after the lm's generate and forward probes, last)
        assert own["rounds"] == 4
    code = main(["explain", str(src), "-O1", "--profile", str(out), "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    sources = {s["name"]: s["source"] for s in report["stages"]}
    assert sources["roll"] == "profile" and sources["actor_train"] == "profile" and sources["adv"] == "profile"
    assert report["profile"] == str(out) and report["predicted_step_time_s"] > 0
    # a profile taken on another device kind is not used for this cluster
    gpu = Profile("H100-80GB", "H100", 8, {"matmul_flops": 6e14, "copy_bw": 2.8e12})
    m = example("ppo_70b")
    assert CostModel(m, CostConfig(profile=gpu)).spec.mem_eff == pytest.approx(2.8e12 / 3.35e12)
    assert CostModel(example("ppo_tiny"), CostConfig(profile=gpu)).profile is None
    assert model_key(m.models["ref"]) == model_key(m.models["actor"])


def test_grid_correction_interpolates_measurements():
    from rlhfc.cost.formulas import grid_ratio

    pts = [[b, s, 0.001 * b * s * (1.2 if (b, s) == (16, 40) else 1.0)] for b in (4, 16, 64) for s in (16, 40, 64)]
    entry = refit({"spec": {}, "threads": 1, "points": {"forward": pts}})
    grid = entry["fit"]["forward_grid"]
    coef = entry["fit"]["forward"]
    for b, s, t in pts:                                   # exact at the grid points
        pred = float(np.dot(forward_features(b, s), coef)) * float(grid_ratio(np, grid, np.array([b]), s)[0])
        assert pred == pytest.approx(t, rel=1e-9)
    mid = float(grid_ratio(np, grid, np.array([10.0]), 28.0)[0])
    assert min(min(r) for r in grid["ratio"]) <= mid <= max(max(r) for r in grid["ratio"])
    assert float(grid_ratio(np, grid, np.array([500.0]), 1000.0)[0]) == pytest.approx(grid["ratio"][-1][-1])


def test_cost_imports_neither_the_runtime_nor_torch():
    """Measuring lives in rlhfc.calibrate; nothing under rlhfc/cost imports the runtime, torch or Ray, at module
    level or inside a function."""
    import ast
    from pathlib import Path

    import rlhfc.cost

    found = []
    for path in sorted(Path(rlhfc.cost.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names
                      if n.split(".")[0] in ("torch", "ray") or n.startswith("rlhfc.runtime")]
    assert found == []


def test_an_unmeasured_shape_is_predicted_from_the_nearest_measured_one():
    """Another width or depth borrows the nearest measured shape's fits (same architecture and head): per-call
    terms follow the layers, per-token terms their matmul FLOPs (at the host's rate) plus a remainder that
    follows layers x width; the correction grid does not transfer; another head or architecture gets none."""
    from rlhfc.cost.profile import Profile, matmul_params, parse_key

    small, wide, deep = ("llama-L1-h32-a2-kv2-f96-v64-lm", "llama-L1-h64-a2-kv2-f192-v64-lm",
                         "llama-L2-h32-a2-kv2-f96-v64-lm")
    fwd = [1e-3, 2e-6, 1e-8]
    prof = Profile("cpu", "test", 2, host={"matmul_flops_1": 1e11, "thread_speedup": [1.0, 1.8]},
                   models={small: {"threads": 1, "fit": {"forward": fwd, "forward_grid": {"B": [1.0]},
                                                         "train": [2e-3, 6e-6, 3e-8], "optimizer": 1e-3,
                                                         "generate": [0.0, 2e-6, 1e-4, 1e-6, 1e-8]}}})
    assert prof.fit(small, "forward") == fwd and prof.donor(small) is None
    assert prof.donor(wide) == small and prof.model_threads(wide) == 1
    assert prof.fit(wide, "forward_grid") is None
    a, b, c = prof.fit(wide, "forward")
    mm = 2 * matmul_params(parse_key(small)) / 1e11      # the matmul part of a token's 2 us (0.3 us)
    assert a == fwd[0] and c == 2 * fwd[2]                # per call: same layers; attention: 2x the width
    ratio = matmul_params(parse_key(wide)) / matmul_params(parse_key(small))
    assert abs(b - (mm * ratio + (fwd[1] - mm) * 2)) < 1e-15 and ratio > 2
    deep_fit = prof.fit(deep, "generate")
    assert deep_fit[2] == 2e-4 and deep_fit[4] == 2e-8   # a decode step's per-layer overhead doubles
    assert prof.fit("llama-L1-h32-a2-kv2-f96-v64-value", "forward") is None
    assert prof.fit("gpt2-L1-h32-a2-kv2-f96-v64-lm", "forward") is None


def test_correction_grid_ratios_are_held_within_the_clamp():
    """A grid ratio far from 1 is more likely a disturbed measurement than a kernel effect: the profile hands the
    cost model ratios within GRID_CLAMP (the stored points stay as measured)."""
    from rlhfc.cost.profile import GRID_CLAMP, Profile

    key = "llama-L1-h32-a2-kv2-f96-v64-lm"
    grid = {"B": [2.0, 8.0], "S": [16.0, 40.0], "ratio": [[1.1, 3.3], [0.4, 0.95]]}
    prof = Profile("cpu", "t", 2, models={key: {"threads": 1, "fit": {"train": [1e-3, 1e-6, 0.0], "train_grid": grid}}})
    lo, hi = GRID_CLAMP
    assert prof.fit(key, "train_grid")["ratio"] == [[1.1, hi], [lo, 0.95]]
    assert grid["ratio"][0][1] == 3.3
