"""Sampling generation with a KV cache, and the forwards that score a rollout.

Layout of a rollout (``RolloutBatch``), B samples, P = longest prompt, R = longest
response::

    input_ids      [B, P + R]   left-padded prompt | right-padded response
    attention_mask [B, P + R]   1 on prompt tokens and response tokens (EOS included)
    response_mask  [B, R]       1 on generated tokens up to and including EOS, 0 after
    prompt_len     int          P; the response of every row starts at column P
    response_lengths [B]        number of 1s in each response_mask row
    prompt_lengths   [B]        number of real prompt tokens per row
    eos            [B] bool     True when the response ended with EOS (False: cut at max_new_tokens)

All integer tensors are ``torch.long``. Padding positions hold ``pad_id``.

Two entry points produce rollouts:

* ``generate(model, prompts, ...) -> RolloutBatch``: the plain path.
* ``generate_stream(model, prompts, ...)``: a Python generator yielding one
  ``FinishedSample`` per prompt as soon as that sample is done (EOS or the
  length limit), in finish order. ``collate(samples, pad_id, prompt_len=P)``
  builds a ``RolloutBatch`` from any subset of them, so downstream forwards can
  start on finished samples while the rest still decode. ``generate`` is exactly
  ``collate(list(generate_stream(...)))``: streaming and plain give identical tokens.

Sampling reproducibility: every random draw goes through the ``torch.Generator``
passed in (``torch.multinomial`` on the generator's device); the same model,
prompts, settings and generator state give the same tokens. ``temperature=0``
is greedy decoding.

Forwards over a rollout (``response_logprobs``, ``response_values``,
``sequence_scores``) return response-aligned tensors: column t of a [B, R]
result is about response token t (the log-prob of emitting it, or the value of
the state just before it), and is 0 where ``response_mask`` is 0. They keep the
autograd graph; wrap them in ``torch.no_grad()`` for rollout-time calls.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

import torch

from rlhfc.runtime.models.build import PolicyModel, ScoreModel, ValueModel

from .decoding import FinishedSample, PartialSample, _model_device, generate_stream  # noqa: F401 - re-exported
from .sampling import row_uniforms, sample_next_token  # noqa: F401 - re-exported: part of this module's API

__all__ = [
    "RolloutBatch",
    "FinishedSample",
    "generate",
    "generate_stream",
    "collate",
    "sample_next_token",
    "response_logprobs",
    "response_logprobs_and_entropy",
    "response_values",
    "sequence_scores",
    "entropy_from_logits",
    "response_entropy",
    "encode_prompts",
    "decode_responses",
    "decode_prompts",
]


# ----------------------------------------------------------------------------- data


@dataclass
class RolloutBatch:
    """A batch of generated samples (shapes in the module docstring)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int
    response_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    eos: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        """R, the number of response columns."""
        return self.input_ids.shape[1] - self.prompt_len

    @property
    def responses(self) -> torch.Tensor:
        """Response token ids [B, R] (pad after each response)."""
        return self.input_ids[:, self.prompt_len :]

    @property
    def prompts(self) -> torch.Tensor:
        """Left-padded prompt token ids [B, P]."""
        return self.input_ids[:, : self.prompt_len]

    def select(self, index: torch.Tensor | Sequence[int]) -> "RolloutBatch":
        """The rows ``index`` (same P and R, so shapes line up with the full batch)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.input_ids.device)
        return RolloutBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            response_mask=self.response_mask[index],
            prompt_len=self.prompt_len,
            response_lengths=self.response_lengths[index],
            prompt_lengths=self.prompt_lengths[index],
            eos=self.eos[index],
        )

    def to(self, device: str | torch.device) -> "RolloutBatch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "prompt_len"})

    def as_dict(self) -> dict[str, Any]:
        """Fields as a dict (``prompt_len`` stays an int); see ``from_dict``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RolloutBatch":
        """Rebuild from a dict holding (at least) the fields of ``as_dict``."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def response_token_lists(self) -> list[list[int]]:
        """Each row's response ids without padding (EOS kept when present)."""
        responses = self.responses.tolist()
        return [r[:n] for r, n in zip(responses, self.response_lengths.tolist())]

    def prompt_token_lists(self) -> list[list[int]]:
        """Each row's prompt ids without padding."""
        prompts = self.prompts.tolist()
        return [p[len(p) - n :] if n else [] for p, n in zip(prompts, self.prompt_lengths.tolist())]


