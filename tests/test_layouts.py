"""Fixed layouts and trainers (issue #13, the language and plan side): the ``layout(dp, tp, pp)`` clause
parses, prints only when given and round-trips; ``run { trainer = ... }`` is resolved per worker; the
placement strategies and search keep a fixed layout; ``plan.json`` workers carry ``trainer``, ``dp``,
``tp``, ``pp`` and ``ranks`` (the runtime's contract); ``explain`` shows what runs; metrics rows carry
``ranks`` per model. The diagnostics are bad-input files (tests/bad/layout_*.rlhf, megatron_*.rlhf)."""

from __future__ import annotations

import json
import os

import pytest

from rlhfc.cli import main as cli
from rlhfc.codegen import emit_job
from rlhfc.frontend import compile_source
from rlhfc.ir import parse_ir, plan, print_module, verify
from rlhfc.ir.diagnostics import CompileError
from rlhfc.passes import PassManager, parse_pipeline

PROGRAM = """
cluster local {{ devices = cpu:{devices} }}

model actor  = llama(layers = 2, hidden = 32, heads = 4, kv_heads = 2, vocab = 64, max_seq = 32) {actor} trainable
model critic = like(actor) head = value trainable {critic}
model ref    = copy(actor) {ref} frozen
model reward = gpt2(layers = 2, hidden = 32, heads = 2, vocab = 64, max_seq = 32) head = score frozen

data prompts = synthetic(count = 64, min_len = 3, max_len = 6)

pipeline ppo(batch = 4) {{
  roll     = actor.generate(prompts, max_new_tokens = 6)
  logp     = actor.logprobs(roll)
  ref_logp = ref.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp, ref_logp, kl_coef = 0.05)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3, minibatches = 2)
  critic.train(value_loss(roll, values, ret), lr = 1e-3, minibatches = 2)
}}

run {{ steps = 2; seed = 3{run} }}
"""

#: actor dp2 (fsdp under auto), critic tp2 and ref pp2 (megatron), reward as the plan places it
MIXED = dict(actor="layout(dp = 2)", critic="layout(tp = 2)", ref="layout(pp = 2)")


def _module(devices=4, run="; trainer = auto", tmp_path=None, **layouts):
    text = PROGRAM.format(devices=devices, run=run, **{k: layouts.get(k, "") for k in ("actor", "critic", "ref")})
    file = os.path.join(str(tmp_path), "p.rlhf") if tmp_path else "<input>"
    module, _ = compile_source(text, file)
    return module


def _passes(module, pipeline: str):
    return PassManager(parse_pipeline(pipeline)).run(module)



@pytest.fixture(autouse=True)
def _megatron_core(megatron_installed):
    """The layouts here are checked as with megatron-core installed (the missing case patches it back)."""


def test_layout_clause_prints_only_when_given_and_round_trips():
    m = _module(**MIXED)
    assert m.models["actor"].layout == {"dp": 2, "tp": 1, "pp": 1}
    assert m.models["critic"].layout == {"dp": 1, "tp": 2, "pp": 1}   # the clause may follow the flag
    assert m.models["reward"].layout is None
    text = print_module(m)
    assert "layout = {dp = 2, pp = 1, tp = 1}" in text and "layout = {dp = 1, pp = 2, tp = 1}" in text
    assert 'trainer = "auto"' in text
    reward = next(line for line in text.splitlines() if "model @reward" in line)
    assert "layout" not in reward
    again = parse_ir(text, "x.rlir")
    verify(again)
    assert print_module(again) == text and again.models["ref"].layout == {"dp": 1, "tp": 1, "pp": 2}
    # a program without the clause and trainer prints as before
    plain = print_module(_module(run=""))
    assert "layout" not in plain and "trainer" not in plain


def test_rlir_layout_is_verified_at_its_key():
    text = print_module(_module(**MIXED)).replace("layout = {dp = 2, pp = 1, tp = 1}", "layout = {dp = 2, tq = 1}")
    with pytest.raises(CompileError) as exc:
        verify(parse_ir(text, "x.rlir"))
    d = exc.value.diagnostics
    assert [x.message for x in d] == ["unknown layout factor 'tq'", "layout lacks 'tp'", "layout lacks 'pp'"]
    assert d[0].loc.file == "x.rlir" and d[0].loc.line == 3   # at the model's layout key


