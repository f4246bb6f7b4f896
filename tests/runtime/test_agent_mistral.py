"""Mistral's tool calls (7B v0.3, Nemo, Small): ``[TOOL_CALLS] [{"name", "arguments", "id"}, ...]`` in the policy's
turn, each result appended as the template writes a ``tool`` message naming the call's id — the trajectory is
token for token the template's rendering of the conversation, never re-tokenized.

The template here is written for these tests in the format of Mistral's (the tools listed before the last user turn,
calls as a JSON list after ``[TOOL_CALLS]``, results in ``[TOOL_RESULTS] ... [/TOOL_RESULTS]`` with the call's id,
which must be nine letters and digits, as Mistral's templates require).
"""

from __future__ import annotations

import json
import string

import pytest

from rlhfc.contract.rules import tool_call_format
from rlhfc.runtime.rollout.agent import AgentLoop, ChatTemplate, mistral_call_id, tool_schema

from test_agent_chat import _Calc, _scripted   # the Hermes tests' scripted decoder and tool (tests/runtime on the path)

MISTRAL = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}{{ raise_exception('tool call ids are 9 characters') }}"
    "{% endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}, "
    "\"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}"
    "{{ eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('tool call ids are 9 characters') }}{% endif %}"
    "[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")

TOOL = '''def calc(expr):
    """Adds the numbers in expr ("1 plus 2")."""
    return str(sum(int(x) for x in expr.split(" plus ")))
'''


@pytest.fixture(scope="module")
def mistral_tok(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhfc.runtime.data.tokenizer import load_tokenizer

    special = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
               "[/TOOL_RESULTS]"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{t: 4 + i for i, t in enumerate(special)}}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", additional_special_tokens=special)
    tok.chat_template = MISTRAL
    folder = tmp_path_factory.mktemp("mistral")
    tok.save_pretrained(folder)
    return load_tokenizer({"source": str(folder)}), folder


def test_the_template_is_read_as_mistrals_format(mistral_tok):
    from rlhfc.frontend.files import tool_template_problem

    tok, folder = mistral_tok
    assert tool_call_format(MISTRAL) == "mistral"
    assert ChatTemplate.of(tok, ()).style == "mistral"
    assert tool_template_problem(str(folder), "actor") is None   # the compiler's check accepts it


def test_two_calls_run_and_their_results_name_the_calls_ids_as_the_template_writes_them(mistral_tok, tmp_path):
    tok, _ = mistral_tok
    path = tmp_path / "t.py"
    path.write_text(TOOL)
    schemas = (tool_schema("calc", str(path), "calc"),)
    calc = _Calc()
    loop = AgentLoop({"calc": calc}, max_turns=3, turn_tokens=200, format=ChatTemplate(schemas, "mistral"))
    call = ('[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "12 plus 30"}, "id": "a1b2c3d4e"}, '
            '{"name": "calc", "arguments": {"expr": "1 plus 1"}, "id": "Zz9Zz9Zz9"}]')
    decode = _scripted({0: [call, "42 and 2"]}, tok)
    (t,), _ = loop.run(decode, [[9]], width=400, keys=[0], tokenizer=tok, want_logprobs=False,
                       records=[{"prompt": "what is 12 plus 30"}])
    assert calc.args == ["12 plus 30", "1 plus 1"] and (t.turns, t.calls) == (2, 2)
    assert tok.decode(t.prompt_ids, keep_special=True) == (
        "<s>[AVAILABLE_TOOLS] " + json.dumps(list(schemas)) + "[/AVAILABLE_TOOLS][INST] what is 12 plus 30[/INST]")
    conversation = [{"role": "user", "content": "what is 12 plus 30"}, {"role": "assistant", "content": call},
                    {"role": "tool", "name": "calc", "content": "42", "tool_call_id": "a1b2c3d4e"},
                    {"role": "tool", "name": "calc", "content": "2", "tool_call_id": "Zz9Zz9Zz9"},
                    {"role": "assistant", "content": "42 and 2"}]
    assert list(t.prompt_ids) + t.tokens == tok.chat_ids(conversation, tools=list(schemas), add_generation_prompt=False)
    tools_text = tok.decode([x for x, p in zip(t.tokens, t.policy) if not p], keep_special=True)
    assert tools_text == ('[TOOL_RESULTS] {"content": "42", "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]'
                          '[TOOL_RESULTS] {"content": "2", "call_id": "Zz9Zz9Zz9"}[/TOOL_RESULTS]')
    assert [who for who, _ in t.segments] == ["policy", "calc+calc", "policy"]


