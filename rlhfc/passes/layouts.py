"""Applying a placement: each model stage's mesh, then the fastest parallel split that fits its memory.

A plan here is ``{stage name: (first, count)}``. :func:`apply` annotates every model stage with its mesh and
picks its ``(dp, tp, pp)``, micro-batches and recompute policy among the splits the hardware rules allow
(:mod:`rlhfc.ir.plan.hardware`) and the run's trainer can run. A stage whose value is a whole
:class:`~rlhfc.ir.plan.Layout` instead of a mesh is *pinned*: it keeps that layout (the placement search's
candidates that carry a baseline system's layouts, or a layout its local search chose), and the other stages
are chosen around what it holds.

Memory is counted once: a stage may use what its devices have left after what the *other* models placed
there hold (their chosen layout's weights and optimizer state, or the least any of their layouts needs
while not yet chosen), beside what its own model already holds there. No device's capacity is split per
model or shrunk beyond that; ``squeeze`` (placement's retry when the simulated peak of stages running at
the same time overflows) divides only that remaining headroom.

:func:`place` places a plan as the ``placement`` pass emits it (its search prices every candidate that way):
the layouts chosen until the devices' totals fit, and the earlier passes' decisions the plan takes back
(:data:`STREAMS`, :data:`OLD_LOGPROBS`: plan keys that are never a stage's name).
"""

from __future__ import annotations

from rlhfc.cost import CostModel, candidate_layouts, evaluate, fits
from rlhfc.ir import Module, plan
from rlhfc.ir.plan import Layout

from .reuse_logprobs import take_back

#: a plan's key (never a stage name) whose value ``False`` says the plan runs without the ``stream`` pass's
#: chunked generation (its ``stream``/``stream_from`` annotations taken back): the baseline systems' plans do
#: not stream, and on some meshes streaming costs more than it overlaps, so the search prices both
STREAMS = "(streams)"
#: a plan's key whose value ``False`` says the plan recomputes the policy's old log-probs with a forward, as the
#: program wrote it (``reuse_logprobs``' decision taken back: :func:`rlhfc.passes.reuse_logprobs.take_back`,
#: the stages regrouped by the pipeline's ``parallelize``): the baseline systems recompute them, and on some
#: clusters (2 CPU cores) the forward beside the others costs less than keeping them during generation
OLD_LOGPROBS = "(sampled logprobs)"


def runnable(module: Module, model, lay: Layout) -> bool:
    """Whether the run's trainer can run ``model`` in ``lay``'s split: a fixed layout only as fixed; else the
    backend's factors only (fsdp: dp), with tp dividing heads, kv_heads, ffn and vocab and pp dividing layers
    (megatron, or auto picking it). A one-process backend (torch) runs whatever the split (it only prices the
    plan)."""
    fixed = plan.fixed_layout(model)
    if fixed is not None:
        return (lay.dp, lay.tp, lay.pp) == (fixed.dp, fixed.tp, fixed.pp)
    traits = plan.backend_traits(plan.resolve_trainer(module.run.trainer, plan.Parallel(lay.dp, lay.tp, lay.pp)))
    if not traits.dims:
        return True
    return traits.runs(lay.dp, lay.tp, lay.pp) and model.layers % lay.pp == 0 \
        and all(v % lay.tp == 0 for v in (model.heads, model.kv_heads, model.ffn, model.vocab))


def model_stages(module: Module) -> dict[str, list]:
    """The stages of each model (the stages a plan places), by model in the order they first appear."""
    out: dict[str, list] = {}
    for s in module.graph.stages:
        if s.target in module.models:
            out.setdefault(s.target, []).append(s)
    return out


def mesh_of(value) -> tuple[int, int]:
    """``(first, count)`` of a plan's value for a stage: a mesh pair, or a pinned :class:`Layout`."""
    return (value.first, value.count) if isinstance(value, Layout) else value


