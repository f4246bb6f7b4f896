"""Plan verification: every plan annotation where present (the IR verifier calls :func:`verify_plan`)."""

from __future__ import annotations

import importlib.util

from rlhfc.contract.engines import DEFAULT_ROLLOUT, TrainTraits, rollout_engines, rollout_traits, train_backends

from ..core import Model, Module, Stage
from ..diagnostics import DiagnosticSink, where
from .attrs import AUTO, STRATEGIES, AsyncRollout, Mesh, Overcommit, Parallel, PlanError, Recompute, Stream, Tail, Fused, _is_int, describe
from .rollout import installed, verify_rollout
from .rules import backend_traits, fixed_layout, on_worker, stage_mesh, stream_source, streams, workers

LORA_INSTALL = "pip install -c constraints.txt -e '.[lora]' (or: pip install 'peft>=0.21,<0.22')"

# -- verifying a plan ------------------------------------------------------------------------------------


def verify_plan(module: Module, sink: DiagnosticSink) -> None:
    """Check every plan annotation where present (absent ones take defaults); the verifier calls this."""
    s = module.annotations.get("strategy")
    if s is not None and s not in STRATEGIES:
        sink.error(f"module annotation strategy must be one of {', '.join(STRATEGIES)}, got {describe(s)}",
                   None, f'write strategy = "{STRATEGIES[0]}" (or remove it)')
    notes = module.annotations.get("changes_training")
    if notes is not None and not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
        sink.error(f"module annotation changes_training must be a list of pass names, got {describe(notes)}", None,
                   'write changes_training = ["overcommit"] (or remove it)')
    total = module.cluster.num_devices if _is_int(module.cluster.num_devices) else None
    for stage in module.graph.stages:
        if stage.outputs and stage.annotations:
            _verify_stage(module, stage, total, sink)
    if total is not None and all(s.outputs for s in module.graph.stages):
        _verify_layouts(module, total, sink)
    verify_rollout(module, sink)


def _splits(traits: TrainTraits) -> str:
    """What a multi-rank backend splits a model into, for messages."""
    return "data-parallel ranks only" if traits.dims == {"dp"} else \
        f"{' x '.join(d for d in ('dp', 'tp', 'pp') if d in traits.dims)} ranks"


# -- fixed layouts and trainers -------------------------------------------------------------------------


def _verify_layouts(module: Module, total: int, sink: DiagnosticSink) -> None:
    """Each model's fixed layout (``layout(...)``) fits the cluster, its stages' meshes and the run's
    trainer; every worker the megatron trainer runs is a layout megatron-core can run."""
    trainer = module.run.trainer
    traits = backend_traits(trainer)
    wrong: set[str] = set()   # models already reported (one diagnostic per model and problem)
    for m in module.models.values():
        fixed = fixed_layout(m)
        if fixed is None:
            continue
        at, text = where(m, "layout"), f"layout({', '.join(f'{k} = {v}' for k, v in fixed.print().items())})"
        if fixed.size > total:
            wrong.add(m.name)
            sink.error(f"model @{m.name}: {text} needs {fixed.size} devices, but cluster @{module.cluster.name} "
                       f"has {total}", at, f"add devices (a cluster of at least {fixed.size}), or choose a layout "
                       f"whose dp * tp * pp is at most {total}")
            continue
        if _fixed_off_nodes(module, m, fixed, text, at, sink):
            wrong.add(m.name)
            continue
        if trainer != AUTO and not traits.dims and fixed.size > 1:
            sink.error(f"model @{m.name}: {text} runs as {fixed.size} processes, but trainer = {trainer} runs every "
                       "model as one process", at, "set run { trainer = auto } (or fsdp for a dp-only layout, "
                       "megatron for tp or pp > 1), or remove the layout clause")
        elif trainer != AUTO and traits.dims and not traits.runs(fixed.dp, fixed.tp, fixed.pp):
            sink.error(f"model @{m.name}: trainer {trainer} runs {_splits(traits)}, but {text} has tp = "
                       f"{fixed.tp}, pp = {fixed.pp}", where(m, "layout.tp" if fixed.tp > 1 else "layout.pp",
                                                             "layout"),
                       "set run { trainer = auto } or megatron (megatron-core tensor/pipeline parallelism), or use "
                       f"layout(dp = {fixed.size})")
        for s in module.graph.stages_on(m.name):
            if not on_worker(module, s) or s.op == "sync":
                continue
            count = stage_mesh(module, s).count
            par = None
            if Parallel.key in s.annotations:
                try:
                    par = Parallel.parse(s.annotations[Parallel.key], count)
                except PlanError:
                    continue   # reported with the stage
            if count != fixed.size:
                wrong.add(m.name)
                sink.error(f"stage %{s.name} runs on {count} devices, but @{m.name} fixes {text}: "
                           f"{fixed.size} devices", where(s), f"give it mesh = {{first = F, count = {fixed.size}}}, "
                           f"or change the layout of @{m.name}")
            elif par is not None and par != fixed:
                wrong.add(m.name)
                sink.error(f"stage %{s.name} has parallel = {{dp = {par.dp}, tp = {par.tp}, pp = {par.pp}}}, but "
                           f"@{m.name} fixes {text}", where(s),
                           f"write parallel = {{dp = {fixed.dp}, tp = {fixed.tp}, pp = {fixed.pp}}} or leave it out")
    missing_reported: set[str] = set()
    for w in workers(module).values():
        m = module.models.get(w.model)
        mine = backend_traits(w.trainer)
        if not (mine.package or not mine.hf_models or {"tp", "pp"} & mine.dims) or m is None or m.name in wrong:
            continue
        wrong.add(m.name)
        if mine.package and mine.name not in missing_reported and not installed(mine.package):
            missing_reported.add(mine.name)
            sink.error(f"model @{m.name} runs on the {mine.name} trainer, but {mine.title} is not installed",
                       where(module.run, "trainer") if trainer != AUTO else where(m, "layout"),
                       f"install the extra: {mine.install}")
        _verify_split(module, m, mine, Parallel(w.dp, w.tp, w.pp), w.mesh.count, sink)
    _verify_lora(module, sink)
    precision = module.run.precision
    for name in train_backends():
        mine = backend_traits(name)
        runs = sorted({w.model for w in workers(module).values() if w.trainer == name})
        if runs and precision not in mine.precisions:
            others = [b for b in train_backends() if precision in backend_traits(b).precisions]
            sink.error(f"precision = {precision} is not supported by the {name} trainer yet (it runs "
                       f"{', '.join('@' + n for n in runs)})", where(module.run, "precision"),
                       f"use precision = {mine.precisions[0]} with trainer = {name}, or trainer = "
                       f"{' or '.join(others)} for {precision} (auto runs a layout with tp = pp = 1 on them)")


