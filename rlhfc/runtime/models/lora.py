"""LoRA adapters on a policy through ``peft`` (an optional extra ``[lora]``).

A model spec with ``"lora": {"rank": r, "alpha": a, "targets": [...]}`` gets low-rank adapters on the
Linear (or GPT-2 ``Conv1D``) modules named by ``targets`` (Hu et al., 2021, "LoRA: Low-Rank Adaptation of
Large Language Models"): ``W x + (a / r) · B A x`` with ``A`` [r, in] and ``B`` [out, r]. ``peft`` injects
the layers into the Hugging Face model in place (``get_peft_model``; the wrapper itself is not kept), so
:class:`~rlhfc.runtime.models.build.PolicyModel` runs as before; every base weight is frozen, so only ``A`` and
``B`` train and the optimizer holds state for them alone.

Initialisation is rlhfc's own, from the model's seed generator (never the global RNG): ``A`` uniform in
``±1/sqrt(in)`` (kaiming-uniform with ``a = sqrt(5)``, as ``nn.Linear`` and peft draw it), ``B`` zero — so a
fresh adapter model computes exactly what its base computes.

The state dict holds the base weights under ``….base_layer.weight`` and the adapters under
``….lora_A.default.weight`` / ``….lora_B.default.weight``; checkpoints and weight syncs move it whole (both
sides are built from the same spec). :func:`merged_state` folds the adapters into plain weights
(``W + ΔW``, peft's ``get_delta_weight``) under the names a model without adapters has: what
``copy(actor)`` starts a reference model from and what ``rlhfc export`` writes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

INSTALL = "pip install -c constraints.txt -e '.[lora]' (or: pip install 'peft>=0.21,<0.22')"


def import_peft():
    try:
        import peft
    except ImportError as exc:
        raise ImportError(f"this model has LoRA adapters, which need the peft library: {INSTALL}") from exc
    return peft


def apply_lora(hf: nn.Module, lora: dict[str, Any], generator: torch.Generator) -> nn.Module:
    """Inject LoRA adapters into ``hf`` (a ``*ForCausalLM``) in place and freeze everything else; returns it."""
    peft = import_peft()
    config = peft.LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]),
                             target_modules=list(lora["targets"]), lora_dropout=0.0, bias="none",
                             fan_in_fan_out=_conv1d(hf, lora["targets"]))
    with torch.random.fork_rng(devices=[]):   # peft draws A from the global RNG; redrawn below
        wrapped = peft.get_peft_model(hf, config)
    model = wrapped.base_model.model
    with torch.no_grad():
        for _, layer in lora_layers(model):
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            a.copy_(_kaiming_uniform(a.shape, generator).to(a.dtype))
            b.zero_()
    return model


def _conv1d(hf: nn.Module, targets) -> bool:
    """GPT-2's ``Conv1D`` stores its weight [in, out]: peft needs ``fan_in_fan_out`` for it."""
    return any(type(m).__name__ == "Conv1D" and name.rsplit(".", 1)[-1] in targets for name, m in hf.named_modules())


def _kaiming_uniform(shape, generator: torch.Generator) -> torch.Tensor:
    bound = 1.0 / math.sqrt(shape[1])   # kaiming_uniform_(a = sqrt(5)) on a [out, in] weight
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The adapter layers of ``model`` (name, peft ``LoraLayer``); empty without adapters or without peft."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state with its adapters folded in (``W + (a/r) B A``), under the names of the same model
    without adapters."""
    layers = dict(lora_layers(model))
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        state[key.replace(".base_layer.", ".")] = value.detach().clone()
    for name, layer in layers.items():
        key = f"{name}.weight"
        state[key] = state[key] + layer.get_delta_weight("default").to(state[key].dtype)
    return state


def trainable_count(model: nn.Module) -> int:
    """Parameters the optimizer updates (the adapters, under LoRA)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = ["INSTALL", "apply_lora", "has_lora", "import_peft", "lora_layers", "merged_state", "trainable_count"]
