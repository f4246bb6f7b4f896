"""What a run gives people: ``rlhfc export`` (Hugging Face folders that transformers loads and that compute
what the trainer computes), ``samples.jsonl`` (+ TensorBoard text) and ``rlhfc plot``. No Ray here: the
checkpoints are written the way a worker writes them; tests/e2e/test_job.py checks a real run's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlhfc.cli import main as cli
from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.driver.checkpoint import SHAPE_KEYS
from rlhfc.runtime.driver.export import char_tokenizer_fast
from rlhfc.runtime.driver.samples import SampleLog, sample_rows, to_markdown
from rlhfc.runtime.models.build import build_model, save_weights
from rlhfc.runtime.rollout.generation import response_logprobs, response_values, sequence_scores
from rlhfc.runtime.worker.base import ModelWorker

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECS = {
    "actor": {"arch": "llama", "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "vocab": 64,
              "max_seq": 64, "head": "lm"},
    "critic": {"arch": "llama", "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "vocab": 64,
               "max_seq": 64, "head": "value"},
    "reward": {"arch": "gpt2", "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 2, "ffn": 128, "vocab": 64,
               "max_seq": 64, "head": "score"},
}


def fake_run(tmp_path, step=3, models=SPECS, seed=11, score_bias=0.0, with_plan=False):
    """A run folder with one checkpoint laid out as workers write it (weights perturbed, as after training;
    a score head's bias is ``score_bias``); what the models are is in the checkpoint's manifest, and with
    ``with_plan`` in ``RUN/job/plan.json`` too."""
    run = tmp_path / "run"
    folder = run / "checkpoints" / f"step_{step}"
    built = {}
    for name, spec in models.items():
        model = build_model(spec, seed=seed)
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
            if spec["head"] == "score":
                model.head.bias.fill_(score_bias)
        (folder / name).mkdir(parents=True)
        save_weights(model, str(folder / name / "weights.safetensors"))
        built[name] = model
    shapes = {n: {k: s.get(k) for k in SHAPE_KEYS} | {"params": 0} for n, s in models.items()}
    meta = {"step": step, "manifest": {"step": step, "models": shapes}}
    (folder / "job.json").write_text(json.dumps(meta))
    if with_plan:   # what `rlhfc run FILE` leaves in RUN/job
        (run / "job").mkdir()
        (run / "job" / "plan.json").write_text(json.dumps(_plan_of(models).to_json()))
    (run / "checkpoints" / "latest").write_text(f"step_{step}\n")
    return run, built


def _plan_of(models: dict):
    """A plan of these models, each trained on its own one-process worker (what export reads of it)."""
    from rlhfc.contract import plan as contract

    full = {n: {**SPECS.get(n, SPECS["actor"]), **s} for n, s in models.items()}
    return contract.Plan(
        module="fake", source=None, program_dir=None, opt_level="O0", passes=(),
        cluster=contract.ClusterPlan("local"), data={}, run=contract.RunPlan(), ir="",
        models={n: contract.ModelPlan(contract.ModelSpec(**s), contract.ModelInit("random"), True, 0)
                for n, s in full.items()},
        graph=contract.GraphPlan("g", {}, ()), metrics=contract.MetricRoles(),
        placement=contract.PlacementPlan("PACK", ({"CPU": 1.0},), {n: contract.WorkerPlan(
            n, (0, 1), 0, 1.0, 0.0, 1, (0,), 1, 1, 1, 1, "torch", "torch") for n in models}))


@pytest.fixture(scope="module")
def rollout():
    worker = ModelWorker("actor", SPECS["actor"], {"kind": "random"}, seed=5)
    return worker.generate(["hello there", "ab", "xyz q"], max_new_tokens=6, temperature=1.0, top_p=1.0)


def _rows(batch):
    """Each row's real tokens (prompt + response, no padding) and where its response starts."""
    out = []
    for i in range(batch.batch_size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        out.append((ids.unsqueeze(0), int(batch.prompt_lengths[i])))
    return out


def test_exported_policy_loads_in_transformers_with_the_trainers_logprobs(tmp_path, rollout):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, built = fake_run(tmp_path)
    assert cli(["export", str(run), "-o", str(tmp_path / "hf")]) == 0   # the one lm-head model by default
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "hf"))
    trainer = response_logprobs(built["actor"], rollout.batch)          # the trainer's batched forward
    with torch.no_grad():
        for i, (ids, p) in enumerate(_rows(rollout.batch)):             # a user's: one unpadded row at a time
            logits = hf(ids).logits[0, p - 1:-1]
            mine = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, p:, None]).squeeze(-1)
            n = int(rollout.batch.response_lengths[i])
            assert torch.allclose(mine, trainer[i, :n], atol=1e-5, rtol=0), (mine, trainer[i, :n])
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert tok.decode(rollout.batch.input_ids[0], skip_special_tokens=True) == \
        rollout.prompts[0] + rollout.responses[0]


