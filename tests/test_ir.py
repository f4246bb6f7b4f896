"""The IR: parameter counts, the canonical text form and its parser, version edges, the verifier."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from rlhfc.frontend import load_file
from rlhfc.ir import (Attr, CompileError, Module, Operand, OpSpec, Stage, Symbol, Value, ValueType,
                      VerificationError, VersionEdge, derive_versions, get_op, human_count, param_count, parse_ir,
                      print_module, register_op, verify)
from rlhfc.passes import PassManager, pipeline_for

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))
LEVELS = ("O0", "O1", "O2", "O3")


@functools.lru_cache(maxsize=None)
def compiled_text(name: str, level: str = "O0") -> str:
    module, _, _ = load_file(str(ROOT / "examples" / f"{name}.rlhf"))
    return print_module(PassManager(pipeline_for(level)).run(module))


def compiled(name: str, level: str = "O0") -> Module:
    """A fresh module (safe to modify) for an example compiled at ``level``."""
    return parse_ir(compiled_text(name, level))


def errors_of(module: Module) -> list:
    with pytest.raises(VerificationError) as info:
        verify(module)
    return info.value.diagnostics


def the_error(module: Module, pattern: str):
    """The one diagnostic whose message matches ``pattern`` (regex); it must carry a hint."""
    diags = errors_of(module)
    hits = [d for d in diags if re.search(pattern, d.message)]
    assert len(hits) == 1, f"no single match for {pattern!r} in {[d.message for d in diags]}"
    assert hits[0].hint, f"no hint for {hits[0].message!r}"
    return hits[0]


# -- parameter counts --------------------------------------------------------------------------
def test_param_counts_of_published_configs():
    assert param_count("llama", 32, 4096, 32, 32, 11008, 32000, 4096) == 6_738_415_616       # Llama-2-7B
    assert param_count("llama", 80, 8192, 64, 8, 28672, 32000, 4096) == 68_976_648_192       # Llama-2-70B
    assert param_count("gpt2", 12, 768, 12, 12, 3072, 50257, 1024) == 124_439_808            # GPT-2 small
    assert human_count(6_738_415_616) == "6.74B" and human_count(68_976_648_192) == "69B"


def test_param_counts_of_compiled_examples():
    m70 = compiled("ppo_70b")
    assert 68.5e9 < m70.models["actor"].params < 69.5e9
    assert m70.models["ref"].params == m70.models["actor"].params
    m7 = compiled("ppo_7b")
    assert 6.7e9 < m7.models["actor"].params < 6.8e9
    assert m7.models["critic"].params < m7.models["actor"].params      # scalar head instead of the lm head
    assert "// 69B params" in compiled_text("ppo_70b")
    assert "// 6.74B params" in compiled_text("ppo_7b")


# -- canonical text ------------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_round_trip(path: Path, level: str):
    text = compiled_text(path.stem, level)
    module = parse_ir(text)
    verify(module)
    assert print_module(module) == text
    assert print_module(module.clone()) == text


def test_canonical_text_shape():
    text = compiled_text("ppo_tiny")
    assert text.startswith("module @ppo_tiny {\n  cluster @local {device = \"cpu\", nodes = 1, per_node = 2}")
    assert "    %roll = generate @actor(%prompts) {max_new_tokens = 24, temperature = 1.0, top_p = 1.0, n = 1}" \
           " : Rollout[16] loc(" in text
    assert "    version @actor %actor_train -> %roll [+1]\n" in text
    assert text.endswith("  }\n}\n")


def _strip_locs(text: str) -> str:
    return re.sub(r' loc\("[^"]*":\d+:\d+\)', "", text)


def test_hand_written_variants_print_canonically():
    canonical = _strip_locs(compiled_text("ppo_tiny"))
    # other whitespace: every token on its own line, indented oddly, plus comments everywhere
    variant = re.sub(r"\s+", "\n   ", re.sub(r"  // [^\n]*", "", canonical))   # (params comments dropped)
    variant = variant.replace("module", "// a hand-written module\nmodule", 1)
    variant = variant.replace("\n   }", "  // closing brace\n}")
    variant = variant.replace("%logp =", "// the policy's log-probs\n%logp =", 1)
    assert variant != canonical
    assert print_module(parse_ir(variant)) == canonical


def test_hand_written_orders_print_canonically():
    canonical = _strip_locs(compiled_text("ppo_tiny"))
    lines = canonical.splitlines(keepends=True)
    versions = [line for line in lines if line.lstrip().startswith("version")]
    reordered = [line for line in lines if line not in versions]
    close = reordered.index("  }\n")
    reordered[close:close] = versions[::-1]                           # version edges in another order
    text = "".join(reordered)
    text = text.replace('{kind = "synthetic", count = 4096, min_len = 4, max_len = 12, seed = 0}',
                        '{seed = 0, max_len = 12, kind = "synthetic", min_len = 4, count = 4096}')
    text = text.replace("{temperature = 1.0} : TokenFloat[16]", "{ temperature=1.0 }:TokenFloat[16]")
    text = re.sub(r"\{arch = \"llama\", layers = 2, (.*?), source = \"\"\}",
                  lambda m: "{source = \"\", " + m.group(1) + ", layers = 2, arch = \"llama\"}", text)
    assert text != canonical
    assert print_module(parse_ir(text)) == canonical


def test_annotations_round_trip():
    m = compiled("ppo_tiny")
    m.annotations["schedule"] = "fifo"
    m.graph.annotations["overlap"] = [["logp", "ref_logp"], ["values"]]
    m.graph.stage("roll").annotations.update(placement={"mesh": [0, 1], "tp": 2}, stream=64, note="x\"y\n")
    m.models["actor"].annotations["offload"] = True
    m.cluster.annotations["topology"] = Symbol("ring")
    text = print_module(m)
    assert "annot {note = \"x\\\"y\\n\", placement = {mesh = [0, 1], tp = 2}, stream = 64}" in text
    assert print_module(parse_ir(text)) == text
    verify(parse_ir(text))


def test_floats_print_shortest_and_round_trip():
    m = compiled("ppo_7b")
    assert "lr = 1e-06" in print_module(m)
    m.graph.stage("roll").attrs["temperature"] = 0.1 + 0.2
    text = print_module(m)
    assert "temperature = 0.30000000000000004" in text
    assert parse_ir(text).graph.stage("roll").attrs["temperature"] == 0.1 + 0.2


def test_print_refuses_non_finite_floats():
    m = compiled("ppo_tiny")
    m.graph.stage("roll").attrs["temperature"] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        print_module(m)


# -- parser errors ---------------------------------------------------------------------------------
def _parse_error(text: str):
    with pytest.raises(CompileError) as info:
        parse_ir(text, "bad.rlir")
    (d,) = info.value.diagnostics
    assert d.loc is not None and d.loc.file == "bad.rlir", d
    return d


def _line_col(text: str, needle: str) -> tuple[int, int]:
    i = text.index(needle)
    return text.count("\n", 0, i) + 1, i - text.rfind("\n", 0, i)


def _key_at(text: str, line_needle: str, key: str) -> tuple[int, int]:
    """(line, column) of ``key = ...`` in the first line containing ``line_needle``."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line_needle in line)
    return i + 1, re.search(rf"[{{ ]{key} =", lines[i]).start() + 2


