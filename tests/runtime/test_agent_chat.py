"""Tool calls in a chat template's own format (rlhfc.runtime.rollout.agent.ChatTemplate): the prompt shows the
tools' schemas, a Hermes ``<tool_call>{json}</tool_call>`` in the policy's turn calls the tool, and its result is
appended as the tokens the template writes for a tool message — so the trajectory is token for token the
template's rendering of the conversation, never re-tokenized."""

from __future__ import annotations

import json
import string

import pytest

from rlhfc.runtime.rollout.agent import AgentLoop, ChatTemplate, tool_schema
from rlhfc.runtime.rollout.decoding import FinishedSample

#: a small Hermes-style template (as Qwen 2.5's, shorter): tools listed in a system turn, calls in <tool_call>,
#: results in a user turn inside <tool_response>
HERMES = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters.required[0] }}): {{ t.function.description }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOL = '''def calc(expr):
    """Adds the numbers in expr ("1 plus 2").

    More text the schema leaves out."""
    return str(sum(int(x) for x in expr.split(" plus ")))
'''


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhfc.runtime.data.tokenizer import load_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, "<unk>": 3, "<|im_start|>": 4, "<tool_call>": 5,
             "</tool_call>": 6}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = HERMES
    folder = tmp_path_factory.mktemp("hermes")
    tok.save_pretrained(folder)
    return load_tokenizer({"source": str(folder)}), tmp_path_factory.mktemp("tools")


class _Calc:
    def __init__(self):
        self.args = []

    def call(self, args):
        self.args += args
        return [type("R", (), {"output": str(sum(int(x) for x in a.split(" plus "))), "kind": "ok"})() for a in args]


def _scripted(texts, tok):
    """Decode: row key k's i-th turn is texts[k][i] (a tool call is written as the template writes one), then EOS."""
    seen = {}

    def decode(rows, *, budgets, resumed, row_keys):
        for i, key in enumerate(row_keys):
            n = seen.get(key, 0)
            seen[key] = n + 1
            ids = tok.encode(texts[key][n]) + [tok.eos_id]
            yield FinishedSample(i, tuple(rows[i]), tuple(ids), True, len(ids) - 1, (), float(len(ids)))
    return decode


def test_the_schema_comes_from_the_tools_signature_and_docstring(chat_tok, tmp_path):
    path = tmp_path / "t.py"
    path.write_text(TOOL)
    schema = tool_schema("calc", str(path), "calc")
    assert schema == {"type": "function", "function": {
        "name": "calc", "description": 'Adds the numbers in expr ("1 plus 2").',
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}


def test_a_hermes_call_runs_the_tool_and_the_trajectory_is_the_templates_rendering(chat_tok, tmp_path):
    tok, _ = chat_tok
    path = tmp_path / "t.py"
    path.write_text(TOOL)
    schemas = (tool_schema("calc", str(path), "calc"),)
    calc = _Calc()
    loop = AgentLoop({"calc": calc}, max_turns=3, turn_tokens=80, format=ChatTemplate(schemas))
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "12 plus 30"}}</tool_call>'
    decode = _scripted({0: [call, "it is 42"], 1: ["no tools: 7"]}, tok)
    records = [{"prompt": "what is 12 plus 30"}, {"prompt": "and 3 plus 4"}]
    trajs, _ = loop.run(decode, [[9], [9]], width=200, keys=[0, 1], tokenizer=tok, want_logprobs=False,
                        records=records)
    a, b = trajs
    assert calc.args == ["12 plus 30"]
    assert (a.turns, a.calls, b.turns, b.calls) == (2, 1, 1, 0)
    # the prompt: the template's user turn with the tools' schemas shown
    assert tok.decode(a.prompt_ids, keep_special=True) == (
        '<|im_start|>system\nTools: calc(expr): Adds the numbers in expr ("1 plus 2").<|im_end|>\n'
        "<|im_start|>user\nwhat is 12 plus 30<|im_end|>\n<|im_start|>assistant\n")
    # token for token what the template renders for the whole conversation (the policy's call is its text)
    conversation = [{"role": "user", "content": "what is 12 plus 30"}, {"role": "assistant", "content": call},
                    {"role": "tool", "name": "calc", "content": "42"}, {"role": "assistant", "content": "it is 42"}]
    rendered = tok.chat_ids(conversation, tools=list(schemas), add_generation_prompt=False)
    assert list(a.prompt_ids) + a.tokens == rendered[:-1]   # it ends at the last turn's EOS, before the newline
    # the policy's tokens: the call and the answer with their EOS; the template's tool turn is not the policy's
    suffix = tok.decode([t for t, p in zip(a.tokens, a.policy) if not p], keep_special=True)
    assert suffix == "\n<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert a.tool_tokens == len(tok.chat_suffix([{"role": "tool", "name": "calc", "content": "42"}]))


