"""Data with fields: loading them, truncating prompts, carrying each prompt's fields with its samples through
generation (n > 1, streamed chunks, overcommit carries), and rules that take them by name; the verifiable
built-in rewards and their answer extractors."""

from __future__ import annotations

import json

import pytest
import torch

from rlhfc.frontend.rules import EXTRACTORS as CHECKED_EXTRACTORS
from rlhfc.runtime import rewards
from rlhfc.runtime.data.answers import EXTRACTORS, extract_answer, extract_problem, parse_number
from rlhfc.runtime.data.prompts import DataError, JsonlPrompts, prompt_parts, prompt_source_from_spec, truncate_text
from rlhfc.runtime.data.tokenizer import CharTokenizer
from rlhfc.runtime.data.values import merge_rollouts
from rlhfc.runtime.rl.guards import RewardError
from rlhfc.runtime.worker.base import ModelWorker

TASKS = [{"question": "2 plus 2", "answer": "4", "tests": ["a"]},
         {"question": "1 plus 5", "answer": "6", "tests": []},
         {"question": "0 plus 3", "answer": 3, "tests": None}]


def _write(path, rows, extra_lines=()):
    path.write_text("\n".join([json.dumps(r) for r in rows] + list(extra_lines)) + "\n")
    return str(path)


def test_jsonl_fields_load_and_travel_with_prompts_in_order(tmp_path):
    src = JsonlPrompts(_write(tmp_path / "t.jsonl", TASKS), field="question", fields=["answer", "tests"])
    batch = src.next_batch(4)   # wraps around
    assert [prompt_parts(p) for p in batch] == [
        ("2 plus 2", {"answer": "4", "tests": ["a"]}), ("1 plus 5", {"answer": "6", "tests": []}),
        ("0 plus 3", {"answer": 3, "tests": None}), ("2 plus 2", {"answer": "4", "tests": ["a"]})]
    assert json.loads(json.dumps(batch)) == batch   # plain JSON: checkpointable when carried
    # a source without fields still hands out plain texts
    plain = prompt_source_from_spec({"kind": "jsonl", "path": str(tmp_path / "t.jsonl"), "field": "question"})
    assert plain.next_batch(2) == ["2 plus 2", "1 plus 5"]
    assert prompt_parts("x") == ("x", {})


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = _write(tmp_path / "t.jsonl", TASKS[:1], ['{"question": "3 plus 3", "tests": []}'])
    with pytest.raises(DataError) as err:
        JsonlPrompts(path, field="question", fields=["answer"])
    assert f"{path}:2: no field 'answer'" in err.value.message


FIT = [{"model": "actor", "tokenizer": {"source": None, "vocab": 40}, "max_seq": 10, "max_new_tokens": 3}]


def test_truncate_left_right_and_error(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "abcdefghijkl"}, {"prompt": "ab"}])
    with pytest.raises(DataError, match=r"p.jsonl:1: the prompt has 13 tokens") as err:   # default: error
        JsonlPrompts(path, fit=FIT)
    assert "truncate = left" in err.value.hint
    left = JsonlPrompts(path, fit=FIT, truncate="left")
    right = JsonlPrompts(path, fit=FIT, truncate="right")
    # room = 10 - 3 = 7 tokens with BOS: 6 characters of the char tokenizer
    assert left.prompts == ["ghijkl", "ab"] and right.prompts == ["abcdef", "ab"]
    assert left.truncated == right.truncated == 1
    tok = CharTokenizer(40)
    enc = lambda t: tok.encode(t, add_bos=True)   # noqa: E731
    assert truncate_text(enc, "xyz", 3, "left") == "yz" and truncate_text(enc, "xyz", 3, "right") == "xy"


