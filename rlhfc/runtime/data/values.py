"""What flows between stages at run time, one class per IR value type.

| IR type        | runtime value                                        |
| -------------- | ---------------------------------------------------- |
| ``Prompts``    | ``list[str]``, or ``list[dict]`` ``{"prompt", "fields"}`` when the data declares fields |
| ``Rollout``    | :class:`Rollout` (token batch + texts + weights version) |
| ``TokenFloat`` | :class:`TokenValues` (``[B, R]`` values + their mask)  |
| ``SeqFloat``   | ``torch.Tensor`` ``[B]``                              |
| ``PolicyLoss`` | :class:`PolicyLossInput`                              |
| ``ValueLoss``  | :class:`ValueLossInput`                               |
| ``Metrics``    | ``dict[str, float]``                                  |

Everything here pickles cleanly through Ray; nothing is ever unpickled from disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from rlhfc.runtime.rollout.generation import RolloutBatch


@dataclass
class Rollout:
    """Generated samples. ``version``: how many train steps the generating weights had seen.

    ``rows``: each sample's row in the step's batch (a streamed chunk holds some rows);
    ``born``: the weights version each sample started with (older than ``version`` for
    samples carried over from an earlier step by overcommitment).
    The response width is the stage's ``max_new_tokens``, so a chunk's rows have the shape they
    have in the whole batch (per-row forwards agree up to the rounding of batched kernels over
    fewer rows; docs/claims.md); under the ``unpad``
    pass (``unpad=True``) it is the longest response in the chunk instead, and merging
    pads chunks to the widest.
    """

    batch: RolloutBatch
    prompts: list[str]
    responses: list[str]
    model: str
    version: int
    tokenizer: str
    rows: list[int] = field(default_factory=list)
    born: list[int] = field(default_factory=list)
    #: decoding steps the generation had run when the last of these samples finished
    decode_steps: int = 0
    #: [B, R] log-prob of each response token under the generating weights, kept when the generate
    #: was asked for it (the ``reuse_logprobs`` pass); 0 past each response
    logprobs: torch.Tensor | None = None
    #: generated under the ``unpad`` pass: forwards run the rows in groups of similar length, each cut to
    #: its own width (:mod:`rlhfc.runtime.train.packing`)
    unpad: bool = False
    #: tokens generation computed for these samples (padded prompts, decode batch slots; see
    #: ``FinishedSample.computed``): against their prompt and response tokens, generation's padding efficiency
    computed_tokens: float = 0.0
    #: per sample, the data fields of its prompt (``{name: JSON value}``; ``{}`` when the data declares none):
    #: a prompt's fields go with each of its ``n`` samples, through streamed chunks and carried samples
    fields: list[dict] = field(default_factory=list)
    #: the rollout engine's statistics of this generate (rollout = vllm: ``refit_s``, ``refit_mb``,
    #: ``engine_start_s``); a streamed stage's first chunk carries them
    engine: dict = field(default_factory=dict)
    #: the engine that generated it (``run { rollout = ... }``): ``torch`` or ``vllm``
    rollout_engine: str = "torch"
    #: per sample, the weights version of each response token as runs ``[[version, tokens], ...]`` (one run for a
    #: sample generated in one call; a carried sample's partial tokens keep the versions that sampled them)
    versions: list[list[list[int]]] = field(default_factory=list)

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
    #: [B] bool, the rows a policy loss trains on (None: all) — DAPO's dynamic sampling
    #: (``group_advantages(filter_groups = true)``) leaves out the groups whose scores are all equal
    keep: torch.Tensor | None = None
    #: how many groups ``keep`` leaves out (with refill: over all the step's sampling rounds)
    dropped_groups: int = 0
    #: dynamic sampling with refill (rlhfc.runtime.rl.refill): the rounds of sampling the step ran (0: no refill)
    sample_rounds: int = 0
    #: ... and the groups those rounds sampled
    sampled_groups: int = 0

    def mean(self) -> float:
        m = self.mask.to(self.values.dtype)
        return float((self.values * m).sum() / m.sum().clamp(min=1))

    def row_sums(self) -> torch.Tensor:
        """[B]: each row's sum over its masked-in tokens (per-token rewards: each trajectory's return)."""
        return (self.values * self.mask.to(self.values.dtype)).sum(-1)


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
    clip_high: float | None = None
    loss_agg: str = "token_mean"
    ratio: str = "token"
    #: statistics of how the batch was made (dropped groups), reported with the train step's metrics
    stats: dict = field(default_factory=dict)
    #: decoupled PPO (asynchronous rollout): the log-probs [B, R] of the weights that generated each token;
    #: ``old_logp`` is then the proximal policy, and tokens whose weight exp(old − behaviour) exceeds
    #: ``behaviour_cap`` are dropped (:func:`rlhfc.runtime.rl.ppo.policy_loss`)
    behaviour_logp: torch.Tensor | None = None
    behaviour_cap: float | None = None
    #: ``loglinear`` (A-3PO): the proximal log-probs are interpolated per sample in the train step from the
    #: behaviour and current ones (``recompute``: ``old_logp`` is the proximal forward)
    proximal: str = "recompute"


@dataclass
class ValueLossInput:
    """Everything a critic's train step needs: the rollout, old values, returns, clip."""

    rollout: Rollout
    old_values: torch.Tensor
    returns: torch.Tensor
    clip: float