def test_parse_error_syntax_is_located():
    text = _strip_locs(compiled_text("ppo_tiny")).replace("Rollout[16]", "Rollout[16] )", 1)
    d = _parse_error(text)
    assert d.message == "unexpected ')'"
    assert (d.loc.line, d.loc.col) == _line_col(text, ")\n    %logp")
    assert "expected" in d.hint
    rendered = d.render(text)
    assert "bad.rlir:" in rendered and "^" in rendered


def test_parse_error_end_of_file():
    d = _parse_error("module @m {\n  cluster @c {device = \"cpu\", nodes = 1, per_node = 1}\n")
    assert d.message == "unexpected end of file" and "'cluster'" in d.hint and d.loc.line == 2


def test_parse_error_undefined_value():
    text = _strip_locs(compiled_text("ppo_tiny")).replace("forward.values @critic(%roll)",
                                                          "forward.values @critic(%rol)")
    d = _parse_error(text)
    assert d.message == "use of undefined value %rol"
    assert (d.loc.line, d.loc.col) == _line_col(text, "%rol)")
    assert "did you mean 'roll'?" in d.hint


def test_parse_error_value_used_above_its_definition():
    text = _strip_locs(compiled_text("ppo_tiny"))
    lines = text.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if "%roll = generate" in line)
    lines[i], lines[i + 1] = lines[i + 1], lines[i]
    d = _parse_error("".join(lines))
    assert d.message == "use of undefined value %roll" and "above" in d.hint