def collate(
    samples: Sequence[FinishedSample],
    pad_id: int,
    prompt_len: int | None = None,
    response_width: int | None = None,
    device: str | torch.device = "cpu",
) -> RolloutBatch:
    """Pack finished samples (sorted by ``index``) into a ``RolloutBatch``.

    ``prompt_len`` / ``response_width`` default to the longest prompt / response
    among ``samples``; pass the full batch's values to give a chunk the same shape.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    samples = sorted(samples, key=lambda s: s.index)
    p = max(len(s.prompt_ids) for s in samples) if prompt_len is None else prompt_len
    r = max(len(s.response_ids) for s in samples) if response_width is None else response_width
    b = len(samples)
    input_ids = torch.full((b, p + r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + r), dtype=torch.long)
    for row, s in enumerate(samples):
        np_, nr = len(s.prompt_ids), len(s.response_ids)
        if np_ > p or nr > r:
            raise ValueError(f"sample {s.index} does not fit in prompt_len={p}, response_width={r}")
        input_ids[row, p - np_ : p] = torch.tensor(s.prompt_ids, dtype=torch.long)
        input_ids[row, p : p + nr] = torch.tensor(s.response_ids, dtype=torch.long)
        attention_mask[row, p - np_ : p + nr] = 1
    return RolloutBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        response_mask=attention_mask[:, p:].clone().to(device),
        prompt_len=p,
        response_lengths=torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long, device=device),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long, device=device),
        eos=torch.tensor([s.eos for s in samples], dtype=torch.bool, device=device),
    )


# ----------------------------------------------------------------------------- sampling


def generate(
    model: PolicyModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> RolloutBatch:
    """Generate responses for ``prompts``; the batch rows follow the prompt order."""
    samples = list(
        generate_stream(
            model,
            prompts,
            max_new_tokens,
            eos_id=eos_id,
            pad_id=pad_id,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=generator,
        )
    )
    return collate(samples, pad_id, device=_model_device(model))


# ----------------------------------------------------------------------------- forwards


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...]."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _response_logits(model: PolicyModel, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Logits [B, R, V] that predict response tokens 0..R-1."""
    r = batch.response_width
    logits = model.forward_logits(batch.input_ids, batch.attention_mask)
    logits = logits[:, batch.prompt_len - 1 : batch.prompt_len - 1 + r]
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def _chunks(batch: RolloutBatch, micro_batch_size: int | None) -> list[RolloutBatch]:
    if micro_batch_size is None or micro_batch_size >= batch.batch_size:
        return [batch]
    return [batch.select(range(i, min(i + micro_batch_size, batch.batch_size))) for i in range(0, batch.batch_size, micro_batch_size)]


def response_logprobs_and_entropy(
    model: PolicyModel, batch: RolloutBatch, temperature: float = 1.0, micro_batch_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [B, R], entropies [B, R]) of the response tokens under ``model``.

    Logits are divided by ``temperature`` first (use the sampling temperature so
    the log-probs are those of the sampling distribution). Masked positions are 0.
    """
    logps, ents = [], []
    for part in _chunks(batch, micro_batch_size):
        logits = _response_logits(model, part, temperature)
        tokens = part.responses.unsqueeze(-1)
        logp = logits.gather(-1, tokens).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        logps.append(_masked(logp, part.response_mask))
        ents.append(_masked(entropy_from_logits(logits), part.response_mask))
    return torch.cat(logps), torch.cat(ents)


def response_logprobs(
    model: PolicyModel, batch: RolloutBatch, temperature: float = 1.0, micro_batch_size: int | None = None
) -> torch.Tensor:
    """Log-probs [B, R] of the response tokens (0 where ``response_mask`` is 0)."""
    out = []
    for part in _chunks(batch, micro_batch_size):
        logits = _response_logits(model, part, temperature)
        logp = logits.gather(-1, part.responses.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        out.append(_masked(logp, part.response_mask))
    return torch.cat(out)


def response_entropy(
    model: PolicyModel, batch: RolloutBatch, temperature: float = 1.0, micro_batch_size: int | None = None
) -> torch.Tensor:
    """Entropy [B, R] of the policy at each response position (0 where masked)."""
    return response_logprobs_and_entropy(model, batch, temperature, micro_batch_size)[1]


def response_values(value_model: ValueModel, batch: RolloutBatch, micro_batch_size: int | None = None) -> torch.Tensor:
    """Values [B, R]: column t is the value of the state before response token t
    (the critic output at position P - 1 + t); 0 where ``response_mask`` is 0."""
    out = []
    for part in _chunks(batch, micro_batch_size):
        v = value_model.values(part.input_ids, part.attention_mask)
        v = v[:, part.prompt_len - 1 : part.prompt_len - 1 + part.response_width]
        out.append(_masked(v, part.response_mask))
    return torch.cat(out)


def sequence_scores(score_model: ScoreModel, batch: RolloutBatch, micro_batch_size: int | None = None) -> torch.Tensor:
    """One score [B] per sample, read at its last real token (EOS if it has one)."""
    return torch.cat([score_model.score(part.input_ids, part.attention_mask) for part in _chunks(batch, micro_batch_size)])


# ----------------------------------------------------------------------------- text


def encode_prompts(tokenizer: Any, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
    """Token ids per prompt text (BOS first by default, so no prompt is empty)."""
    return [tokenizer.encode(t, add_bos=add_bos) for t in texts]


def decode_responses(tokenizer: Any, batch: RolloutBatch) -> list[str]:
    """Response texts (special tokens, EOS included, are dropped)."""
    return [tokenizer.decode(ids) for ids in batch.response_token_lists()]


def decode_prompts(tokenizer: Any, batch: RolloutBatch) -> list[str]:
    """Prompt texts (special tokens dropped)."""
    return [tokenizer.decode(ids) for ids in batch.prompt_token_lists()]
