"""Build ``plan.json``: everything the runtime needs, as the contract's typed :class:`~rlhfc.contract.plan.Plan`.

The plan is the annotated IR flattened for the runtime — model specs, data
specs, run settings, stages in schedule order, version edges — plus two
derived sections: ``placement`` (Ray placement-group bundles and which bundle
each model worker sits on) and ``metrics`` (which values are the reward, the KL
pair, the policy and value train stats).

Placement is data-driven: a model's workers are the ones :mod:`rlhfc.ir.plan`
says the plan needs (one per model and mesh) — see :func:`placement`.
"""

from __future__ import annotations

import dataclasses
import os

from rlhfc.contract import plan as contract
from rlhfc.contract.plugins import recorded
from rlhfc.ir import Module, Symbol, plan, print_module
from rlhfc.ir.schedule import shared_processes
from rlhfc.ir.verify_fields import rollout_readers, tokenizer_key


def model_spec(m) -> contract.ModelSpec:
    return contract.ModelSpec(m.arch, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, m.max_seq, m.head,
                              os.path.abspath(m.source) if m.source else None,
                              dict(m.lora) if m.lora else None,   # adapters (rlhfc.runtime.models.lora): only they train
                              dropout=bool(m.dropout and m.source))


def _trained_spec(module: Module, m) -> contract.ModelSpec:
    """The model's spec, with the recompute decision of its train stage (``recompute``, for the trainer:
    :func:`rlhfc.runtime.models.recompute.apply_recompute`) when it recomputes anything."""
    spec = model_spec(m)
    for s in module.graph.stages_on(m.name):
        decision = plan.recompute_decision(s)
        if decision is not None and decision.policy != "none":
            spec = dataclasses.replace(spec, recompute=decision.runtime())
    return spec


def _init(module: Module, m) -> contract.ModelInit:
    if isinstance(m.init, Symbol):
        root = module.models[m.init.name]
        while isinstance(root.init, Symbol):   # copy(copy(actor)) starts from actor's initial weights
            root = module.models[root.init.name]
        if root.init == "pretrained":
            return contract.ModelInit("pretrained")       # the same folder: load it directly
        return contract.ModelInit("copy", root.name, model_spec(root))
    return contract.ModelInit(m.init)


def placement(module: Module) -> contract.PlacementPlan:
    """Ray bundles (one per node) and, per worker (:func:`rlhfc.ir.plan.workers`: one per model and mesh),
    its node, devices, resource share and threads.

    A worker on devices shared with k other workers gets 1/(k+1) of each shared device, so shares
    add up to the node's bundle. On CPU clusters the worker is pinned to its cores (``cores``) and
    runs one torch thread per whole core of its share: idle OpenMP threads of co-located workers
    spin and slow the busy one down (5x measured on 2 cores with 2 threads each).

    Each worker also says how it runs (:func:`rlhfc.ir.plan.worker_layout`): the registered ``trainer``
    backend (``auto`` resolved), its layout ``dp``, ``tp``, ``pp`` and ``ranks`` = dp·tp·pp processes (1, with
    dp = tp = pp = 1, on a one-process backend); the rollout ``engine`` of its model's generate stages
    (:func:`rlhfc.ir.plan.model_engine`), and on GPUs the ``gpu_memory_utilization`` its engine starts with
    (the stages' ``gpu_memory``).
    """
    c = module.cluster
    gpu = c.device != "cpu"
    bundles = tuple(({"CPU": float(c.per_node), "GPU": float(c.per_node)} if gpu else {"CPU": float(c.per_node)})
                    for _ in range(c.nodes))
    placed = plan.workers(module)
    shared = shared_processes(module, placed)
    workers = {w.name: contract.WorkerPlan(
        model=w.model, mesh=w.mesh.pair(), bundle=w.node, num_cpus=0.0 if gpu else float(w.share),
        num_gpus=float(w.share) if gpu else 0.0, threads=1 if gpu else w.threads, cores=tuple(w.cores),
        ranks=w.ranks, dp=w.dp, tp=w.tp, pp=w.pp, trainer=w.trainer, engine=plan.model_engine(module, w.model),
        gpu_memory_utilization=_gpu_memory(module, w.model), offload=_offload(module, key), process=shared.get(key),
        reversed_stages=_reversed_stages(module, key))
        for key, w in placed.items()}
    return contract.PlacementPlan("PACK" if c.nodes == 1 else "STRICT_SPREAD", bundles, workers)


def _offload(module: Module, key) -> bool:
    """Whether the worker ``key`` (model, mesh) runs a train stage marked ``offload`` (optimizer on the host)."""
    return any(s.op == "train" and plan.offload(s) and plan.worker_key(module, s) == key for s in module.graph.stages)


def _reversed_stages(module: Module, key) -> bool:
    """Whether the worker ``key`` trains as the second model of a fused pair (its stages on its cores in reverse)."""
    return any(s.op == "train" and (f := plan.fused(s)) is not None and f.role == 1 and plan.worker_key(module, s) == key
               for s in module.graph.stages)