@dataclass
class CarryOver:
    """Unfinished samples at the end of an overcommitted generation, carried into the next step.

    Each item is plain JSON: ``{"prompt", "prompt_ids", "partial", "born", "versions", "fields"}``
    (checkpointable; ``versions``: the partial tokens' weights versions as runs, :func:`token_versions`;
    ``fields``: the prompt's data fields; both absent in checkpoints of older jobs).
    """

    samples: list[dict]


def token_versions(item: dict, total: int, version: int) -> list[list[int]]:
    """The weights versions of the first ``total`` response tokens of generation input ``item`` (a prompt, or a
    carried sample with ``partial`` tokens and their ``versions``), as runs ``[[version, tokens], ...]``: the
    partial tokens' runs, then ``version`` (the generating weights now) for the tokens after them. A carried
    sample without runs (an older checkpoint's) counts its partial tokens at its ``born`` version."""
    partial = len(item.get("partial") or ())
    runs = [list(r) for r in (item.get("versions") or ([[int(item["born"]), partial]] if partial else []))]
    if total > partial:
        if runs and runs[-1][0] == version:
            runs[-1][1] += total - partial
        else:
            runs.append([int(version), total - partial])
        return runs
    out, left = [], total
    for v, n in runs:   # fewer tokens than carried (a sample cut before its last token): the leading runs
        if left <= 0:
            break
        out.append([v, min(n, left)])
        left -= n
    return out


def oldest_version(rollout: Rollout) -> int:
    """The oldest weights version that generated any token of ``rollout`` (its samples' ``born`` where it
    records no per-token versions)."""
    per_token = [v for runs in rollout.versions for v, n in runs if n > 0]
    return min(per_token or rollout.born or [rollout.version])


_BATCH_TENSORS = ("input_ids", "attention_mask", "response_mask", "response_lengths", "prompt_lengths", "eos")


