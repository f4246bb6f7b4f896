"""The discrete-event simulator: dependencies, overlap groups, streaming, versions, memory, bottleneck."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlhfc.cost import CostConfig, CostModel, simulate

from .helpers import EXAMPLES, annotate, example, gpu_ppo, mesh

CFG = CostConfig(dispatch_s=0.0)


def _task(result, stage, step=None):
    return next(t for t in result.step_tasks(step) if t.stage == stage)


def test_sequential_plan_is_the_sum_of_its_stages():
    m = example("ppo_tiny")
    r = simulate(m, CFG, steps=3)
    total = sum(c.time_s for c in r.costs.values())
    assert r.step_time_s == pytest.approx(total, rel=1e-9)
    # one after another, in IR order, within every step; steps one after another
    tasks = r.step_tasks()
    assert all(a.end <= b.start + 1e-12 for a, b in zip(tasks, tasks[1:]))
    assert r.step_spans[1][0] >= r.step_spans[0][1]
    assert len(r.tasks) == 3 * len(m.graph.stages)


def test_overlap_group_runs_concurrently_only_on_disjoint_meshes():
    m = gpu_ppo()
    seq = simulate(m, CFG, steps=2)
    group = {s: {"overlap": 1} for s in ("logp", "ref_logp", "values", "scores")}
    shared = simulate(annotate(gpu_ppo(), group), CFG, steps=2)
    # same devices: launching together cannot run them at the same time
    assert shared.step_time_s == pytest.approx(seq.step_time_s, rel=1e-9)
    split = annotate(gpu_ppo(), {"logp": mesh(0, 2, overlap=1), "ref_logp": mesh(2, 2, overlap=1),
                                 "values": mesh(4, 2, overlap=1), "scores": mesh(6, 2, overlap=1)})
    r = simulate(split, CFG, steps=2)
    starts = {s: _task(r, s).start for s in ("logp", "ref_logp", "values", "scores")}
    assert max(starts.values()) - min(starts.values()) < 1e-9            # launched together
    assert _task(r, "adv").start >= max(_task(r, s).end for s in starts) - 1e-12
    # without the group the same placement runs them one after another
    alone = simulate(annotate(gpu_ppo(), {"logp": mesh(0, 2), "ref_logp": mesh(2, 2), "values": mesh(4, 2),
                                          "scores": mesh(6, 2)}), CFG, steps=2)
    assert _task(alone, "ref_logp").start >= _task(alone, "logp").end - 1e-12
    assert r.step_time_s < alone.step_time_s


def test_streaming_starts_consumers_before_generation_ends():
    plan = {"roll": mesh(0, 4, stream={"chunk": 64}), "logp": mesh(4, 4, stream_from="roll")}
    m = annotate(gpu_ppo(batch=256, new=512), plan)
    cfg = CostConfig(dispatch_s=0.0, response_lengths="lognormal:0.25:1.0")
    r = simulate(m, cfg, steps=2)
    roll, logp = _task(r, "roll"), _task(r, "logp")
    assert len(logp.chunks) == 4 and logp.start < roll.end                 # overlaps the decoding tail
    assert logp.chunks[-1][0] >= roll.end - 1e-9                           # the last chunk waits for the end
    plain = simulate(annotate(gpu_ppo(batch=256, new=512), {"roll": mesh(0, 4), "logp": mesh(4, 4)}), cfg, steps=2)
    assert _task(plain, "logp").start >= _task(plain, "roll").end - 1e-12
    # consumers on the generating devices cannot start early
    shared = simulate(annotate(gpu_ppo(batch=256, new=512), {"roll": {"stream": {"chunk": 64}},
                                                              "logp": {"stream_from": "roll"}}), cfg, steps=2)
    assert _task(shared, "logp").start >= _task(shared, "roll").end - 1e-12


def test_parameter_versions_order_unrolled_steps_without_a_barrier():
    m = annotate(gpu_ppo(), {"roll": mesh(0, 4), "actor_train": mesh(4, 4)})
    r = simulate(m, CFG, steps=3, step_barrier=False)
    for k in (1, 2):
        roll = next(t for t in r.tasks if t.stage == "roll" and t.step == k)
        train = next(t for t in r.tasks if t.stage == "actor_train" and t.step == k - 1)
        assert roll.start >= train.end - 1e-12          # version @actor %actor_train -> %roll [+1]
    # the critic trains on the step's values: its next values wait for it, other stages need not
    crit = next(t for t in r.tasks if t.stage == "critic_train" and t.step == 0)
    vals = next(t for t in r.tasks if t.stage == "values" and t.step == 1)
    assert vals.start >= crit.end - 1e-12


def test_reallocation_is_charged_when_layouts_change():
    plan = {"roll": mesh(0, 8, tp=8), "logp": mesh(0, 8, tp=8), "actor_train": mesh(0, 8, tp=2, pp=4)}
    r = simulate(annotate(gpu_ppo(), plan), CFG, steps=2)
    assert r.sync_s.get("roll", 0) > 0 and r.sync_s.get("actor_train", 0) > 0 and "logp" not in r.sync_s
    assert any("changes layout" in n for n in r.notes)
    assert _task(r, "roll").duration == pytest.approx(r.costs["roll"].time_s + r.sync_s["roll"], rel=1e-9)


def test_memory_peak_is_resident_plus_running():
    m = gpu_ppo()
    r = simulate(m, CFG, steps=1)
    d = r.devices[0]
    resident = sum(d.static.values())
    biggest = max(c.transient_bytes for c in r.costs.values() if c.layout is not None)
    assert d.peak_memory_bytes == pytest.approx(resident + biggest, rel=1e-9)
    assert {"@actor weights", "@actor grads+optimizer", "@ref weights", "@reward weights"} <= set(d.static)
    assert "@ref grads+optimizer" not in d.static
    # a model placed on half the devices is not resident on the other half
    r2 = simulate(annotate(gpu_ppo(), {"scores": mesh(4, 4)}), CFG, steps=1)
    assert "@reward weights" not in r2.devices[0].static and "@reward weights" in r2.devices[5].static


def test_utilisation_and_bottleneck():
    m = annotate(gpu_ppo(), {"roll": mesh(0, 4), "logp": mesh(0, 4), "ref_logp": mesh(0, 4), "values": mesh(0, 4),
                             "scores": mesh(0, 4), "actor_train": mesh(0, 4), "critic_train": mesh(0, 4)})
    r = simulate(m, CFG, steps=3)
    assert r.devices[0].utilisation > 0.9 and r.devices[7].utilisation == 0.0
    b = r.bottleneck
    assert b["stage"] in r.costs and 0 < b["share"] <= 1 and b["bound"] in ("compute", "memory", "comm", "overhead")
    assert r.critical_path and r.critical_path[-1].end == pytest.approx(r.makespan_s)


def test_cost_model_reuse_gives_identical_results():
    m = example("grpo_tiny")
    cm = CostModel(m, CFG)
    assert simulate(m, steps=2, cost_model=cm).step_time_s == simulate(m, CFG, steps=2).step_time_s


def _with_sync():
    """The actor generating on devices 0-3 and training on 4-7, a sync stage refreshing the generating copy."""
    from rlhfc.ir import Stage, Value, ValueType

    m = annotate(gpu_ppo(), {"roll": mesh(0, 4, tp=4), "logp": mesh(4, 4, tp=4), "actor_train": mesh(4, 4, tp=4)})
    g = m.graph
    train = g.stage("actor_train")
    out = Value(g.fresh_name("actor_sync"), ValueType("Metrics"))
    g.insert(g.stages.index(train) + 1, Stage("sync", "actor", [train.outputs[0]], [out],
                                              {"bucket_mb": 64, "to_first": 0, "to_count": 4},
                                              {"mesh": {"first": 4, "count": 4}}))
    m.refresh_versions()
    return m


def test_sync_stages_keep_per_mesh_copies():
    """With sync stages (the realloc pass's), each mesh keeps a copy: the sync carries the transfer."""
    from rlhfc.ir import get_op

    if get_op("sync") is None:
        pytest.skip("no sync op registered")
    r = simulate(_with_sync(), CFG, steps=2)
    assert set(r.sync_s) == {"actor_sync"} and r.sync_s["actor_sync"] > 0.03 and not r.notes
    sync = _task(r, "actor_sync")
    assert sync.resources == list(range(8)) and sync.duration == pytest.approx(r.sync_s["actor_sync"], rel=1e-9)
    # both meshes hold the actor's weights
    assert "@actor weights" in r.devices[0].static and "@actor weights" in r.devices[5].static


def _o2(name: str):
    from rlhfc.frontend import load_file
    from rlhfc.passes import PassManager, parse_pipeline
    from rlhfc.passes.pipelines import PIPELINES

    module, _, _ = load_file(str(EXAMPLES / f"{name}.rlhf"))
    pipeline = ",".join(PIPELINES["O2"]).replace("placement", "placement{candidates=40}", 1)
    return PassManager(parse_pipeline(pipeline)).run(module)


@pytest.mark.parametrize("build", [
    lambda: gpu_ppo(),
    lambda: annotate(gpu_ppo(), {"scores": mesh(4, 4), "values": mesh(0, 2, overlap=1),
                                 "ref_logp": mesh(2, 2, overlap=1)}),
    lambda: annotate(gpu_ppo(batch=256, new=512), {"roll": mesh(0, 4, stream={"chunk": 48}),
                                                   "logp": mesh(4, 4, stream_from="roll")}),
    lambda: annotate(gpu_ppo(), {"roll": mesh(0, 8, tp=8), "actor_train": mesh(0, 8, tp=2, pp=4)}),
    lambda: _with_sync(),
    lambda: _o2("ppo_70b"),     # placed (a searched plan) and recomputed
], ids=["flat", "overlap", "stream", "relayout", "sync", "ppo_70b-O2"])
def test_exclusive_peaks_are_the_simulated_peaks(build):
    """What a search asks of a candidate — its memory check without a timeline, its step time and fit
    without the simulation's statistics — is the simulation's, exactly."""
    from rlhfc.cost import fits
    from rlhfc.cost.quick import exclusive_peaks, search_price

    m = build()
    cm = CostModel(m, CFG)
    sim = simulate(m, steps=1, cost_model=cm)
    assert exclusive_peaks(m, cm) == [d.peak_memory_bytes for d in sim.devices]
    assert fits(m, cost_model=cm) == fits(m, sim=sim, cost_model=cm)
    three = simulate(m, steps=3, cost_model=cm)
    assert search_price(m, cm, 3) == (three.step_time_s, fits(m, sim=three, cost_model=cm))
    # a device made too small: the same verdicts
    small = CostModel(m, CFG)
    small.spec = replace(small.spec, memory=max(exclusive_peaks(m, cm)) * 0.999)
    assert fits(m, cost_model=small) is False and search_price(m, small, 3)[1] is False
    assert fits(m, sim=simulate(m, steps=1, cost_model=small), cost_model=small) is False


def test_a_task_that_takes_no_time_holds_no_memory_after_it():
    """An interval of no length holds nothing: before, its end sorted before its start and it stayed counted."""
    from rlhfc.cost.scheduling import Task
    from rlhfc.cost.simulator import _peak_overlap

    instant = Task("a", 0, "compute", None, 1.0, 1.0, (0, 1), 0.0, 5e9)
    later = Task("b", 0, "compute", None, 2.0, 3.0, (0, 1), 1.0, 1e9)
    assert _peak_overlap([instant, later]) == (1e9, ["%b@0"])


# -- CPU clusters: workers are processes that share cores ----------------------------------------------------

def _cpu_cm(m, speedup=(1.0,)):
    from dataclasses import replace

    cm = CostModel(m, CFG)
    cm.spec = replace(cm.spec, thread_speedup=tuple(speedup))
    return cm


def test_cpu_concurrent_workers_share_the_cores():
    """On a CPU cluster co-located workers run at the same time, each with its fair share of the cores."""
    group = {s: mesh(0, 2, overlap=1) for s in ("logp", "ref_logp", "values", "scores")}
    m = annotate(example("ppo_tiny"), group)
    r = simulate(m, CFG, steps=2)
    names = ("logp", "ref_logp", "values", "scores")
    tasks = [_task(r, s) for s in names]
    assert max(t.start for t in tasks) - min(t.start for t in tasks) < 1e-12       # launched together
    work = sum(r.costs[s].time_s for s in names)
    span = max(t.end for t in tasks) - min(t.start for t in tasks)
    # four one-thread processes on two cores: never faster than two cores' worth, much faster than in turn
    assert work / 2 - 1e-12 <= span < 0.75 * work
    # each core is busy while the four run (and the devices report it)
    assert all(0 < d.utilisation <= 1 for d in r.devices)


def test_cpu_streamed_consumer_runs_beside_generation():
    """A streamed consumer on the generating cores starts before generation ends: the OS runs both
    processes, one per core, and generation is not slowed (CPU time-sharing, unlike a GPU's queue)."""
    from rlhfc.passes import PassManager, parse_pipeline

    m = PassManager(parse_pipeline("parallelize,stream{chunk=4}")).run(example("ppo_tiny"))
    r = simulate(m, CFG, steps=2)
    roll, ref = _task(r, "roll"), _task(r, "ref_logp")
    assert ref.start < roll.end and len(ref.chunks) == 4
    assert ref.chunks[-1][0] >= roll.end - 1e-12
    # three streamed consumers beside generation: four processes on two cores while they run
    assert r.costs["roll"].time_s < roll.duration < 2 * r.costs["roll"].time_s


def test_cores_follow_the_work():
    """A stage the driver runs alone gets every core of its mesh, even when other workers share them (the
    -O0 schedule); stages that may run at the same time on the same cores split them (parallel forwards),
    the generated calls say so (``threads=1``) and the simulator prices those threads: the parallel part
    of a call on one thread loses the measured two-thread speed-up."""
    from rlhfc.codegen.emitter import PythonEmitter
    from rlhfc.frontend import compile_source
    from rlhfc.ir.schedule import stage_threads
    from rlhfc.passes import PassManager, parse_pipeline

    text = (EXAMPLES / "ppo_tiny.rlhf").read_text().replace("devices = cpu:2", "devices = cpu:4")
    actor = [s.name for s in example("ppo_tiny").graph.stages if s.target == "actor"]
    others = ("ref_logp", "values", "scores", "critic_train")

    def run(other_mesh, passes="dce"):
        m, _ = compile_source(text, "<test>")
        m = PassManager(parse_pipeline(passes)).run(m)
        annotate(m, {**{s: mesh(0, 2) for s in actor}, **{s: other_mesh for s in others}})
        return m, simulate(m, steps=1, cost_model=_cpu_cm(m, (1.0, 1.8)))

    _, alone = run(mesh(2, 2))
    m, shared = run(mesh(0, 2))                                   # four workers on the same two cores
    for r in (alone, shared):                                     # ... but one stage at a time
        assert _task(r, "roll").duration == pytest.approx(r.costs["roll"].time_s, rel=1e-9)
    assert set(stage_threads(m).values()) == {2}
    m, par = run(mesh(0, 2), "dce,parallelize")                   # the four forwards overlap on both cores
    threads = stage_threads(m)
    assert threads["roll"] == 2 and all(threads[s] == 1 for s in ("logp", "ref_logp", "values", "scores"))
    text_job = PythonEmitter(m, source=None, opt_level="O1", passes=[]).emit()
    assert "w.critic.values.remote(roll, threads=1)" in text_job and "generate.remote(prompts" in text_job
    assert "threads=" not in next(line for line in text_job.splitlines() if "generate.remote" in line)
    values, cost = _task(par, "values"), par.costs["values"]
    sigma = cost.parts["overhead"] / cost.time_s
    assert values.duration >= cost.time_s * (sigma + (1 - sigma) * 1.8) * (1 - 1e-6)


def test_fair_shares_are_max_min_fair_within_meshes():
    from rlhfc.cost.scheduling import _fair_shares, _Job

    def job(cores, threads=1):
        return _Job(None, 0, [], frozenset(cores), threads, [], [])

    a, b, c = job({0, 1}), job({0, 1}), job({0, 1})
    shares = _fair_shares([a, b, c])
    assert [shares[id(j)] for j in (a, b, c)] == pytest.approx([2 / 3] * 3)
    # a process pinned to core 1 alone gets it; the two on both cores share what is left
    x, y, z = job({1}), job({0, 1}), job({0, 1})
    s = _fair_shares([x, y, z])
    assert s[id(x)] == pytest.approx(2 / 3) and s[id(y)] == pytest.approx(2 / 3)
    assert sum(s.values()) == pytest.approx(2.0)
    # one two-thread worker alone uses both cores; a one-thread worker at most one
    w2, w1 = job({0, 1}, threads=2), job({0, 1})
    assert _fair_shares([w2])[id(w2)] == pytest.approx(2.0) and _fair_shares([w1])[id(w1)] == pytest.approx(1.0)


def test_cpu_workers_match_the_runtime_placement():
    """The simulator's workers (and their threads) are the ones the generated job starts."""
    from rlhfc.codegen.plan import placement
    from rlhfc.ir.plan import workers
    from rlhfc.frontend import load_file
    from rlhfc.passes import PassManager, parse_pipeline

    for strategy in ("flatten", "interleave", "separate"):
        m, _, _ = load_file(str(EXAMPLES / "ppo_tiny.rlhf"))
        m = PassManager(parse_pipeline(f"dce,parallelize,stream,placement{{strategy={strategy}}},realloc")).run(m)
        sim = workers(m)
        run = placement(m).workers
        assert {w.name: w.threads for w in sim.values()} == {name: w.threads for name, w in run.items()}


def test_gpu_sync_through_the_object_store_pays_two_host_copies():
    from rlhfc.cost.sync import host_copy_time
    from rlhfc.passes import PassManager, parse_pipeline

    times = {}
    for transport in ("object_store", "collective"):
        m = annotate(gpu_ppo(), {"roll": mesh(0, 4, tp=4)} | {s: mesh(4, 4, tp=4) for s in
                                                              ("logp", "ref_logp", "values", "scores",
                                                               "actor_train", "critic_train")})
        m = PassManager(parse_pipeline(f"realloc{{transport={transport}}}")).run(m)
        r = simulate(m, CFG, steps=2)
        times[transport] = r.sync_s["actor_sync"]
    cm = CostModel(gpu_ppo(), CFG)
    nbytes = cm.spec.bytes_per_param * cm.module.models["actor"].params / 4
    assert times["object_store"] - times["collective"] == pytest.approx(2 * host_copy_time(nbytes, cm.spec))
    # GPU clusters get the collective transport by default
    m = annotate(gpu_ppo(), {"roll": mesh(0, 4, tp=4), "actor_train": mesh(4, 4, tp=4)})
    m = PassManager(parse_pipeline("realloc")).run(m)
    assert m.graph.stage("actor_sync").attrs["transport"] == "collective"


def test_a_multi_rank_generator_reshards_after_training_and_the_simulator_prices_the_gather():
    """``realloc`` gives a model that trains as a group of ranks and generates on the same mesh a ``sync``
    onto its own mesh (a reshard into full copies); the simulator charges the group's all-gather of the
    weights each rank lacks (tp2: half), and a one-process model gets no reshard."""
    import os
    import re

    from rlhfc.cost.sync import reshard_time
    from rlhfc.frontend import compile_source
    from rlhfc.ir import plan
    from rlhfc.passes import PassManager, parse_pipeline

    path = os.path.join(os.path.dirname(__file__), "..", "e2e", "mixed_layouts.rlhf")
    text = open(path).read().replace("layout(dp = 2) trainable", "layout(tp = 2) trainable")
    m, _ = compile_source(text, path)
    m = PassManager(parse_pipeline("dce,realloc")).run(m)
    syncs = [s for s in m.graph.stages if s.op == "sync"]
    assert [(s.target, plan.is_reshard(m, s)) for s in syncs] == [("actor", True)]
    assert m.graph.stages.index(syncs[0]) == m.graph.stages.index(m.graph.stage("actor_train")) + 1
    r = simulate(m, CFG, steps=2)
    cm = CostModel(m, CFG)
    nbytes = cm.spec.bytes_per_param * m.models["actor"].params
    src = cm.layout(m.graph.stage("actor_train"))
    want = reshard_time(nbytes, 0.5, 64, src, cm.spec, m.cluster.per_node)
    assert r.sync_s[syncs[0].name] == pytest.approx(want, rel=1e-9) and want > 0
    one, _ = compile_source(re.sub(r" layout\([^)]*\)", "", text).replace("; trainer = auto", ""), path)
    one = PassManager(parse_pipeline("dce,realloc")).run(one)
    assert not [s for s in one.graph.stages if s.op == "sync"]