def test_fields_follow_samples_through_n_chunks_and_carry(make_spec):
    worker = ModelWorker("actor", make_spec("llama", vocab=40, max_seq=32), {"kind": "random"}, seed=0)
    prompts = [{"prompt": "2 plus 2", "fields": {"answer": "4"}}, {"prompt": "1 plus 5", "fields": {"answer": "6"}}]
    roll = worker.generate(prompts, max_new_tokens=4, temperature=1.0, top_p=1.0, n=3)
    assert roll.prompts == ["2 plus 2"] * 3 + ["1 plus 5"] * 3
    assert [f["answer"] for f in roll.fields] == ["4"] * 3 + ["6"] * 3
    # streamed in chunks of 2 and overcommitted: train on 4 of 6, carry 2 with their fields
    items = list(worker.generate_chunks(prompts, chunk=2, max_new_tokens=4, temperature=1.0, top_p=1.0, n=3,
                                        take=4))
    chunks, carry = items[:-1], items[-1].samples
    merged = merge_rollouts(chunks)
    assert merged.size == 4 and len(carry) == 2
    for p, f in zip(merged.prompts + [c["prompt"] for c in carry], merged.fields + [c["fields"] for c in carry]):
        assert f == {"answer": "4" if p == "2 plus 2" else "6"}
    json.dumps(carry)   # checkpointable
    # the carried samples finish in the next call, still with their fields
    again = merge_rollouts([c for c in worker.generate_chunks([], chunk=8, max_new_tokens=4, temperature=1.0,
                                                              top_p=1.0, carry=carry, take=2)
                            if not hasattr(c, "samples")])
    assert [f["answer"] for f in again.fields] == [c["fields"]["answer"] for c in carry]


def test_rule_receives_fields_by_name_and_batched():
    seen = []

    def per_sample(prompt, response, answer):
        seen.append((prompt, response, answer))
        return float(response == answer)

    def batched(prompts, responses, answer):
        return torch.tensor([float(r == a) for r, a in zip(responses, answer)])

    def takes_all(prompt, response, **fields):
        return float(sorted(fields) == ["answer", "tests"])

    fields = [{"answer": "4", "tests": 1}, {"answer": "4", "tests": 2}, {"answer": "6", "tests": 3}]
    prompts, responses = ["2 plus 2", "2 plus 2", "1 plus 5"], ["4", "5", "6"]
    assert rewards.rule_scores(per_sample, prompts, responses, fields=fields).tolist() == [1.0, 0.0, 1.0]
    assert seen == [("2 plus 2", "4", "4"), ("2 plus 2", "5", "4"), ("1 plus 5", "6", "6")]
    assert rewards.is_batched(batched) and not rewards.is_batched(per_sample)
    assert rewards.rule_scores(batched, prompts, responses, fields=fields).tolist() == [1.0, 0.0, 1.0]
    assert rewards.rule_scores(takes_all, prompts, responses, fields=fields).tolist() == [1.0, 1.0, 1.0]


def test_rule_errors_name_function_sample_and_prompt():
    def boom(prompt, response, answer):
        return 1 / 0 if answer == "6" else 1.0

    with pytest.raises(RewardError, match=r"boom raised ZeroDivisionError.* on sample 1, prompt '1 plus 5'"):
        rewards.rule_scores(boom, ["2 plus 2", "1 plus 5"], ["4", "6"], name="m:boom",
                            fields=[{"answer": "4"}, {"answer": "6"}])
    with pytest.raises(RewardError, match="takes the data field 'answer', but sample 0"):
        rewards.rule_scores(boom, ["2 plus 2"], ["4"], name="m:boom")

    def short(prompts, responses):
        return [1.0]

    with pytest.raises(RewardError, match="returned 1 scores for 2 samples"):
        rewards.rule_scores(short, ["a", "b"], ["x", "y"], name="m:short")


@pytest.mark.parametrize("spec, response, expected", [
    ("", " 7 ", " 7 "), ("strip", " 7 \n", "7"), ("first_line", "\n a \n b", "a"), ("last_line", "a\nb \n", "b"),
    ("first_number", "x -3 then 1,200.5", "-3"), ("last_number", "x -3 then 1,200.5", "1200.5"),
    ("last_number", "none", ""), ("boxed", r"so \boxed{\frac{1}{2}} ok", r"\frac{1}{2}"), ("boxed", "no", ""),
    ("after:####", "work #### 42 ", "42"), ("re:answer is (\\w+)", "the answer is seven.", "seven"),
    ("re:\\d+", "a 12 b", "12"),
])
def test_extractors(spec, response, expected):
    assert extract_problem(spec) is None
    assert extract_answer(response, spec) == expected


def test_extractor_names_agree_with_the_compiler_and_bad_ones_are_refused():
    assert CHECKED_EXTRACTORS == EXTRACTORS   # the compiler checks the names without importing the runtime
    assert extract_problem("lastnumber") and extract_problem("re:(") and extract_problem("after:")


