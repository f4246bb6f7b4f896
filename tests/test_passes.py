"""Pass infrastructure: the Pass base class, registry, option parsing, PassManager, pipelines, plugins."""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlhfc.frontend import load_file
from rlhfc.ir import CompileError, Module, Stage, Value, ValueType, VersionEdge, parse_ir, print_module, verify
from rlhfc.passes import (PIPELINES, Pass, PassFailure, PassManager, get_pass, load_plugin, parse_pipeline,
                          pipeline_for, register_pass, registered_passes, unregister_pass)

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "examples" / "custom_pass.py"


@functools.lru_cache(maxsize=None)
def _text(name: str) -> str:
    module, _, _ = load_file(str(ROOT / "examples" / f"{name}.rlhf"))
    return print_module(module)


def example(name: str = "ppo_tiny") -> Module:
    return parse_ir(_text(name))


# -- passes defined by the tests ----------------------------------------------------------------------
@dataclass(frozen=True)
class Raises(Pass):
    name = "test-raises"
    description = "a broken pass that raises"

    def run(self, module):
        raise RuntimeError("boom")


@dataclass(frozen=True)
class LeavesInvalidIR(Pass):
    name = "test-invalid"
    description = "a broken pass that drops the operand of the values stage"

    def run(self, module):
        module.graph.stage("values").inputs.pop()
        return module


@dataclass(frozen=True)
class Options(Pass):
    name = "test-options"
    description = "a pass with one option of each type"
    count: int = field(default=1, metadata={"doc": "how many"})
    ratio: float = 0.5
    label: str = "x"
    flag: bool = False
    limit: int | None = None

    def __post_init__(self):
        if self.count < 0:
            raise ValueError("count must be >= 0")

    def run(self, module):
        module.annotations["test_options"] = self.spec()
        return module


@dataclass(frozen=True)
class NeedsOption(Pass):
    name = "test-needs-option"
    description = "a pass with a required option"
    level: int

    def run(self, module):
        return module


TEST_PASSES = (Raises, LeavesInvalidIR, Options, NeedsOption)


@pytest.fixture
def test_passes():
    for cls in TEST_PASSES:
        register_pass(cls)
    yield
    for cls in TEST_PASSES:
        unregister_pass(cls.name)


@pytest.fixture(scope="module")
def clamp():
    load_plugin(str(PLUGIN))
    return get_pass("clamp-generation")


# -- base class and registry -----------------------------------------------------------------------------
def test_pass_options_are_dataclass_fields():
    assert [f.name for f in Options.options()] == ["count", "ratio", "label", "flag", "limit"]
    assert Options.option_help()[0] == ("count", "int", "1", "how many")
    assert Options.option_help()[4] == ("limit", "int | None", "none", "")
    assert NeedsOption.option_help() == [("level", "int", "(required)", "")]
    assert Options().spec() == "test-options"
    assert Options(count=3, flag=True).spec() == "test-options{count=3,flag=true}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().count = 2


def test_builtin_passes_are_registered_lazily():
    passes = registered_passes()
    assert "dce" in passes and passes["dce"].exact and passes["dce"].description
    assert get_pass("dce") is passes["dce"]


def test_unknown_pass_has_a_hint():
    with pytest.raises(CompileError) as info:
        get_pass("dec")
    (d,) = info.value.diagnostics
    assert d.message == "unknown pass 'dec'"
    assert d.hint.startswith("did you mean 'dce'?") and "rlhfc passes" in d.hint


def test_register_pass_rejects_mistakes(test_passes):
    @dataclass(frozen=True)
    class Nameless(Pass):
        pass

    with pytest.raises(ValueError, match="has no name"):
        register_pass(Nameless)

    class NotADataclass(Pass):
        name = "test-not-dataclass"

    with pytest.raises(ValueError, match="@dataclass"):
        register_pass(NotADataclass)

    @dataclass(frozen=True)
    class Impostor(Pass):
        name = "test-raises"

    with pytest.raises(ValueError, match="already registered"):
        register_pass(Impostor)

    @dataclass(frozen=True)
    class Shadow(Pass):
        name = "dce"

    with pytest.raises(ValueError, match="already registered|reserved"):
        register_pass(Shadow)
    register_pass(Raises)  # the same class again is fine