def _gpu_memory(module: Module, model: str) -> float | None:
    """The share of its GPU a worker's CUDA rollout engine starts with: the most its generate stages were
    marked (``gpu_memory = f``: rlhfc.passes.engine.set_gpu_memory), else None."""
    shares = [plan.gpu_memory(s) for s in module.graph.stages
              if s.op == "generate" and s.target == model and plan.gpu_memory(s) is not None]
    return max(shares) if shares else None


def metric_roles(module: Module) -> contract.MetricRoles:
    """Which IR values the runtime reports as reward, KL, policy and value losses."""
    g = module.graph
    roles: dict = {}
    gen = next((s for s in g.stages if s.op == "generate"), None)
    if gen:
        roles["rollout"] = gen.outputs[0].name
    for s in g.stages:
        if s.op in ("compute.gae", "compute.kl_penalty", "compute.group_advantages"):
            seq = next((v for v in s.inputs if v.type.kind == "SeqFloat"), None)
            if seq is not None and "reward" not in roles:
                roles["reward"] = seq.name
            if s.op == "compute.gae" and len(s.inputs) == 4:
                roles["kl"] = [s.inputs[2].name, s.inputs[3].name]
            if s.op == "compute.kl_penalty":
                roles["kl"] = [s.inputs[1].name, s.inputs[2].name]
        if s.op == "compute.ppo_clip" and len(s.inputs) == 4 and "kl" not in roles:
            roles["kl"] = [s.inputs[1].name, s.inputs[3].name]
    if "reward" not in roles:   # a sequence score, else an environment's per-turn rewards (summed per row)
        seq = next((v for s in g.stages for v in s.outputs if v.type.kind == "SeqFloat"), None) or \
            next((s.outputs[0] for s in g.stages if s.op == "compute.env_turn_rewards"), None)
        if seq is not None:
            roles["reward"] = seq.name
    for s in g.stages:
        if s.op == "train":
            head = module.models[s.target].head
            roles["policy_train" if head == "lm" else "value_train"] = s.name
    if "kl" in roles:
        roles["kl"] = tuple(roles["kl"])
    return contract.MetricRoles(**roles)


def _data(module: Module, d) -> contract.DataPlan:
    """A data source's plan: its options (paths absolute) and every model that reads its prompts' tokens
    (the job checks each prompt fits that model's max_seq at start)."""
    g = module.graph
    options = dict(d.options)
    if "path" in options:
        options["path"] = os.path.abspath(options["path"])
    fit: list[contract.PromptFit] = []
    for s in g.stages:
        if s.op != "generate" or not s.inputs or g.producer(s.inputs[0]).target != d.name:
            continue
        gen = module.models[s.target]
        for r in [s] + rollout_readers(g, s.outputs[0]):
            m = module.models[r.target]
            entry = contract.PromptFit(m.name, model_spec(m).source, m.vocab, m.max_seq, s.attrs["max_new_tokens"],
                                       bool(s.attrs.get("chat")))   # chat: prompts counted in the chat template
            if tokenizer_key(m) == tokenizer_key(gen) and entry not in fit:
                fit.append(entry)
    return contract.DataPlan(d.kind, options, tuple(fit))


def build_plan(module: Module, *, source: str | None, opt_level: str | None, passes: list[str],
               plugins: list[str] | tuple[str, ...] = ()) -> contract.Plan:
    g = module.graph
    stages = tuple(contract.StagePlan(
        s.name, s.op, s.target, tuple(v.name for v in s.inputs), tuple(v.name for v in s.outputs),
        tuple(str(v.type) for v in s.outputs), _jsonable(s.attrs), _jsonable(s.annotations),
        str(s.loc) if s.loc else None) for s in g.stages)
    c = module.cluster
    run = {k: v for k, v in module.run.attrs().items()}
    run["reward_modules"] = tuple(run.get("reward_modules", ()))
    return contract.Plan(
        module=module.name,
        source=source,
        # rule("module:function") modules are looked up in the program's folder (runtime.rewards)
        program_dir=os.path.dirname(os.path.abspath(source)) if source else None,
        opt_level=opt_level,
        passes=tuple(passes),
        cluster=contract.ClusterPlan(c.name, c.device, c.nodes, c.per_node, c.memory),
        models={m.name: contract.ModelPlan(_trained_spec(module, m), _init(module, m), m.trainable, m.params)
                for m in module.models.values()},
        data={d.name: _data(module, d) for d in module.data.values()},
        run=contract.RunPlan(**run),
        graph=contract.GraphPlan(g.name, dict(g.params), stages, tuple(
            contract.VersionEdge(e.model, e.writer, e.reader, e.distance, e.staleness) for e in g.versions)),
        placement=placement(module),
        metrics=metric_roles(module),
        ir=print_module(module),
        plugins=tuple(recorded(p) for p in plugins),
        tools={t.name: contract.ToolPlan(t.fn, float(t.timeout), int(t.memory_mb), int(t.max_output), t.kind)
               for t in module.tools.values()},
    )


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Symbol):
        return f"@{value.name}"
    return value