def set_meshes(module: Module, assign: dict) -> None:
    """Every assigned stage's mesh, split dp only (a fixed-layout model's: its layout, on a mesh of its size);
    a pinned stage (its value a :class:`Layout`): that layout."""
    for s in module.graph.stages:
        if s.name not in assign:
            continue
        if isinstance(assign[s.name], Layout):
            plan.set_layout(s, assign[s.name])
            continue
        first, count = assign[s.name]
        fixed = plan.fixed_layout(module.models.get(s.target or ""))
        if fixed is not None and fixed.size == count:
            plan.set_layout(s, Layout(first, count, fixed.dp, fixed.tp, fixed.pp))
        else:
            plan.set_layout(s, Layout(first, count, dp=count))


#: placement's retries when stages running at the same time overflow a device: each stage's headroom divided by
SQUEEZES = (1, 2, 4, 8)


def apply_fitting(module: Module, assign: dict, fits) -> None:
    """:func:`apply`, the stages' headroom squeezed (:data:`SQUEEZES`) until ``fits(module)``. A squeeze that
    would choose the layouts of the one before is skipped (that plan did not fit), and the last is not
    checked (it is kept either way): a search places a thousand plans this way."""
    picks = None
    for squeeze in SQUEEZES:
        if picks is not None and picks.same_at(squeeze):
            continue
        picks = apply(module, assign, squeeze=squeeze)
        if squeeze == SQUEEZES[-1] or fits(module):
            return


def place(module: Module, assign: dict, strategy: str, regroup=None) -> None:
    """Annotate ``module`` with the plan ``assign`` (meshes, or pinned layouts, per stage; :data:`STREAMS`,
    :data:`OLD_LOGPROBS`) as the pass emits it: each stage's layout (:func:`apply`), each stage's memory budget
    tightened until the devices' totals fit, the strategy. ``regroup``: the pipeline's ``parallelize`` pass
    (None if it has none), run again when the plan takes ``reuse_logprobs``' decision back."""
    if assign.get(OLD_LOGPROBS) is False:
        take_back(module)
        if regroup is not None:
            regroup.run(module)
        assign = {**assign, **_restored_meshes(module, assign)}
    if assign.get(STREAMS) is False:
        for s in module.graph.stages:
            plan.unset(s, "stream", "stream_from")
    # each stage's memory budget tightened until the devices' totals fit
    apply_fitting(module, assign, lambda m: m.cluster.device == "cpu" or fits(m))
    plan.set_strategy(module, strategy)


def _restored_meshes(module: Module, assign: dict) -> dict:
    """A mesh for each model stage ``assign`` does not place (a forward :data:`OLD_LOGPROBS` restored): its
    model's mesh for stages other than generation (as the search places a model's stages together)."""
    out = {}
    stages = [s for group in model_stages(module).values() for s in group]
    for s in stages:
        if s.name not in assign:
            siblings = [mesh_of(assign[o.name]) for o in stages if o.target == s.target and o.name in assign]
            others = [mesh_of(assign[o.name]) for o in stages if o.target == s.target and o.name in assign
                      and o.op != "generate"]
            if others or siblings:
                out[s.name] = (others or siblings)[0]
    return out


class Picks:
    """What :func:`apply` chose for each stage it chose among candidates, and what decided it: the candidates
    in order of time, each one's peak and the devices' base (``need``, ``base``), so that another squeeze's
    choice can be told without choosing again. The same picks leave the same state for the stages after, so
    the same picks everywhere are the same plan."""

    def __init__(self, memory: float):
        self.memory = memory
        self.stages: list[tuple] = []   # (candidates by time, their peaks, base, all candidates, the pick)

    def same_at(self, squeeze: int) -> bool:
        for order, need, base, idx, pick in self.stages:
            room = (self.memory - base) / squeeze   # as apply computes it
            again = next((i for i in order if need[i] - base <= room), None)
            if again is None:
                again = sorted(idx, key=lambda i: need[i])[0]
            if again != pick:
                return False
        return True