@pytest.mark.parametrize("text, found", [
    ('[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "1 plus 1"}, "id": "abcdefghi"}]',
     [("calc", "1 plus 1", "abcdefghi")]),
    ('[TOOL_CALLS][{"name": "calc", "arguments": "2 plus 2", "id": "123456789"}]', [("calc", "2 plus 2", "123456789")]),
    ('[TOOL_CALLS] {"name": "calc", "arguments": {"expr": "3"}, "id": "ABCDEFGHI"}', [("calc", "3", "ABCDEFGHI")]),
    ('[TOOL_CALLS] [{"name": "other", "arguments": {}, "id": "abcdefghi"}]', []),   # not a declared tool
    ('[TOOL_CALLS] [{"name": "calc", "arguments": ', []),                             # not JSON: an answer
    ('{"name": "calc", "arguments": {"expr": "1"}}', []),                             # no [TOOL_CALLS]: an answer
])
def test_what_counts_as_a_call(mistral_tok, text, found):
    tok, _ = mistral_tok
    assert ChatTemplate(style="mistral").parse(tok.encode(text), tok, ["calc"]) == found


def test_a_call_without_a_valid_id_gets_one_of_its_own_the_template_accepts(mistral_tok):
    tok, _ = mistral_tok
    text = '[TOOL_CALLS] [{"name": "calc", "arguments": {"expr": "5"}}, {"name": "calc", "arguments": "6", "id": "x"}]'
    (_, _, a), (_, _, b) = ChatTemplate(style="mistral").parse(tok.encode(text), tok, ["calc"])
    assert len(a) == len(b) == 9 and a.isalnum() and b.isalnum() and a != b
    assert a == mistral_call_id(None, "calc", {"expr": "5"}, 0)   # the same call, the same id
    ids = ChatTemplate(style="mistral").results([("calc", "5", a), ("calc", "6", b)], tok)
    assert tok.decode(ids, keep_special=True) == (f'[TOOL_RESULTS] {{"content": "5", "call_id": "{a}"}}[/TOOL_RESULTS]'
                                                  f'[TOOL_RESULTS] {{"content": "6", "call_id": "{b}"}}[/TOOL_RESULTS]')


def test_a_chat_generate_with_tools_on_a_mistral_template_runs_on_the_worker(mistral_tok, tmp_path):
    """Through ModelWorker.generate, on a tiny llama saved beside the tokenizer: every trajectory's prompt is the
    template's (tools listed), and the policy's tokens are the loss mask."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rlhfc.runtime.worker.base import ModelWorker

    tok, folder = mistral_tok
    model = tmp_path / "model"
    hf = AutoTokenizer.from_pretrained(folder)
    hf.save_pretrained(model)
    config = LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model, safe_serialization=True)
    (tmp_path / "tools.py").write_text(TOOL)
    worker = ModelWorker("actor", {"head": "lm", "source": str(model)}, {"kind": "pretrained"}, seed=0)
    spec = {"name": "calc", "path": str(tmp_path / "tools.py"), "function": "calc", "timeout": 2.0,
            "memory_mb": 256, "max_output": 64}
    roll = worker.generate([{"prompt": "what is 1 plus 2"}], max_new_tokens=24, temperature=1.0, top_p=1.0, n=2,
                           chat=True, tools=[spec], max_turns=2, turn_tokens=12)
    want = tok.chat_ids([{"role": "user", "content": "what is 1 plus 2"}],
                        tools=[tool_schema("calc", spec["path"], "calc")])
    assert all(ids == want for ids in roll.batch.prompt_token_lists())
    assert tok.decode(want, keep_special=True).startswith("<s>[AVAILABLE_TOOLS] [")
    assert roll.batch.response_mask.sum() > 0