def rollout_state(rollout: Rollout, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A rollout as plain JSON and named tensors (``prefix.<field>``), for a checkpoint's in-flight rollouts
    (asynchronous rollout); :func:`rollout_from_state` rebuilds it exactly."""
    tensors = {f"{prefix}.{k}": getattr(rollout.batch, k).detach().cpu().contiguous() for k in _BATCH_TENSORS}
    if rollout.logprobs is not None:
        tensors[f"{prefix}.logprobs"] = rollout.logprobs.detach().cpu().contiguous()
    meta = {"prompt_len": rollout.batch.prompt_len, "prompts": rollout.prompts, "responses": rollout.responses,
            "model": rollout.model, "version": rollout.version, "tokenizer": rollout.tokenizer,
            "rows": rollout.rows, "born": rollout.born, "decode_steps": rollout.decode_steps,
            "unpad": rollout.unpad, "computed_tokens": rollout.computed_tokens, "fields": rollout.fields,
            "engine": rollout.engine, "rollout_engine": rollout.rollout_engine, "versions": rollout.versions}
    return meta, tensors


def rollout_from_state(meta: dict, tensors: dict[str, torch.Tensor], prefix: str) -> Rollout:
    batch = RolloutBatch(prompt_len=int(meta["prompt_len"]), **{k: tensors[f"{prefix}.{k}"] for k in _BATCH_TENSORS})
    return Rollout(batch, list(meta["prompts"]), list(meta["responses"]), meta["model"], int(meta["version"]),
                   meta["tokenizer"], list(meta["rows"]), list(meta["born"]), int(meta["decode_steps"]),
                   tensors.get(f"{prefix}.logprobs"), bool(meta["unpad"]), float(meta["computed_tokens"]),
                   list(meta["fields"]), dict(meta["engine"]), meta["rollout_engine"], list(meta.get("versions", [])))


def select_rows(rollout: Rollout, index: torch.Tensor) -> Rollout:
    """The rows ``index`` of a rollout (texts, bookkeeping and kept log-probs with them)."""
    rows = index.tolist()
    pick = lambda xs: [xs[i] for i in rows] if xs else xs  # noqa: E731
    return replace(rollout, batch=rollout.batch.select(index), prompts=pick(rollout.prompts),
                   responses=pick(rollout.responses), rows=pick(rollout.rows), born=pick(rollout.born),
                   versions=pick(rollout.versions) if len(rollout.versions) == rollout.size else rollout.versions,
                   fields=pick(rollout.fields) if len(rollout.fields) == rollout.size else rollout.fields,
                   logprobs=rollout.logprobs[index.to(rollout.logprobs.device)] if rollout.logprobs is not None
                   else None)


def _order(chunks: list) -> list[int]:
    rows = [r for c in chunks for r in c.rows]
    return sorted(range(len(rows)), key=lambda i: rows[i])


def _pad_cols(x: torch.Tensor, width: int, value: int | float = 0) -> torch.Tensor:
    """``x`` [B, w, ...] right-padded with ``value`` to [B, width, ...]."""
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def merge_rollouts(chunks: list[Rollout], pad_id: int = 0) -> Rollout:
    """Reassemble streamed chunks into one rollout, rows in batch order (narrower chunks — cropped by
    the ``unpad`` pass — are right-padded with ``pad_id`` to the widest)."""
    if len(chunks) == 1:
        return chunks[0]
    order = _order(chunks)
    width = max(c.batch.response_width for c in chunks)
    p = chunks[0].batch.prompt_len
    cat = {f: torch.cat([getattr(c.batch, f) for c in chunks])[order]
           for f in ("response_lengths", "prompt_lengths", "eos")}
    cat["input_ids"] = torch.cat([_pad_cols(c.batch.input_ids, p + width, pad_id) for c in chunks])[order]
    cat["attention_mask"] = torch.cat([_pad_cols(c.batch.attention_mask, p + width) for c in chunks])[order]
    cat["response_mask"] = torch.cat([_pad_cols(c.batch.response_mask, width) for c in chunks])[order]
    batch = RolloutBatch(prompt_len=p, **cat)
    flat = lambda attr: [x for c in chunks for x in getattr(c, attr)]  # noqa: E731
    prompts, responses, rows, born = flat("prompts"), flat("responses"), flat("rows"), flat("born")
    fields, versions = flat("fields"), flat("versions")
    return Rollout(batch, [prompts[i] for i in order], [responses[i] for i in order], chunks[0].model,
                   max(c.version for c in chunks), chunks[0].tokenizer, [rows[i] for i in order],
                   [born[i] for i in order], max(c.decode_steps for c in chunks),
                   torch.cat([_pad_cols(c.logprobs, width) for c in chunks])[order]
                   if all(c.logprobs is not None for c in chunks) else None, all(c.unpad for c in chunks),
                   sum(c.computed_tokens for c in chunks),
                   [fields[i] for i in order] if len(fields) == len(order) else [],
                   {k: v for c in chunks for k, v in c.engine.items()}, chunks[0].rollout_engine,
                   [versions[i] for i in order] if len(versions) == len(order) else [])


def merge_parts(parts: list, chunks: list[Rollout]):
    """Reassemble a consumer's per-chunk results (TokenValues or [B] tensors) in batch order."""
    if len(parts) == 1:
        return parts[0]
    order = _order(chunks)
    if isinstance(parts[0], TokenValues):
        width = max(p.values.shape[1] for p in parts)
        return TokenValues(torch.cat([_pad_cols(p.values, width) for p in parts])[order],
                           torch.cat([_pad_cols(p.mask, width) for p in parts])[order])
    return torch.cat(list(parts))[order]