def apply(module: Module, assign: dict, layouts: bool = True, squeeze: int = 1) -> Picks:
    """Annotate every model stage with its mesh and the fastest parallel split that fits (a fixed-layout
    model's stages: its layout, on a mesh of its size; a pinned stage: its layout, chosen first so the
    others fit around it); what it chose (:class:`Picks`)."""
    set_meshes(module, assign)
    if not layouts or module.cluster.device == "cpu":
        return Picks(0.0)
    cm = CostModel(module)
    picks = Picks(cm.spec.memory)
    # a group of processes runs one split: beyond torch (one process), a model's stages on one mesh share
    # the split its train stage (else its first stage there) gets
    one_split = module.run.trainer == plan.AUTO or bool(plan.backend_traits(module.run.trainer).dims)
    stages = [s for s in sorted(module.graph.stages, key=lambda s: (not isinstance(assign.get(s.name), Layout),
                                                                   s.op != "train"))
              if s.name in assign and s.op.split(".")[0] in ("generate", "forward", "train")]
    cands, res = {}, {}
    for s in stages:
        cands[s.name], r = layout_table(module, cm, s, *mesh_of(assign[s.name]))
        if r is not None:
            res[s.name] = r
    held = _Resident(module, assign, stages, res)
    chosen: dict[tuple, tuple[int, int, int]] = {}
    for s in stages:
        first, count = mesh_of(assign[s.name])
        key = (s.target, first, count)
        if isinstance(assign[s.name], Layout):   # pinned: kept, and held on its devices
            lay = assign[s.name]
            c = cm.stage_cost(s, lay)
            held.choose(s, c.weights_bytes, c.state_bytes, c.transient_bytes)
            chosen.setdefault(key, (lay.dp, lay.tp, lay.pp))
            continue
        c = cands[s.name]
        idx = list(range(len(c)))
        if one_split and key in chosen:
            idx = [i for i in idx if (c[i].dp, c[i].tp, c[i].pp) == chosen[key]]
        if not idx:
            continue
        r = res[s.name]
        base, need = held.need(s, r, idx)
        room = (cm.spec.memory - base) / squeeze
        order = sorted(idx, key=r["total"].tolist().__getitem__)
        fitting = [i for i in order if need[i] - base <= room]
        pick = (fitting or sorted(idx, key=lambda i: need[i]))[0]
        picks.stages.append((order, need, base, idx, pick))
        plan.set_layout(s, c[pick])
        held.choose(s, *(float(r[k][pick]) for k in ("weights_bytes", "state_bytes", "transient_bytes")))
        chosen.setdefault(key, (c[pick].dp, c[pick].tp, c[pick].pp))
    return picks


def layout_table(module: Module, cm, stage, first: int, count: int) -> tuple[list, dict | None]:
    """The layouts ``stage`` may take on devices ``first .. first+count-1`` (the hardware rules', runnable by the
    run's trainer) and their prices (:func:`rlhfc.cost.evaluate`, arrays aligned with the list; None when there
    are none). Kept in ``cm``'s cache: a placement search asks again for every candidate plan that puts the
    stage there (inside ``shared_prices()`` the cache outlives the cost model)."""
    key = ("layout-table", stage.name, first, count, repr(plan.recompute_decision(stage)))
    if key not in cm._cache:
        model = module.models[stage.target]
        c = candidate_layouts(first, count, per_node=module.cluster.per_node, heads=model.heads,
                              kv_heads=model.kv_heads, layers=model.layers, microbatches=(1, 2, 4, 8),
                              recompute=plan.RECOMPUTE_POLICIES if stage.op == "train" else ("none",))
        c = [x for x in c if runnable(module, model, x)]
        # a few hundred candidates: NumPy prices them faster than one JAX compile per shape, and whether
        # JAX is installed must not change a plan
        cm._cache[key] = (c, evaluate(module, stage.name, c, cost_model=cm, backend="numpy") if c else None)
    return cm._cache[key]