def _verify_lora(module: Module, sink: DiagnosticSink) -> None:
    """LoRA adapters need peft, and run under a backend that trains them (torch: one process per model)."""
    lora = [m for m in module.models.values() if m.lora]
    if lora and importlib.util.find_spec("peft") is None:
        sink.error(f"model @{lora[0].name} has LoRA adapters, but the peft library is not installed",
                   where(lora[0], "lora"), f"install the extra: {LORA_INSTALL}")
    for w in workers(module).values():
        m = module.models.get(w.model)
        if m is not None and m.lora and not backend_traits(w.trainer).lora:
            able = [b for b in train_backends() if backend_traits(b).lora]
            sink.error(f"model @{m.name} has LoRA adapters, which only the {' or '.join(able)} trainer runs, not "
                       f"{w.trainer}", where(module.run, "trainer") if module.run.trainer != AUTO else where(m, "lora"),
                       f"set run {{ trainer = {able[0]} }} (one process per model), or drop lora(...)")


def _fixed_off_nodes(module: Module, m: Model, fixed: Parallel, text: str, at, sink: DiagnosticSink) -> bool:
    """A fixed layout no node-aligned mesh of the cluster can hold (:mod:`rlhfc.ir.plan.hardware`): more than a
    node's devices but not whole nodes, or tensor-parallel groups that would cross a node. Reported; True if so."""
    per, size = module.cluster.per_node, fixed.size
    if not (_is_int(per) and per >= 1) or module.cluster.nodes == 1:
        return False
    if size > per and size % per:
        sink.error(f"model @{m.name}: {text} needs {size} devices, more than a node's {per} but not whole nodes",
                   at, f"a mesh lies inside one node or spans whole nodes: make dp * tp * pp at most {per} or a "
                   f"multiple of {per}")
        return True
    if fixed.tp > per or (size > per and per % fixed.tp):
        ok = [t for t in range(1, per + 1) if per % t == 0]
        sink.error(f"model @{m.name}: tp = {fixed.tp} tensor-parallel groups would cross nodes of {per} devices",
                   where(m, "layout.tp", "layout"), "tp all-reduces every layer and stays inside a node: use tp = "
                   f"{' or '.join(map(str, ok))}")
        return True
    return False


