"""Run-time guards (issue 17): every bad input or value is a clear error with its context, never a traceback
and never a silent wrong result.

* data files: bytes that are not UTF-8, lines that are not JSON, prompts too long for a model — named by
  file:line, as a JobError (printed without a traceback);
* rule rewards: only the built-in rules, the program folder's modules and allowed installed modules run; a
  rule that raises, returns a non-number or NaN names the function, the sample and its prompt;
* NaN / inf scores, values, advantages, losses and gradients stop the stage before anything is updated.
"""

from __future__ import annotations

import math
import string

import pytest
import torch

from rlhfc.runtime import compute, rewards
from rlhfc.runtime.data.prompts import DataError, JsonlPrompts, SyntheticPrompts, prompt_source_from_spec
from rlhfc.runtime.data.tokenizer import load_tokenizer
from rlhfc.runtime.data.values import PolicyLossInput, TokenValues
from rlhfc.runtime.errors import JobError
from rlhfc.runtime.rl.guards import NonFiniteError, RewardError, check_finite
from rlhfc.runtime.worker.base import ModelWorker


# -- data files ------------------------------------------------------------------------------------------
def test_jsonl_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: byte 0xe9 at column 16 is not valid UTF-8") as exc:
        JsonlPrompts(str(path))
    assert isinstance(exc.value, JobError) and "UTF-8" in exc.value.hint


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"\n')
    with pytest.raises(DataError, match=r"p\.jsonl:3: not valid JSON") as exc:
        prompt_source_from_spec({"kind": "jsonl", "path": str(path), "field": "prompt"})
    assert isinstance(exc.value, JobError)
    with pytest.raises(DataError, match="cannot read data file"):
        JsonlPrompts(str(tmp_path / "missing.jsonl"))


def test_jsonl_byte_order_mark_and_crlf_are_fine(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert JsonlPrompts(str(path)).prompts == ["a", "b"]


def _fit(max_seq=16, max_new_tokens=8, vocab=96):
    return [{"model": "actor", "tokenizer": {"source": None, "vocab": vocab}, "max_seq": max_seq,
             "max_new_tokens": max_new_tokens}]


def test_prompt_too_long_for_max_seq_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "short"}\n\n{"prompt": "much too long a prompt"}\n')
    JsonlPrompts(str(path), fit=_fit(max_seq=40))               # fits
    with pytest.raises(DataError, match=r"p\.jsonl:3: the prompt has 23 tokens \(with BOS\); with "
                                        r"max_new_tokens = 8 that is 31, more than max_seq 16 of model 'actor'"):
        prompt_source_from_spec({"kind": "jsonl", "path": str(path), "field": "prompt", "fit": _fit()})
    with pytest.raises(DataError, match=r"synthetic prompt \d+ \(of max_len 12\)"):
        SyntheticPrompts(64, 4, 12, fit=_fit(max_seq=16))          # 13 + 8 > 16
    SyntheticPrompts(64, 4, 12, fit=_fit(max_seq=21))


# -- which rules may run ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ref", ["os:system", "builtins:print", "subprocess:run", "rlhfc.runtime.job:main",
                                 "rlhfc.runtime.rewards:resolve_rule", "no_such_module_xyz:f"])
def test_rules_outside_the_program_and_the_builtins_are_refused(ref, tmp_path):
    with pytest.raises(rewards.RuleError, match="not|refused"):
        rewards.resolve_rule(ref, program_dir=str(tmp_path), allowed=("os", "builtins", "subprocess"))


