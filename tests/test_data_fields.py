"""The compiler's side of data fields: jsonl / parquet / arrow sources with fields and truncate, printed in the
canonical IR only when given (round-trip), rule functions whose extra parameters must be declared fields, and
the rule's extract option (printed only when given)."""

from __future__ import annotations

import json

from rlhfc.frontend import load_file
from rlhfc.ir import verify
from rlhfc.ir.parser import parse_ir
from rlhfc.ir.printer import print_module

PROGRAM = """
cluster local { devices = cpu:2 }
model actor = llama(layers = 2, hidden = 64, heads = 4, vocab = 40, max_seq = 16) trainable
data tasks = %s
pipeline grpo(batch = 2) {
  roll   = actor.generate(tasks, n = 4, max_new_tokens = 2)
  scores = rule(%s, roll%s)
  adv    = group_advantages(roll, scores, method = grpo)
  actor.train(ppo_clip(roll, adv, adv, clip = 0.2), lr = 1e-3)
}
"""


def _write(tmp_path, source: str, rule: str = '"rewards:check"', options: str = "") -> str:
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"q": "1 plus 1", "answer": "2", "tests": [i]})
                                                for i in range(3)) + "\n")
    (tmp_path / "t.parquet").write_bytes(b"PAR1")   # read by the job, not by check
    (tmp_path / "rewards.py").write_text("def check(prompt, response, answer, tests=None):\n    return 1.0\n\n"
                                         "def batched(prompts, responses, answer):\n    return [1.0] * len(prompts)\n")
    path = tmp_path / "p.rlhf"
    path.write_text(PROGRAM % (source, rule, options))
    return str(path)


def test_fields_and_truncate_print_parse_round_trip(tmp_path):
    module, diags, _ = load_file(_write(tmp_path, 'jsonl("t.jsonl", prompt = "q", fields = [answer, "tests"], '
                                                  'truncate = left)', options=', extract = "last_number"'))
    assert not [d for d in diags if d.severity == "error"]
    text = print_module(module)
    assert 'field = "q", fields = ["answer", "tests"], truncate = "left"' in text
    assert 'compute.rule(%roll) {fn = "rewards:check", extract = "last_number"}' in text
    again = parse_ir(text)
    verify(again)
    assert print_module(again) == text


def test_defaults_do_not_print(tmp_path):
    module, _, _ = load_file(_write(tmp_path, 'jsonl("t.jsonl", prompt = "q", fields = [answer])'))
    text = print_module(module)
    assert "truncate" not in text and "extract" not in text   # programs without them keep their IR


def test_parquet_source_and_batched_rule_check(tmp_path):
    module, diags, _ = load_file(_write(tmp_path, 'parquet("t.parquet", prompt = "q", fields = [answer])',
                                        rule='"rewards:batched"'))
    assert not [d for d in diags if d.severity == "error"]
    assert module.data["tasks"].kind == "parquet" and module.data["tasks"].options["fields"] == ["answer"]


def test_arith_tiny_data_is_what_its_script_writes():
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("make_arith_data", os.path.join(root, "examples",
                                                                                  "make_arith_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(root, "examples", "arith_tiny.jsonl"), encoding="utf-8") as fh:
        assert fh.read().splitlines() == mod.lines()


def test_the_job_reports_how_many_prompts_it_truncated(tmp_path, capsys):
    from rlhfc.codegen import emit_job
    from rlhfc.runtime.job import Job

    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"q": q, "answer": "1"}) + "\n"
                                                 for q in ("short", "a prompt far too long for max_seq 16")))
    path = _write(tmp_path, 'jsonl("long.jsonl", prompt = "q", fields = [answer], truncate = right)')
    module, _, _ = load_file(path)
    emit_job(module, str(tmp_path / "job"), source_path=path)
    job = Job(str(tmp_path / "job"), out=str(tmp_path / "run"), progress=False)   # reads the data; no Ray yet
    assert job.data["tasks"].prompts == ["short", "a prompt far "]   # 16 - 2 new tokens - BOS = 13 characters
    assert "note: data @tasks: 1 of 2 prompts truncated (right)" in capsys.readouterr().err