class _Resident:
    """Per device, what each model keeps resident (weights; gradients + optimizer state: the largest over the
    model's stages there, as the simulator counts them) and the largest activations / KV cache of the stages
    chosen so far. Before a model's layout is chosen it holds the least any of its candidate layouts needs.

    Invariant kept by every choice that fits: on each device, what the models hold plus the largest transient
    of a chosen stage there is within capacity (stages on one device run one at a time; the simulator checks
    the overlaps)."""

    def __init__(self, module: Module, assign: dict, stages: list, res: dict):
        import numpy as np

        self.np = np
        self.n = max([module.cluster.num_devices] + [sum(mesh_of(assign[s.name])) for s in stages])
        self.devices = {s.name: slice(mesh_of(assign[s.name])[0], sum(mesh_of(assign[s.name]))) for s in stages}
        self.floor: dict[str, np.ndarray] = {}
        for s in stages:
            if s.name not in res:
                continue
            low = float((res[s.name]["weights_bytes"] + res[s.name]["state_bytes"]).min())
            per = self.floor.setdefault(s.target, np.zeros(self.n))
            sl = self.devices[s.name]
            per[sl] = np.maximum(per[sl], low)
        # per model: weights, gradients + optimizer state, and where a stage of it was chosen
        self.weights: dict[str, np.ndarray] = {}
        self.state: dict[str, np.ndarray] = {}
        self.chosen: dict[str, np.ndarray] = {}
        self.transient = np.zeros(self.n)

    def _held(self, model: str, sl: slice):
        np = self.np
        floor = self.floor.get(model)
        floor = floor[sl] if floor is not None else np.zeros(sl.stop - sl.start)
        if model not in self.chosen:
            return floor
        return np.where(self.chosen[model][sl], self.weights[model][sl] + self.state[model][sl], floor)

    def need(self, stage, r, idx: list[int]) -> tuple[float, dict[int, float]]:
        """The most any device of ``stage``'s mesh holds now (``base``), and its peak under each candidate."""
        np = self.np
        own, sl = stage.target, self.devices[stage.name]
        zero = np.zeros(sl.stop - sl.start)
        others = zero.copy()
        for m in sorted(set(self.floor) | set(self.weights)):
            if m != own:
                others = others + self._held(m, sl)
        wd = self.weights[own][sl] if own in self.weights else zero
        sd = self.state[own][sl] if own in self.state else zero
        # the devices' distinct situations (a mesh's devices mostly hold the same)
        profiles = list(dict.fromkeys(zip(others.tolist(), wd.tolist(), sd.tolist(), self.transient[sl].tolist(),
                                          self._held(own, sl).tolist())))
        base = float(max(o + held + t for o, _, _, t, held in profiles))
        ix = np.asarray(idx, dtype=int)
        w, st, tr = (np.asarray(r[k], dtype=float)[ix] for k in ("weights_bytes", "state_bytes", "transient_bytes"))
        peak = None
        for o, wdp, sdp, t, _ in profiles:
            p = o + np.maximum(wdp, w) + np.maximum(sdp, st) + np.maximum(t, tr)
            peak = p if peak is None else np.maximum(peak, p)
        return base, dict(zip(idx, peak.tolist()))

    def choose(self, stage, weights: float, state: float, transient: float) -> None:
        np, sl, m = self.np, self.devices[stage.name], stage.target
        for table in (self.weights, self.state, self.chosen):
            table.setdefault(m, np.zeros(self.n, dtype=bool if table is self.chosen else float))
        self.weights[m][sl] = np.maximum(self.weights[m][sl], weights)
        self.state[m][sl] = np.maximum(self.state[m][sl], state)
        self.chosen[m][sl] = True
        self.transient[sl] = np.maximum(self.transient[sl], transient)