def test_parse_error_unknown_key_is_at_the_key():
    text = _strip_locs(compiled_text("ppo_tiny")).replace("kv_heads = 4, ffn = 192", "kv_head = 4, ffn = 192", 1)
    d = _parse_error(text)
    assert d.message == "unknown key 'kv_head' in model"
    assert (d.loc.line, d.loc.col) == _line_col(text, "kv_head = 4")
    assert "did you mean 'kv_heads'?" in d.hint


@pytest.mark.parametrize("old,new,message", [
    ("run {steps = 40,", "run {stepz = 40,", "unknown run setting 'stepz'"),
    (", per_node = 2}", "}", "cluster @local is missing 'per_node'"),
    ("{batch = 16} : Prompts[16]", "{batch = 16, batch = 16} : Prompts[16]", "duplicate key 'batch'"),
    ("%logp = forward", "%roll = forward", "value %roll is defined twice"),
    ("Rollout[16]", "Rollout", "type Rollout needs batch size"),
    ("version @actor %actor_train -> %logp", "version @actor %actor_train -> %nope", "version edge names unknown stage %nope"),
    ('data @prompts {kind = "synthetic", ', "data @prompts {", "data source @prompts is missing 'kind'"),
    ("%adv, %ret = ", "%adv = ", "1 results but 2 types"),
])
def test_parse_errors_are_located(old, new, message):
    text = _strip_locs(compiled_text("ppo_tiny"))
    assert old in text
    d = _parse_error(text.replace(old, new, 1))
    assert d.message == message and d.hint


def test_keywords_may_be_keys_in_annotations():
    m = compiled("ppo_tiny")
    m.graph.stage("roll").annotations.update({"model": "a", "loc": 1, "data": 2, "version": 3, "run": 4})
    text = print_module(m)
    assert print_module(parse_ir(text)) == text


# -- version edges -------------------------------------------------------------------------------------
def test_version_edges_of_the_ppo_example():
    m = compiled("ppo_tiny")
    assert set(m.graph.versions) == {
        VersionEdge("actor", "actor_train", "roll", 1),
        VersionEdge("actor", "actor_train", "logp", 1),
        VersionEdge("critic", "critic_train", "values", 1),
    }
    # frozen models (ref, reward) have no version edges: their weights never change
    assert not [e for e in m.graph.versions if e.model in ("ref", "reward")]
    text = compiled_text("ppo_tiny")
    assert text.index("version @actor %actor_train -> %roll [+1]") < \
        text.index("version @actor %actor_train -> %logp [+1]") < \
        text.index("version @critic %critic_train -> %values [+1]")


def test_version_edges_of_every_example_are_derived():
    for path in EXAMPLES:
        m = compiled(path.stem)
        assert set(m.graph.versions) == set(derive_versions(m.graph, m.trainable_models()))
        assert {e.distance for e in m.graph.versions} == {1}


def test_version_distance_zero_after_train():
    m = compiled("ppo_tiny")
    g = m.graph
    roll = g.values()["roll"]
    post = Stage("forward.logprobs", "actor", [roll], [Value("logp_new", ValueType("TokenFloat", 16))],
                 {"temperature": 1.0})
    g.insert(g.stages.index(g.stage("actor_train")) + 1, post)
    m.refresh_versions()
    assert VersionEdge("actor", "actor_train", "logp_new", 0) in g.versions
    verify(m)
    assert "version @actor %actor_train -> %logp_new [+0]" in print_module(m)


# -- verifier: each message says what is wrong and how to fix it ----------------------------------------
def test_examples_verify():
    for path in EXAMPLES:
        verify(compiled(path.stem))


def test_verify_missing_version_edge():
    m = compiled("ppo_tiny")
    m.graph.versions.remove(VersionEdge("actor", "actor_train", "logp", 1))
    d = the_error(m, "missing parameter-version edge")
    assert "%logp reads the @actor weights %actor_train wrote the previous step" in d.message
    assert "add `version @actor %actor_train -> %logp [+1]`" in d.hint
    assert "refresh_versions" in d.hint


