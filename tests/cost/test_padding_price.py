"""The cost model prices the work the runtime does on long-tailed lengths: live rows per decode step (finished
rows leave the decode batch) and packed tokens per forward/training call (length groups), and `explain`
shows each stage's padding efficiency. Checked against the runtime's own rules on sampled lengths."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfc.cost.lengths import PromptLengths, geometric, packed_tokens
from rlhfc.runtime.train.packing import GROUP_COST_TOKENS, length_groups


def _sample(dist, rng, n):
    return rng.choice(np.arange(1, dist.T + 1), size=n, p=dist.array() / dist.array().sum())


def test_the_group_cost_is_the_runtimes():
    from rlhfc.cost import lengths

    assert lengths.GROUP_COST_TOKENS == GROUP_COST_TOKENS


@pytest.mark.parametrize("rows,T,p", [(16, 96, 1 / 32), (64, 128, 1 / 24), (32, 64, 1 / 96)])
def test_packed_tokens_match_the_runtimes_grouping_on_sampled_lengths(rows, T, p):
    dist, prompts = geometric(T, p), PromptLengths(5, 13)
    rng = np.random.default_rng(0)
    measured, calls = [], []
    for _ in range(200):
        resp = _sample(dist, rng, rows)
        prm = rng.integers(prompts.lo, prompts.hi + 1, size=rows)
        groups = length_groups((resp + prm).tolist())
        # the runtime crops each group to its longest prompt and its longest response
        measured.append(sum(len(g) * (prm[g].max() + resp[g].max()) for g in map(np.asarray, groups)))
        calls.append(len(groups))
    tokens, groups = packed_tokens(dist, prompts, rows)
    assert tokens == pytest.approx(np.mean(measured), rel=0.15)
    assert abs(groups - np.mean(calls)) <= max(1.0, 0.35 * np.mean(calls))
    padded = rows * (prompts.expected_max(rows) + dist.expected_max(rows))
    assert tokens < padded


def _decode_row_steps(lengths: list[int]) -> int:
    """Rows in the decode batch summed over steps, by generate_stream's rule: finished rows leave the batch
    once a quarter of it has finished."""
    live = list(lengths)
    batch = len(live)
    finished = 0
    total = 0
    for step in range(max(lengths)):
        total += batch
        done_now = sum(1 for x in live if x == step + 1)
        finished += done_now
        live = [x for x in live if x > step + 1]
        if not live:
            break
        if finished >= max(1, batch // 4):
            batch, finished = len(live), 0
    return total


@pytest.mark.parametrize("rows,T,p", [(16, 96, 1 / 32), (64, 128, 1 / 24)])
def test_decode_rows_follow_the_live_rows(rows, T, p):
    from rlhfc.cost.model import COMPACT_OVERHANG

    dist = geometric(T, p)
    rng = np.random.default_rng(1)
    measured = np.mean([_decode_row_steps(_sample(dist, rng, rows).tolist()) for _ in range(300)])
    w = dist.p_running(rows)
    live = dist.expected_active(rows) / np.maximum(w, 1e-12)
    predicted = float(np.sum(w * np.clip(live * COMPACT_OVERHANG, 1.0, rows)))
    assert predicted == pytest.approx(measured, rel=0.15)
    assert predicted < rows * dist.expected_max(rows) * 0.8    # well under a padded batch's


def test_explain_shows_padding_efficiency_and_unpad_raises_it(tmp_path):
    from rlhfc.cost.model import CostModel
    from rlhfc.frontend import load_file
    from rlhfc.passes import PassManager, parse_pipeline

    from .helpers import EXAMPLES

    text = (EXAMPLES / "ppo_tiny.rlhf").read_text().replace("vocab = 96", "vocab = 32") \
        .replace("max_new_tokens = 24", "max_new_tokens = 96").replace("max_seq = 64", "max_seq = 128")
    path = tmp_path / "long.rlhf"
    path.write_text(text)
    eff = {}
    for passes in ("dce", "dce,unpad"):
        m, _, _ = load_file(str(path))
        m = PassManager(parse_pipeline(passes)).run(m)
        cm = CostModel(m)
        eff[passes] = {s: CostModel.padding_efficiency(cm.stage_cost(m.graph.stage(s)))
                       for s in ("roll", "values", "actor_train")}
    assert all(0 < e <= 1 for v in eff.values() for e in v.values())
    assert eff["dce,unpad"]["values"] > 1.5 * eff["dce"]["values"]
    assert eff["dce,unpad"]["actor_train"] > 1.5 * eff["dce"]["actor_train"]
    assert eff["dce"]["roll"] > 0.7    # decoding drops finished rows at every level

    from typer.testing import CliRunner

    from rlhfc.cli.app import app

    out = CliRunner().invoke(app, ["explain", str(path), "-O2"]).output
    assert "pad eff" in out and "padding efficiency" in out


def test_generation_in_micro_batches_is_priced_as_continuous_batching():
    """On CPU the runtime runs a generate planned in M micro-batches as one continuous batch of ⌈n/M⌉ slots
    (prompts join as rows finish): the same decode row-steps as M waves, in fewer steps."""
    from rlhfc.cost.model import CostModel
    from rlhfc.frontend import compile_source

    from .helpers import EXAMPLES

    text = (EXAMPLES / "ppo_tiny.rlhf").read_text().replace("vocab = 96", "vocab = 32") \
        .replace("max_new_tokens = 24", "max_new_tokens = 96").replace("max_seq = 64", "max_seq = 128")
    m, _ = compile_source(text, "<test>")
    gen = m.graph.stage("roll")
    cm = CostModel(m)
    one = cm.generation_work(gen, 1)
    cont = cm.generation_work(gen, 4)
    dist = one["dist"]
    waves_steps = 4 * dist.expected_max(4)
    assert dist.expected_max(16) < 4 * cont["expected_steps"] < waves_steps   # steps per wave x 4 waves
    assert cont["rows"] == 4 and max(cont["active"]) <= 4
    assert cont["computed_tokens"] == pytest.approx(
        4 * cont["prompt"] + float(np.sum(cont["steps_w"] * cont["active"])))