@pytest.mark.parametrize("text, found", [
    ('<tool_call>{"name": "calc", "arguments": {"expr": "1 plus 1"}}</tool_call>', [("calc", "1 plus 1")]),
    ('thinking... <tool_call> {"name": "calc", "arguments": "2 plus 2"} </tool_call>', [("calc", "2 plus 2")]),
    ('<tool_call>{"name": "calc", "arguments": {"a": 1, "b": 2}}</tool_call>', [("calc", '{"a": 1, "b": 2}')]),
    ('<tool_call>{"name": "calc", "arguments": "1"}</tool_call><tool_call>{"name": "calc", "arguments": "2"}'
     '</tool_call>', [("calc", "1"), ("calc", "2")]),                         # several calls, in order
    ('<tool_call>{"name": "other", "arguments": {}}</tool_call>', []),        # not a declared tool
    ('<tool_call>{"name": "calc", "arguments": </tool_call>', []),             # not JSON: the turn is an answer
    ("calc 1 plus 1", []),                                                      # plain text is not a call here
])
def test_what_counts_as_a_call(chat_tok, text, found):
    tok, _ = chat_tok
    assert ChatTemplate().parse(tok.encode(text), tok, ["calc"]) == found


def test_several_calls_in_a_turn_run_and_their_results_follow_as_the_template_writes_them(chat_tok, tmp_path):
    """Two calls in one turn: both run (one batch to the tool), and their results are appended as the template
    renders two tool messages after the turn — the trajectory is still the template's rendering of the whole
    conversation."""
    tok, _ = chat_tok
    path = tmp_path / "t.py"
    path.write_text(TOOL)
    schemas = (tool_schema("calc", str(path), "calc"),)
    calc = _Calc()
    loop = AgentLoop({"calc": calc}, max_turns=2, turn_tokens=160, format=ChatTemplate(schemas))
    two = ('<tool_call>{"name": "calc", "arguments": {"expr": "1 plus 2"}}</tool_call>'
           '<tool_call>{"name": "calc", "arguments": {"expr": "3 plus 4"}}</tool_call>')
    decode = _scripted({0: [two, "3 and 7"]}, tok)
    (t,), _ = loop.run(decode, [[9]], width=300, keys=[0], tokenizer=tok, want_logprobs=False,
                       records=[{"prompt": "sums"}])
    assert calc.args == ["1 plus 2", "3 plus 4"] and t.calls == 2 and t.turns == 2
    conversation = [{"role": "user", "content": "sums"}, {"role": "assistant", "content": two},
                    {"role": "tool", "name": "calc", "content": "3"}, {"role": "tool", "name": "calc", "content": "7"},
                    {"role": "assistant", "content": "3 and 7"}]
    rendered = tok.chat_ids(conversation, tools=list(schemas), add_generation_prompt=False)
    assert list(t.prompt_ids) + t.tokens == rendered[:-1]
    assert [who for who, _ in t.segments] == ["policy", "calc+calc", "policy"]