# -- pipeline strings -----------------------------------------------------------------------------------
def test_parse_pipeline_with_options(test_passes):
    passes = parse_pipeline(" dce , test-options{count=3, ratio=0.25,label=hi,flag=true,limit=none}, test-raises")
    assert [p.name for p in passes] == ["dce", "test-options", "test-raises"]
    assert passes[1] == Options(count=3, ratio=0.25, label="hi", flag=True, limit=None)
    assert parse_pipeline("test-options{limit=4}")[0].limit == 4
    assert parse_pipeline("") == []


@pytest.mark.parametrize("text,message,hint", [
    ("test-options{cont=3}", "pass test-options has no option 'cont'", "did you mean 'count'?"),
    ("dce{x=1}", "pass dce has no option 'x'", "dce takes no options"),
    ("test-options{count=many}", "option 'count' expects int, got 'many'", "test-options{count=8}"),
    ("test-options{ratio=big}", "option 'ratio' expects float, got 'big'", "ratio=0.5"),
    ("test-options{flag=maybe}", "option 'flag' expects bool, got 'maybe'", "flag=true"),
    ("test-options{count}", "option 'count' needs a value", "count=VALUE"),
    ("test-options{count=1,count=2}", "option 'count' given twice", "once"),
    ("test-options{count=-1}", "pass test-options: count must be >= 0", "rlhfc passes"),
    ("test-needs-option", "pass test-needs-option needs option 'level'", "test-needs-option{level=...}"),
    ("test-options{count=1", "unclosed '{'", "--passes"),
    ("dce}", "unbalanced '}'", "--passes"),
    ("{count=1}", "pass options without a pass name", "name{opt=value}"),
    ("nope", "unknown pass 'nope'", "rlhfc passes"),
])
def test_parse_pipeline_errors(test_passes, text, message, hint):
    with pytest.raises(CompileError) as info:
        parse_pipeline(text)
    (d,) = info.value.diagnostics
    assert message in d.message and hint in d.hint


# -- PassManager ----------------------------------------------------------------------------------------
def test_pass_manager_runs_in_order_and_records(test_passes):
    pm = PassManager(parse_pipeline("dce,test-options{count=2}"))
    out = pm.run(example())
    assert out.annotations["test_options"] == "test-options{count=2}"
    assert [r.spec for r in pm.records] == ["dce", "test-options{count=2}"]
    assert [r.changed for r in pm.records] == [False, True]
    assert pm.records[1].after == print_module(out)


def test_pass_that_raises_is_named_with_the_passes_before_it(test_passes):
    pm = PassManager(parse_pipeline("dce,test-options,test-raises"))
    with pytest.raises(PassFailure) as info:
        pm.run(example())
    d = info.value.diagnostics[0]
    assert d.message == "pass test-raises failed after [dce, test-options]: RuntimeError: boom"
    assert "bug in pass test-raises" in d.hint
    assert isinstance(info.value.__cause__, RuntimeError)


def test_pass_that_leaves_invalid_ir_is_caught_by_the_verifier(test_passes):
    pm = PassManager(parse_pipeline("dce,test-invalid"))
    with pytest.raises(PassFailure) as info:
        pm.run(example())
    head, *rest = info.value.diagnostics
    assert head.message == "pass test-invalid failed after [dce]: it left invalid IR"
    assert "--print-after test-invalid" in head.hint
    assert [d.message for d in rest] == ["stage %values (forward.values): expects 1 operands, got 0"]
    rendered = str(info.value)
    assert rendered.startswith("rlhfc: error: pass test-invalid failed after [dce]")


def test_pass_that_raises_a_compile_error_keeps_its_diagnostics(test_passes):
    @register_pass
    @dataclass(frozen=True)
    class Refuses(Pass):
        name = "test-refuses"

        def run(self, module):
            from rlhfc.ir import error
            raise error("this module has no GPUs", None, "use a GPU cluster")

    try:
        with pytest.raises(PassFailure) as info:
            PassManager(parse_pipeline("dce,test-refuses")).run(example())
        messages = [d.message for d in info.value.diagnostics]
        assert messages == ["pass test-refuses failed after [dce]", "this module has no GPUs"]
    finally:
        unregister_pass("test-refuses")


def test_verify_each_can_be_switched_off(test_passes):
    module = PassManager(parse_pipeline("test-invalid"), verify_each=False).run(example())
    with pytest.raises(CompileError):
        verify(module)


