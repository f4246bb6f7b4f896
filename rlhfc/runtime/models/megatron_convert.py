"""Weight converters between rlhfc's models (Hugging Face layout) and megatron-core's ``GPTModel``.

The single-rank model (:mod:`rlhfc.runtime.models.build`) keeps Hugging Face names and shapes: that is the
layout of checkpoints, weight syncs and the generation replica. Under ``trainer = megatron`` a model
runs as ``tp × pp`` ranks of a megatron-core ``GPTModel``; this module maps one layout onto the other.
It needs only torch (no megatron import), so it is tested everywhere.

Three layouts take part:

- **hf** — ``{name: tensor}`` as ``build_model(spec).state_dict()`` holds it (``hf.model.*`` /
  ``hf.transformer.*`` and ``hf.lm_head.weight`` for a policy; ``trunk.*`` and ``head.*`` for value
  and score models).
- **full megatron** — megatron's names with *global* layer numbers and tensors in megatron's order,
  arranged so that cutting a tensor into ``tp`` equal pieces along its partition dimension gives each
  tensor-parallel rank its piece: query/key/value rows grouped per key-value group (each group's
  queries, then its key, then its value), the gated MLP's input projection as each rank's
  ``[gate piece; up piece]`` one after the other. GPT-2's ``Conv1D`` weights are transposed.
- **local** — one rank's ``state_dict`` entries: its pipeline stage's layers numbered from 0, each
  tensor-parallel tensor cut to the rank's piece.

Tensor-parallel cuts (megatron's column/row-parallel linears and the vocab-parallel embedding):
dimension 0 for the embedding, the LM output layer, ``linear_qkv`` and ``linear_fc1`` (weights and
biases); dimension 1 for ``linear_proj`` and ``linear_fc2`` weights; everything else (norms, the
row-parallel biases, GPT-2's position embeddings, a scalar value/score head) is replicated.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

#: the megatron-core names of one transformer layer's tensors and their tensor-parallel dimension
_LAYER_DIMS = {
    "input_layernorm.weight": None, "input_layernorm.bias": None,
    "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1, "self_attention.linear_proj.bias": None,
    "pre_mlp_layernorm.weight": None, "pre_mlp_layernorm.bias": None,
    "mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc2.weight": 1, "mlp.linear_fc2.bias": None,
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def partition_dim(spec: Mapping, key: str) -> int | None:
    """The dimension along which tensor ``key`` (a megatron name) is cut over tensor-parallel ranks."""
    m = _LAYER.match(key)
    if m:
        return _LAYER_DIMS[m.group(2)]
    if key == "embedding.word_embeddings.weight":
        return 0
    if key == "output_layer.weight" and spec["head"] == "lm":
        return 0
    return None


def tied(spec: Mapping) -> bool:
    """Whether the LM output layer shares the word embeddings (GPT-2 policies)."""
    return spec["arch"] == "gpt2" and spec["head"] == "lm"


def _trunk_prefix(spec: Mapping) -> str:
    if spec["head"] != "lm":
        return "trunk."
    return "hf.model." if spec["arch"] == "llama" else "hf.transformer."


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Mapping) -> torch.Tensor:
    """Stack q [nq·d, ...], k and v [ng·d, ...] into megatron's grouped order (works for biases too)."""
    groups = spec["kv_heads"]
    d = spec["hidden"] // spec["heads"]
    qs = q.reshape(groups, -1, *q.shape[1:])
    ks = k.reshape(groups, d, *k.shape[1:])
    vs = v.reshape(groups, d, *v.shape[1:])
    return torch.cat([qs, ks, vs], dim=1).reshape(-1, *q.shape[1:])


def _qkv_from_megatron(qkv: torch.Tensor, spec: Mapping) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = spec["kv_heads"]
    d = spec["hidden"] // spec["heads"]
    per = spec["heads"] // groups
    g = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _gated_to_megatron(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """Each tensor-parallel rank's [gate piece; up piece], one rank after the other."""
    return torch.cat([torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))])