def _verify_split(module: Module, m: Model, traits: TrainTraits, par: Parallel, count: int,
                  sink: DiagnosticSink) -> None:
    """What backend ``traits`` cannot run of ``m`` in layout ``par`` on a mesh of ``count`` devices: a Hugging
    Face folder where it builds models from their config only; tensor and pipeline splits that do not divide
    the model; a layout other than the mesh."""
    name = traits.name
    fixed = fixed_layout(m) is not None
    auto = "; or trainer = auto runs it as fsdp/torch with tp = pp = 1" if module.run.trainer != AUTO else ""
    if m.source and not traits.hf_models:
        sink.error(f"model @{m.name} is loaded from a Hugging Face folder, which the {name} trainer cannot run "
                   "yet", where(m, "layout") if fixed else where(m, "source", "init"),
                   f"the {name} trainer builds llama(...)/gpt2(...) models from their config: declare the model "
                   f"by its shape{auto}")
    shape = {"heads": m.heads, "kv_heads": m.kv_heads, "ffn": m.ffn, "vocab": m.vocab}
    if par.tp > 1 and all(_is_int(v) and v >= 1 for v in shape.values()):
        bad = [f"{k} ({v})" for k, v in shape.items() if v % par.tp]
        if bad:
            ok = [t for t in range(1, m.heads + 1) if all(v % t == 0 for v in shape.values())]
            sink.error(f"model @{m.name}: tp = {par.tp} does not divide its {' and '.join(bad)}",
                       where(m, "layout.tp", "layout") if fixed else where(m),
                       f"{name} splits the attention heads, key/value heads, MLP width and vocabulary over "
                       f"tensor-parallel ranks: use tp = {' or '.join(map(str, ok))}")
    if par.pp > 1 and _is_int(m.layers) and m.layers >= 1 and m.layers % par.pp:
        ok = [p for p in range(1, m.layers + 1) if m.layers % p == 0]
        sink.error(f"model @{m.name}: pp = {par.pp} does not divide its {m.layers} layers",
                   where(m, "layout.pp", "layout") if fixed else where(m),
                   f"{name} gives each pipeline stage layers / pp layers: use pp = {' or '.join(map(str, ok))}")
    if par.size != count:
        sink.error(f"model @{m.name} runs dp * tp * pp = {par.size} {name} ranks on a mesh of {count} devices",
                   where(m, "layout") if fixed else where(m),
                   f"dp * tp * pp must equal the mesh size {count}")