def test_invalid_input_is_reported_before_any_pass():
    m = example()
    m.graph.versions.clear()
    with pytest.raises(PassFailure) as info:
        PassManager(parse_pipeline("dce")).run(m)
    assert info.value.diagnostics[0].message == "the IR is invalid before the first pass"


def test_print_after(test_passes):
    seen = []
    pm = PassManager(parse_pipeline("dce,test-options{count=2}"), print_after={"test-options"},
                     printer=lambda spec, text: seen.append((spec, text)))
    out = pm.run(example())
    assert seen == [("test-options{count=2}", print_module(out))]
    seen.clear()
    PassManager(parse_pipeline("dce,test-options"), print_after={"*"},
                printer=lambda spec, text: seen.append(spec)).run(example())
    assert seen == ["dce", "test-options"]


def test_print_after_unknown_pass():
    with pytest.raises(CompileError, match="unknown pass 'dcee'"):
        PassManager([], print_after={"dcee"})


def test_print_after_defaults_to_stderr(capsys):
    PassManager(parse_pipeline("dce"), print_after={"dce"}).run(example())
    err = capsys.readouterr().err
    assert err.startswith("// ----- IR after dce -----\nmodule @ppo_tiny {")


# -- -O levels --------------------------------------------------------------------------------------------
def test_pipelines_are_defined_for_every_level():
    assert list(PIPELINES) == ["O0", "O1", "O2", "O3"]
    assert PIPELINES["O0"] == []
    for lower, higher in (("O1", "O2"), ("O2", "O3")):
        assert set(PIPELINES[lower]) <= set(PIPELINES[higher])
    passes = registered_passes()
    for level, items in PIPELINES.items():
        assert [p.name for p in pipeline_for(level)] == [i.partition("{")[0] for i in items]   # options parse
        for name in (i.partition("{")[0] for i in items):
            assert name in passes, f"{level} names unregistered pass {name}"
            if level != "O3":
                assert passes[name].exact, f"{level} may only hold exact passes; {name} changes training"


def test_pipeline_for_spellings():
    assert [p.name for p in pipeline_for("O1")] == PIPELINES["O1"]
    assert [p.name for p in pipeline_for("2")] == [i.partition("{")[0] for i in PIPELINES["O2"]]
    assert [p.name for p in pipeline_for("o3")] == [i.partition("{")[0] for i in PIPELINES["O3"]]
    with pytest.raises(CompileError) as info:
        pipeline_for("O7")
    assert info.value.diagnostics[0].hint.startswith("levels: O0, O1, O2, O3")


# -- dce --------------------------------------------------------------------------------------------------
def _add_unused_chain(m: Module) -> None:
    g = m.graph
    roll = g.values()["roll"]
    ref = Stage("forward.logprobs", "actor", [roll], [Value("extra_logp", ValueType("TokenFloat", 16))],
                {"temperature": 1.0})
    kl = Stage("compute.kl_penalty", None, [g.values()["scores"], ref.outputs[0], g.values()["ref_logp"]],
               [Value("extra_kl", ValueType("TokenFloat", 16))], {"coef": 0.1, "estimator": "k1"})
    at = g.stages.index(g.stage("adv"))
    g.insert(at, ref)
    g.insert(at + 1, kl)
    m.refresh_versions()
    verify(m)


def test_dce_removes_unused_stages_and_their_producers():
    m = example()
    before = print_module(m)
    _add_unused_chain(m)
    assert VersionEdge("actor", "actor_train", "extra_logp", 1) in m.graph.versions
    out = PassManager(parse_pipeline("dce")).run(m)
    assert print_module(out) == before


def test_dce_keeps_train_stages_and_is_idempotent():
    m = example()
    out = PassManager(parse_pipeline("dce,dce")).run(m)
    assert [s.name for s in out.graph.stages if s.op == "train"] == ["actor_train", "critic_train"]
    assert print_module(out) == _text("ppo_tiny")


# -- plugins and the example custom pass ------------------------------------------------------------------
def test_custom_pass_from_python(clamp):
    assert clamp.name == "clamp-generation" and not clamp.exact
    m = example("ppo_7b")
    before = print_module(m).splitlines()
    out = PassManager([clamp(max_new_tokens=8)]).run(m)
    after = print_module(out).splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1                   # updates nothing else
    assert "max_new_tokens = 512" in changed[0][0] and "max_new_tokens = 8" in changed[0][1]


