"""Plan verification: every plan annotation where present (the IR verifier calls :func:`verify_plan`)."""

from __future__ import annotations

from ..core import Module, Stage
from ..diagnostics import DiagnosticSink, where
from .attrs import STRATEGIES, Mesh, Overcommit, Parallel, PlanError, Recompute, Stream, _is_int, describe
from .rules import stream_source, streams

# -- verifying a plan ------------------------------------------------------------------------------------


def verify_plan(module: Module, sink: DiagnosticSink) -> None:
    """Check every plan annotation where present (absent ones take defaults); the verifier calls this."""
    s = module.annotations.get("strategy")
    if s is not None and s not in STRATEGIES:
        sink.error(f"module annotation strategy must be one of {', '.join(STRATEGIES)}, got {describe(s)}",
                   None, f'write strategy = "{STRATEGIES[0]}" (or remove it)')
    total = module.cluster.num_devices if _is_int(module.cluster.num_devices) else None
    for stage in module.graph.stages:
        if stage.outputs and stage.annotations:
            _verify_stage(module, stage, total, sink)


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
            if module.run.trainer == "fsdp" and (par.tp > 1 or par.pp > 1):
                sink.error(f"{label}: trainer fsdp runs data-parallel ranks only, but the layout has tp = {par.tp}, "
                           f"pp = {par.pp}", at, "use parallel = {dp = N} for this stage, or trainer = torch "
                           "(tensor and pipeline parallel trainers are not implemented yet)")
        except PlanError as exc:
            report(exc)
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
                                                        "kept: logprobs = true")):
        if name not in ann:
            continue
        if stage.op not in ops:
            sink.error(f"{label}: '{name}' applies to {' and '.join(ops)} stages only, not {stage.op}", at, hint)
        elif not isinstance(ann[name], bool):
            sink.error(f"{label}: {name} must be true or false, got {describe(ann[name])}", at, f"write {name} = true")
    if "overlap" in ann and not _is_int(ann["overlap"]):
        sink.error(f"{label}: overlap must be an integer group id, got {describe(ann['overlap'])}", at,
                   "stages with the same overlap = K are launched together, e.g. overlap = 1")
    for cls in (Stream, Overcommit):
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
