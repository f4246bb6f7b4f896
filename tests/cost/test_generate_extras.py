"""What a job's torch generate pays beyond the profiled call, measured by `rlhfc profile` at one point
(``generate_extras``: plain, with kept log-probs, streamed in pickled chunks) and priced where the plan
says so: ``logprobs = true`` adds its measured fraction, ``stream = {chunk = C}`` its seconds per chunk."""

from __future__ import annotations

import pytest

from rlhfc.cost import CostConfig, CostModel, Profile
from rlhfc.cost.profile import merge_profiles, model_key, refit

from .helpers import annotate, example

#: [B, P, T, chunks, plain s, with log-probs s, streamed s]
EXTRAS = [16, 16, 40, 4, 0.050, 0.052, 0.056]


def _profile(extras: bool) -> Profile:
    m = example("ppo_tiny")
    points = {"generate": [[b, p, 8.0, 1e-2 + 1e-4 * b * p] for b in (4, 16) for p in (6, 16)],
              "forward": [[b, s, 1e-3 + 2e-6 * b * s] for b in (4, 16) for s in (16, 40)]}
    if extras:
        points["generate_extras"] = [list(EXTRAS)]
    models = {model_key(m.models[n]): refit({"spec": {}, "threads": 1, "points": dict(points)})
              for n in ("actor", "critic", "reward")}
    return Profile("cpu", "test", 1, host={"matmul_flops_1": 1e11}, models=models)


def test_the_extras_are_fitted_merged_and_carried_to_other_shapes():
    prof = _profile(True)
    key = model_key(example("ppo_tiny").models["actor"])
    assert prof.fit(key, "generate_logprobs") == pytest.approx(0.052 / 0.050 - 1)
    assert prof.fit(key, "generate_chunk") == pytest.approx((0.056 - 0.052) / 4)
    wide = key.replace("-h64-", "-h96-")   # an unmeasured width: per call / per chunk, unscaled
    assert prof.fit(wide, "generate_chunk") == pytest.approx(0.001)
    merged = merge_profiles(_profile(False), prof)
    assert merged.fit(key, "generate_logprobs") == pytest.approx(0.04)
    # a slower streamed call than the log-probs one never gives a negative price
    low = refit({"spec": {}, "threads": 1, "points": {"generate_extras": [[16, 16, 40, 4, 0.05, 0.049, 0.048]]}})
    assert low["fit"]["generate_logprobs"] == 0.0 and low["fit"]["generate_chunk"] == 0.0
    assert "generate_chunk" not in _profile(False).models[key]["fit"]


def test_kept_logprobs_and_streamed_chunks_are_priced_where_the_plan_has_them():
    def roll_s(extras: bool, **ann) -> float:
        m = annotate(example("ppo_tiny"), {"roll": ann} if ann else {})
        cm = CostModel(m, CostConfig(profile=_profile(extras)))
        return cm.stage_cost(m.graph.stage("roll")).time_s - cm.dispatch

    plain = roll_s(False)
    assert roll_s(True) == pytest.approx(plain)   # the plan keeps no log-probs and does not stream
    assert roll_s(False, logprobs=True, stream={"chunk": 4}) == pytest.approx(plain)   # the profile has none
    assert roll_s(True, logprobs=True) == pytest.approx(plain * 1.04)
    batch = example("ppo_tiny").graph.stage("roll").outputs[0].type.batch
    assert roll_s(True, stream={"chunk": 4}) == pytest.approx(plain + 0.001 * (-(-batch // 4)))
    assert roll_s(True, logprobs=True, stream={"chunk": 4}) == pytest.approx(plain * 1.04 + 0.001 * (-(-batch // 4)))
