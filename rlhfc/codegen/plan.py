"""Build ``plan.json``: everything the runtime needs, as plain JSON.

The plan is the annotated IR flattened for the runtime — model specs, data
specs, run settings, stages in schedule order, version edges — plus two
derived sections: ``placement`` (Ray placement-group bundles and which bundle
each model worker sits on) and ``metrics`` (which values are the reward, the KL
pair, the policy and value train stats).

Placement is data-driven: a model's workers are the ones :mod:`rlhfc.ir.plan`
says the plan needs (one per model and mesh) — see :func:`placement`.
"""

from __future__ import annotations

import os

from rlhfc.ir import Module, plan, print_module


def model_spec(m) -> dict:
    spec = {"arch": m.arch, "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
            "ffn": m.ffn, "vocab": m.vocab, "max_seq": m.max_seq, "head": m.head,
            "source": os.path.abspath(m.source) if m.source else None}
    if m.lora:   # adapters (rlhfc.runtime.lora): only they train
        spec["lora"] = dict(m.lora)
    return spec


def _trained_spec(module: Module, m) -> dict:
    """The model's spec, with the recompute decision of its train stage (``spec["recompute"]``, for the
    trainer: :func:`rlhfc.runtime.recompute.apply_recompute`) when it recomputes anything."""
    spec = model_spec(m)
    for s in module.graph.stages_on(m.name):
        decision = plan.recompute_decision(s)
        if decision is not None and decision.policy != "none":
            spec["recompute"] = decision.runtime()
    return spec


def _init(module: Module, m) -> dict:
    from rlhfc.ir import Symbol

    if isinstance(m.init, Symbol):
        root = module.models[m.init.name]
        while isinstance(root.init, Symbol):   # copy(copy(actor)) starts from actor's initial weights
            root = module.models[root.init.name]
        if root.init == "pretrained":
            return {"kind": "pretrained"}       # the same folder: load it directly
        return {"kind": "copy", "from": root.name, "spec": model_spec(root)}
    return {"kind": m.init}


def placement(module: Module) -> dict:
    """Ray bundles (one per node) and, per worker (:func:`rlhfc.ir.plan.workers`: one per model and mesh),
    its node, devices, resource share and threads.

    A worker on devices shared with k other workers gets 1/(k+1) of each shared device, so shares
    add up to the node's bundle. On CPU clusters the worker is pinned to its cores (``cores``) and
    runs one torch thread per whole core of its share: idle OpenMP threads of co-located workers
    spin and slow the busy one down (5x measured on 2 cores with 2 threads each).

    Each worker also says how it runs (:func:`rlhfc.ir.plan.worker_layout`, the runtime's contract):
    ``trainer`` (``"torch"`` | ``"fsdp"`` | ``"megatron"``, ``auto`` resolved), its layout ``dp``, ``tp``,
    ``pp`` and ``ranks`` = dp·tp·pp processes (1, with dp = tp = pp = 1, under torch); ``engine = "vllm"`` when
    its model's generate stages run on vLLM (:func:`rlhfc.ir.plan.model_engine`; absent: torch), and on GPUs
    the ``gpu_memory_utilization`` its engine starts with (the stages' ``gpu_memory``).
    """
    c = module.cluster
    gpu = c.device != "cpu"
    bundles = [({"CPU": float(c.per_node), "GPU": float(c.per_node)} if gpu else {"CPU": float(c.per_node)})
               for _ in range(c.nodes)]
    workers = {w.name: {"model": w.model, "mesh": list(w.mesh.pair()), "bundle": w.node,
                        "num_cpus": 0 if gpu else w.share, "num_gpus": w.share if gpu else 0,
                        "threads": 1 if gpu else w.threads, "cores": list(w.cores), "ranks": w.ranks,
                        "dp": w.dp, "tp": w.tp, "pp": w.pp, "trainer": w.trainer,
                        **({"engine": "vllm"} if plan.model_engine(module, w.model) == "vllm" else {}),
                        **_gpu_memory(module, w.model)}
               for w in plan.workers(module).values()}
    return {"strategy": "PACK" if c.nodes == 1 else "STRICT_SPREAD", "bundles": bundles, "workers": workers}