def test_resolve_trainer():
    P = plan.Parallel
    assert [plan.resolve_trainer("auto", p) for p in (P(1, 1, 1), P(2, 1, 1), P(1, 2, 1), P(2, 1, 2))] == \
        ["torch", "fsdp", "megatron", "megatron"]
    assert plan.resolve_trainer("fsdp", P(1, 1, 1)) == "torch" and plan.resolve_trainer("fsdp", P(2, 1, 1)) == "fsdp"
    assert plan.resolve_trainer("megatron", P(1, 1, 1)) == "megatron"
    assert plan.resolve_trainer("torch", P(2, 2, 1)) == "torch"


def test_a_layout_that_needs_ranks_runs_without_naming_a_trainer(tmp_path, megatron_installed):
    """No ``trainer = ...`` and a ``layout(...)`` of several processes: the run chooses ``auto`` (printed), so
    each model runs on a backend that runs its layout; without such a layout the default stays one process."""
    module = _module(run="", **MIXED)
    assert module.run.trainer == "auto" and 'trainer = "auto"' in print_module(module)
    verify(module)
    workers = _plan_json(_passes(module, "dce"), tmp_path)["placement"]["workers"]
    assert {n: w["trainer"] for n, w in workers.items() if n != "reward"} == \
        {"actor": "fsdp", "critic": "megatron", "ref": "megatron"}
    assert _module(run="").run.trainer == "torch"
    assert _module(run="", actor="layout(dp = 1)").run.trainer == "torch"   # one process: no change
    with pytest.raises(CompileError, match="trainer = torch runs every model as one process"):
        _module(run="; trainer = torch", actor="layout(dp = 2)")   # named: a located error (tests/bad/)


def _plan_json(module, tmp_path, name="job") -> dict:
    job = str(tmp_path / name)
    emit_job(module, job, opt_level="custom", passes=[])
    with open(os.path.join(job, "plan.json")) as fh:
        return json.load(fh)


def test_plan_json_workers_carry_trainer_layout_and_ranks(tmp_path):
    workers = _plan_json(_passes(_module(**MIXED), "dce"), tmp_path)["placement"]["workers"]
    got = {n: (w["trainer"], w["dp"], w["tp"], w["pp"], w["ranks"], w["mesh"]) for n, w in workers.items()}
    assert got == {"actor": ("fsdp", 2, 1, 1, 2, [0, 2]), "critic": ("megatron", 1, 2, 1, 2, [0, 2]),
                   "ref": ("megatron", 1, 1, 2, 2, [0, 2]),
                   "reward": ("fsdp", 4, 1, 1, 4, [0, 4])}   # unplaced: the whole cluster, data parallel
    # the default trainer runs every model as one process
    workers = _plan_json(_passes(_module(run=""), "dce"), tmp_path, "torch")["placement"]["workers"]
    assert {(w["trainer"], w["dp"], w["tp"], w["pp"], w["ranks"]) for w in workers.values()} == \
        {("torch", 1, 1, 1, 1)}
    # explicit megatron: every model on megatron-core, also at one rank
    workers = _plan_json(_passes(_module(devices=1, run="; trainer = megatron"), "dce"), tmp_path, "mc")
    assert {(w["trainer"], w["ranks"]) for w in workers["placement"]["workers"].values()} == {("megatron", 1)}


@pytest.mark.parametrize("strategy", ["flatten", "interleave", "separate", "search"])
def test_placement_keeps_fixed_layouts(strategy):
    m = _passes(_module(devices=8, **MIXED), f"dce,placement{{strategy={strategy},candidates=60}}")
    fixed = {"actor": (2, 1, 1), "critic": (1, 2, 1), "ref": (1, 1, 2)}
    for s in m.graph.stages:
        if s.target in fixed:
            lay = plan.stage_layout(m, s)
            assert (lay.dp, lay.tp, lay.pp) == fixed[s.target] and lay.count == 2, (strategy, s.name, lay)
    ws = {w.model: w for w in plan.workers(m).values()}
    assert len(plan.workers(m)) == 4   # a fixed-layout model keeps its generation with it (no copy)
    assert (ws["actor"].trainer, ws["critic"].trainer, ws["ref"].trainer) == ("fsdp", "megatron", "megatron")
    assert all(ws[n].ranks == 2 for n in fixed)


def test_a_stage_off_its_fixed_mesh_is_an_error():
    m = _module(**MIXED)
    for name in ("roll", "actor_train"):
        plan.set_layout(m.graph.stage(name), plan.Layout(2, 2, dp=2))
    verify(m)
    plan.set_layout(m.graph.stage("logp"), plan.Layout(0, 4, dp=4))
    with pytest.raises(CompileError) as exc:
        verify(m)
    (d,) = exc.value.diagnostics
    assert "stage %logp runs on 4 devices, but @actor fixes layout(dp = 2, tp = 1, pp = 1)" in d.message
    assert "count = 2" in d.hint


