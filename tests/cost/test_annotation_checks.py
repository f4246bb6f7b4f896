"""The verifier's checks of the plan annotations (docs/ir.md, "Annotations")."""

from __future__ import annotations

import pytest

from rlhfc.ir import VerificationError, parse_ir, print_module, verify

from .helpers import gpu_ppo


def _errors(plan: dict, module=None, module_ann=None) -> list:
    m = module or gpu_ppo()
    for stage, ann in plan.items():
        m.graph.stage(stage).annotations.update(ann)
    m.annotations.update(module_ann or {})
    try:
        verify(m)
    except VerificationError as exc:
        return exc.diagnostics
    return []


def test_valid_plan_annotations_verify_and_round_trip():
    m = gpu_ppo()
    plan = {"roll": {"mesh": {"first": 0, "count": 4}, "parallel": {"dp": 1, "tp": 4, "pp": 1},
                     "stream": {"chunk": 32}, "overcommit": {"delta": 8}, "microbatches": 2},
            "logp": {"mesh": {"first": 4, "count": 4}, "parallel": {"tp": 2, "pp": 2}, "overlap": 1},
            "actor_train": {"parallel": {"dp": 2, "tp": 4}, "recompute": "selective", "microbatches": 4}}
    assert _errors(plan, m, {"strategy": "search"}) == []
    text = print_module(m)
    assert "annot {mesh = {count = 4, first = 0}, microbatches = 2, overcommit = {delta = 8}" in text
    assert print_module(parse_ir(text)) == text
    verify(parse_ir(text))


def test_mesh_outside_the_cluster():
    (d,) = _errors({"roll": {"mesh": {"first": 4, "count": 8}}})
    assert "mesh {first = 4, count = 8} covers devices 4..11 but cluster @pod has devices 0..7 (1 x 8)" in d.message
    assert d.hint == "use count = 4 from first = 4" and d.loc is not None
    (d,) = _errors({"roll": {"mesh": [0, 8]}})
    assert "mesh must be {first = I, count = N}" in d.message and "count = 8" in d.hint
    (d,) = _errors({"roll": {"mesh": {"first": 0, "count": 0}}})
    assert "count >= 1" in d.message


def test_parallel_must_multiply_to_the_mesh():
    (d,) = _errors({"roll": {"mesh": {"first": 0, "count": 8}, "parallel": {"dp": 2, "tp": 2, "pp": 1}}})
    assert "uses 4 devices but the mesh has 8" in d.message and "use dp = 4" in d.hint
    errs = _errors({"roll": {"parallel": {"tp": 3}}})                       # 8 devices, tp 3
    assert any("tp * pp = 3 does not divide 8" in e.hint for e in errs)
    errs = _errors({"roll": {"parallel": {"dp": 1, "tp": 8, "pp": 1}}, "logp": {"parallel": {"dp": 0}}})
    assert any("parallel must be {dp = D, tp = T, pp = P}" in e.message for e in errs)
    (d,) = _errors({"roll": {"parallel": {"dp": 1, "tp": 8, "pp": 1, "sp": 2}}})
    assert "parallel must be" in d.message


def test_tp_must_divide_heads_and_pp_fit_layers():
    m = gpu_ppo(nodes=8)
    errs = _errors({"roll": {"parallel": {"dp": 1, "tp": 64, "pp": 1}},
                    "logp": {"parallel": {"dp": 1, "tp": 1, "pp": 64}}}, m)
    msgs = " ".join(e.message for e in errs)
    assert "tp = 64 does not divide the 32 attention heads of @actor" in msgs
    assert "pp = 64 is more pipeline stages than the 32 layers of @actor" in msgs
    assert any("tp must be one of 1, 2, 4, 8, 16, 32" in e.hint for e in errs)


@pytest.mark.parametrize("ann,message", [
    ({"microbatches": 0}, "microbatches must be an integer >= 1"),
    ({"recompute": "some"}, "recompute must be one of none, selective, full"),
    ({"overlap": "a"}, "overlap must be an integer group id"),
    ({"stream": {"chunk": 0}}, "stream must be {chunk = N} with an integer N >= 1"),
    ({"stream": {"size": 4}}, "stream must be {chunk = N}"),
    ({"overcommit": {"delta": -1}}, "overcommit must be {delta = N} with an integer N >= 0"),
])
def test_stage_annotation_forms(ann, message):
    (d,) = _errors({"roll": ann})
    assert message in d.message and d.hint


def test_stream_and_overcommit_only_on_generate():
    (d,) = _errors({"logp": {"stream": {"chunk": 4}}})
    assert "'stream' applies to generate stages only, not forward.logprobs" in d.message
    (d,) = _errors({}, module_ann={"strategy": "random"})
    assert "strategy must be one of flatten, interleave, separate, search" in d.message


def test_fsdp_trainer_runs_dp_ranks_and_refuses_tensor_or_pipeline_parallel_layouts():
    from rlhfc.ir.plan import workers

    m = gpu_ppo()
    m.run.trainer = "fsdp"
    text = print_module(m)
    assert 'trainer = "fsdp"' in text and print_module(parse_ir(text)) == text
    (d,) = _errors({"roll": {"mesh": {"first": 0, "count": 4}, "parallel": {"dp": 2, "tp": 2, "pp": 1}}}, m)
    assert "trainer fsdp runs data-parallel ranks only" in d.message and "trainer = torch" in d.hint
    m = gpu_ppo()
    m.run.trainer = "fsdp"
    assert _errors({"actor_train": {"mesh": {"first": 0, "count": 4}, "parallel": {"dp": 4}},
                    "roll": {"mesh": {"first": 0, "count": 4}, "parallel": {"dp": 4}}}, m) == []
    ranks = {w.name: w.ranks for w in workers(m).values()}
    assert ranks["actor"] == 4 and all(r == 8 for n, r in ranks.items() if n != "actor")   # the rest: all 8 devices
    m.run.trainer = "torch"
    assert {w.ranks for w in workers(m).values()} == {1}
    assert "trainer" not in print_module(m)