def test_verify_stale_version_edge():
    m = compiled("ppo_tiny")
    m.graph.versions.append(VersionEdge("actor", "actor_train", "ref_logp", 1))
    d = the_error(m, "stale parameter-version edge")
    assert "%ref_logp does not read @actor" in d.message and d.hint.startswith("remove it")


def test_verify_version_edge_with_wrong_distance():
    m = compiled("ppo_tiny")
    m.graph.versions[m.graph.versions.index(VersionEdge("actor", "actor_train", "roll", 1))] = \
        VersionEdge("actor", "actor_train", "roll", 0)
    msgs = [d.message for d in errors_of(m)]
    assert any("runs before %actor_train, so the distance is +1" in s for s in msgs)
    assert any(s.startswith("missing parameter-version edge: %roll") for s in msgs)


def test_verify_duplicate_version_edge():
    m = compiled("ppo_tiny")
    m.graph.versions.append(m.graph.versions[0])
    assert "remove the duplicate" in the_error(m, "listed twice").hint


def test_verify_use_before_definition():
    m = compiled("ppo_tiny")
    g = m.graph
    logp = g.stage("logp")
    g.stages.remove(logp)
    g.stages.insert(0, logp)                   # %logp now reads %roll before %roll is made
    m.refresh_versions()
    d = the_error(m, "uses %roll before it is defined")
    assert d.message.startswith("stage %logp (forward.logprobs)")
    assert "move the stage that defines %roll above this one" in d.hint


def test_verify_stale_value_object():
    m = compiled("ppo_tiny")
    stage = m.graph.stage("logp")
    stage.inputs = [Value("roll", ValueType("Rollout", 16))]       # same name, not the producer's object
    d = the_error(m, "not the one its producer defines")
    assert "replace_all_uses" in d.hint


def test_verify_value_defined_twice():
    m = compiled("ppo_tiny")
    m.graph.stage("ref_logp").outputs[0].name = "logp"
    m.refresh_versions()
    assert "rename" in the_error(m, "value %logp is defined twice").hint


def test_verify_train_frozen_model():
    m = compiled("ppo_tiny")
    m.models["critic"].trainable = False
    m.refresh_versions()
    d = the_error(m, "frozen")
    assert d.message == "stage %critic_train (train): model @critic is frozen and cannot be trained"
    assert "trainable = true" in d.hint


def test_verify_frozen_training_points_into_the_rlir_file():
    text = _strip_locs(compiled_text("ppo_tiny")).replace('head = "value", trainable = true',
                                                          'head = "value", trainable = false')
    text = text.replace("    version @critic %critic_train -> %values [+1]\n", "")
    d = the_error(parse_ir(text, "x.rlir"), "frozen")
    assert (d.loc.file, d.loc.line, d.loc.col) == ("x.rlir", *_line_col(text, "%critic_train ="))


def test_verify_points_at_the_source_for_modules_from_rlhf():
    m, _, _ = load_file(str(ROOT / "examples" / "ppo_tiny.rlhf"))
    m.graph.stage("roll").attrs["temperature"] = -1.0
    d = the_error(m, "temperature")
    assert d.loc.file.endswith("ppo_tiny.rlhf") and d.loc.line == 15


def test_verify_wrong_operand_type():
    m = compiled("ppo_tiny")
    g = m.graph
    g.stage("ref_logp").inputs = [g.values()["logp"]]
    d = the_error(m, "operand 'rollout'")
    assert d.message == ("stage %ref_logp (forward.logprobs): operand 'rollout' must be Rollout, "
                         "got %logp : TokenFloat[16]")
    assert "a Rollout comes from generate" in d.hint


def test_verify_operand_count():
    m = compiled("ppo_tiny")
    m.graph.stage("values").inputs = []
    assert "operands: (rollout: Rollout)" in the_error(m, "expects 1 operands, got 0").hint


def test_verify_wrong_loss_for_head():
    m = compiled("ppo_tiny")
    g = m.graph
    g.stage("critic_train").inputs = [g.values()["ppo_clip"]]
    d = the_error(m, "cannot train @critic")
    assert "a 'value' head needs a ValueLoss" in d.message and "compute.value_loss" in d.hint


