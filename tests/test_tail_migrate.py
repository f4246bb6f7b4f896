"""The ``tail_migrate`` pass on the IR (its runtime end to end: tests/e2e/test_tail_migrate_run.py): where it marks a
generate, the threshold it picks, where it is a documented no-op, and the located errors of a bad option or a
hand-written ``tail`` on an unstreamed generate."""

from __future__ import annotations

import os
import re

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, plan
from rlhfc.ir.printer import print_module
from rlhfc.passes import PassManager, parse_pipeline
from rlhfc.passes.tail_migrate import tail_below

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "e2e", "tiny_tail.rlhf")
STREAMED = "dce,stream{chunk=4},placement,tail_migrate"


def _gen(text: str | None = None, passes: str = STREAMED):
    source = text if text is not None else open(PROGRAM).read()
    module, _ = compile_source(source, PROGRAM)
    module = PassManager(parse_pipeline(passes)).run(module)
    return module, next(s for s in module.graph.stages if s.op == "generate")


def test_a_streamed_generate_on_two_ranks_moves_its_tail_below_a_ranks_share_over_the_ranks():
    module, gen = _gen()
    assert plan.worker_ranks(module, "actor", plan.stage_mesh(module, gen)) == 2
    assert plan.tail(gen) == plan.Tail(4, "prefill")   # 16 rows, 8 a rank: below 8 / 2; a re-prefill is cheaper
    assert 'tail = {below = 4, move = "prefill"}' in print_module(module)
    _, gen = _gen(passes="dce,stream{chunk=4},placement,tail_migrate{threshold=0.25,move=kv}")
    assert plan.tail(gen) == plan.Tail(2, "kv")
    _, gen = _gen(passes=STREAMED + ",tail_migrate{threshold=0.25}")   # run again: its own mark replaced
    assert plan.tail(gen) == plan.Tail(2, "prefill")
    assert tail_below(8, 2, "auto") == 4 and tail_below(3, 4, "auto") == 1 and tail_below(8, 2, "1") == 8


@pytest.mark.parametrize("edit,passes", [
    (lambda t: t.replace(" layout(dp = 2)", ""), STREAMED),   # one rank
    (lambda t: t, "dce,placement,tail_migrate"),             # not streamed: no forwards to run beside the tail
], ids=["one_rank", "unstreamed"])
def test_where_there_is_no_tail_to_move_the_pass_changes_nothing(edit, passes):
    _, gen = _gen(edit(open(PROGRAM).read()), passes)
    assert plan.tail(gen) is None


def test_an_engine_whose_rows_share_a_batchs_random_state_keeps_its_generates():
    from rlhfc.contract.engines import rollout_traits

    assert rollout_traits("torch").row_streams and not rollout_traits("vllm").row_streams
    text = open(PROGRAM).read().replace("run { steps", 'run { rollout = "vllm"; steps').replace("heads = 2", "heads = 1")
    module, gen = _gen(text)
    assert plan.tail(gen) is None


def test_a_bad_threshold_is_a_located_error():
    with pytest.raises(CompileError) as exc:
        parse_pipeline("tail_migrate{threshold=2}")
    assert "threshold must be auto or a fraction in (0, 1]" in str(exc.value)


def test_a_tail_on_an_unstreamed_generate_is_refused_by_the_verifier():
    from rlhfc.ir.verifier import verify

    module, _ = compile_source(open(PROGRAM).read(), PROGRAM)
    gen = next(s for s in module.graph.stages if s.op == "generate")
    gen.annotations["tail"] = {"below": 2}
    with pytest.raises(CompileError) as exc:
        verify(module)
    assert "tail (long-tail migration) needs a streamed generate" in str(exc.value) and "tiny_tail.rlhf:11" in str(exc.value)
    gen.annotations["stream"] = {"chunk": 4}
    gen.annotations["tail"] = {"below": 0}
    with pytest.raises(CompileError) as exc:
        verify(module)
    assert "tail must be {below = K, move = kv|prefill} with an integer K >= 1" in str(exc.value)
    gen.annotations["tail"] = {"below": 2, "move": "teleport"}
    with pytest.raises(CompileError) as exc:
        verify(module)
    assert "tail must be {below = K, move = kv|prefill}" in str(exc.value) and "teleport" in str(exc.value)


def test_the_move_is_priced_and_a_bad_one_is_a_located_error():
    """``move = auto`` takes the cheaper of a KV move and a re-prefill as priced: at this program's shape (1 layer x
    32 on CPU) the caches' two crossings of Ray's object store cost more than a forward of a few rows; at
    4 layers x 512 with 160-token responses the forward costs more (as measured: benchmarks/rlhfuse.py --move)."""
    from rlhfc.cost import CostModel

    module, gen = _gen()
    price = CostModel(module).tail_move(gen, 2, 4)
    assert price["rows"] == 6 and price["tokens"] > 8
    assert 0 < price["prefill"] < price["kv"]
    # the bytes: 2 (keys, values) x layers x kv width x 4 bytes a token
    assert price["kv_bytes"] == pytest.approx(2 * 1 * 32 * 4 * price["rows"] * price["tokens"])
    wide = open(PROGRAM).read().replace("layers = 1, hidden = 32, heads = 2", "layers = 4, hidden = 512, heads = 8") \
        .replace("max_seq = 64", "max_seq = 192").replace("max_new_tokens = 40", "max_new_tokens = 160")
    module, gen = _gen(wide)
    price = CostModel(module).tail_move(gen, 2, 4)
    assert 0 < price["kv"] < price["prefill"] and plan.tail(gen) == plan.Tail(4, "kv")
    with pytest.raises(CompileError) as exc:
        parse_pipeline("tail_migrate{move=teleport}")
    assert "move must be auto, kv or prefill" in str(exc.value)


def test_explain_says_where_the_tail_starts_and_the_rank_time_it_frees(capsys):
    from rlhfc.cli import main

    assert main(["explain", PROGRAM, "--passes", STREAMED]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "moves its tail (tail_migrate)" in x)
    assert "each of its 2 ranks decodes its 8 rows and stops once fewer than 4 decode" in line
    assert "at most 6 rows left continue on the first rank" in line
    assert re.search(r"the tail starts at [\d.]+ m?s of [\d.]+ m?s, freeing 1 rank for the last", line), line


def test_at_o2_the_migration_stays_only_where_the_step_is_predicted_faster():
    """``tail_migrate{when=faster}`` (-O2, -O3) keeps its marks only where the simulator predicts the step at
    least 1 % faster with them; at this program's shape it predicts no gain (a 1-layer model's decode steps cost
    about the same at half the rows), so the generate is left to its first rank, as without the pass."""
    from rlhfc.passes.predict import steady_step

    _, always = _gen(passes=STREAMED)
    module, faster = _gen(passes=STREAMED.replace("tail_migrate", "tail_migrate{when=faster}"))
    assert plan.tail(always) is not None and plan.tail(faster) is None
    with_tail, _ = _gen(passes=STREAMED)
    assert steady_step(with_tail) > 0.99 * steady_step(module)
    with pytest.raises(CompileError) as exc:
        parse_pipeline("tail_migrate{when=sometimes}")
    assert "when must be always or faster" in str(exc.value)
