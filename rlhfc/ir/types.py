"""Types of the SSA values that flow between stages.

Every per-sample value carries its batch size (number of sequences), so the
verifier can check that a stage does not mix values of different batches:

| type             | what it holds                                             |
| ---------------- | --------------------------------------------------------- |
| ``Prompts[B]``   | B prompts drawn from a data source                        |
| ``Rollout[B]``   | B prompt+response sequences with masks                    |
| ``TokenFloat[B]``| one float per response token (log-probs, values, advantages) |
| ``SeqFloat[B]``  | one float per sequence (reward-model scores, rule rewards) |
| ``PolicyLoss[B]``| a loss that trains a model with an ``lm`` head            |
| ``ValueLoss[B]`` | a loss that trains a model with a ``value`` head          |
| ``Metrics``      | scalars reported by a stage (e.g. a train step)           |
"""

from __future__ import annotations

from dataclasses import dataclass

#: Type names that carry a batch size.
BATCHED_KINDS = ("Prompts", "Rollout", "TokenFloat", "SeqFloat", "PolicyLoss", "ValueLoss")
#: Type names without one.
UNBATCHED_KINDS = ("Metrics",)
ALL_KINDS = BATCHED_KINDS + UNBATCHED_KINDS


@dataclass(frozen=True)
class ValueType:
    """A value type: ``kind`` is one of :data:`ALL_KINDS`; ``batch`` is None only for unbatched kinds."""

    kind: str
    batch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown value type {self.kind!r}")
        if (self.kind in BATCHED_KINDS) != (self.batch is not None):
            raise ValueError(f"type {self.kind} {'needs' if self.kind in BATCHED_KINDS else 'takes no'} batch size")

    def __str__(self) -> str:
        return self.kind if self.batch is None else f"{self.kind}[{self.batch}]"

    @staticmethod
    def parse(text: str) -> "ValueType":
        """Inverse of ``str``: ``"Rollout[32]"`` -> ValueType("Rollout", 32)."""
        text = text.strip()
        if "[" in text and text.endswith("]"):
            kind, batch = text[:-1].split("[", 1)
            return ValueType(kind, int(batch))
        return ValueType(text)