def test_verify_head_mismatch():
    m = compiled("ppo_tiny")
    m.graph.stage("values").target = "actor"
    m.refresh_versions()
    assert 'head = "value"' in the_error(m, "has a 'lm' head but forward.values needs 'value'").hint


def test_verify_unknown_op():
    m = compiled("ppo_tiny")
    m.graph.stage("logp").op = "forward.logprob"
    d = the_error(m, "unknown op")
    assert d.message == "stage %logp (forward.logprob): unknown op 'forward.logprob'"
    assert d.hint.startswith("did you mean 'forward.logprobs'?") and "register_op" in d.hint


def test_verify_unknown_attribute():
    m = compiled("ppo_tiny")
    m.graph.stage("roll").attrs["temprature"] = 0.5
    d = the_error(m, "unknown attribute")
    assert d.message == "stage %roll (generate): unknown attribute 'temprature'"
    assert d.hint.startswith("did you mean 'temperature'?") and "annot" in d.hint


def test_verify_missing_attribute():
    m = compiled("ppo_tiny")
    del m.graph.stage("actor_train").attrs["lr"]
    assert the_error(m, "missing attribute 'lr'").hint == "add `lr = 1e-05`"


@pytest.mark.parametrize("key,value,message,hint", [
    ("temperature", 1, "expects a float, got int 1", "write it as a float: temperature = 1.0"),
    ("n", 2.0, "expects an int, got float 2.0", "samples per prompt (GRPO/RLOO groups) (an integer >= 1 and <= 4096); e.g. n = 1"),
    ("top_p", 1.5, "must be <= 1.0, got 1.5", "nucleus sampling mass (a number >= 0.0 and <= 1.0); e.g. top_p = 1.0"),
    ("max_new_tokens", 0, "must be >= 1, got 0", "longest response (an integer >= 1); e.g. max_new_tokens = 32"),
])
def test_verify_attribute_values(key, value, message, hint):
    text = _strip_locs(compiled_text("ppo_tiny"))
    m = parse_ir(text, "x.rlir")
    m.graph.stage("roll").attrs[key] = value
    d = the_error(m, f"'{key}'")
    assert d.message == f"'{key}' {message}" and d.hint == hint
    assert (d.loc.file, d.loc.line, d.loc.col) == ("x.rlir", *_key_at(text, "%roll = generate", key))


def test_verify_attribute_without_a_position_names_the_stage():
    m = compiled("ppo_tiny")
    roll = m.graph.stage("roll")
    roll.field_locs.clear()
    roll.attrs["top_p"] = 1.5
    d = the_error(m, "top_p")
    assert d.message == "stage %roll (generate): 'top_p' must be <= 1.0, got 1.5" and d.loc == roll.ir_loc


def test_verify_attribute_choices():
    m = compiled("grpo_tiny")
    m.graph.stage("adv").attrs["method"] = "ppo"
    assert the_error(m, "must be one of grpo, rloo, reinforce_pp").hint.endswith(
        "(one of grpo, rloo, reinforce_pp, reinforce_pp_baseline); e.g. method = grpo")


def test_verify_result_type():
    m = compiled("grpo_tiny")
    m.graph.stage("roll").outputs[0].type = ValueType("Rollout", 8)   # n = 4 samples per prompt -> 32
    d = the_error(m, "result %roll has type Rollout\\[8\\], expected Rollout\\[32\\]")
    assert "change the type to Rollout[32]" in d.hint


def test_verify_batch_mismatch():
    m = compiled("ppo_tiny")
    m.graph.stage("values").outputs[0].type = ValueType("TokenFloat", 8)
    msgs = [d.message for d in errors_of(m)]
    assert any("operands have different batch sizes [8, 16]" in s for s in msgs)


def test_verify_trained_twice():
    m = compiled("ppo_tiny")
    g = m.graph
    again = Stage("train", "actor", [g.values()["ppo_clip"]], [Value("again", ValueType("Metrics"))],
                  dict(g.stage("actor_train").attrs))
    g.stages.append(again)
    assert "epochs/minibatches" in the_error(m, "trained by two stages").hint


def test_verify_copy_cycle():
    m = compiled("ppo_tiny")
    m.models["actor"].init = Symbol("ref")                 # ref = copy(actor), actor = copy(ref)
    d = the_error(m, "copy cycle")
    assert d.message == "model @actor: copy cycle @actor -> @ref -> @actor"
    assert "random" in d.hint