def test_rule_from_the_program_folder_is_loaded_from_its_path(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "from os import system\n"
        "import helper\n"
        "def exact(prompt, response):\n    return float(prompt == response) + helper.BONUS\n"
        "def three(prompt, response, extra):\n    return 0.0\n"
        "def one(prompt):\n    return 0.0\n"
        "class Cls:\n    pass\n")
    (tmp_path / "helper.py").write_text("BONUS = 0.5\n")
    fn = rewards.resolve_rule("my_rewards:exact", program_dir=str(tmp_path))
    assert fn("a", "a") == 1.5 and fn("a", "b") == 0.5
    assert rewards.resolve_rule("my_rewards:exact", program_dir=str(tmp_path)) is fn   # loaded once
    # a third parameter is a data field, passed by name (check verifies the data declares it)
    assert rewards.resolve_rule("my_rewards:three", program_dir=str(tmp_path)).__name__ == "three"
    for name, why in (("system", "not a plain Python function"), ("one", r"must take \(prompt, response\)"),
                      ("Cls", "not a plain Python function"), ("nope", "no function")):
        with pytest.raises(rewards.RuleError, match=why):
            rewards.resolve_rule(f"my_rewards:{name}", program_dir=str(tmp_path))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "rules.py").write_text("def f(prompt, response):\n    return 2.0\n")
    assert rewards.resolve_rule("pkg.rules:f", program_dir=str(tmp_path))("", "") == 2.0
    with pytest.raises(rewards.RuleError, match="not in the program's folder"):
        rewards.resolve_rule("my_rewards:exact", program_dir=str(tmp_path / "pkg"))


def test_allowed_installed_module_and_configure(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "installed_rewards_xyz.py").write_text("def score(prompt, response):\n    return 3.0\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(rewards.RuleError, match="not listed in reward_modules"):
        rewards.resolve_rule("installed_rewards_xyz:score", program_dir=str(tmp_path))
    monkeypatch.setattr(rewards, "_CONFIG", {"program_dir": None, "allowed": ()})
    rewards.configure(str(tmp_path), ["installed_rewards_xyz"])
    assert rewards.resolve_rule("installed_rewards_xyz:score")("", "") == 3.0
    assert rewards.resolve_rule("rlhfc.runtime.rewards:vowel_count") is rewards.vowel_count


# -- rule rewards that fail ------------------------------------------------------------------------------
def _boom(prompt, response):
    if prompt == "bad":
        raise ZeroDivisionError("division by zero")
    return 1.0


def test_reward_function_that_raises_names_function_sample_and_prompt():
    with pytest.raises(RewardError, match=r"reward function my:boom raised ZeroDivisionError: division by zero "
                                          r"\(at test_guards\.py:\d+\) on sample 2, prompt 'bad'"):
        rewards.rule_scores(_boom, ["ok", "ok", "bad"], ["r", "r", "r"], name="my:boom")
    with pytest.raises(RewardError, match=r"returned 'x', not a number, on sample 1, prompt 'q'"):
        rewards.rule_scores(lambda p, r: "x" if p == "q" else 0.0, ["p", "q"], ["", ""], name="f")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e300])
def test_non_finite_reward_names_the_sample(bad):
    with pytest.raises(NonFiniteError, match=r"the reward of my:f is (NaN|\+inf|-inf) for sample 1 \(prompt 'b'\)"):
        rewards.rule_scores(lambda p, r: bad if p == "b" else 0.0, ["a", "b"], ["", ""], name="my:f")


# -- driver-side stages ----------------------------------------------------------------------------------
def test_check_finite_names_first_bad_sample_and_ignores_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    vals = torch.tensor([[0.0, 1.0, math.nan], [2.0, math.inf, math.nan]])
    assert check_finite(vals, "x", mask=mask) is vals            # only padding is non-finite
    vals[1, 0] = math.nan
    with pytest.raises(NonFiniteError, match=r"an advantage is NaN for sample 1 \(prompt 'q'\)"):
        check_finite(vals, "an advantage", mask=mask, prompts=["p", "q"])


def test_gae_and_group_advantages_refuse_non_finite_inputs():
    mask = torch.ones(2, 3, dtype=torch.long)
    values = TokenValues(torch.zeros(2, 3), mask)
    with pytest.raises(NonFiniteError, match="a score is NaN for sample 1"):
        compute.gae(torch.tensor([0.0, math.nan]), values, gamma=1.0, lam=0.95, kl_coef=0.0, estimator="k1",
                    whiten=True)
    bad_values = TokenValues(torch.tensor([[0.0, 0.0, 0.0], [0.0, math.inf, 0.0]]), mask)
    with pytest.raises(NonFiniteError, match=r"a value estimate is \+inf for sample 1"):
        compute.gae(torch.zeros(2), bad_values, gamma=1.0, lam=0.95, kl_coef=0.0, estimator="k1", whiten=True)

    class Roll:   # what group_advantages reads of a rollout
        prompts = ["a", "a", "b", "b"]
        mask = torch.ones(4, 2, dtype=torch.long)

    with pytest.raises(NonFiniteError, match=r"a score is -inf for sample 2 \(prompt 'b'\)"):
        compute.group_advantages(Roll(), torch.tensor([0.0, 1.0, -math.inf, 0.0]), method="grpo",
                                 normalize_std=True, group=2)


