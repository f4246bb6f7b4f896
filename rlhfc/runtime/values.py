"""What flows between stages at run time, one class per IR value type.

| IR type        | runtime value                                        |
| -------------- | ---------------------------------------------------- |
| ``Prompts``    | ``list[str]``                                        |
| ``Rollout``    | :class:`Rollout` (token batch + texts + weights version) |
| ``TokenFloat`` | :class:`TokenValues` (``[B, R]`` values + their mask)  |
| ``SeqFloat``   | ``torch.Tensor`` ``[B]``                              |
| ``PolicyLoss`` | :class:`PolicyLossInput`                              |
| ``ValueLoss``  | :class:`ValueLossInput`                               |
| ``Metrics``    | ``dict[str, float]``                                  |

Everything here pickles cleanly through Ray; nothing is ever unpickled from disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation import RolloutBatch


@dataclass
class Rollout:
    """Generated samples. ``version``: how many train steps the generating weights had seen."""

    batch: RolloutBatch
    prompts: list[str]
    responses: list[str]
    model: str
    version: int
    tokenizer: str

    @property
    def size(self) -> int:
        return self.batch.batch_size

    @property
    def mask(self) -> torch.Tensor:
        return self.batch.response_mask


@dataclass
class TokenValues:
    """One float per response token: ``values`` [B, R], zero where ``mask`` [B, R] is 0."""

    values: torch.Tensor
    mask: torch.Tensor

    def mean(self) -> float:
        m = self.mask.to(self.values.dtype)
        return float((self.values * m).sum() / m.sum().clamp(min=1))


@dataclass
class PolicyLossInput:
    """Everything a policy's train step needs: the rollout, old log-probs, advantages, settings."""

    rollout: Rollout
    old_logp: torch.Tensor
    advantages: torch.Tensor
    ref_logp: torch.Tensor | None
    clip: float
    entropy_coef: float
    kl_coef: float
    estimator: str
    temperature: float


@dataclass
class ValueLossInput:
    """Everything a critic's train step needs: the rollout, old values, returns, clip."""

    rollout: Rollout
    old_values: torch.Tensor
    returns: torch.Tensor
    clip: float
