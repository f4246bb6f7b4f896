"""Prompt and response length distributions.

Generation time follows the *longest* response of a batch while the number of
still-active samples shrinks, so the cost model needs the whole distribution,
not a mean. :class:`LengthDist` holds the probability of each response length
1..T (T = ``max_new_tokens``) and answers order-statistic questions about a
batch of n independent samples.

Response models (``CostConfig.response_lengths``):

- ``"auto"`` (default): models with random weights (``init = "random"`` or a
  copy of one; the runtime's char tokenizer) stop when they happen to sample
  EOS, about once per ``vocab`` tokens: a geometric law with p = 1/vocab,
  truncated at T. Pretrained models (``hf(...)``) get the long-tailed law below.
- ``"max"``: every response is T tokens (how most throughput benchmarks run).
- ``"geometric:P"``: stop with probability P after each token.
- ``"lognormal:F:S"``: median F*T tokens, log-std S, truncated at T (mass
  beyond T ends at T). The default long tail is F = 0.25, S = 1.0, whose
  p99.9/median ratio (~22) matches the "> 10x" reported for LMSYS-Chat-1M.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from rlhfc.contract import rules

DEFAULT_LONG_TAIL = (0.25, 1.0)


@dataclass(frozen=True)
class LengthDist:
    """``pmf[l-1]`` = P(length = l) for l = 1..T."""

    pmf: tuple

    @property
    def T(self) -> int:
        return len(self.pmf)

    def array(self) -> np.ndarray:
        return np.asarray(self.pmf, dtype=np.float64)

    def cdf(self) -> np.ndarray:
        """F(t) = P(L <= t) for t = 0..T (length T+1)."""
        return np.concatenate([[0.0], np.minimum(np.cumsum(self.array()), 1.0)])

    def mean(self) -> float:
        return float(np.dot(np.arange(1, self.T + 1), self.array()))

    def p_running(self, n: int) -> np.ndarray:
        """P(some of n samples is still decoding after t tokens) = 1 - F(t)^n, t = 0..T-1."""
        f = self.cdf()[:-1]
        return 1.0 - f ** max(n, 1)

    def expected_active(self, n: int) -> np.ndarray:
        """Expected number of the n samples that need token t+1, t = 0..T-1 (n * P(L > t))."""
        return n * (1.0 - self.cdf()[:-1])

    def expected_max(self, n: int) -> float:
        """E[max of n lengths] = sum_t P(max > t)."""
        return float(self.p_running(n).sum())

    def order_stats(self, n: int) -> np.ndarray:
        """E[L_(k:n)] for k = 1..n: the expected length of the k-th sample to finish."""
        return _order_stats(self.pmf, int(n))

    def kth_running(self, k: int, n: int) -> np.ndarray:
        """P(fewer than k of n samples have finished after t tokens), t = 0..T-1."""
        return _fewer_than(self.pmf, int(n))[:, min(max(k, 1), n) - 1]


@lru_cache(maxsize=256)
def _fewer_than(pmf: tuple, n: int) -> np.ndarray:
    """Matrix [t, k-1] = P(Binomial(n, F(t)) < k) for t = 0..T-1, k = 1..n."""
    f = np.concatenate([[0.0], np.minimum(np.cumsum(pmf), 1.0)])[:-1]
    j = np.arange(n + 1)
    logc = np.array([math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1) for x in j])
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = np.where(f[:, None] > 0, j[None, :] * np.log(np.where(f > 0, f, 1.0))[:, None],
                      np.where(j == 0, 0.0, -np.inf))
        lq = np.where(f[:, None] < 1, (n - j)[None, :] * np.log(np.where(f < 1, 1 - f, 1.0))[:, None],
                      np.where(j == n, 0.0, -np.inf))
        probs = np.exp(logc[None, :] + lp + lq)
    cum = np.cumsum(probs, axis=1)          # P(Bin <= j)
    return np.clip(cum[:, :n], 0.0, 1.0)    # P(Bin < k) = P(Bin <= k-1), k = 1..n


@lru_cache(maxsize=256)
def _order_stats(pmf: tuple, n: int) -> np.ndarray:
    return _fewer_than(pmf, n).sum(axis=0)


def geometric(T: int, p: float) -> LengthDist:
    p = min(max(float(p), 1e-12), 1.0)
    l = np.arange(1, T + 1)
    pmf = p * (1 - p) ** (l - 1)
    pmf[-1] = (1 - p) ** (T - 1)          # everything that did not stop earlier ends at T
    return LengthDist(tuple(float(x) for x in pmf))


def lognormal(T: int, median_frac: float, sigma: float) -> LengthDist:
    mu = math.log(max(median_frac * T, 1.0))
    edges = np.arange(1, T + 1, dtype=np.float64) + 0.5    # length l takes (l - 0.5, l + 0.5]; 1 takes all below
    z = (np.log(edges) - mu) / (sigma * math.sqrt(2))
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z))
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    pmf[-1] += 1.0 - cdf[-1]               # the tail beyond T is cut at T
    pmf = np.clip(pmf, 0, None)
    return LengthDist(tuple(float(x) for x in pmf / pmf.sum()))


def fixed(T: int) -> LengthDist:
    pmf = np.zeros(T)
    pmf[-1] = 1.0
    return LengthDist(tuple(float(x) for x in pmf))


def response_dist(spec: str, T: int, *, vocab: int, pretrained: bool) -> LengthDist:
    """The response-length law named by ``spec`` (see module docstring)."""
    T = max(int(T), 1)
    kind, _, rest = (spec or "auto").partition(":")
    args = [float(x) for x in rest.split(":") if x] if rest else []
    if kind == "auto":
        return lognormal(T, *DEFAULT_LONG_TAIL) if pretrained else geometric(T, 1.0 / max(vocab, 1))
    if kind == "max":
        return fixed(T)
    if kind == "geometric":
        return geometric(T, args[0] if args else 1.0 / max(vocab, 1))
    if kind == "lognormal":
        f, s = (args + list(DEFAULT_LONG_TAIL)[len(args):])[:2]
        return lognormal(T, f, s)
    raise ValueError(f"unknown response-length model {spec!r}: use auto, max, geometric:P or lognormal:F:S")


@dataclass(frozen=True)
class PromptLengths:
    """Prompt lengths in tokens: ``lo``..``hi`` uniform (synthetic data) or an empirical sample."""

    lo: int
    hi: int
    sample: tuple = ()

    def mean(self) -> float:
        if self.sample:
            return float(np.mean(self.sample))
        return (self.lo + self.hi) / 2

    def expected_max(self, n: int) -> float:
        """E[longest prompt of n] (the padded prompt width of a static batch)."""
        if self.sample:
            xs = np.sort(np.asarray(self.sample, dtype=np.float64))
            m = len(xs)
            ranks = np.arange(1, m + 1) / m
            probs = np.diff(np.concatenate([[0.0], ranks ** max(n, 1)]))
            return float(np.dot(xs, probs))
        width = self.hi - self.lo + 1
        below = sum(((x - self.lo + 1) / width) ** max(n, 1) for x in range(self.lo, self.hi))
        return float(self.hi - below)


#: what one more length group costs the torch trainer, in computed tokens (a call's fixed overhead): the
#: contract's rule, which the runtime's grouping follows
GROUP_COST_TOKENS = rules.GROUP_COST_TOKENS


def packed_tokens(dist: LengthDist, prompts: PromptLengths, rows: int,
                  group_cost: float = GROUP_COST_TOKENS) -> tuple[float, int]:
    """Expected (computed tokens, groups) when ``rows`` samples run in length groups, as the torch trainer
    runs an unpadded rollout: rows sorted by length, cut into contiguous groups that minimise the computed
    tokens (rows x the group's longest row) plus ``group_cost`` per group. Modelled on the expected order
    statistics of the response lengths, each group's prompt width the expected longest of its rows. Over
    :data:`PACK_MODEL_ROWS` rows, the model runs on that many and scales (the groups' shares stay)."""
    rows = max(1, int(rows))
    if rows > PACK_MODEL_ROWS:
        tokens, groups = _packed(dist, prompts, PACK_MODEL_ROWS, float(group_cost) * PACK_MODEL_ROWS / rows)
        return tokens * rows / PACK_MODEL_ROWS, groups
    return _packed(dist, prompts, rows, float(group_cost))


#: the most rows :func:`packed_tokens` groups one by one (O(rows^2) dynamic programming)
PACK_MODEL_ROWS = 256


@lru_cache(maxsize=1024)
def _packed(dist: LengthDist, prompts: PromptLengths, rows: int, group_cost: float) -> tuple[float, int]:
    resp = dist.order_stats(rows)              # ascending: E[k-th shortest response]
    pmax = [0.0] + [prompts.expected_max(k) for k in range(1, rows + 1)]
    best = [0.0] + [math.inf] * rows
    cut = [0] * (rows + 1)
    tokens = [0.0] * (rows + 1)
    for end in range(1, rows + 1):
        for start in range(end):
            width = resp[end - 1] + pmax[end - start]
            cost = best[start] + (end - start) * width + group_cost
            if cost < best[end]:
                best[end], cut[end], tokens[end] = cost, start, tokens[start] + (end - start) * width
    groups, end = 0, rows
    while end > 0:
        groups, end = groups + 1, cut[end]
    return float(tokens[rows]), groups


def prompt_lengths(source, pretrained: bool) -> PromptLengths:
    """Prompt token lengths of a data source: the char tokenizer gives one token per character plus BOS;
    a pretrained tokenizer roughly one per four characters."""
    per_char = 0.25 if pretrained else 1.0

    def tokens(chars: float) -> int:
        return _prompt_tokens(chars, per_char)

    if source is None:
        return PromptLengths(16, 16)
    if source.kind == "synthetic":
        lo = int(source.options.get("min_len", 4))
        hi = int(source.options.get("max_len", 16))
        return PromptLengths(tokens(lo), tokens(max(hi, lo)))
    path = source.options.get("path", "")
    try:   # read once per version of the file: the placement search prices many candidates of one program
        st = os.stat(path)
        version = (st.st_mtime_ns, st.st_size)
    except (OSError, TypeError, ValueError):
        version = None
    return _file_prompt_lengths(path, source.options.get("field", "prompt"), per_char, version)


def _prompt_tokens(chars: float, per_char: float) -> int:
    return max(1, int(round(chars * per_char)) + 1)


@lru_cache(maxsize=64)
def _file_prompt_lengths(path: str, field: str, per_char: float, version: tuple[int, int] | None) -> PromptLengths:
    """The prompt lengths of a JSONL file's first 20 000 records (``version``: its mtime and size, so an
    edited file is read again)."""
    import json

    sample: list[int] = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                obj = json.loads(line)
                if isinstance(obj, dict) and isinstance(obj.get(field), str):
                    sample.append(_prompt_tokens(len(obj[field]), per_char))
                if len(sample) >= 20000:
                    break
    except (OSError, ValueError, TypeError):
        sample = []
    if not sample:
        return PromptLengths(64, 64)
    return PromptLengths(min(sample), max(sample), tuple(sample))
