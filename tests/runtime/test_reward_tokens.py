"""Real checkpoints' tokenizers as the peers treat them (issue #36): models whose Hugging Face folders hold the
same tokenizer files exchange token ids wherever the folders are (the tokenizer is known by content, not by
path: a critic initialised from a reward model's checkpoint reads the policy's rollouts); a reward model that
shares the policy's tokenizer scores the token ids as generated, EOS included, and one with its own tokenizer
its own encoding of the text with BOS first and EOS last where the response ended — as a direct transformers
call on that tokenizer's ids gives."""

from __future__ import annotations

import shutil

import pytest

import torch

from rlhfc.contract.rules import tokenizer_fingerprint
from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.driver.export import char_tokenizer_fast
from rlhfc.runtime.models.build import build_model
from rlhfc.runtime.worker.base import ModelWorker, tokenizer_id

PROMPTS = ["ab", "cd e", "xyz", "q"]
GEN = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, n=2)


def _folder(path, spec, seed: int, vocab: int):
    """A Hugging Face folder: ``spec``'s model (seeded) and the built-in tokenizer of ``vocab`` as a fast one."""
    build_model(spec, seed=seed).hf.save_pretrained(str(path))
    char_tokenizer_fast(CharTokenizer(vocab)).save_pretrained(str(path))
    return str(path)


def test_two_folders_holding_the_same_tokenizer_are_one_tokenizer(tmp_path, make_spec):
    a = _folder(tmp_path / "a", make_spec("llama"), 1, 96)
    b = _folder(tmp_path / "b", make_spec("llama"), 2, 96)
    c = _folder(tmp_path / "c", make_spec("llama", vocab=64), 3, 64)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) != tokenizer_fingerprint(c)
    assert tokenizer_id({"source": a}) == tokenizer_id({"source": b}) != tokenizer_id({"source": c})
    # a copy of the folder elsewhere, tokenizer_config.json naming where it was saved from: the same tokenizer
    shutil.copytree(a, tmp_path / "d")
    cfg = tmp_path / "d" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("{", '{"name_or_path": "/somewhere/else", ', 1))
    assert tokenizer_fingerprint(str(tmp_path / "d")) == tokenizer_fingerprint(a)
    assert tokenizer_fingerprint(str(tmp_path / "nothing")) is None


def test_a_critic_from_another_folder_with_the_same_tokenizer_reads_the_policys_rollout(tmp_path, make_spec):
    from rlhfc.frontend import compile_source
    from rlhfc.ir import verify

    pol = _folder(tmp_path / "policy", make_spec("llama"), 1, 96)
    rm = _folder(tmp_path / "reward_model", make_spec("llama"), 2, 96)
    program = f"""
cluster local {{ devices = cpu:1 }}
model actor  = hf("{pol}") trainable
model critic = hf("{rm}") head = value trainable
model reward = hf("{rm}") head = score frozen
data prompts = synthetic(count = 64, min_len = 3, max_len = 6)
pipeline ppo(batch = 4) {{
  roll     = actor.generate(prompts, max_new_tokens = 6)
  logp     = actor.logprobs(roll)
  values   = critic.values(roll)
  scores   = reward.score(roll)
  adv, ret = gae(scores, values, logp)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3)
  critic.train(value_loss(roll, values, ret), lr = 1e-3)
}}
run {{ steps = 1 }}
"""
    module, _ = compile_source(program, str(tmp_path / "p.rlhf"))   # no "another tokenizer" error
    verify(module)
    actor = ModelWorker("actor", {"source": pol, "head": "lm"}, {"kind": "pretrained"}, seed=0)
    critic = ModelWorker("critic", {"source": rm, "head": "value"}, {"kind": "pretrained"}, seed=0)
    roll = actor.generate(PROMPTS, **GEN)
    values = critic.values(roll)   # token ids accepted: the same tokenizer
    assert values.values.shape == roll.mask.shape


def test_a_reward_model_of_the_policys_tokenizer_scores_the_generated_ids_eos_included(make_spec):
    actor = ModelWorker("actor", make_spec("llama"), {"kind": "random"}, seed=0)
    reward = ModelWorker("reward", make_spec("llama", head="score"), {"kind": "random"}, seed=0)
    roll = actor.generate(PROMPTS * 4, **GEN)
    assert bool(roll.batch.eos.any())
    got = reward.score(roll)
    b = roll.batch
    want = reward.model.score(b.input_ids, b.attention_mask)   # the ids as generated
    torch.testing.assert_close(got, want)
    eos = actor.tokenizer.eos_id
    for i, ids in enumerate(b.response_token_lists()):   # ... EOS the last of them where a response ended
        assert (ids[-1] == eos) == bool(b.eos[i])


