"""megatron-core's ``GPTModel`` for an rlhfc model spec, and what running it on a CPU machine needs.

:func:`build_gpt` builds one rank's stage of the model (the local, pure-PyTorch layer spec: no
Transformer Engine, no Apex; float32, no dropout, no fused kernels), with a replicated scalar head in
the place of the output layer for value and score models. :class:`Outputs` dresses the last stage's
outputs as a model so the single-rank log-prob, value and loss code reads them unchanged.

On a machine without CUDA three megatron-core spots need a CUDA device (``torch.cuda.current_device()``
for buffers and the rotary table; a CUDA RNG state for the tensor-parallel RNG tracker; the pipeline
schedules' token counters, made with ``device="cuda"``): :func:`cpu_shims` points the first and the
last at the CPU and uses megatron's own no-op tracker (dropout is off). Stages exchange activations
with plain ``isend``/``irecv`` (``batch_p2p_comm = False``), which gloo supports.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from . import megatron_convert as conv
from .build import last_token_index

INSTALL_HINT = "pip install -c constraints.txt -e '.[megatron]'"


def cpu_shims() -> None:
    """Let megatron-core run on CPU (see module docstring); a no-op where CUDA is available."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")   # buffers and the rotary table: on the CPU
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)   # fork() is a no-op
    schedules.torch = _TorchOnCPU()   # the schedules' token counters are made with device="cuda"


class _TorchOnCPU:
    """``torch`` as megatron's pipeline schedules see it on a CPU machine: ``device="cuda"`` means the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def transformer_config(spec: dict, tp: int, pp: int, device: str = "cpu"):
    """The megatron-core ``TransformerConfig`` of an rlhfc model spec (float32, no dropout, no fusions)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = spec["arch"] == "llama"
    return TransformerConfig(
        num_layers=spec["layers"], hidden_size=spec["hidden"], num_attention_heads=spec["heads"],
        num_query_groups=spec["kv_heads"], ffn_hidden_size=spec["ffn"],
        normalization="RMSNorm" if llama else "LayerNorm", layernorm_epsilon=1e-6 if llama else 1e-5,
        gated_linear_unit=llama, add_bias_linear=not llama,
        activation_func=F.silu if llama else partial(F.gelu, approximate="tanh"),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        use_cpu_initialization=not device.startswith("cuda"), perform_initialization=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        batch_p2p_comm=False,   # plain isend/irecv between stages: gloo has them, and no CUDA synchronize
        **recompute_settings(spec.get("recompute")),
    )


def recompute_settings(decision: dict | None) -> dict:
    """Megatron's recompute settings nearest the plan's decision: ``full`` -> every layer recomputed whole;
    ``selective`` -> megatron's selective (core attention); a traced op set (``ops``) is not expressible
    there -> ``full`` (it keeps no more than the decision, so what fit still fits)."""
    policy = (decision or {}).get("policy", "none")
    if policy == "none":
        return {}
    if policy == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


class ScalarHead(nn.Linear):
    """A value/score head in the place of megatron's output layer: ``Linear(hidden, 1)``, replicated."""

    def forward(self, hidden, weight=None, runtime_gather_output=None, **_):   # megatron's call signature
        return super().forward(hidden), None


def build_gpt(spec: dict, tp: int, pp: int, device: str = "cpu"):
    """This rank's stage of the megatron-core ``GPTModel`` for ``spec`` (weights uninitialised)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config(spec, tp, pp, device)
    llama = spec["arch"] == "llama"
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm" if llama else "LayerNorm"),
                     vocab_size=spec["vocab"], max_sequence_length=spec["max_seq"], pre_process=pre,
                     post_process=post, parallel_output=True,
                     # a tied embedding split over stages is two copies kept equal by the worker (megatron's
                     # own set-up moves them to CUDA): the last stage's output layer is a parameter of its own
                     share_embeddings_and_output_weights=conv.tied(spec) and pp == 1,
                     position_embedding_type="rope" if llama else "learned_absolute", rotary_base=10000)
    if post and spec["head"] != "lm":
        model.output_layer = ScalarHead(spec["hidden"], 1)
    return model.to(device)


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A rank's parameters by megatron name (the model has no other state worth keeping)."""
    return dict(model.named_parameters())


class Outputs(nn.Module):
    """The last stage's outputs dressed as a model: the single-rank log-prob, value and loss code reads
    them through the wrappers' methods (``forward_logits``, ``values``, ``score``, ``token_outputs``)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward_logits(self, input_ids, attention_mask):
        return self.out

    def token_outputs(self, input_ids, attention_mask):
        return self.out

    values = token_outputs

    def score(self, input_ids, attention_mask):
        idx = last_token_index(attention_mask)
        return self.out.gather(1, idx.unsqueeze(1)).squeeze(1)


def row_shifts(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading padding columns (each row's tokens must be one contiguous block)."""
    m = mask.long().cpu()
    n = m.sum(-1)
    lead = (m.cumsum(-1) == 0).sum(-1)
    pos = torch.arange(m.shape[1]).expand_as(m)
    inside = (pos >= lead[:, None]) & (pos < (lead + n)[:, None])
    if bool((inside.long() != m).any()):
        raise ValueError("the megatron trainer needs each row's tokens in one contiguous block (left/right padding)")
    return lead


def roll_rows(x: torch.Tensor, shift: torch.Tensor, sign: int) -> torch.Tensor:
    """Shift each row of x [B, T, ...] left by ``shift`` (sign 1) or back right (sign -1), circularly."""
    t = x.shape[1]
    index = (torch.arange(t)[None, :] + sign * shift[:, None]) % t
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, index.to(x.device))
