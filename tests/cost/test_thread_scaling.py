"""What `rlhfc profile` measures beside the grid for predictions inside real jobs, and how the simulator uses
it: each model's own thread speed-up (timed on 1 thread back to back with its workers' count, priced per
stage), the part of a train call paid once per call rather than once per minibatch, each call timed after
an idle pause as a job's worker calls come; and the dispatch a call's price holds, not stretched by sharing."""

from __future__ import annotations

import pytest

from rlhfc.cost import CostConfig, CostModel, Profile, simulate
from rlhfc.cost.profile import merge_profiles, model_key, refit, train_call

from .helpers import example


def _points(scale: float, gen: float = 1.0) -> dict:
    """A 2 x 2 grid of forward/train points and 2 generate points, every time times ``scale``."""
    return {"forward": [[b, s, scale * (1e-3 + 2e-6 * b * s)] for b in (4, 16) for s in (16, 40)],
            "train": [[b, s, scale * (8e-3 + 6e-6 * b * s)] for b in (2, 8) for s in (16, 40)],
            "generate": [[b, 6, 8.0, gen * scale * (1e-2 + 1e-4 * b)] for b in (4, 16)]}


def _profile(two: dict, one: dict | None, host_speedup=(1.0, 1.7)) -> Profile:
    m = example("ppo_tiny")
    models = {}
    for name in ("actor", "critic", "reward"):
        entry = refit({"spec": {}, "threads": 2, "points": dict(two)})
        if one is not None:
            entry["at_threads"] = {"1": {"points": dict(one)}}
        models[model_key(m.models[name])] = entry
    return Profile("cpu", "test", 2, host={"matmul_flops_1": 1e11, "thread_speedup": list(host_speedup)},
                   models=models)


def test_thread_speedup_is_the_models_own_measured_ratio():
    """T(1) / T(2) per primitive, the median over the points timed at both counts; none without 1-thread
    points (the host's probe stands in); a merge keeps the fastest of each count's points."""
    one = _points(0.9, gen=1.2)     # one thread: forwards and train 10 % faster, generation 20 % slower
    prof = _profile(_points(1.0), one)
    key = model_key(example("ppo_tiny").models["actor"])
    assert prof.thread_speedup(key, "forward") == pytest.approx((1.0, 0.9))
    assert prof.thread_speedup(key, "train") == pytest.approx((1.0, 0.9))
    assert prof.thread_speedup(key, "generate") == pytest.approx((1.0, 1.08))
    assert _profile(_points(1.0), None).thread_speedup(key, "forward") is None
    slower = _profile(_points(1.0), _points(1.5))
    merged = merge_profiles(slower, prof)
    assert merged.thread_speedup(key, "forward") == pytest.approx((1.0, 0.9))
    # an unmeasured width borrows the measured shape's table
    wide = key.replace("-h64-", "-h96-")
    assert prof.thread_speedup(wide, "train") == pytest.approx((1.0, 0.9))
    # ... and its fits at each measured count, transferred (no correction grid), for the stage's own prices
    assert prof.thread_counts(wide) == [1, 2] and prof.fit_at(wide, "forward_grid", 1) is None
    one_fit, two_fit = prof.fit_at(wide, "forward", 1), prof.fit_at(wide, "forward", 2)
    assert two_fit == prof.fit(wide, "forward") and one_fit[0] == pytest.approx(0.9 * two_fit[0], rel=1e-6)
    assert prof.fit_at(key, "forward", 4) is None


def test_a_one_thread_stage_is_priced_with_the_models_speedup():
    """At -O2 the forwards run on 1 thread each beside one another; with the model's own table a stage's
    busy time is its 2-thread price x s(2) / s(1), not the host probe's x 1.7."""
    from rlhfc.passes import PassManager, parse_pipeline

    m = PassManager(parse_pipeline("dce,parallelize")).run(example("ppo_tiny"))
    host_only = simulate(m, CostConfig(profile=_profile(_points(1.0), None), dispatch_s=0.0), steps=2)
    own = simulate(m, CostConfig(profile=_profile(_points(1.0), _points(0.9)), dispatch_s=0.0), steps=2)
    # the four forwards share the two cores (half a core each) in both: their busy times differ by the
    # thread term only
    slowdown = {}
    for name, r in (("host", host_only), ("own", own)):
        task = next(t for t in r.step_tasks() if t.stage == "values")
        slowdown[name] = task.busy / r.costs["values"].time_s
    cost = host_only.costs["values"]
    sigma = cost.parts["overhead"] / cost.time_s
    assert slowdown["own"] == pytest.approx(2 * 0.9, rel=1e-6)
    assert slowdown["host"] == pytest.approx(2 * (sigma + (1 - sigma) * 1.7), rel=1e-6)
    assert own.costs["values"].time_s == pytest.approx(cost.time_s, rel=1e-9)   # priced on its 2 cores alike
    # the dispatch a worker call's price holds is the driver's round trip: not stretched by the sharing
    d = 2e-3
    r = simulate(m, CostConfig(profile=_profile(_points(1.0), _points(0.9)), dispatch_s=d), steps=2)
    task, priced = next(t for t in r.step_tasks() if t.stage == "values"), r.costs["values"].time_s
    assert task.busy == pytest.approx(d + (priced - d) * 2 * 0.9, rel=1e-6)