# -- worker stages ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def actor(make_spec):
    return ModelWorker("actor", make_spec("llama", vocab=64), {"kind": "random"}, seed=3)


def _snapshot(worker):
    return {k: v.clone() for k, v in worker.model.state_dict().items()}


def _loss(worker, advantages=None):
    roll = worker.generate(["abc", "de"], max_new_tokens=4, temperature=1.0, top_p=1.0, n=2)
    logp = worker.logprobs(roll).values
    adv = torch.ones_like(logp) if advantages is None else advantages(logp)
    return PolicyLossInput(roll, logp, adv, None, 0.2, 0.0, 0.0, "k3", 1.0)


def test_non_finite_loss_stops_train_before_any_update(actor):
    before = _snapshot(actor)
    version = actor.version

    def nan_adv(logp):
        adv = torch.ones_like(logp)
        adv[1, 0] = math.nan
        return adv

    with pytest.raises(NonFiniteError, match=r"the policy loss of 'actor' is nan"):
        actor.train(_loss(actor, nan_adv), lr=1e-2, epochs=1, minibatches=1, max_grad_norm=1.0, weight_decay=0.0)
    after = _snapshot(actor)
    assert all(torch.equal(before[k], after[k]) for k in before) and actor.version == version


def test_non_finite_gradient_never_reaches_the_weights(actor):
    actor.train(_loss(actor), lr=1e-3, epochs=1, minibatches=2, max_grad_norm=1.0, weight_decay=0.0)   # optimizer
    before = _snapshot(actor)
    for p in actor.model.parameters():
        p.grad = torch.zeros_like(p)
    next(actor.model.parameters()).grad[0] = math.inf
    with pytest.raises(NonFiniteError, match=r"the gradient norm of 'actor' is inf"):
        actor.optimizer.step()
    after = _snapshot(actor)
    assert all(torch.equal(before[k], after[k]) for k in before)
    actor.optimizer.zero_grad(set_to_none=True)


def test_more_minibatches_than_samples_is_an_error_not_a_cap(actor):
    with pytest.raises(ValueError, match=r"minibatches \(5\) is more than the 4 samples"):
        actor.train(_loss(actor), lr=1e-3, epochs=1, minibatches=5, max_grad_norm=1.0, weight_decay=0.0)


def test_non_finite_reward_model_score_names_the_sample(actor, make_spec):
    reward = ModelWorker("reward", make_spec("llama", head="score", vocab=64), {"kind": "random"}, seed=4)
    with torch.no_grad():
        for p in reward.model.parameters():
            p.fill_(math.nan)
    roll = actor.generate(["abc", "de"], max_new_tokens=3, temperature=1.0, top_p=1.0)
    with pytest.raises(NonFiniteError, match=r"the score of reward model 'reward' is NaN for sample 0 "
                                             r"\(prompt 'abc'\) \(2 samples in all\)"):
        reward.score(roll)


# -- tokenizers ------------------------------------------------------------------------------------------
def _save_tokenizer(folder, letters: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in letters:
        vocab[c] = len(vocab)
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)


def test_model_folder_without_tokenizer_or_with_a_larger_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer({"source": str(tmp_path), "vocab": 96})
    _save_tokenizer(tmp_path, string.ascii_lowercase + " ")   # 31 tokens
    assert load_tokenizer({"source": str(tmp_path), "vocab": 31}).vocab_size == 31
    with pytest.raises(ValueError, match="has 31 tokens but the model's vocabulary has 20"):
        load_tokenizer({"source": str(tmp_path), "vocab": 20})