def test_an_environments_observation_is_a_user_turn(chat_tok):
    tok, _ = chat_tok
    ids = ChatTemplate().observe("the value is 7", tok, "env")
    assert tok.decode(ids, keep_special=True) == "\n<|im_start|>user\nthe value is 7<|im_end|>\n<|im_start|>assistant\n"
    assert json.dumps(ChatTemplate().prompt([1], "key", "look it up", tok)[1]) == "[]"   # joins the user turn
    first = tok.decode(ChatTemplate().prompt([1], "key", "look it up", tok)[0], keep_special=True)
    assert first == "<|im_start|>user\nkey\n\nlook it up<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hermes_model(chat_tok, tmp_path_factory):
    """A tiny llama beside the Hermes tokenizer, and a tool file."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok, _ = chat_tok
    folder = tmp_path_factory.mktemp("hermes_model")
    hf = AutoTokenizer.from_pretrained(tok.hf.name_or_path)
    hf.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    (folder / "tools.py").write_text(TOOL)
    return folder


def test_a_chat_generate_with_tools_prompts_with_the_schemas_on_the_worker(hermes_model, chat_tok):
    """Through ModelWorker.generate: every trajectory's prompt is the template's, schemas shown; the rollout's
    prompt width is the longest such prompt; the policy's tokens are the loss mask."""
    from rlhfc.runtime.worker.base import ModelWorker

    tok, _ = chat_tok
    folder = str(hermes_model)
    worker = ModelWorker("actor", {"head": "lm", "source": folder}, {"kind": "pretrained"}, seed=0)
    spec = {"name": "calc", "path": str(hermes_model / "tools.py"), "function": "calc", "timeout": 2.0,
            "memory_mb": 256, "max_output": 64}
    roll = worker.generate([{"prompt": "what is 1 plus 2"}], max_new_tokens=24, temperature=1.0, top_p=1.0, n=3,
                           chat=True, tools=[spec], max_turns=2, turn_tokens=12)
    want = tok.chat_ids([{"role": "user", "content": "what is 1 plus 2"}],
                        tools=[tool_schema("calc", spec["path"], "calc")])
    assert all(ids == want for ids in roll.batch.prompt_token_lists())
    assert tok.decode(want, keep_special=True).startswith("<|im_start|>system\nTools: calc(expr): Adds the numbers")
    assert roll.batch.response_mask.sum() > 0 and roll.prompts == ["what is 1 plus 2"] * 3


def test_check_refuses_a_chat_generate_with_tools_whose_template_has_no_tool_calls(hermes_model, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from rlhfc.frontend import load_file
    from rlhfc.ir import CompileError

    plain = tmp_path / "plain_template"   # the same model, a chat template without tool calls
    shutil.copytree(hermes_model, plain)
    hf = AutoTokenizer.from_pretrained(plain)
    hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    hf.save_pretrained(plain)
    (tmp_path / "tools.py").write_text(TOOL)
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "1 plus 2"}) + "\n")

    def program(folder):
        path = tmp_path / "p.rlhf"
        path.write_text(f"""
cluster local {{ devices = cpu:2 }}
model actor = hf("{folder}") trainable
data tasks = jsonl("q.jsonl")
tool calc = python("tools:calc")
pipeline grpo(batch = 1) {{
  roll   = actor.generate(tasks, n = 2, max_new_tokens = 24, chat = true, tools = [calc], max_turns = 2)
  scores = rule("rlhfc.runtime.rewards:vowel_count", roll)
  adv    = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, adv, adv, clip = 0.2), lr = 1e-3)
}}
""")
        return str(path)

    load_file(program(hermes_model))   # a Hermes template: fine
    with pytest.raises(CompileError) as err:
        load_file(program(plain))
    text = str(err.value)
    assert "has no tool-call format rlhfc reads (it writes neither <tool_call>...</tool_call> nor" in text
    assert "p.rlhf:7:69: error" in text and "drop chat to use the plain-text convention" in text