def _gpu_memory(module: Module, model: str) -> dict:
    """``{"gpu_memory_utilization": f}`` for a worker whose vLLM generate stages the compiler marked
    ``gpu_memory = f`` (a CUDA engine's share of its GPU: rlhfc.passes.engine.set_gpu_memory), else ``{}``."""
    shares = [float(s.annotations["gpu_memory"]) for s in module.graph.stages
              if s.op == "generate" and s.target == model and "gpu_memory" in s.annotations]
    return {"gpu_memory_utilization": max(shares)} if shares else {}


def metric_roles(module: Module) -> dict:
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
    if "reward" not in roles:
        seq = next((v for s in g.stages for v in s.outputs if v.type.kind == "SeqFloat"), None)
        if seq is not None:
            roles["reward"] = seq.name
    for s in g.stages:
        if s.op == "train":
            head = module.models[s.target].head
            roles["policy_train" if head == "lm" else "value_train"] = s.name
    return roles


def build_plan(module: Module, *, source: str | None, opt_level: str | None, passes: list[str]) -> dict:
    g = module.graph
    stages = []
    for s in g.stages:
        stages.append({"name": s.name, "op": s.op, "target": s.target, "inputs": [v.name for v in s.inputs],
                       "outputs": [v.name for v in s.outputs], "types": [str(v.type) for v in s.outputs],
                       "attrs": s.attrs, "annotations": _jsonable(s.annotations),
                       "loc": str(s.loc) if s.loc else None})
    from rlhfc.ir.verify_fields import rollout_readers, tokenizer_key

    data = {}
    for d in module.data.values():
        spec = {"kind": d.kind, **d.options}
        if d.kind in ("jsonl", "parquet", "arrow"):
            spec["path"] = os.path.abspath(spec["path"])
        # every model that reads these prompts' tokens: the job checks each prompt fits its max_seq at start
        fit = []
        for s in g.stages:
            if s.op != "generate" or not s.inputs or g.producer(s.inputs[0]).target != d.name:
                continue
            gen = module.models[s.target]
            for r in [s] + rollout_readers(g, s.outputs[0]):
                m = module.models[r.target]
                entry = {"model": m.name, "tokenizer": {"source": model_spec(m)["source"], "vocab": m.vocab},
                         "max_seq": m.max_seq, "max_new_tokens": s.attrs["max_new_tokens"]}
                if s.attrs.get("chat"):
                    entry["chat"] = True   # prompts are counted in the chat template
                if tokenizer_key(m) == tokenizer_key(gen) and entry not in fit:
                    fit.append(entry)
        if fit:
            spec["fit"] = fit
        data[d.name] = spec
    return {
        "format": 1,
        "module": module.name,
        "source": source,
        # rule("module:function") modules are looked up in the program's folder (runtime.rewards)
        "program_dir": os.path.dirname(os.path.abspath(source)) if source else None,
        "opt_level": opt_level,
        "passes": passes,
        "cluster": {"name": module.cluster.name, **module.cluster.attrs()},
        "models": {m.name: {"spec": _trained_spec(module, m), "init": _init(module, m), "trainable": m.trainable,
                            "params": m.params} for m in module.models.values()},
        "data": data,
        "run": module.run.attrs(),
        "graph": {"name": g.name, "params": g.params, "stages": stages,
                  "stages_by_name": {s["name"]: {"op": s["op"], "target": s["target"]} for s in stages},
                  "value_to_stage": {v: s["name"] for s in stages for v in s["outputs"]},
                  "versions": [{"model": e.model, "writer": e.writer, "reader": e.reader, "distance": e.distance}
                               for e in g.versions]},
        "placement": placement(module),
        "metrics": metric_roles(module),
        "ir": print_module(module),
    }


def _jsonable(value):
    from rlhfc.ir import Symbol

    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Symbol):
        return f"@{value.name}"
    return value