def test_exported_critic_and_reward_compute_the_trainers_values_and_scores(tmp_path, rollout):
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    run, built = fake_run(tmp_path)
    assert cli(["export", str(run), "--model", "reward", "--step", "3", "-o", str(tmp_path / "rm")]) == 0
    assert cli(["export", str(run), "--model", "critic", "-o", str(tmp_path / "vm")]) == 0
    rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"), local_files_only=True).eval()
    vm = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "vm"), local_files_only=True).eval()
    scores = sequence_scores(built["reward"], rollout.batch)
    values = response_values(built["critic"], rollout.batch)
    with torch.no_grad():
        for i, (ids, p) in enumerate(_rows(rollout.batch)):
            assert abs(float(rm(ids).logits[0, 0]) - float(scores[i])) < 1e-5
            n = int(rollout.batch.response_lengths[i])
            mine = vm(ids).logits[0, p - 1:p - 1 + n, 0]   # a response token's value: the state before it
            assert torch.allclose(mine, values[i, :n], atol=1e-5, rtol=0), (mine, values[i, :n])


def test_char_tokenizer_json_encodes_and_decodes_as_the_runtime(tmp_path):
    from transformers import AutoTokenizer

    for vocab in (64, 98):
        char = CharTokenizer(vocab)
        char_tokenizer_fast(char).save_pretrained(str(tmp_path / str(vocab)))
        hf = AutoTokenizer.from_pretrained(str(tmp_path / str(vocab)), local_files_only=True)
        assert len(hf) == vocab and (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
        for text in ("hello world", "Zebra, Quartz! 42", "tab\tand\nnewline", "café {~}", ""):
            ids = char.encode(text)
            assert hf.encode(text, add_special_tokens=False) == ids, text
            assert hf(text).input_ids == [1, *ids]               # as the runtime encodes a prompt
            assert hf.decode([1, *ids, 2, 0], skip_special_tokens=True) == char.decode(ids)


@pytest.mark.parametrize("args, message", [
    (["export", "{tmp}/nope", "-o", "{tmp}/o"], "run folder {tmp}/nope does not exist"),
    (["export", "{run}", "--step", "9", "-o", "{tmp}/o"], "has no checkpoint of step 9"),
    (["export", "{run}", "--model", "critc", "-o", "{tmp}/o"], "the run has no model 'critc'"),
    (["export", "{run}", "-o", "{run}"], "exists and is not an empty folder"),
    (["export", "{run}", "--job", "{tmp}", "-o", "{tmp}/o"], "is not a job folder (no plan.json)"),
    (["plot", "{tmp}/nope"], "run folder {tmp}/nope does not exist"),
    (["plot", "{run}"], "has no metrics.jsonl"),
])
def test_export_and_plot_refuse_bad_input_with_a_hint(tmp_path, capsys, args, message):
    run, _ = fake_run(tmp_path, models={"actor": SPECS["actor"]})
    fill = {"tmp": str(tmp_path), "run": str(run)}
    assert cli([a.format(**fill) for a in args]) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_export_refuses_a_score_head_bias_transformers_cannot_hold(tmp_path, capsys):
    run, _ = fake_run(tmp_path, models={"reward": SPECS["reward"]}, score_bias=0.25)
    assert cli(["export", str(run), "--model", "reward", "-o", str(tmp_path / "o")]) == 2
    assert "the score head has a bias (+0.25), which GPT2ForSequenceClassification's layer has not" in \
        capsys.readouterr().err
    assert not (tmp_path / "o").exists()   # nothing half-written is left


def test_export_without_a_single_policy_asks_for_a_model(tmp_path, capsys):
    run, _ = fake_run(tmp_path, models={"critic": SPECS["critic"]})
    assert cli(["export", str(run), "-o", str(tmp_path / "o")]) == 2
    assert "choose one with --model (models: critic)" in capsys.readouterr().err


# -- samples ----------------------------------------------------------------------------------------
def test_sample_rows_spread_over_the_batch_with_reward_scores_and_fields(rollout):
    scores = torch.tensor([0.5, float("nan"), -1.0])
    values = {"scores": scores, "roll": rollout, "adv": torch.zeros(3, 4)}
    rows = sample_rows(7, rollout, values, "scores", 2, fields=[{"id": 0}, {"id": 1}, {"id": 2}])
    assert [r["row"] for r in rows] == [0, 1]
    assert rows[0] == {"step": 7, "row": 0, "prompt": "hello there", "response": rollout.responses[0],
                       "reward": 0.5, "scores": {"scores": 0.5}, "response_tokens":
                       int(rollout.batch.response_lengths[0]), "versions": [[0, int(rollout.batch.response_lengths[0])]],
                       "fields": {"id": 0}}
    assert rows[1]["reward"] is None                      # NaN is written as null
    assert [r["row"] for r in sample_rows(0, rollout, values, None, 10)] == [0, 1, 2]
    assert sample_rows(0, rollout, values, "scores", 0) == []
    assert "| 0 | `hello there` |" in to_markdown(rows)


def test_samples_log_resume_keeps_earlier_steps_once_and_replays_them_to_tensorboard(tmp_path, rollout):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    values = {"scores": torch.tensor([1.0, 2.0, 3.0])}
    log = SampleLog(str(tmp_path), 2)
    for step in range(4):
        log.write(step, rollout, values, "scores")
    with open(log.path, "a") as fh:
        fh.write('{"step": 4, "pro')                       # a crash mid-write
    resumed = SampleLog(str(tmp_path), 2)
    kept, notes = resumed.trim(2)                        # the checkpoint was step 2: steps 2, 3 run again
    assert [r["step"] for r in kept] == [0, 0, 1, 1] and len(notes) == 1
    writer = SummaryWriter(str(tmp_path / "tb"))
    resumed.open(writer, replay=kept)
    for step in (2, 3):
        resumed.write(step, rollout, values, "scores")
    writer.close()
    lines = [json.loads(x) for x in open(log.path)]
    assert [r["step"] for r in lines] == [0, 0, 1, 1, 2, 2, 3, 3] and [r["row"] for r in lines[:2]] == [0, 1]
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    steps = [e.step for e in acc.Tensors("samples/text_summary")]
    assert steps == [0, 1, 2, 3]


# -- plot -------------------------------------------------------------------------------------------
def test_plot_draws_a_panel_per_metric_group(tmp_path, capsys):
    from PIL import Image

    rows = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.05, "kl": 0.01 * s if s else None,
             "policy_loss": -0.1, "value_loss": 1.0 / (s + 1), "response_len_mean": 5.0 + s,
             "response_len_max": 8, "samples_per_s": 10.0 + s, "entropy": 3.0} for s in range(12)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 12, "rew')
    assert cli(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "Reward, KL (policy vs reference), Losses, Response length, Throughput, Policy statistics" in out
    img = Image.open(tmp_path / "c.png").convert("RGB")
    assert img.size == (1200, 960)                       # 2 columns x 3 rows of panels at 100 dpi
    w, h = img.size
    px = img.load()
    for col in range(2):                                 # every panel has a drawn curve (matplotlib's blue)
        for row in range(3):
            box = [(x, y) for x in range(col * w // 2, (col + 1) * w // 2, 2)
                   for y in range(row * h // 3, (row + 1) * h // 3, 2)]
            blue = sum(1 for x, y in box if abs(px[x, y][0] - 31) < 30 and abs(px[x, y][1] - 119) < 30
                       and abs(px[x, y][2] - 180) < 30)
            assert blue > 20, (col, row, blue)
    assert cli(["plot", str(tmp_path)]) == 0 and (tmp_path / "curves.png").stat().st_size > 10_000


# -- the run settings -------------------------------------------------------------------------------
def test_precision_and_log_samples_print_only_when_not_default_and_round_trip(tmp_path):
    from rlhfc.frontend import load_file
    from rlhfc.ir import parse_ir, print_module

    program = (
        'cluster local { devices = cpu:1 }\n'
        'model actor = llama(layers = 1, hidden = 32, heads = 2, vocab = 64) trainable\n'
        'data prompts = synthetic(count = 64, min_len = 4, max_len = 8)\n'
        'pipeline grpo(batch = 4) {\n'
        '  roll = actor.generate(prompts, n = 2, max_new_tokens = 8)\n'
        '  actor.train(ppo_clip(roll, actor.logprobs(roll), group_advantages(roll, '
        'rule("rlhfc.runtime.rewards:vowel_count", roll))), lr = 1e-3)\n'
        '}\n')
    texts = {}
    for name, run in (("plain", ""), ("set", "run { precision = bf16; log_samples = 0 }\n"),
                      ("defaults", "run { precision = fp32; log_samples = 4 }\n")):
        (tmp_path / f"{name}.rlhf").write_text(program + run)
        module, _, _ = load_file(str(tmp_path / f"{name}.rlhf"))
        text = print_module(module)
        assert print_module(parse_ir(text)) == text
        texts[name] = next(x for x in text.splitlines() if x.strip().startswith("run {")).split(" loc(")[0]
    assert 'precision = "bf16", log_samples = 0}' in texts["set"]
    for name in ("plain", "defaults"):
        assert "precision" not in texts[name] and "log_samples" not in texts[name]


def test_export_of_an_hf_folder_model_copies_its_tokenizer_and_writes_the_checkpoints_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tmp_path / "base"
    base = build_model(SPECS["actor"], seed=2)
    base.hf.save_pretrained(str(source))
    char_tokenizer_fast(CharTokenizer(64)).save_pretrained(str(source))
    (source / "README.md").write_text("not a tokenizer file")
    run, built = fake_run(tmp_path, models={"actor": {"source": str(source), "head": "lm"}}, with_plan=True)
    assert cli(["export", str(run), "-o", str(tmp_path / "o")]) == 0
    files = set(os.listdir(tmp_path / "o"))
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= files and "README.md" not in files
    assert AutoTokenizer.from_pretrained(str(tmp_path / "o")).encode("abc", add_special_tokens=False) == [3, 4, 5]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "o"))
    trained = built["actor"].hf.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in hf.state_dict().items())            # the checkpoint's
    assert not torch.equal(hf.state_dict()["lm_head.weight"], base.hf.state_dict()["lm_head.weight"])


def test_export_with_a_job_that_did_not_write_the_checkpoint_is_an_error(tmp_path, capsys):
    run, _ = fake_run(tmp_path, models={"actor": SPECS["actor"]}, with_plan=True)
    plan = json.loads((run / "job" / "plan.json").read_text())
    plan["models"]["actor"]["spec"]["hidden"] = 64            # another program's actor
    (run / "job" / "plan.json").write_text(json.dumps(plan))
    assert cli(["export", str(run), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "do not fit the model the plan describes" in err and "--job" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_folder_holding_samples_is_an_earlier_run(tmp_path):
    from rlhfc.runtime.driver.checkpoint import RunFolderError, check_fresh_run_folder, run_folder_contents

    (tmp_path / "samples.jsonl").write_text('{"step": 0}\n')
    assert run_folder_contents(str(tmp_path)) == ["samples.jsonl"]
    with pytest.raises(RunFolderError, match="already holds a run: samples.jsonl; nothing was overwritten"):
        check_fresh_run_folder(str(tmp_path), None, "rlhfc run p.rlhf --resume")