def test_a_reward_model_with_its_own_tokenizer_scores_its_own_encoding_with_bos_and_eos(tmp_path, make_spec):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path / "rm", make_spec("llama", vocab=64), 5, 64)   # another vocabulary: its own tokens
    actor = ModelWorker("actor", make_spec("llama"), {"kind": "random"}, seed=0)
    reward = ModelWorker("reward", {"source": folder, "head": "score"}, {"kind": "pretrained"}, seed=0)
    roll = actor.generate(PROMPTS * 4, **GEN)
    assert roll.tokenizer != reward.tok_id and bool(roll.batch.eos.any()) and not bool(roll.batch.eos.all())
    got = reward.score(roll)
    hf_tok = AutoTokenizer.from_pretrained(folder)
    model = reward.model
    for i, (p, r) in enumerate(zip(roll.prompts, roll.responses)):
        ids = [hf_tok.bos_token_id] + hf_tok.encode(p + r, add_special_tokens=False)
        if bool(roll.batch.eos[i]):
            ids.append(hf_tok.eos_token_id)
        x = torch.tensor([ids])
        with torch.no_grad():   # the transformers trunk and the score head at the last token, directly
            hidden = model.trunk(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
            want = model.head(hidden)[0, -1, 0].float()
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def _gpt2_folder_with_dropout(path, make_spec) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = make_spec("gpt2")
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=128, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1)
    GPT2LMHeadModel(config).save_pretrained(str(path))
    char_tokenizer_fast(CharTokenizer(spec["vocab"])).save_pretrained(str(path))
    return str(path)


def test_a_loaded_gpt2_trains_without_its_configs_dropout_unless_the_program_keeps_it(tmp_path, make_spec):
    """A GPT-2 folder whose config says dropout 0.1: loaded for RL, every dropout rate is 0 (log-prob ratios and
    value targets without dropout noise, as TRL's disable_dropout), so two forwards in train mode agree;
    ``dropout = true`` (``spec["dropout"]``) keeps the folder's rates."""
    folder = _gpt2_folder_with_dropout(tmp_path / "gpt2", make_spec)
    x = torch.randint(3, 90, (2, 12))
    mask = torch.ones_like(x)
    off = build_model({"source": folder, "head": "lm"})
    off.train()
    assert all(m.p == 0.0 for m in off.modules() if isinstance(m, torch.nn.Dropout))
    assert torch.equal(off.forward_logits(x, mask), off.forward_logits(x, mask))
    kept = build_model({"source": folder, "head": "lm", "dropout": True})
    kept.train()
    assert {m.p for m in kept.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}
    assert not torch.equal(kept.forward_logits(x, mask), kept.forward_logits(x, mask))


def test_dropout_true_is_a_setting_of_hf_models_only(tmp_path, make_spec):
    from rlhfc.frontend import compile_source
    from rlhfc.ir import parse_ir, print_module
    from rlhfc.ir.diagnostics import CompileError

    folder = _gpt2_folder_with_dropout(tmp_path / "gpt2", make_spec)
    program = """
cluster local {{ devices = cpu:1 }}
model actor = {ctor} trainable
data prompts = synthetic(count = 64, min_len = 3, max_len = 6)
pipeline p(batch = 4) {{
  roll   = actor.generate(prompts, n = 2, max_new_tokens = 6)
  logp   = actor.logprobs(roll)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores)
  actor.train(ppo_clip(roll, logp, adv), lr = 1e-3)
}}
run {{ steps = 1 }}
"""
    kept, _ = compile_source(program.format(ctor=f'hf("{folder}", dropout = true)'), str(tmp_path / "a.rlhf"))
    text = print_module(kept)
    assert kept.models["actor"].dropout is True and "dropout = true" in text
    assert print_module(parse_ir(text)) == text
    plain, _ = compile_source(program.format(ctor=f'hf("{folder}")'), str(tmp_path / "b.rlhf"))
    assert plain.models["actor"].dropout is False and "dropout = " not in print_module(plain)
    with pytest.raises(CompileError, match="unknown hf setting 'dropuot'"):
        compile_source(program.format(ctor=f'hf("{folder}", dropuot = true)'), str(tmp_path / "c.rlhf"))
    with pytest.raises(CompileError, match="dropout must be true or false"):
        compile_source(program.format(ctor=f'hf("{folder}", dropout = 1)'), str(tmp_path / "d.rlhf"))