def test_custom_pass_leaves_shorter_generation_alone(clamp):
    m = example("grpo_tiny")
    out = PassManager(parse_pipeline("clamp-generation{max_new_tokens=64}")).run(m)
    assert print_module(out) == _text("grpo_tiny")


def test_custom_pass_rejects_a_bad_option(clamp):
    with pytest.raises(CompileError, match="max_new_tokens must be >= 1"):
        parse_pipeline("clamp-generation{max_new_tokens=0}")


def test_loading_the_plugin_twice_is_fine(clamp):
    load_plugin(str(PLUGIN))
    assert get_pass("clamp-generation").name == "clamp-generation"


def test_plugin_by_module_name(tmp_path, monkeypatch):
    (tmp_path / "my_rlhfc_plugin.py").write_text(
        "from dataclasses import dataclass\n"
        "from rlhfc.passes import Pass, register_pass\n\n"
        "@register_pass\n@dataclass(frozen=True)\n"
        "class Tag(Pass):\n"
        "    name = 'test-tag'\n    description = 'tag the module'\n    value: str = 'v'\n\n"
        "    def run(self, module):\n        module.annotations['tag'] = self.value\n        return module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        load_plugin("my_rlhfc_plugin")
        out = PassManager(parse_pipeline("test-tag{value=hello}")).run(example())
        assert 'module @ppo_tiny annot {tag = "hello"} {' in print_module(out)
    finally:
        unregister_pass("test-tag")
        sys.modules.pop("my_rlhfc_plugin", None)


@pytest.mark.parametrize("spec,content,message", [
    ("no_such_rlhfc_plugin_module", None, "cannot import plugin 'no_such_rlhfc_plugin_module'"),
    ("missing/plugin.py", None, "plugin file not found"),
    ("broken.py", "raise RuntimeError('bad plugin')\n", "failed to load: RuntimeError: bad plugin"),
    ("syntax.py", "def (:\n", "failed to load: SyntaxError"),
])
def test_plugin_errors(tmp_path, spec, content, message):
    if content is not None:
        (tmp_path / spec).write_text(content)
        spec = str(tmp_path / spec)
    with pytest.raises(CompileError) as info:
        load_plugin(spec)
    assert message in info.value.diagnostics[0].message and info.value.diagnostics[0].hint


def _docstring_blocks() -> tuple[list[str], str]:
    """The shell commands and the Python block of examples/custom_pass.py's docstring."""
    import ast

    doc = ast.get_docstring(ast.parse(PLUGIN.read_text()))
    shell = doc.split("From the command line", 1)[1].split("From Python", 1)[0]
    commands = [c.split("#")[0].strip() for c in shell.replace("\\\n", " ").splitlines()
                if c.strip().startswith("rlhfc ")]
    python = doc.split("From Python", 1)[1].split("::", 1)[1].split("How to write your own", 1)[0]
    return commands, "\n".join(line[4:] for line in python.splitlines())


def test_custom_pass_docstring_python_usage_runs(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _, code = _docstring_blocks()
    exec(compile(code, "custom_pass docstring", "exec"), {})
    assert "max_new_tokens = 8," in capsys.readouterr().out


def test_custom_pass_docstring_commands_run(monkeypatch, capsys):
    import shlex

    from rlhfc.cli import main

    monkeypatch.chdir(ROOT)
    commands, _ = _docstring_blocks()
    assert len(commands) == 3
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
    out = capsys.readouterr().out
    assert "max_new_tokens = 8," in out and "max_new_tokens = 64," in out and "clamp-generation " in out


def test_pass_that_leaves_malformed_ir(test_passes):
    @register_pass
    @dataclass(frozen=True)
    class Garbage(Pass):
        name = "test-garbage"

        def run(self, module):
            module.graph.stage("logp").inputs = ["roll"]        # a name, not the Value
            module.graph.stage("values").attrs = None            # not even a dict
            return module

    try:
        with pytest.raises(PassFailure) as info:
            PassManager(parse_pipeline("test-garbage")).run(example())
        assert info.value.diagnostics[0].message.startswith("pass test-garbage failed after []: it left")
    finally:
        unregister_pass("test-garbage")