def test_missing_megatron_core_is_a_check_time_error(monkeypatch):
    import importlib.util

    from rlhfc.ir.plan import check

    real = importlib.util.find_spec
    monkeypatch.setattr(check.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else real(name, *a))
    with pytest.raises(CompileError) as exc:
        _module(**MIXED)
    (d,) = exc.value.diagnostics
    assert "model @ref runs on the megatron trainer, but megatron-core is not installed" in d.message
    assert "pip install -c constraints.txt -e '.[megatron]'" in d.hint
    assert d.loc is not None and d.loc.line == 6   # ref's layout clause (auto picks megatron for its pp = 2)


def test_explain_shows_the_layout_trainer_and_processes_that_run(tmp_path, capsys):
    path = tmp_path / "p.rlhf"
    path.write_text(PROGRAM.format(devices=4, run="; trainer = auto", **MIXED))
    assert cli(["explain", str(path), "-O1", "--no-profile"]) == 0
    out = capsys.readouterr().out
    section = out.split("== Workers")[1].split("==")[0]
    assert "actor: dp2 tp1 pp1 · fsdp · 2 processes (devices 0-1)" in section
    assert "critic: dp1 tp2 pp1 · megatron · 2 processes" in section
    assert "reward: dp4 tp1 pp1 · fsdp · 4 processes (devices 0-3)" in section
    json_path = tmp_path / "e.json"
    assert cli(["explain", str(path), "-O1", "--no-profile", "--format", "json", "-o", str(json_path)]) == 0
    rows = {r["worker"]: r for r in json.loads(json_path.read_text())["workers"]}
    assert (rows["ref"]["trainer"], rows["ref"]["pp"], rows["ref"]["ranks"]) == ("megatron", 2, 2)


def test_metrics_rows_carry_processes_per_model(tmp_path):
    from rlhfc.runtime.driver.metrics import MetricsLog, model_ranks

    from types import SimpleNamespace as W

    workers = {"actor": W(model="actor", ranks=2), "actor_at_2_1": W(model="actor", ranks=1),
               "critic": W(model="critic", ranks=2), "reward": W(model="reward", ranks=1)}
    assert model_ranks(workers) == {"actor": 3, "critic": 2, "reward": 1}   # a model's workers add up
    log = MetricsLog(str(tmp_path))

    class Board:   # TensorBoard takes numbers only: the dict is skipped
        def __init__(self):
            self.scalars = []

        def add_scalar(self, k, v, step):
            self.scalars.append(k)

        def flush(self):
            pass

    log.tb = Board()
    log.write({"step": 0, "reward_mean": 0.5, "ranks": model_ranks(workers)})
    assert log.tb.scalars == ["reward_mean"]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["ranks"] == {"actor": 3, "critic": 2, "reward": 1}


def test_job_writes_ranks_from_the_plan_into_every_row():
    import inspect

    from rlhfc.runtime import job

    # the driver's loop adds the plan's processes per model to each row (the e2e runs check the rest)
    assert 'm["ranks"] = model_ranks(self.plan.placement.workers)' in inspect.getsource(job.Job.run)


def test_on_gpus_a_group_runs_one_split_the_trainer_can_run():
    """Beyond torch, a model's stages on one mesh share one split (its train stage's), and the
    placement weighs only splits the trainer runs: under fsdp no tp/pp, under auto megatron-valid ones."""
    from rlhfc.frontend import load_file
    from rlhfc.passes.layouts import runnable as _runnable

    m, _, _ = load_file(os.path.join(os.path.dirname(__file__), "..", "examples", "ppo_7b.rlhf"))
    m.run.trainer = "auto"
    m = _passes(m, "dce,placement{strategy=flatten}")
    for w in plan.workers(m).values():
        splits = {(lay.dp, lay.tp, lay.pp) for lay in (plan.stage_layout(m, s) for s in m.graph.stages_on(w.model)
                                                         if plan.on_worker(m, s))}
        assert splits == {(w.dp, w.tp, w.pp)}, (w, splits)
    actor = m.models["actor"]
    assert _runnable(m, actor, plan.Layout(0, 8, 1, 8, 1)) and not _runnable(m, actor, plan.Layout(0, 6, 1, 6, 1))
    m.run.trainer = "fsdp"
    assert _runnable(m, actor, plan.Layout(0, 8, 8, 1, 1)) and not _runnable(m, actor, plan.Layout(0, 8, 1, 8, 1))
