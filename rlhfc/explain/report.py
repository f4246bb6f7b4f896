"""The report ``rlhfc explain`` renders: what the compiler decided and what it predicts.

:func:`build_report` optimises nothing itself: it takes the module after the passes (and the pass
records), prices and simulates it (:mod:`rlhfc.cost`), runs the memory check, and returns a
:class:`Report`. Plan annotations (overlap groups, streams, overcommitment) are read through
:mod:`rlhfc.ir.plan`. The number formats and device grouping the renderers share live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.cost import CostConfig, CostModel, memory_issues, simulate
from rlhfc.contract.engines import rollout_traits
from rlhfc.cost.profile import model_key
from rlhfc.cost.simulator import STEADY_STEPS
from rlhfc.ir import Module, print_module
from rlhfc.ir import plan
from rlhfc.ir.plan import AsyncRollout, async_rollout, overcommit_delta, unset, overlap_group, stream_chunk, workers
from rlhfc.ir.schedule import build_schedule, shared_processes


@dataclass
class Report:
    """A compiled program, priced and simulated: its IR, the passes that ran (with their records), the cost
    model, the simulation, memory issues and notes for the reader."""

    module: Module
    ir: str
    level: str | None
    passes: list
    records: list
    cost_model: CostModel
    sim: object
    issues: list
    notes: list = field(default_factory=list)
    source: str | None = None
    #: what the placement search did (:class:`rlhfc.passes.search.SearchReport` as a dict), when it ran
    search: dict | None = None

    @property
    def costs(self):
        return self.sim.costs

    def device_label(self) -> str:
        c = self.module.cluster
        spec = self.cost_model.spec
        calibrated = spec.source if spec.source != "catalog" else "catalog figures"
        return f"@{c.name}: {c.nodes} x {c.per_node} {c.device} ({calibrated})"


def build_report(module: Module, *, records=None, level: str | None = None, passes=None,
                 config: CostConfig | None = None, steps: int = 3, source: str | None = None) -> Report:
    """Price, simulate and check ``module`` (the IR after the passes)."""
    cm = CostModel(module, config)
    sim = simulate(module, steps=steps, cost_model=cm)
    issues = memory_issues(module, cm.config, sim=sim, cost_model=cm)
    notes = list(sim.notes)
    if cm.spec.source == "uncalibrated":
        notes.append("cpu times are uncalibrated guesses: run `rlhfc profile FILE` once on this machine "
                     "(then explain uses the profile)")
    prof = cm.profile
    if prof is not None and cm.kind == "cpu":
        missing = sorted({c.model for c in sim.costs.values() if c.source == "analytic" and c.model})
        for name in sorted({c.model for c in sim.costs.values() if c.source == "profile" and c.model}):
            donor = prof.donor(model_key(module.models[name]))
            if donor is not None:
                notes.append(f"the profile has not measured @{name}'s shape: its stages are predicted from the "
                             f"measurements of {donor}, scaled to its FLOPs and width (re-run `rlhfc profile` on "
                             "this program to measure it)")
        if missing:
            notes.append(f"the profile has no measurements for {', '.join('@' + m for m in missing)}: "
                         "those stages use the analytical model (re-run `rlhfc profile` on this program)")
    for s in module.graph.stages:
        if overcommit_delta(s):
            notes.append(f"%{s.name} overcommits by {overcommit_delta(s)} prompts: each step trains on the first "
                         f"{s.outputs[0].type.batch} to finish (this changes which samples are trained on)")
    notes += async_notes(module, cm, sim, steps)
    notes += agent_notes(module, sim)
    notes += tail_notes(module, sim)
    notes += fused_notes(module)
    groups: dict = {}
    for s in module.graph.stages:
        g = overlap_group(s)
        if g is not None:
            groups.setdefault(g, []).append(s.name)
    for g, names in sorted(groups.items()):
        if len(names) > 1:
            notes.append(f"overlap group {g}: {', '.join('%' + n for n in names)} are launched together")
    for s in module.graph.stages:
        if stream_chunk(s):
            notes.append(f"%{s.name} streams chunks of {stream_chunk(s)} finished samples to its forwards")
    refill = build_schedule(module).refill
    if refill is not None:   # the simulation prices one sampling round
        extra = sum(sim.costs[n].time_s for n in refill.round if n in sim.costs)
        notes.append(f"%{refill.filter} refills (dynamic sampling): the step time above assumes one sampling round "
                     f"(every group of the first {refill.groups} prompts has unequal scores); each further round "
                     f"runs {', '.join('%' + n for n in refill.round)} again, about {extra:.3g} s more, up to "
                     f"{refill.max_refill} more rounds (+{refill.max_refill * extra:.3g} s at worst)")
    from .recompute import recompute_notes

    notes += recompute_notes(module, cm)
    notes += offload_notes(module, cm)
    from .engines import engine_notes

    notes += engine_notes(module, cm)
    found = getattr(module, "search_report", None)   # set by the placement pass when it searched
    return Report(module, print_module(module), level, list(passes or []), list(records or []), cm, sim, issues,
                  notes, source, found.as_dict() if found is not None else None)


def async_notes(module: Module, cm: CostModel, sim, steps: int) -> list[str]:
    """What asynchronous rollout changes, and its predicted gain: the steady-state step against the same plan
    run synchronously (the bound taken away), both simulated over the same steps."""
    ahead = [(s, a) for s in module.graph.stages if (a := async_rollout(module, s)) is not None]
    if not ahead:
        return []
    sync = module.clone()
    sync.run.staleness = None
    for s in sync.graph.stages:
        unset(s, AsyncRollout.key)
    sync.refresh_versions()
    n = max(steps, STEADY_STEPS)   # a pipeline of steps settles after its warm-up
    base = simulate(sync, steps=n, cost_model=CostModel(sync, cm.config)).step_time_s
    if n != steps:
        sim = simulate(module, steps=n, cost_model=CostModel(module, cm.config))
    out = []
    for s, a in ahead:
        out.append(f"%{s.name} runs up to {a.staleness} step(s) ahead of training (asynchronous rollout; this changes "
                   f"what the job trains on: samples from weights up to {a.staleness} version(s) old, decoupled PPO "
                   f"with behaviour_cap {a.behaviour_cap:g}"
                   + (", its proximal policy interpolated (A-3PO), no proximal forward)" if a.proximal == "loglinear"
                      else ")"))
    out.append(f"asynchronous rollout: predicted steady-state step {sim.step_time_s:.3g} s against "
               f"{base:.3g} s synchronous (x{base / sim.step_time_s:.2f})" if sim.step_time_s > 0 else
               "asynchronous rollout: no step time predicted")
    return out


def agent_notes(module: Module, sim) -> list[str]:
    """The loop of each multi-turn generate as priced (:meth:`rlhfc.cost.model.CostModel.turn_work`): its turns'
    decode calls and the tool calls between them."""
    out = []
    for s in module.graph.stages:
        cost = sim.costs.get(s.name)
        if not plan.multi_turn(s) or cost is None or "turn_s" not in cost.work:
            continue
        w = cost.work
        between = (f"tool(s) {', '.join(str(s.attrs['tools']).split(','))}" if s.attrs.get("tools") else
                   f"environment {s.attrs.get('env')}")
        turns = ", ".join(f"turn {k + 1} {fmt_seconds(t)} ({r:.0f} rows)"
                          for k, (t, r) in enumerate(zip(w["turn_s"], w["turn_rows"])))
        basis = ("max_turns, an upper bound: `--turns` or `--turns-from RUN` prices a mean"
                 if w["turns_source"] != "given" else "--turns or a run's, --turns-from")
        calls = (f"{w['tool_calls']:.0f} tool calls, {fmt_seconds(w['tool_s'])} on this mesh (sandbox fork and "
                 "exchange; `--tool-s` adds the tool's own seconds per call)" if w["tools"] else
                 f"{w['env_steps']:.0f} environment steps (in the worker, not priced)")
        out.append(f"%{s.name} is a multi-turn loop: up to {w['max_turns']} policy turns of at most "
                   f"{w['turn_tokens']} token{'s' if w['turn_tokens'] != 1 else ''}, {between} between them; priced at {w['expected_turns']:g} turns per "
                   f"trajectory ({basis}), each turn one decode call re-prefilling prompt + trajectory so far "
                   f"(+{w['obs_tokens']:.3g} answer tokens a turn): {turns}; {calls}")
    return out


def tail_notes(module: Module, sim) -> list[str]:
    """Each long-tail migration (the ``tail_migrate`` pass) as the length law places it: how many rows move, when
    a rank's tail starts (:func:`rlhfc.cost.scheduling.tail_split`), the rank time it frees a step, and the
    predicted step against the same plan without the migration (on a CPU cluster the simulator gives the freed
    cores to the stages that share them; on GPUs it does not model the freed devices yet)."""
    import copy

    from rlhfc.cost.scheduling import tail_split

    out, without = [], None
    for s in module.graph.stages:
        t, cost = plan.tail(s), sim.costs.get(s.name)
        if t is None or cost is None:
            continue
        ranks = plan.worker_ranks(module, s.target, plan.stage_mesh(module, s))
        per = -(-(s.outputs[0].type.batch or 1) // ranks)
        price = CostModel(module).tail_move(s, ranks, t.below)
        how = (f"with their KV caches ({price['kv_bytes'] / 1e6:.2g} MB, priced {fmt_seconds(price['kv'])} against "
               f"{fmt_seconds(price['prefill'])} re-prefilled)" if t.move == "kv" else
               f"re-prefilled (priced {fmt_seconds(price['prefill'])}"
               + (f" against {fmt_seconds(price['kv'])} moving their KV caches)"
                  if rollout_traits(plan.stage_engine(module, s)).kv_moves else ")"))
        line = (f"%{s.name} moves its tail (tail_migrate): each of its {ranks} ranks decodes its {per} rows and stops "
                f"once fewer than {t.below} decode; the at most {ranks * (t.below - 1)} rows left continue on the "
                f"first rank {how}, each on its own random stream: the same tokens")
        split = tail_split(module, s, cost)
        end = max(cost.finish_offsets) if cost.finish_offsets else 0.0
        if split is not None and end > split[0]:
            line += (f"; by the length law the tail starts at {fmt_seconds(split[0])} of {fmt_seconds(end)}, freeing "
                     f"{ranks - 1} rank{'s' if ranks > 2 else ''} for the last {fmt_seconds(end - split[0])}")
        if without is None:
            bare = copy.deepcopy(module)
            for g in bare.graph.stages:
                plan.set_tail(g, None)
            without = simulate(bare).step_time_s
        if sim.step_time_s > 0 and without > 0:
            line += (f"; predicted step {fmt_seconds(sim.step_time_s)} against {fmt_seconds(without)} without it "
                     f"(x{without / sim.step_time_s:.2f}"
                     + (", the freed cores given to the forwards that share them)" if module.cluster.device == "cpu"
                        else "; freed GPUs are not modelled yet)"))
        out.append(line)
    return out


def fused_notes(module: Module) -> list[str]:
    """Each fused training pair (the ``fuse_training`` pass): the searched schedule's predicted gain and its gap to
    the lower bound (RLHFuse's max(critical path, busiest device)), and its drawing (one line per device: ``a``/``A``
    the first model's forward/backward steps, ``c``/``C`` the second's)."""
    from rlhfc.cost.fused_pairs import pair_schedule
    from rlhfc.cost.fused_schedule import device_orders, render

    out = []
    for s in module.graph.stages:
        f = plan.fused(s)
        other = next((g for g in module.graph.stages if g.name == f.partner), None) if f is not None else None
        if f is None or f.role != 0 or other is None:
            continue
        schedule = pair_schedule(module, s, other)
        _, span = device_orders(schedule)
        drawing = "\n      ".join(render(schedule, width=60))
        out.append(f"%{s.name} and %{other.name} train as one fused pipeline schedule (fuse_training, RLHFuse) on "
                   f"{schedule.devices} devices, @{other.target}'s stages in reverse: the searched schedule takes "
                   f"{fmt_seconds(span)} against {fmt_seconds(schedule.unfused)} one after the other (x{f.gain:.2f}; "
                   f"lower bound {fmt_seconds(schedule.lower_bound)}, "
                   f"{max(span / schedule.lower_bound - 1.0, 0.0) if schedule.lower_bound > 0 else 0.0:.0%} above it"
                   + ("; the CPU simulator prices the two as sharing the cores, not this gain" if
                      module.cluster.device == "cpu" else "") + f"):\n      {drawing}")
    return out


def search_summary(report: Report) -> str | None:
    """One line on the placement search (None when placement did not search): candidates, time, best."""
    sr = report.search
    if not sr:
        return None
    seeds = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in sr["seeds"].items())
    return (f"placement search ({sr['strategy']}): {sr['candidates']} candidate plans priced in "
            f"{sr['seconds']:.1f} s, best {fmt_seconds(sr['best_s'])} per step "
            f"({len(sr['trajectory'])} improvements; strategies: {seeds})")


def worker_rows(module: Module) -> list[dict]:
    """What the job runs, per worker (:func:`rlhfc.ir.plan.workers`, as ``plan.json`` says it): its name,
    model, devices, the resolved trainer, the layout, the processes (``ranks``) and the process it shares with
    other workers (``process``, :func:`rlhfc.ir.schedule.shared_processes`; None for its own)."""
    placed = workers(module)
    shared = shared_processes(module, placed)
    return [{"worker": w.name, "model": w.model, "mesh": {"first": w.mesh.first, "count": w.mesh.count},
             "trainer": w.trainer, "dp": w.dp, "tp": w.tp, "pp": w.pp, "ranks": w.ranks,
             "process": shared.get(key)}
            for key, w in placed.items()]


def worker_text(row: dict) -> str:
    """``actor: dp2 tp1 pp1 · fsdp · 2 processes (devices 0-1)``; ``ref: ... · 1 process, shared with actor,
    critic (devices 0-1)``"""
    m = row["mesh"]
    devices = f"device {m['first']}" if m["count"] == 1 else f"devices {m['first']}-{m['first'] + m['count'] - 1}"
    procs = f"{row['ranks']} process{'es' if row['ranks'] != 1 else ''}"
    if row.get("process"):
        procs += " shared with " + ", ".join(n for n in row["process"].split("+") if n != row["worker"])
    return f"{row['worker']}: dp{row['dp']} tp{row['tp']} pp{row['pp']} · {row['trainer']} · {procs} ({devices})"


def fmt_seconds(x: float) -> str:
    if x >= 100:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e6:.0f} us"


def fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def device_groups(report: Report) -> list[tuple[list[int], object]]:
    """Consecutive devices with the same load and memory, collapsed (128 identical GPUs are one row)."""
    out: list = []
    for d in report.sim.devices:
        sig = (round(d.busy_s, 9), round(d.peak_memory_bytes), tuple(sorted(d.static.items())))
        if out and out[-1][2] == sig and out[-1][0][-1] == d.index - 1:
            out[-1][0].append(d.index)
        else:
            out.append(([d.index], d, sig))
    return [(ids, d) for ids, d, _ in out]


def ids_text(ids: list[int]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def offload_notes(module, cm) -> list[str]:
    """What ``explain`` says about each train stage whose optimizer lives on the host (the ``offload`` pass):
    the device memory it frees and the seconds per step it costs."""
    from rlhfc.ir import plan

    notes = []
    for s in module.graph.stages:
        if not plan.offload(s):
            continue
        cost = cm.stage_cost(s)
        trial = module.clone()
        plan.set_offload(trial.graph.stage(s.name), False)
        kept = type(cm)(trial, cm.config).stage_cost(trial.graph.stage(s.name))
        freed = kept.state_bytes - cost.state_bytes
        host = cost.parts.get("offload", 0.0)
        notes.append(f"%{s.name} keeps @{s.target}'s optimizer state on the host (offload: "
                     + (f"frees {freed / 2 ** 30:.1f} GiB per device, costs {host:.3g} s of host transfers and "
                        f"host-side Adam per step" if freed > 0 else "the host is the device here: nothing moves")
                     + ")")
    return notes

