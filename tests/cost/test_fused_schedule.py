"""The fused actor/critic training schedule (RLHFuse's intra-stage fusion, #39): the list scheduler keeps every
dependency, device and memory cap; 1F1B alone takes its textbook time; the annealed fused schedule lies between
its lower bound and the two pipelines run one after the other, reaches the bound where it is reachable, is
repeatable, and finishes in seconds at RLHFuse's model sizes."""

from __future__ import annotations

import pytest

from rlhfc.cost.fused_schedule import (BWD, FWD, Op, Pipeline, device_of, device_orders, one_f_one_b, order_span, render,
                                       search, stage_sequence)


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


def test_the_executable_orders_keep_each_models_1f1b_order_and_the_searched_interleaving():
    """What the megatron backend's fused training runs (:func:`device_orders`): per device, the two models'
    operations in the searched interleaving, each model's in its rank's 1F1B order (megatron's own schedule);
    it completes (no device waits on an operation queued behind it) faster than the unfused time, and at two or
    four stages within 2 % of the searched makespan. An interleaving that cannot run falls back to the unfused
    order."""
    for devices, micro in ((2, 4), (4, 8)):
        actor, critic = Pipeline("actor", micro, 1.0, 2.0), Pipeline("critic", micro, 0.7, 1.4)
        fused = search(devices, actor, critic, iterations=1500, seed=0)
        orders, span = device_orders(fused)
        for d, order in enumerate(orders):
            for m in (0, 1):
                assert [op[1:] for op in order if op[0] == m] == \
                    stage_sequence(d if m == 0 else devices - 1 - d, devices, micro)
        assert span <= 1.02 * fused.makespan and span < fused.unfused
        assert order_span(devices, (actor, critic), orders) == pytest.approx(span)
    assert stage_sequence(0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    # device 0 waits for the critic's first forward, which device 1 runs only after its actor backward, which
    # waits for device 0's actor forward: no order of this form completes
    pipes = (Pipeline("a", 1, 1.0, 1.0), Pipeline("c", 1, 1.0, 1.0))
    stuck = [[(1, "F", 0), (1, "B", 0), (0, "F", 0), (0, "B", 0)], [(0, "F", 0), (0, "B", 0), (1, "F", 0), (1, "B", 0)]]
    assert order_span(2, pipes, stuck) is None