def test_verify_copy_of_another_shape():
    m = compiled("ppo_tiny")
    m.models["ref"].layers = 3
    d = the_error(m, "copies @actor but their architectures differ")
    assert "(layers)" in d.message and d.hint


def test_verify_unknown_device_kind():
    m = compiled("ppo_7b")
    m.cluster.device = "A100-80G"
    d = the_error(m, "unknown device kind 'A100-80G'")
    assert d.hint.startswith("did you mean 'A100-80GB'?") and "H100-80GB" in d.hint


@pytest.mark.parametrize("mutate,pattern,hint", [
    (lambda m: setattr(m.cluster, "nodes", 0), "nodes must be a positive integer", "nodes = 2"),
    (lambda m: setattr(m.models["actor"], "arch", "lama"), "unknown architecture 'lama'", "did you mean 'llama'?"),
    (lambda m: setattr(m.models["actor"], "head", "values"), "unknown head 'values'", "did you mean 'value'?"),
    (lambda m: setattr(m.models["reward"], "heads", 5), "hidden \\(64\\) is not divisible by heads \\(5\\)", "try heads = 2 or 4 or 8"),
    (lambda m: setattr(m.models["reward"], "kv_heads", 3), "heads \\(4\\) is not divisible by kv_heads", "divides heads"),
    (lambda m: setattr(m.models["reward"], "vocab", "96"), "vocab must be a positive integer, got \"96\"", "vocab = 96"),
    (lambda m: setattr(m.models["reward"], "init", "zeros"), "init must be", 'init = "random"'),
    (lambda m: setattr(m.models["reward"], "init", "pretrained"), "needs a source folder", "source ="),
    (lambda m: setattr(m.models["reward"], "trainable", 1), "trainable must be true or false", "trainable = true"),
    (lambda m: setattr(m.models["ref"], "init", Symbol("actr")), "copies unknown model @actr", "did you mean"),
    (lambda m: setattr(m.data["prompts"], "kind", "csv"), "unknown kind 'csv'", "synthetic"),
    (lambda m: m.data["prompts"].options.update(max_length=3), "unknown synthetic option 'max_length'", "max_len"),
    (lambda m: m.data["prompts"].options.update(count="9"), "'count' must be a positive integer", "count = 1024"),
    (lambda m: setattr(m.run, "optimize", "O9"), "optimize must be one of O0, O1, O2, O3, got O9", "O1 is the default"),
    (lambda m: setattr(m.run, "steps", 0), "steps must be an integer >= 1", "steps = 1"),
    (lambda m: setattr(m.graph.stage("roll"), "target", "critc"), "unknown model @critc", "did you mean 'critic'?"),
    (lambda m: setattr(m.graph.stage("prompts"), "target", "eval"), "unknown data source @eval", "@prompts"),
    (lambda m: setattr(m.graph.stage("adv"), "target", "actor"), "compute.gae takes no model", "without a target"),
])
def test_verify_module_level_checks(mutate, pattern, hint):
    m = compiled("ppo_tiny")
    mutate(m)
    m.refresh_versions()
    assert hint in the_error(m, pattern).hint


@pytest.mark.parametrize("old,new,key,message", [
    ("heads = 4, kv_heads = 4", "heads = 3, kv_heads = 3", "heads", "hidden (64) is not divisible by heads (3)"),
    ("kv_heads = 4", "kv_heads = 3", "kv_heads", "heads (4) is not divisible by kv_heads (3)"),
    ('arch = "llama"', 'arch = "gpt2"', None, None),   # gpt2 with kv_heads = heads is fine ...
    ('arch = "llama", layers = 2, hidden = 64, heads = 4, kv_heads = 4',   # ... with fewer, it is not
     'arch = "gpt2", layers = 2, hidden = 64, heads = 4, kv_heads = 2', "kv_heads",
     "gpt2 has no grouped-query attention: kv_heads (2) must equal heads (4)"),
    ("layers = 2", "layers = 0", "layers", "layers must be a positive integer, got 0"),
])
def test_verify_bad_model_shape_points_at_the_rlir_field(old, new, key, message):
    text = compiled_text("ppo_tiny")     # keeps loc(...) of the .rlhf source: the diagnostic must not use it
    line = next(line for line in text.splitlines() if line.startswith("  model @reward "))
    bad = text.replace(line, line.replace(old, new, 1))
    module = parse_ir(bad, "x.rlir")
    if message is None:
        verify(module)
        return
    d = the_error(module, re.escape(message))
    assert d.message == message and "<function" not in d.message + d.hint
    assert (d.loc.file, d.loc.line, d.loc.col) == ("x.rlir", *_key_at(bad, "model @reward ", key))
    assert module.models["reward"].loc.file.endswith("ppo_tiny.rlhf")


