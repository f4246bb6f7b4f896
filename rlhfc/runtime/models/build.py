"""Model construction for the runtime: a plain dict spec in, a torch module out.

Why this file is long: it is the one place a spec becomes a module — config-built and loaded models, the
three heads, seeded initialisation and the weight helpers every backend shares.

The compiler hands the runtime one JSON object per model::

    {"arch": "llama" | "gpt2", "layers": 2, "hidden": 64, "heads": 4,
     "kv_heads": 4, "ffn": 256, "vocab": 96, "max_seq": 512,
     "head": "lm" | "value" | "score", "source": None | "/abs/local/hf/folder"}

Optional keys: ``"dtype"`` ("float32" | "bfloat16" | "float16", default float32)
and ``"attn"`` (a Hugging Face attention implementation, default "sdpa").

``build_model(spec, seed, device)`` returns one of three wrappers, chosen by
``spec["head"]``. Every wrapper takes ``(input_ids [B, T] long,
attention_mask [B, T] 0/1)`` and computes position ids from the mask, so a
left-padded row gives the same outputs as the same row unpadded:

* ``PolicyModel``  (head "lm"):    ``forward_logits(ids, mask) -> [B, T, V]``
  and ``decode_step(...)`` for KV-cached generation.
* ``ValueModel``   (head "value"): ``values(ids, mask) -> [B, T]``, one value per token.
* ``ScoreModel``   (head "score"): ``score(ids, mask) -> [B]``, the head applied at
  each row's last token whose mask is 1.

All three expose ``.trunk`` (the Hugging Face base model: ``LlamaModel``,
``GPT2Model``, ...), ``.spec`` (the normalised spec) and ``.hidden_size``.

Weights: random weights are drawn from a local ``torch.Generator`` on CPU, one
parameter at a time in ``named_parameters()`` order, so the same spec and seed
give bitwise-identical weights on any device, and the global RNG is untouched.
``get_weights`` / ``set_weights`` / ``save_weights`` / ``load_weights`` move a
flat ``{name: tensor}`` dict (safetensors-ready); ``copy_weights(src, dst)``
copies the shared trunk between wrappers with different heads (``copy(actor)``).

``source`` folders: ``head "lm"`` loads ``AutoModelForCausalLM``; ``"value"`` /
``"score"`` load ``AutoModel`` (the trunk) and take the scalar head from the
folder when it stores one (``score.weight`` of a ``*ForSequenceClassification``
with ``num_labels=1``, or TRL's ``v_head.summary.weight``), else draw it from ``seed``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

__all__ = [
    "ARCHS",
    "HEADS",
    "PolicyModel",
    "ValueModel",
    "ScoreModel",
    "normalize_spec",
    "build_model",
    "position_ids_from_mask",
    "last_token_index",
    "get_weights",
    "set_weights",
    "save_weights",
    "load_weights",
    "copy_weights",
    "count_parameters",
]

ARCHS = ("llama", "gpt2")
HEADS = ("lm", "value", "score")

# Token-id convention of the built-in tokenizer (see tokenizer.py); config-built
# models are told about it so HF's config validation does not complain.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# ----------------------------------------------------------------------------- spec


def normalize_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Return a complete, validated copy of ``spec`` with defaults filled in.

    Defaults: ``kv_heads = heads``, ``ffn`` = 4 * hidden (gpt2) or 8 * hidden / 3
    rounded up to a multiple of 32 (llama), ``max_seq = 512``,
    ``head = "lm"``, ``source = None``, ``dtype = "float32"``, ``attn = "sdpa"``.
    With a ``source`` folder the shape fields are taken from the folder's config
    and may be missing from ``spec``; its dropout is switched off unless ``dropout`` is true (models built
    from a config have none).
    """
    out = dict(spec)
    out.setdefault("head", "lm")
    out.setdefault("source", None)
    out.setdefault("dtype", "float32")
    out.setdefault("attn", "sdpa")
    if out["head"] not in HEADS:
        raise ValueError(f"model head must be one of {HEADS}, got {out['head']!r}")
    if out["dtype"] not in _DTYPES:
        raise ValueError(f"model dtype must be one of {sorted(_DTYPES)}, got {out['dtype']!r}")
    if out["source"] is not None:
        return out
    arch = out.get("arch")
    if arch not in ARCHS:
        raise ValueError(f"model arch must be one of {ARCHS} (or give a 'source' folder), got {arch!r}")
    for key in ("layers", "hidden", "heads", "vocab"):
        if not isinstance(out.get(key), int) or out[key] <= 0:
            raise ValueError(f"model spec needs a positive int {key!r}, got {out.get(key)!r}")
    if out.get("kv_heads") is None:
        out["kv_heads"] = out["heads"]
    if out.get("ffn") is None:
        # gpt2: 4h; llama: 8h/3 rounded up to a multiple of 32 (the compiler's default too)
        out["ffn"] = 4 * out["hidden"] if arch == "gpt2" else -(-(8 * out["hidden"] // 3) // 32) * 32
    if out.get("max_seq") is None:
        out["max_seq"] = 512
    if out["hidden"] % out["heads"]:
        raise ValueError(f"hidden ({out['hidden']}) must be divisible by heads ({out['heads']})")
    if out["heads"] % out["kv_heads"]:
        raise ValueError(f"heads ({out['heads']}) must be divisible by kv_heads ({out['kv_heads']})")
    if arch == "gpt2" and out["kv_heads"] != out["heads"]:
        raise ValueError("gpt2 has no grouped-query attention: kv_heads must equal heads")
    return out


def _hf_config(spec: dict[str, Any]):
    """A Hugging Face config for a config-built (random-weight) model."""
    from transformers import GPT2Config, LlamaConfig

    if spec["arch"] == "llama":
        config = LlamaConfig(
            vocab_size=spec["vocab"],
            hidden_size=spec["hidden"],
            intermediate_size=spec["ffn"],
            num_hidden_layers=spec["layers"],
            num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"],
            max_position_embeddings=spec["max_seq"],
            tie_word_embeddings=False,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
    else:
        config = GPT2Config(
            vocab_size=spec["vocab"],
            n_embd=spec["hidden"],
            n_inner=spec["ffn"],
            n_layer=spec["layers"],
            n_head=spec["heads"],
            n_positions=spec["max_seq"],
            # RL fine-tuning runs without dropout (log-probs must be reproducible).
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=PAD_ID,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
        )
    config._attn_implementation = spec["attn"]
    return config


# ----------------------------------------------------------------------------- helpers


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] that count only real tokens: 0 at each row's first 1.

    Padding positions get a clamped, meaningless position (they are masked out).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last position whose mask is 1 (0 for an all-zero row)."""
    t = attention_mask.shape[-1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


@torch.no_grad()
def _init_weights_(module: nn.Module, generator: torch.Generator, n_layers: int, arch: str | None) -> None:
    """Overwrite every parameter of ``module`` from ``generator`` (CPU, float32).

    Scheme (the usual one for these archs): biases 0, norm scales 1, matrices
    N(0, 0.02); GPT-2 residual projections (``c_proj``) N(0, 0.02 / sqrt(2L)).
    """
    for name, param in module.named_parameters():
        if param.ndim < 2:
            value = torch.ones(param.shape) if not name.endswith("bias") else torch.zeros(param.shape)
        else:
            std = 0.02
            if arch == "gpt2" and name.endswith("c_proj.weight"):
                std = 0.02 / math.sqrt(2 * n_layers)
            value = torch.empty(param.shape).normal_(0.0, std, generator=generator)
        param.copy_(value.to(param.dtype))


@torch.no_grad()
def _init_head_(head: nn.Linear, generator: torch.Generator) -> None:
    """Scalar head: weights N(0, 1/hidden) so outputs start at O(1), bias 0."""
    std = 1.0 / math.sqrt(head.in_features)
    head.weight.copy_(torch.empty(head.weight.shape).normal_(0.0, std, generator=generator).to(head.weight.dtype))
    if head.bias is not None:
        head.bias.zero_()


def _construct(fn):
    """Run a constructor without touching the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        return fn()


# ----------------------------------------------------------------------------- wrappers


class PolicyModel(nn.Module):
    """A causal LM (head "lm"). ``self.hf`` is the Hugging Face ``*ForCausalLM``."""

    head_kind = "lm"

    def __init__(self, hf_model: nn.Module, spec: dict[str, Any]):
        super().__init__()
        self.hf = hf_model
        self.spec = spec

    @property
    def trunk(self) -> nn.Module:
        """The transformer without the LM head (shared with value/score models)."""
        return self.hf.base_model

    @property
    def hidden_size(self) -> int:
        return self.hf.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def forward_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] (float32) for a (left- and/or right-) padded batch."""
        out = self.hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.logits.float()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.forward_logits(input_ids, attention_mask)

    def decode_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Any,
    ) -> tuple[torch.Tensor, Any]:
        """One incremental step: ``input_ids`` [B, t] new tokens, ``attention_mask``
        [B, past + t] over all tokens so far, ``position_ids`` [B, t].
        Returns (logits [B, t, V] float32, updated cache)."""
        out = self.hf(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=True,
        )
        return out.logits.float(), out.past_key_values


class _TrunkWithScalarHead(nn.Module):
    """A Hugging Face base model plus ``Linear(hidden, 1)``."""

    head_kind = ""

    def __init__(self, trunk: nn.Module, spec: dict[str, Any]):
        super().__init__()
        self.trunk = trunk
        self.spec = spec
        self.head = nn.Linear(trunk.config.hidden_size, 1, dtype=trunk.dtype, device=trunk.device)

    @property
    def hidden_size(self) -> int:
        return self.trunk.config.hidden_size

    def token_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Head output at every position, [B, T] float32 (padding positions are garbage)."""
        out = self.trunk(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return self.head(out.last_hidden_state).squeeze(-1).float()


class ValueModel(_TrunkWithScalarHead):
    """Critic (head "value"): ``values(ids, mask) -> [B, T]``, one value per token."""

    head_kind = "value"

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.token_outputs(input_ids, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.values(input_ids, attention_mask)


class ScoreModel(_TrunkWithScalarHead):
    """Reward model (head "score"): ``score(ids, mask) -> [B]`` at each row's last real token."""

    head_kind = "score"

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        per_token = self.token_outputs(input_ids, attention_mask)
        idx = last_token_index(attention_mask)
        return per_token.gather(1, idx.unsqueeze(1)).squeeze(1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.score(input_ids, attention_mask)


# ----------------------------------------------------------------------------- building


def build_model(
    spec: Mapping[str, Any], seed: int = 0, device: str | torch.device = "cpu"
) -> PolicyModel | ValueModel | ScoreModel:
    """Build the wrapper for ``spec`` (see module docstring) on ``device``.

    Config models get random weights from ``seed`` (bitwise reproducible, device
    independent). ``source`` models load the folder with ``local_files_only=True``;
    value/score heads on top of a loaded trunk are drawn from ``seed``.
    The model is returned in eval mode; call ``.train()`` before optimising.
    """
    spec = normalize_spec(spec)
    dtype = _DTYPES[spec["dtype"]]
    generator = torch.Generator(device="cpu").manual_seed(int(seed))

    if spec["source"] is not None:
        model = _load_from_source(spec, dtype, generator)
    else:
        config = _hf_config(spec)
        if spec["head"] == "lm":
            from transformers import AutoModelForCausalLM

            hf = _construct(lambda: AutoModelForCausalLM.from_config(config))
            _init_weights_(hf, generator, spec["layers"], spec["arch"])
            model = PolicyModel(hf, spec)
        else:
            from transformers import AutoModel

            trunk = _construct(lambda: AutoModel.from_config(config))
            _init_weights_(trunk, generator, spec["layers"], spec["arch"])
            cls = ValueModel if spec["head"] == "value" else ScoreModel
            model = _construct(lambda: cls(trunk, spec))
            _init_head_(model.head, generator)
    if spec.get("lora") and isinstance(model, PolicyModel):   # adapters (rlhfc.runtime.models.lora), base frozen
        from .lora import apply_lora

        model.hf = apply_lora(model.hf, spec["lora"], generator)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model


def without_dropout(config) -> Any:
    """``config`` with every dropout rate of its own set to 0 (``*dropout*``, ``*pdrop*``: GPT-2's 0.1, llama's
    ``attention_dropout``): RL's log-prob ratios and value targets must not carry dropout noise (TRL's
    ``disable_dropout``, OpenRLHF and verl alike). Returns the names it zeroed."""
    zeroed = []
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)
            zeroed.append(key)
    return zeroed


def _load_from_source(spec: dict[str, Any], dtype: torch.dtype, generator: torch.Generator) -> nn.Module:
    """A model loaded from its folder, dropout switched off unless the spec keeps it (``dropout: True``)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    kwargs = dict(local_files_only=True, dtype=dtype, attn_implementation=spec["attn"], use_safetensors=True)
    if not spec.get("dropout"):
        config = AutoConfig.from_pretrained(spec["source"], local_files_only=True)
        without_dropout(config)
        kwargs["config"] = config
    if spec["head"] == "lm":
        hf = _construct(lambda: AutoModelForCausalLM.from_pretrained(spec["source"], **kwargs))
        return PolicyModel(hf, spec)
    trunk = _construct(lambda: AutoModel.from_pretrained(spec["source"], **kwargs))
    cls = ValueModel if spec["head"] == "value" else ScoreModel
    model = _construct(lambda: cls(trunk, spec))
    _init_head_(model.head, generator)
    _load_saved_head_(spec["source"], model.head)
    return model


# Names under which checkpoints store a scalar head: HF *ForSequenceClassification
# (num_labels=1), TRL's value-head wrapper, and our own wrappers.
_SAVED_HEAD_NAMES = (("score.weight", "score.bias"), ("v_head.summary.weight", "v_head.summary.bias"), ("head.weight", "head.bias"))


@torch.no_grad()
def _load_saved_head_(folder: str, head: nn.Linear) -> bool:
    """Copy a scalar head stored in ``folder``'s safetensors files into ``head``.

    Returns False (head left as initialised) when no file holds one of
    ``_SAVED_HEAD_NAMES`` with shape [1, hidden]; a classifier head of several labels is a ValueError.
    """
    import glob
    import os

    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for weight_key, bias_key in _SAVED_HEAD_NAMES:
                if weight_key not in keys:
                    continue
                weight = f.get_tensor(weight_key)
                if weight.ndim == 2 and weight.shape[0] > 1 and weight.shape[1] == head.weight.shape[1]:
                    raise ValueError(f"{folder}: its classifier head {weight_key} scores {weight.shape[0]} labels; "
                                     "a reward or value model gives one number per sequence (save the "
                                     "AutoModelForSequenceClassification with num_labels = 1)")
                if tuple(weight.shape) != tuple(head.weight.shape):
                    continue
                head.weight.copy_(weight.to(head.weight.dtype))
                if head.bias is not None:
                    head.bias.copy_(f.get_tensor(bias_key).to(head.bias.dtype) if bias_key in keys else torch.zeros(1))
                return True
    return False


# ----------------------------------------------------------------------------- weights


def get_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` copy of the model's state (CPU, contiguous).

    Every entry is its own tensor (tied weights are copied twice), so the dict can
    go straight to ``safetensors.torch.save_file``.
    """
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def set_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a dict produced by ``get_weights`` (strict: names must match)."""
    model.load_state_dict(dict(state), strict=True)


def save_weights(model: nn.Module, path: str) -> None:
    """Write ``get_weights(model)`` to a ``.safetensors`` file."""
    from safetensors.torch import save_file

    save_file(get_weights(model), path)


def load_weights(model: nn.Module, path: str) -> None:
    """Read a ``.safetensors`` file written by ``save_weights`` into ``model``."""
    from safetensors.torch import load_file

    set_weights(model, load_file(path))


@torch.no_grad()
def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """Initialise ``dst`` from ``src``: everything when both have the same head
    kind, otherwise only the shared trunk (``dst``'s own head is kept).

    Raises ``ValueError`` when the trunks differ in parameter names or shapes. A source with LoRA adapters
    gives its merged weights (``W + ΔW``, :func:`rlhfc.runtime.models.lora.merged_state`).
    """
    if getattr(src, "spec", {}).get("lora"):
        from .lora import merged_state

        plain = build_model({**src.spec, "lora": None}, device=next(src.parameters()).device)
        set_weights(plain, merged_state(src))
        src = plain
    if type(src) is type(dst):
        set_weights(dst, src.state_dict())
        return
    src_state = src.trunk.state_dict()
    dst_state = dst.trunk.state_dict()
    if src_state.keys() != dst_state.keys():
        missing = sorted(set(src_state) ^ set(dst_state))[:5]
        raise ValueError(f"copy_weights: trunks differ in parameter names, e.g. {missing}")
    for name, tensor in src_state.items():
        if tensor.shape != dst_state[name].shape:
            raise ValueError(
                f"copy_weights: trunk parameter {name} has shape {tuple(tensor.shape)} in the source "
                f"but {tuple(dst_state[name].shape)} in the destination"
            )
    dst.trunk.load_state_dict(src_state, strict=True)


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
