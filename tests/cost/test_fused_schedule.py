"""The fused actor/critic training schedule (RLHFuse's intra-stage fusion, #39): the list scheduler keeps every
dependency, device and memory cap; 1F1B alone takes its textbook time; the annealed fused schedule lies between
its lower bound and the two pipelines run one after the other, reaches the bound where it is reachable, is
repeatable, and finishes in seconds at RLHFuse's model sizes."""

from __future__ import annotations

import pytest

from rlhfc.cost.fused_schedule import BWD, FWD, Op, Pipeline, device_of, one_f_one_b, render, search


def _check(schedule, hop: float = 0.0) -> None:
    """Every operation once, on its device, one at a time, after its dependencies (plus the hop between
    devices), and never more activations held per model than 1F1B holds at that stage."""
    p = schedule.devices
    end: dict[Op, float] = {}
    for d, runs in enumerate(schedule.runs):
        last = 0.0
        held = {}
        for start, stop, op in runs:
            assert device_of(op, p) == d and start >= last - 1e-9
            last = stop
            end[op] = stop
            held[op.model] = held.get(op.model, 0) + (1 if op.kind == FWD else -1)
            stage = op.stage
            assert held[op.model] <= min(schedule.pipelines[op.model].micro, p - stage)
    assert len(end) == sum(2 * pipe.micro * p for pipe in schedule.pipelines)
    starts = {op: s for runs in schedule.runs for s, _, op in runs}
    for op, s in starts.items():
        deps = []
        if op.kind == FWD and op.stage > 0:
            deps = [Op(op.model, FWD, op.micro, op.stage - 1)]
        elif op.kind == BWD:
            deps = [Op(op.model, FWD, op.micro, op.stage)] + \
                ([Op(op.model, BWD, op.micro, op.stage + 1)] if op.stage < p - 1 else [])
        for dep in deps:
            cross = device_of(dep, p) != device_of(op, p)
            assert s >= end[dep] + (hop if cross else 0.0) - 1e-9, (op, dep)
    assert schedule.makespan == pytest.approx(max(end.values()))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_one_f_one_b_alone_takes_m_plus_p_minus_1_slots(p, m):
    sched = one_f_one_b(p, Pipeline("actor", m, 1.0, 2.0))
    _check(sched)
    assert sched.makespan == pytest.approx((m + p - 1) * 3.0)


def test_the_fused_schedule_is_valid_between_its_bound_and_the_unfused_time_and_repeatable():
    actor, critic = Pipeline("actor", 8, 1.0, 2.0), Pipeline("critic", 8, 0.5, 1.0)
    fused = search(4, actor, critic, hop=0.05, iterations=800)
    _check(fused, hop=0.05)
    assert fused.lower_bound <= fused.makespan < fused.unfused
    assert fused.lower_bound == max(fused.critical_path, fused.busiest_device)
    # RLHFuse's bound, max(critical path, total work / devices), is never above the one reported
    total = sum(pipe.micro * (pipe.forward_s + pipe.backward_s) for pipe in (actor, critic))
    assert fused.lower_bound >= max(fused.critical_path, total * 4 / 4)
    again = search(4, actor, critic, hop=0.05, iterations=800)
    assert [[(s, e, op) for s, e, op in rs] for rs in again.runs] == [[(s, e, op) for s, e, op in rs]
                                                                     for rs in fused.runs]
    lines = render(fused, width=40)
    assert len(lines) == 4 and all(len(line) == len("device  0 |") + 41 for line in lines)
    assert set("".join(lines)) >= set("aAcC")


def test_equal_pipelines_fuse_onto_the_lower_bound():
    """Two equal pipelines in opposite directions fill each other's bubbles: the search finds a schedule at the
    bound (the busiest device's work plus the head and tail no schedule avoids), 1.29x the unfused time."""
    pipe = Pipeline("m", 8, 1.0, 2.0)
    fused = search(4, pipe, pipe, iterations=3000)
    _check(fused)
    assert fused.makespan == pytest.approx(fused.lower_bound) and fused.gap == pytest.approx(0.0, abs=1e-9)
    assert fused.unfused == pytest.approx(2 * 33.0) and fused.gain > 1.25


@pytest.mark.parametrize("actor_b,critic_b", [(13, 13), (33, 13), (65, 33)], ids=["13b-13b", "33b-13b", "65b-33b"])
def test_the_search_at_rlhfuses_model_sizes_finishes_in_seconds_and_reports_its_gap(actor_b, critic_b):
    """LLaMA actor/critic pairs of RLHFuse's evaluation sizes on an 8-stage pipeline, 16 micro-batches each; a
    stage's time proportional to its parameters (backward twice the forward). Seconds, a valid schedule, a
    gain over the unfused pipelines and its gap to the bound reported."""
    actor = Pipeline("actor", 16, actor_b / 8, 2 * actor_b / 8)
    critic = Pipeline("critic", 16, critic_b / 8, 2 * critic_b / 8)
    fused = search(8, actor, critic, hop=0.01 * actor_b / 8, iterations=1000, time_limit_s=20.0)
    _check(fused, hop=0.01 * actor_b / 8)
    assert fused.seconds < 20.0
    assert fused.unfused > fused.makespan >= fused.lower_bound
    assert 0.0 <= fused.gap < 0.25