def test_verifiable_builtin_rewards():
    assert rewards.exact_match("q", " 4\n", "4") == 1.0 and rewards.exact_match("q", "4.0", "4") == 0.0
    assert rewards.exact_match("q", "3", 3) == 1.0   # a JSON number compares as its text
    assert rewards.numeric_match("q", "4.0", "4") == 1.0 and rewards.numeric_match("q", "1,000", 1000) == 1.0
    assert rewards.numeric_match("q", "3/4", "0.75") == 1.0 and rewards.numeric_match("q", "x", "1") == 0.0
    assert rewards.numeric_match("q", "4.001", "4") == 0.0
    assert rewards.answer_format("q", "  ") == 0.0 and rewards.answer_format("q", "7") == 1.0
    assert parse_number(True) is None and parse_number("nan") is None
    # through rule_scores, with an extractor: exact match of the last number; format: a boxed answer present
    fields = [{"answer": "12"}, {"answer": "12"}]
    got = rewards.rule_scores(rewards.exact_match, ["a", "b"], ["so 5 + 7 = 12", "12 or 13"], fields=fields,
                              extract="last_number")
    assert got.tolist() == [1.0, 0.0]
    fmt = rewards.rule_scores(rewards.answer_format, ["a", "b"], [r"\boxed{3}", "3"], extract="boxed")
    assert fmt.tolist() == [1.0, 0.0]
    for name in ("exact_match", "numeric_match", "answer_format"):
        assert rewards.resolve_rule(f"rlhfc.runtime.rewards:{name}") is getattr(rewards, name)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_table_sources_via_datasets(tmp_path, kind):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list([{"question": t["question"], "answer": str(t["answer"])} for t in TASKS])
    path = str(tmp_path / f"t.{kind}")
    if kind == "parquet":
        table.to_parquet(path)
    else:
        table.save_to_disk(str(tmp_path / "saved"))
        import glob
        import shutil

        shutil.copy(sorted(glob.glob(str(tmp_path / "saved" / "*.arrow")))[0], path)
    src = prompt_source_from_spec({"kind": kind, "path": path, "field": "question", "fields": ["answer"]})
    assert [prompt_parts(p) for p in src.next_batch(2)] == [("2 plus 2", {"answer": "4"}), ("1 plus 5", {"answer": "6"})]
    with pytest.raises(DataError, match=r"no column 'tests'"):
        prompt_source_from_spec({"kind": kind, "path": path, "field": "question", "fields": ["tests"]})


CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}u:{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def _chat_folder(tmp_path, template: str | None = CHAT_TEMPLATE) -> str:
    """A tiny llama folder with a character tokenizer that has (or lacks) a chat template."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in string.ascii_lowercase + string.digits + " :;":
        vocab[c] = len(vocab)
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    if template:
        tok.chat_template = template
    folder = tmp_path / ("chat" if template else "plain")
    tok.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def test_chat_template_wraps_prompts_and_fields_still_follow(tmp_path):
    from rlhfc.runtime.data.tokenizer import load_tokenizer

    folder = _chat_folder(tmp_path)
    tok = load_tokenizer({"source": folder})
    assert tok.decode(tok.encode_chat("2 plus 2")) == "u:2 plus 2;a:" and tok.encode_chat("x")[0] == tok.bos_id
    worker = ModelWorker("actor", {"head": "lm", "source": folder}, {"kind": "pretrained"}, seed=0)
    prompts = [{"prompt": "2 plus 2", "fields": {"answer": "4"}}]
    roll = worker.generate(prompts, max_new_tokens=3, temperature=1.0, top_p=1.0, n=2, chat=True)
    ids = roll.batch.prompt_token_lists()[0]
    assert tok.decode(ids) == "u:2 plus 2;a:" and roll.prompts == ["2 plus 2"] * 2   # rules see the raw prompt
    assert roll.fields == [{"answer": "4"}] * 2
    plain = worker.generate(prompts, max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert tok.decode(plain.batch.prompt_token_lists()[0]) == "2 plus 2"
    # fitting counts the template's tokens: "u:" + 8 + ";a:" + BOS = 14
    fit = [{"model": "actor", "tokenizer": {"source": folder, "vocab": None}, "max_seq": 16, "max_new_tokens": 3,
            "chat": True}]
    path = _write(tmp_path / "c.jsonl", [{"prompt": "2 plus 2"}])
    with pytest.raises(DataError, match="14 tokens .with BOS and the chat template"):
        JsonlPrompts(path, fit=fit)
    # room 16 - 3 = 13 tokens: the template takes 6, so 7 characters stay
    assert JsonlPrompts(path, fit=fit, truncate="left").prompts == [" plus 2"]


def test_chat_needs_a_template_at_check(tmp_path):
    from rlhfc.frontend.files import chat_template_problem

    assert chat_template_problem(_chat_folder(tmp_path), "actor") is None
    assert "has no chat template" in chat_template_problem(_chat_folder(tmp_path, None), "actor")[0]
    assert "character tokenizer" in chat_template_problem(None, "actor")[0]


def test_chat_compiles_for_a_folder_with_a_template(tmp_path):
    from rlhfc.codegen.plan import build_plan
    from rlhfc.frontend import load_file
    from rlhfc.ir.printer import print_module

    folder = _chat_folder(tmp_path)
    (tmp_path / "t.jsonl").write_text(json.dumps({"prompt": "2 plus 2", "answer": "4"}) + "\n")
    program = tmp_path / "p.rlhf"
    program.write_text(f"""
cluster local {{ devices = cpu:2 }}
model actor = hf("{folder}") trainable
data tasks = jsonl("t.jsonl", fields = [answer], truncate = left)
pipeline grpo(batch = 1) {{
  roll   = actor.generate(tasks, n = 2, max_new_tokens = 3, chat = true)
  scores = rule("rlhfc.runtime.rewards:exact_match", roll, extract = "strip")
  adv    = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, adv, adv, clip = 0.2), lr = 1e-3)
}}
""")
    module, _, _ = load_file(str(program))
    assert "chat = true" in print_module(module)
    plan = build_plan(module, source=str(program), opt_level="O0", passes=[])
    assert plan.data["tasks"].fit[0].chat is True and plan.data["tasks"].options["fields"] == ["answer"]
    source = prompt_source_from_spec(plan.data["tasks"].as_spec())   # the job's view: fits with the template
    assert prompt_parts(source.next_batch(1)[0]) == ("2 plus 2", {"answer": "4"})


def test_truncation_fits_every_model_when_two_share_a_tokenizer_and_a_third_does_not(tmp_path):
    """Models sharing a tokenizer count each prompt once; a prompt shortened for one model is counted again for
    the next (the shortest room wins, whatever the order)."""
    path = _write(tmp_path / "p.jsonl", [{"prompt": "abcdefghijkl"}, {"prompt": "ab"}])
    fit = [{"model": "a", "tokenizer": {"vocab": 40}, "max_seq": 10, "max_new_tokens": 3},
           {"model": "b", "tokenizer": {"vocab": 64}, "max_seq": 10, "max_new_tokens": 5},
           {"model": "c", "tokenizer": {"vocab": 40}, "max_seq": 10, "max_new_tokens": 3}]
    source = JsonlPrompts(path, fit=fit, truncate="left")
    # a: room 7 with BOS, 6 characters ("ghijkl"); b: room 5, 4 characters ("ijkl"), still 6 for c
    assert source.prompts == ["ijkl", "ab"] and source.truncated == 2
    with pytest.raises(DataError, match=r"the prompt has 13 tokens.*model 'a'"):   # the first model, as before
        JsonlPrompts(path, fit=fit)


def test_synthetic_prompts_are_those_drawn_one_character_at_a_time():
    """The bulk draw gives the prompts ``random.choice`` per character gives (runs and checkpoints of earlier
    versions keep their data)."""
    import random
    import string

    from rlhfc.runtime.data.prompts import SyntheticPrompts

    def one_at_a_time(seed, index, min_len, max_len, alphabet):
        rng = random.Random(f"rlhfc-prompt:{seed}:{index}")
        n = rng.randint(min_len, max_len)
        return "".join(rng.choice(alphabet) for _ in range(n))

    for alphabet in (string.ascii_lowercase, "a", "ab", string.digits, string.printable, "xyz" * 11):
        for i in range(60):
            assert SyntheticPrompts.make_prompt(i % 3, i, 1, 300, alphabet) == one_at_a_time(i % 3, i, 1, 300, alphabet)


def test_char_tokenizer_encodes_each_character_as_its_lookup_says():
    for vocab in (4, 40, 64, 98, 120):
        tok = CharTokenizer(vocab)
        for text in ("Hello, World!\n\tÄé~}", "", "abc", "ABC xyz 0123"):
            ids = [i for i in (tok._char_id(c) for c in text) if i is not None]
            assert tok.encode(text) == ids and tok.encode(text, add_bos=True) == [tok.bos_id] + ids
