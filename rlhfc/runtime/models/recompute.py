"""Activation recomputation in the trainers: the ``recompute`` decision of a train stage, applied.

The compiler's ``recompute`` pass decides, per trained model, which activations of a transformer block are
kept for backward and which are recomputed; the plan carries the decision to the worker as::

    {"policy": "none"}                      # autograd keeps what it keeps (no checkpointing)
    {"policy": "full"}                      # keep only the block's inputs, recompute the whole block
    {"policy": "ops", "save": ["mm.default#0", "silu.default#0", ...]}

``ops``: the block runs under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant) with a selective
policy (:func:`torch.utils.checkpoint.create_selective_checkpoint_contexts`): the outputs of the listed
aten calls (``<op>.<overload>#<k>``: the k-th call of that op in the block's forward, in order) are kept,
every other op is recomputed in backward, from the block's inputs and the kept outputs. Recomputation replays
the same ops on the same inputs, so gradients are bitwise those without it on CPU (the tests check).

This module imports no compiler code (a job runs without the compiler).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from torch import nn

from rlhfc.contract import rules

POLICIES = ("none", "full", "ops")


def op_key(func, k: int) -> str:
    """``mm.default#3``: the name the plan gives the k-th call (from 0) of aten op ``func`` in a block (the
    contract's rule, :func:`rlhfc.contract.rules.op_key`, which the recompute pass names them by)."""
    return rules.op_key(str(func), k)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a runtime model (llama ``layers``, gpt2 ``h``), in order."""
    trunk = getattr(model, "trunk", model)
    trunk = getattr(trunk, "base_model", trunk)
    for name in ("layers", "h"):
        found = getattr(trunk, name, None)
        if isinstance(found, nn.ModuleList):
            return list(found)
    raise ValueError(f"recompute: no transformer blocks (layers / h) in {type(trunk).__name__}")


def _selective_context(save: frozenset[str]):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    seen = {False: Counter(), True: Counter()}   # calls of each op so far, in the forward and in the recompute

    def policy(ctx, func, *args, **kwargs):
        counts = seen[bool(ctx.is_recompute)]
        key = op_key(func, counts[func])
        counts[func] += 1
        return CheckpointPolicy.MUST_SAVE if key in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_recompute(model: nn.Module, decision: dict[str, Any] | None) -> str:
    """Make every block of ``model`` train under ``decision`` (see the module docstring); returns its policy.

    Only forwards that build a graph (grad enabled) checkpoint; inference forwards run as before. Applying
    again replaces the previous decision."""
    decision = dict(decision or {"policy": "none"})
    policy = decision.get("policy", "none")
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    save = frozenset(decision.get("save") or ())
    for block in blocks(model):
        block.__dict__.pop("_rlhfc_forward", None)
        block.__dict__.pop("forward", None)          # back to the class's forward
        if policy == "none":
            continue
        block._rlhfc_forward = block.forward
        block.forward = _checkpointed(block._rlhfc_forward, policy, save)
    return policy


def _checkpointed(forward, policy: str, save: frozenset[str]):
    from torch.utils.checkpoint import checkpoint

    context = functools.partial(_selective_context, save) if policy == "ops" else None

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if context is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    return run


# -- measuring what a forward keeps for backward (tests and benchmarks) -----------------------------------------

def kept_activation_bytes(fn, *args, **kwargs) -> tuple[Any, int]:
    """Run ``fn(*args, **kwargs)`` and return (its output, the bytes of the tensors it allocated that are
    still alive once it returned, its output's storage excepted): exactly what the forward keeps for backward
    (autograd's saved tensors, or a checkpoint's kept outputs), counted once per storage."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    created: dict[int, tuple[StorageWeakRef, int]] = {}

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            ins = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten((a, kw))[0]
                   if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    s = t.untyped_storage()
                    if StorageWeakRef(s).cdata in ins:   # a view or an in-place result: nothing allocated
                        continue
                    ref = StorageWeakRef(s)
                    old = created.get(ref.cdata)
                    if old is None or old[0].expired():   # a freed storage's address may be reused
                        created[ref.cdata] = (ref, s.nbytes())
            return out

    with Allocations():
        out = fn(*args, **kwargs)
    gc.collect()
    outs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    alive = sum(n for key, (ref, n) in created.items() if key not in outs and not ref.expired())
    return out, alive


def saved_tensor_bytes(fn, *args, exclude=(), **kwargs) -> tuple[Any, int]:
    """Run ``fn`` under :func:`torch.autograd.graph.saved_tensors_hooks` and return (its output, the bytes of
    the distinct storages autograd saved for backward, those of the tensors in ``exclude`` — inputs,
    parameters — left out). Checkpointed regions save through their own hooks, so this measures plain
    autograd (policy ``none``); :func:`kept_activation_bytes` measures any policy."""
    from torch.multiprocessing.reductions import StorageWeakRef

    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        key = StorageWeakRef(s).cdata
        if key not in skip:
            saved[key] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(saved.values())