def test_train_call_is_the_intercept_less_what_a_minibatch_repeats():
    """T(2 minibatches) - T(1) of the same rows is what a minibatch repeats; the rest of the intercept is paid
    once per call, and a train stage of M minibatches is priced with it once."""
    a, per_mb, opt = 8e-3, 3e-3, 1e-3
    pts = _points(1.0)
    pts["train_mb2"] = [[b, 40, 8e-3 + 6e-6 * b * 40 + per_mb] for b in (2, 8)]
    pts["optimizer"] = [opt]
    fits = refit({"spec": {}, "threads": 1, "points": pts})["fit"]
    assert fits["train"][0] == pytest.approx(a, rel=1e-6)
    assert fits["train_call"] == pytest.approx(a - per_mb, rel=1e-6)
    assert train_call({"train": pts["train"]}, fits) is None
    # never more than the intercept less the optimizer step
    assert train_call({**pts, "train_mb2": [[2, 40, 0.0]]}, fits) == pytest.approx(a - opt, rel=1e-6)

    m = example("ppo_tiny")
    key = model_key(m.models["actor"])
    prof = Profile("cpu", "test", 1, host={"matmul_flops_1": 1e11, "thread_speedup": [1.0]},
                   models={key: refit({"spec": {}, "threads": 1, "points": pts})})
    stage = m.graph.stage("actor_train")

    def price(minibatches):
        stage.attrs["minibatches"] = minibatches
        return CostModel(m, CostConfig(profile=prof, dispatch_s=0.0)).stage_cost(stage).time_s

    # one more minibatch of the same rows adds the repeated part only (the grid's ratio is 1 here)
    assert price(2) - price(1) == pytest.approx(per_mb, rel=1e-3)


def test_a_stage_speedup_follows_its_own_rows():
    """The fixed cost of a call and its per-token work scale differently with threads: a 1-thread profile
    whose intercepts are half the 2-thread ones makes small calls (a streamed chunk) gain more from one
    thread than a whole batch; each is the ratio of the stage's own prices at the two counts."""
    import numpy as np

    from rlhfc.cost.model import price

    two = _points(1.0)
    one = {"forward": [[b, s, 0.5e-3 + 2e-6 * b * s] for b in (4, 16) for s in (16, 40)],
           "train": [[b, s, 4e-3 + 6e-6 * b * s] for b in (2, 8) for s in (16, 40)],
           "generate": [[b, 6, 8.0, 0.5e-2 + 1e-4 * b] for b in (4, 16)]}
    m = example("ppo_tiny")
    cm = CostModel(m, CostConfig(profile=_profile(two, one), dispatch_s=0.0))
    stage = m.graph.stage("values")
    whole, chunk = cm.stage_speedup(stage), cm.stage_speedup(stage, rows=2.0)
    assert len(whole) == 2 and whole[0] == 1.0 and 0.5 < chunk[1] < whole[1] < 1.0   # s(2) = T(1) / T(2)

    def at(t, rows):
        return float(np.asarray(price(np, cm.price_inputs(stage, [cm.layout(stage)], rows, threads=t))["total"])[0])

    assert chunk[1] == pytest.approx(at(1, 2.0) / at(2, 2.0), rel=1e-9)
    assert at(2, None) == pytest.approx(cm.stage_cost(stage).time_s, rel=1e-9)   # the mesh's own count
    # no 1-thread points: the host's probe prices thread counts
    assert CostModel(m, CostConfig(profile=_profile(two, None))).stage_speedup(stage) is None


def test_profile_times_other_thread_counts_only_where_stages_can_get_them():
    """1 thread beside the workers' count (what a stage gets whenever it shares its cores), the powers of two
    in between unless --quick; nothing more for a one-thread model."""
    from rlhfc.calibrate import thread_counts

    assert thread_counts(1) == [] and thread_counts(2) == [1] and thread_counts(2, quick=True) == [1]
    assert thread_counts(8) == [1, 2, 4] and thread_counts(8, quick=True) == [1] and thread_counts(6) == [1, 2, 4]


def test_profile_times_a_model_call_after_an_idle_pause_as_a_job_calls_it():
    """Each timed repetition follows an idle pause (a job's worker waits between its calls), which is not
    timed; the in-process benchmark, whose steps run back to back, profiles with pause 0."""
    import time

    from rlhfc.calibrate import JOB_PAUSE_S, _timeit

    starts = []

    def call():
        starts.append(time.perf_counter())

    sec = _timeit(call, reps=3, pause=0.01)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) == 4 and min(gaps) >= 0.01 and sec < 0.005
    assert 0 < JOB_PAUSE_S <= 0.05