# -- Llama 3.1-3.3's JSON calls (TRL's copy of the llama3_1 template) ------------------------------------------------


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory):
    import importlib.resources

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlhfc.runtime.data.tokenizer import load_tokenizer

    template = importlib.resources.files("trl").joinpath("chat_templates/llama3_1.jinja").read_text()
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
               "<|eom_id|>"]
    vocab = {"<pad>": 0, "<unk>": 1, **{t: 2 + i for i, t in enumerate(special)}}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<|begin_of_text|>",
                                  eos_token="<|eot_id|>", unk_token="<unk>", additional_special_tokens=special)
    tok.chat_template = template
    folder = tmp_path_factory.mktemp("llama31")
    tok.save_pretrained(folder)
    return load_tokenizer({"source": str(folder)}), str(folder)


def test_a_llama_3_json_call_runs_the_tool_and_its_result_is_the_templates_ipython_turn(llama_tok, chat_tok,
                                                                                       tmp_path):
    """With Llama 3.1's template the tools are listed in the first user turn, the policy's turn
    ``{"name": "calc", "parameters": {...}}`` calls the tool (a turn of other text is the answer; a call of an
    undeclared tool or broken JSON is none), and the result follows as the template's ipython turn — the
    trajectory is token for token the template's rendering of the conversation; the compiler's check accepts
    the template."""
    from rlhfc.contract.rules import tool_call_format
    from rlhfc.frontend.files import chat_template_text, tool_template_problem

    tok, folder = llama_tok
    assert tool_call_format(tok.hf.chat_template) == "json" and tool_call_format(HERMES) == "hermes"
    assert tool_template_problem(folder, "actor") is None and tool_call_format(chat_template_text(folder)) == "json"
    path = tmp_path / "t.py"
    path.write_text(TOOL)
    schemas = (tool_schema("calc", str(path), "calc"),)
    fmt = ChatTemplate.of(tok, schemas)   # as the worker picks it
    assert fmt == ChatTemplate(schemas, "json") and ChatTemplate.of(chat_tok[0], schemas).style == "hermes"
    assert fmt.parse(tok.encode('{"name": "calc", "parameters": {"expr": "1 plus 2"}}'), tok, ["calc"]) == \
        [("calc", "1 plus 2")]
    for text in ('{"name": "other", "parameters": {"expr": "1"}}', '{"name": "calc", "para', "the answer is 3"):
        assert fmt.parse(tok.encode(text), tok, ["calc"]) == []
    calc = _Calc()
    loop = AgentLoop({"calc": calc}, max_turns=3, turn_tokens=120, format=fmt)
    call = '{"name": "calc", "parameters": {"expr": "12 plus 30"}}'
    decode = _scripted({0: [call, "it is 42"]}, tok)
    (a,), _ = loop.run(decode, [[9]], width=400, keys=[0], tokenizer=tok, want_logprobs=False,
                       records=[{"prompt": "what is 12 plus 30"}])
    assert calc.args == ["12 plus 30"] and (a.turns, a.calls) == (2, 1)
    prompt = tok.decode(a.prompt_ids, keep_special=True)
    assert "Given the following functions" in prompt and '"name": "calc"' in prompt
    assert prompt.endswith("what is 12 plus 30<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    conversation = [{"role": "user", "content": "what is 12 plus 30"},
                    {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                        "name": "calc", "arguments": {"expr": "12 plus 30"}}}]},
                    {"role": "tool", "name": "calc", "content": "42"}, {"role": "assistant", "content": "it is 42"}]
    assert list(a.prompt_ids) + a.tokens == tok.chat_ids(conversation, tools=list(schemas),
                                                         add_generation_prompt=False)
    suffix = tok.decode([t for t, p in zip(a.tokens, a.policy) if not p], keep_special=True)
    # (this template writes a string result as JSON, quoted: what the model saw in training)
    assert suffix == '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|><|start_header_id|>assistant' \
                     "<|end_header_id|>\n\n"