def _gated_from_megatron(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    pieces = [p.chunk(2) for p in fc1.chunk(tp)]
    return torch.cat([g for g, _ in pieces]), torch.cat([u for _, u in pieces])


def to_megatron(hf: Mapping[str, torch.Tensor], spec: Mapping, tp: int) -> dict[str, torch.Tensor]:
    """hf layout → full megatron layout (see module docstring)."""
    t = _trunk_prefix(spec)
    out: dict[str, torch.Tensor] = {}
    if spec["arch"] == "llama":
        out["embedding.word_embeddings.weight"] = hf[t + "embed_tokens.weight"]
        for i in range(spec["layers"]):
            h, m = f"{t}layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
            out[m + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
                hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"],
                spec)
            out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
            out[m + "mlp.linear_fc1.weight"] = _gated_to_megatron(hf[h + "mlp.gate_proj.weight"],
                                                                 hf[h + "mlp.up_proj.weight"], tp)
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
        out["decoder.final_layernorm.weight"] = hf[t + "norm.weight"]
    else:
        hsz = spec["hidden"]
        out["embedding.word_embeddings.weight"] = hf[t + "wte.weight"]
        out["embedding.position_embeddings.weight"] = hf[t + "wpe.weight"]
        for i in range(spec["layers"]):
            h, m = f"{t}h.{i}.", f"decoder.layers.{i}."
            for ln, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[m + name + ".weight"] = hf[h + ln + ".weight"]
                out[m + name + ".bias"] = hf[h + ln + ".bias"]
            w = hf[h + "attn.c_attn.weight"].t()     # Conv1D [in, out] -> Linear [out, in]
            b = hf[h + "attn.c_attn.bias"]
            out[m + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(*w.split(hsz), spec)
            out[m + "self_attention.linear_qkv.bias"] = _qkv_to_megatron(*b.split(hsz), spec)
            out[m + "self_attention.linear_proj.weight"] = hf[h + "attn.c_proj.weight"].t()
            out[m + "self_attention.linear_proj.bias"] = hf[h + "attn.c_proj.bias"]
            out[m + "mlp.linear_fc1.weight"] = hf[h + "mlp.c_fc.weight"].t()
            out[m + "mlp.linear_fc1.bias"] = hf[h + "mlp.c_fc.bias"]
            out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.c_proj.weight"].t()
            out[m + "mlp.linear_fc2.bias"] = hf[h + "mlp.c_proj.bias"]
        out["decoder.final_layernorm.weight"] = hf[t + "ln_f.weight"]
        out["decoder.final_layernorm.bias"] = hf[t + "ln_f.bias"]
    if spec["head"] == "lm":
        out["output_layer.weight"] = hf["hf.lm_head.weight"]
    else:
        out["output_layer.weight"] = hf["head.weight"]
        out["output_layer.bias"] = hf["head.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def from_megatron(full: Mapping[str, torch.Tensor], spec: Mapping, tp: int) -> dict[str, torch.Tensor]:
    """Full megatron layout → hf layout (the inverse of :func:`to_megatron`)."""
    t = _trunk_prefix(spec)
    out: dict[str, torch.Tensor] = {}
    if spec["arch"] == "llama":
        out[t + "embed_tokens.weight"] = full["embedding.word_embeddings.weight"]
        for i in range(spec["layers"]):
            h, m = f"{t}layers.{i}.", f"decoder.layers.{i}."
            q, k, v = _qkv_from_megatron(full[m + "self_attention.linear_qkv.weight"], spec)
            gate, up = _gated_from_megatron(full[m + "mlp.linear_fc1.weight"], tp)
            out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                        h + "self_attn.v_proj.weight": v,
                        h + "self_attn.o_proj.weight": full[m + "self_attention.linear_proj.weight"],
                        h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                        h + "mlp.down_proj.weight": full[m + "mlp.linear_fc2.weight"],
                        h + "input_layernorm.weight": full[m + "input_layernorm.weight"],
                        h + "post_attention_layernorm.weight": full[m + "pre_mlp_layernorm.weight"]})
        out[t + "norm.weight"] = full["decoder.final_layernorm.weight"]
    else:
        out[t + "wte.weight"] = full["embedding.word_embeddings.weight"]
        out[t + "wpe.weight"] = full["embedding.position_embeddings.weight"]
        for i in range(spec["layers"]):
            h, m = f"{t}h.{i}.", f"decoder.layers.{i}."
            for ln, name in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                out[h + ln + ".weight"] = full[m + name + ".weight"]
                out[h + ln + ".bias"] = full[m + name + ".bias"]
            out[h + "attn.c_attn.weight"] = torch.cat(
                _qkv_from_megatron(full[m + "self_attention.linear_qkv.weight"], spec)).t()
            out[h + "attn.c_attn.bias"] = torch.cat(_qkv_from_megatron(full[m + "self_attention.linear_qkv.bias"], spec))
            out[h + "attn.c_proj.weight"] = full[m + "self_attention.linear_proj.weight"].t()
            out[h + "attn.c_proj.bias"] = full[m + "self_attention.linear_proj.bias"]
            out[h + "mlp.c_fc.weight"] = full[m + "mlp.linear_fc1.weight"].t()
            out[h + "mlp.c_fc.bias"] = full[m + "mlp.linear_fc1.bias"]
            out[h + "mlp.c_proj.weight"] = full[m + "mlp.linear_fc2.weight"].t()
            out[h + "mlp.c_proj.bias"] = full[m + "mlp.linear_fc2.bias"]
        out[t + "ln_f.weight"] = full["decoder.final_layernorm.weight"]
        out[t + "ln_f.bias"] = full["decoder.final_layernorm.bias"]
    if spec["head"] == "lm":
        tied_copy = "output_layer.weight" not in full
        out["hf.lm_head.weight"] = (full["embedding.word_embeddings.weight"].clone() if tied_copy
                                    else full["output_layer.weight"])   # own storage: safetensors refuses shared
    else:
        out["head.weight"] = full["output_layer.weight"]
        out["head.bias"] = full["output_layer.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def stage_layers(spec: Mapping, pp: int, pp_rank: int) -> range:
    """The global layer numbers pipeline stage ``pp_rank`` of ``pp`` holds (an even split)."""
    n = spec["layers"] // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def shard(full: Mapping[str, torch.Tensor], spec: Mapping, tp: int, tp_rank: int, pp: int, pp_rank: int
          ) -> dict[str, torch.Tensor]:
    """Full megatron layout → the local state of rank (tp_rank, pp_rank)."""
    layers = stage_layers(spec, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for key, tensor in full.items():
        m = _LAYER.match(key)
        if m:
            i = int(m.group(1))
            if i not in layers:
                continue
            local = f"decoder.layers.{i - layers.start}.{m.group(2)}"
        elif key.startswith("embedding."):
            if not first:
                continue
            local = key
        else:   # final norm, output layer
            if not last:
                continue
            local = key
        dim = partition_dim(spec, key)
        out[local] = tensor.chunk(tp, dim)[tp_rank].contiguous() if dim is not None else tensor
    if tied(spec):
        if pp == 1:
            out.pop("output_layer.weight", None)   # the output layer uses the embedding itself
        elif last:   # the last stage keeps its own copy of the embedding, kept equal by the embedding group
            out["output_layer.weight"] = full["embedding.word_embeddings.weight"].chunk(tp, 0)[tp_rank].contiguous()
    return out


def unshard(pieces: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], spec: Mapping, tp: int, pp: int
            ) -> dict[str, torch.Tensor]:
    """The local states of every (tp_rank, pp_rank) → the full megatron layout (inverse of :func:`shard`)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for (tp_rank, pp_rank), local in pieces.items():
        start = stage_layers(spec, pp, pp_rank).start
        for key, tensor in local.items():
            m = _LAYER.match(key)
            if m:
                key = f"decoder.layers.{int(m.group(1)) + start}.{m.group(2)}"
            elif key == "output_layer.weight" and tied(spec):
                continue   # the copy of the embedding
            parts.setdefault(key, {})[tp_rank] = tensor
    out = {}
    for key, by_rank in parts.items():
        dim = partition_dim(spec, key)
        out[key] = torch.cat([by_rank[r] for r in range(tp)], dim) if dim is not None else by_rank[0]
    return out