def _verify_stage(module: Module, stage: Stage, total, sink: DiagnosticSink) -> None:
    ann = stage.annotations
    at = where(stage)
    label = f"stage %{stage.name}"

    def report(exc: PlanError) -> None:
        sink.error(f"{label}: {exc.message}", at, exc.hint)

    count = total
    if Mesh.key in ann:
        try:
            count = Mesh.parse(ann[Mesh.key], module.cluster).count
        except PlanError as exc:
            report(exc)
            count = None
    if Parallel.key in ann:
        try:
            par = Parallel.parse(ann[Parallel.key], count)
            for exc in par.verify(count, module.models.get(stage.target or "")):
                report(exc)
            run = backend_traits(module.run.trainer)
            if module.run.trainer != AUTO and run.dims and not run.runs(par.dp, par.tp, par.pp):
                sink.error(f"{label}: trainer {module.run.trainer} runs {_splits(run)}, but the layout has tp = {par.tp}, "
                           f"pp = {par.pp}", at, "use parallel = {dp = N} for this stage, trainer = megatron or auto "
                           "(megatron-core tensor/pipeline parallel ranks), or trainer = torch (one process)")
        except PlanError as exc:
            report(exc)
    if "refit_mb" in ann and not (_is_int(ann["refit_mb"]) and ann["refit_mb"] >= 1):
        sink.error(f"{label}: refit_mb must be an integer >= 1, got {describe(ann['refit_mb'])}", at,
                   "write refit_mb = 64 (MiB per bucket of the vLLM engine's refit)")
    if "microbatches" in ann and not (_is_int(ann["microbatches"]) and ann["microbatches"] >= 1):
        sink.error(f"{label}: microbatches must be an integer >= 1, got {describe(ann['microbatches'])}", at,
                   "write microbatches = 4 (micro-batches per forward / per optimizer step)")
    if Recompute.key in ann:
        try:
            Recompute.parse(ann[Recompute.key])
        except PlanError as exc:
            report(exc)
    for name, ops, hint in (("unpad", ("generate", "train"), "forwards follow their rollout: mark the generate "
                                                              "stage unpad = true"),
                            ("logprobs", ("generate",), "mark the generate stage whose sampling log-probs are "
                                                        "kept: logprobs = true"),
                            ("offload", ("train",), "offload = true keeps a trained model's optimizer state (and "
                                                    "its step) on the host: mark its train stage")):
        if name not in ann:
            continue
        if stage.op not in ops:
            sink.error(f"{label}: '{name}' applies to {' and '.join(ops)} stages only, not {stage.op}", at, hint)
        elif not isinstance(ann[name], bool):
            sink.error(f"{label}: {name} must be true or false, got {describe(ann[name])}", at, f"write {name} = true")
    if "engine" in ann:   # rollout = auto's choice (rlhfc.passes.engine)
        choices = [e for e in rollout_engines() if rollout_traits(e).auto]
        if stage.op != "generate" or ann["engine"] not in choices:
            sink.error(f"{label}: engine = {describe(ann['engine'])} is not a rollout choice", at,
                       "the engine pass marks generate stages " + " or ".join(f'engine = "{e}"' for e in choices) +
                       f" under run {{ rollout = auto }}; {DEFAULT_ROLLOUT} is the unmarked default")
        elif module.run.rollout != AUTO:
            sink.error(f"{label}: engine = \"{ann['engine']}\" marks rollout = auto's choice, but the run has rollout = "
                       f"{module.run.rollout}", at, "drop the annotation, or write run { rollout = \"auto\" }")
    if "gpu_memory" in ann:   # a CUDA vLLM engine's gpu_memory_utilization (rlhfc.passes.engine.set_gpu_memory)
        share = ann["gpu_memory"]
        if stage.op != "generate" or isinstance(share, bool) or not isinstance(share, (int, float)) \
                or not 0 < share <= 1:
            sink.error(f"{label}: gpu_memory = {describe(share)} is not a generate stage's share of a GPU", at,
                       "gpu_memory marks the fraction of a GPU a vLLM engine starts with: a number in (0, 1] "
                       "on a generate stage, e.g. gpu_memory = 0.3")
    if "threads" in ann and (not _is_int(ann["threads"]) or ann["threads"] < 1):   # rlhfc.passes.threads
        sink.error(f"{label}: threads must be a positive integer, got {describe(ann['threads'])}", at,
                   "threads = N caps the torch threads a CPU stage runs with, e.g. threads = 1")
    if "overlap" in ann and not _is_int(ann["overlap"]):
        sink.error(f"{label}: overlap must be an integer group id, got {describe(ann['overlap'])}", at,
                   "stages with the same overlap = K are launched together, e.g. overlap = 1")
    if Tail.key in ann and stage.op == "generate" and Stream.key not in ann:
        sink.error(f"{label}: tail (long-tail migration) needs a streamed generate (stream = {{chunk = N}})",
                   at, "the ranks hand their finished rows on in chunks while the tail moves: add stream, or drop "
                   "tail")
    if Fused.key in ann:
        if stage.op != "train":
            sink.error(f"{label}: 'fused' applies to train stages only, not {stage.op}", at,
                       "move fused = {...} to the train stages whose schedules it interleaves")
        else:
            try:
                Fused.parse(ann[Fused.key])
            except PlanError as exc:
                report(exc)
    for cls in (Stream, Overcommit, AsyncRollout, Tail):
        if cls.key not in ann:
            continue
        if stage.op != "generate":
            sink.error(f"{label}: '{cls.key}' applies to generate stages only, not {stage.op}", at,
                       f"move {cls.key} = {{...}} to the generate stage whose samples it concerns")
            continue
        try:
            cls.parse(ann[cls.key])
        except PlanError as exc:
            report(exc)
    if "stream_from" in ann:
        _verify_stream_from(module, stage, label, at, sink)


def _verify_stream_from(module: Module, stage: Stage, label: str, at, sink: DiagnosticSink) -> None:
    name = stage.annotations["stream_from"]
    src = stream_source(module.graph, stage)
    if src is None:
        sink.error(f"{label}: stream_from must name the rollout of a generate stage, got {describe(name)}", at,
                   "write stream_from = \"<rollout>\" with the result of the streamed generate stage")
    elif not streams(src):
        sink.error(f"{label}: stream_from = {name!r} but %{src.name} is not streamed", at,
                   f"annotate %{src.name} with stream = {{chunk = N}}, or remove stream_from")
    elif not (stage.op.startswith("forward.") and len(stage.inputs) == 1 and stage.inputs[0] is src.outputs[0]):
        sink.error(f"{label}: only a forward stage whose one operand is %{name} can run inside its stream, "
                   f"not {stage.op}", at, "remove stream_from: the stage runs after the stream instead")