def test_verify_field_without_a_position_names_the_entity():
    m = compiled("ppo_tiny")
    reward = m.models["reward"]
    reward.field_locs.clear()
    reward.heads = reward.kv_heads = 3
    d = the_error(m, "heads")
    assert d.message == "model @reward: hidden (64) is not divisible by heads (3)" and d.loc == reward.ir_loc


def test_verify_reports_every_problem_at_once():
    m = compiled("ppo_tiny")
    m.cluster.device = "tpu"
    m.graph.stage("roll").attrs["temprature"] = 0.5
    m.graph.versions.pop()
    assert len(errors_of(m)) == 3


def test_invalid_module_still_prints():
    m = compiled("ppo_tiny")
    m.models["actor"].arch = "lama"
    text = print_module(m)                       # no params comment for an invalid architecture
    assert 'arch = "lama"' in text and print_module(parse_ir(text)) == text


# -- graph API and op registry -----------------------------------------------------------------------------
def test_graph_edit_api():
    g = compiled("ppo_tiny").graph
    roll = g.values()["roll"]
    assert g.producer(roll) is g.stage("roll")
    assert {s.name for s in g.users(roll)} == {"logp", "ref_logp", "values", "scores", "ppo_clip", "value_loss"}
    assert [s.name for s in g.predecessors(g.stage("adv"))] == ["scores", "values", "logp", "ref_logp"]
    with pytest.raises(ValueError, match="still used"):
        g.remove(g.stage("logp"))
    assert g.fresh_name("roll") == "roll_1" and g.fresh_name("new") == "new"
    g.replace_all_uses(g.values()["ref_logp"], g.values()["logp"])
    assert not g.users(g.values()["ref_logp"])
    g.remove(g.stage("ref_logp"))
    assert "ref_logp" not in g.values()


def test_register_op_checks_the_spec():
    with pytest.raises(ValueError, match="unknown kind 'list'"):
        register_op(OpSpec("compute.bad", (), (Attr("xs", "list"),), ("TokenFloat",)))
    with pytest.raises(ValueError, match="unknown value type 'Tensor'"):
        register_op(OpSpec("compute.bad", (Operand("x", ("Tensor",)),), (), ("TokenFloat",)))
    with pytest.raises(ValueError, match="optional operands must come last"):
        register_op(OpSpec("compute.bad", (Operand("a", ("Rollout",), optional=True), Operand("b", ("Rollout",))),
                           (), ("TokenFloat",)))
    assert get_op("compute.bad") is None


def test_registered_custom_op_verifies_and_round_trips():
    spec = register_op(OpSpec("compute.test_length_bonus", (Operand("rollout", ("Rollout",)),),
                              (Attr("scale", "float", 1.0, min=0.0),), ("SeqFloat",)))
    try:
        m = compiled("ppo_tiny")
        g = m.graph
        stage = Stage(spec.op, None, [g.values()["roll"]], [Value("bonus", ValueType("SeqFloat", 16))],
                      {"scale": 0.5})
        g.insert(g.stages.index(g.stage("scores")) + 1, stage)
        verify(m)
        text = print_module(m)
        assert "%bonus = compute.test_length_bonus(%roll) {scale = 0.5} : SeqFloat[16]" in text
        assert print_module(parse_ir(text)) == text
    finally:
        from rlhfc.ir import ops
        ops._OPS.pop("compute.test_length_bonus", None)


def test_docs_describe_every_builtin_op():
    from rlhfc.ir.ops import BUILTIN_OPS, METHOD_OPS

    doc = (ROOT / "docs" / "ir.md").read_text()
    for op in {"load", *METHOD_OPS.values(), *BUILTIN_OPS.values()}:
        assert f"| `{op}` |" in doc, f"docs/ir.md lacks a row for op {op}"
