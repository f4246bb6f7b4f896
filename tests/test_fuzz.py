"""Fuzzing the compiler's user-facing edges: programs, data files and command lines.

Three fuzzers, each driving the real entry point in-process (:func:`rlhfc.cli.main`, the function behind
the ``rlhfc`` command) and judging only what a user sees — the exit status and the text on stderr:

* **programs** — every ``examples/*.rlhf`` (and a variant that reads a JSONL file) gets one to three
  grammar-aware token edits: delete / duplicate / swap lines and tokens; a number becomes 0, -1, huge, a
  float or a size; a name becomes another name of its kind in the program (a model for a model, a keyword
  argument for a keyword argument, …); a brace or parenthesis is dropped; a string becomes another string
  or a path (missing, a folder, a bad data file, a rule target); a keyword argument is deleted, doubled or
  given a value of another kind; a line of another example is spliced in. Each is run through
  ``rlhfc check``: exit 0, or exit 2 with diagnostics that each start ``file:line:col`` and end in a
  ``hint:`` line — never a traceback or an internal error (exit 3).
* **data files** — the JSONL prompt file the JSONL variant reads is cut mid-line, given values of the
  wrong type, bytes that are not UTF-8, nothing at all, over-long prompts, deep nesting, lone surrogates …
  ``rlhfc check`` must report a bad file as a located diagnostic, the job's own loader
  (:func:`rlhfc.runtime.data.prompts.prompt_source_from_spec`, what a run reads) as a ``DataError``, and the two
  must agree on which files are good.
* **command lines** — random argv built from the real option set of every command (click's parameters),
  with good and bad values and arguments: exit 0, 1 or 2 with a message, never 3. ``run`` stops before
  training (``run_job`` is replaced by a recorder) and ``profile`` before measuring.

Seeds are fixed (a failure prints its seed, the edit and the output; rerun it by its test id).
``--fuzz-n N`` (tests/conftest.py) sets the number of programs: 2000 in CI, e.g. 10000 locally; the data
and command-line fuzzers scale with it.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
from pathlib import Path

import pytest

from rlhfc.cli import app, main
from rlhfc.contract.plan import load_plan

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.rlhf"))
CHUNK = 500            # programs per test case (each case has its own seed)
GOOD_PROMPTS = ["hello there", "what is two plus two", "abc", "write a poem", "é and ü", "x" * 20,
                "tell me a story", "count: 1 2 3"]


# -- running the CLI in-process and judging its output ---------------------------------------------------
def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``rlhfc ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


_HEADER = re.compile(r"^(?P<where>\S.*?): (?P<sev>error|warning|note): ")
_LOC = re.compile(r"^(?P<file>.+):(?P<line>\d+):(?P<col>\d+)$")


def diagnostics_problem(err: str, file: str, n_lines: int) -> str | None:
    """What is wrong with the diagnostics on stderr of ``rlhfc check FILE`` (None: nothing): each must
    start ``FILE:LINE:COL: severity:`` inside the file, an error must carry a ``hint:`` line, and no line
    may be a traceback or an internal error."""
    if "Traceback" in err or "internal error" in err:
        return "a traceback or internal error"
    diags: list[tuple[re.Match, list[str]]] = []
    for line in err.splitlines():
        m = _HEADER.match(line)
        if m:
            diags.append((m, []))
        elif diags:
            diags[-1][1].append(line)
    if not diags:
        return "exit 2 without a diagnostic"
    for m, body in diags:
        where = _LOC.match(m["where"])
        if where is None or where["file"] != file:
            return f"a diagnostic without a location in {file}: {m.string!r}"
        if not (1 <= int(where["line"]) <= n_lines + 1 and int(where["col"]) >= 1):
            return f"a location outside the file: {m.string!r}"
        if m["sev"] == "error" and not any(b.startswith("  hint: ") for b in body):
            return f"an error without a hint: {m.string!r}"
    return None


def check_program(folder: Path, text: str, name: str = "prog.rlhf") -> tuple[str, str | None]:
    """Write ``text`` to FOLDER/NAME and run ``rlhfc check NAME`` there: ("ok" | "error", None) when the
    outcome is acceptable, else ("bug", what went wrong and the output)."""
    (folder / name).write_bytes(text.encode("utf-8", "surrogatepass"))
    code, out, err = run_cli(["check", name])
    if code == 0:
        if not err.rstrip().endswith("stages)"):
            return "bug", f"exit 0 without 'ok':\n{err}"
        problem = diagnostics_problem(err, name, text.count("\n") + 1) if _HEADER.search(err) else None
        return ("bug", f"{problem}:\n{err}") if problem else ("ok", None)
    if code != 2:
        return "bug", f"exit {code}:\n{err}"
    problem = diagnostics_problem(err, name, text.count("\n") + 1)
    return ("bug", f"{problem}:\n{err}") if problem else ("error", None)


# -- the fixture folder: data files and model folders the mutated paths point at --------------------------
def jsonl_variant(text: str) -> str:
    """``ppo_tiny`` reading its prompts from ``prompts.jsonl``."""
    new = re.sub(r"synthetic\([^)]*\)", 'jsonl("prompts.jsonl", field = "prompt")', text)
    assert new != text
    return new


@pytest.fixture()
def world(tmp_path, monkeypatch):
    """A folder with the files mutated programs may name, as the current folder."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in GOOD_PROMPTS))
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "ok"}\n{"prompt": \xff}\n')
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "folder").mkdir()
    (tmp_path / "rules.py").write_text("def reward(prompt, response):\n    return 0.0\n")
    for data in (ROOT / "examples").glob("*.jsonl"):   # the examples' own data files (arith_tiny.jsonl)
        shutil.copy(data, tmp_path / data.name)
    shutil.copy(ROOT / "examples" / "agent_lookup.py", tmp_path / "agent_lookup.py")   # agent_tiny's environment
    fixtures = ROOT / "tests" / "bad" / "fixtures"
    for name in ("no_tokenizer", "bad_heads", "big_tokenizer"):
        if (fixtures / name).is_dir():
            shutil.copytree(fixtures / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- program mutations -----------------------------------------------------------------------------------
_TOKEN = re.compile(r'(?P<comment>#[^\n]*)|(?P<string>"(?:[^"\\\n]|\\.)*")'
                    r"|(?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?[KMGBT]?|\.\d+(?:[eE][-+]?\d+)?)"
                    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<punct>[^\s])")
KEYWORDS = {"cluster", "model", "data", "pipeline", "run", "trainable", "frozen", "true", "false"}
NUMBERS = ["0", "-1", "1", "2", "3", "7", "64", "-0", "0.0", "0.5", "1.5", "-2.5", "1e-12", "1e308", "1e309",
           "99999999999999999999", "4294967297", "7B", "0B", "1.5K", "3T", "2e5", ".5"]
STRINGS = ['""', '"prompts.jsonl"', '"missing.jsonl"', '"bad.jsonl"', '"empty.jsonl"', '"folder"', '"."', '"/"',
           '"/dev/null"', '"../prompts.jsonl"', '"no_tokenizer"', '"bad_heads"', '"big_tokenizer"',
           '"rules:reward"', '"rules:nope"', '"os:system"', '"builtins:print"', '"rlhfc.runtime.rewards:nope"',
           '"rlhfc.runtime.rewards:vowel_count"', '"a:b:c"', '":"', '"H100-80GB"', '"cpu"', '"prompt"',
           '"text"', '"\\q"', '"\\u00e9"', '"é"', '"\\x00"', '"' + "z" * 300 + '"']


class Scope:
    """The names of a program by kind: declared (models, data, pipeline values), keyword-argument names,
    method names, function names, setting names; what a grammar-aware edit swaps a name for."""

    def __init__(self, toks: list[re.Match]):
        kinds: dict[str, set[str]] = {k: set() for k in ("declared", "kwarg", "method", "func", "other")}
        for i, t in enumerate(toks):
            if t.lastgroup != "name" or t.group() in KEYWORDS:
                continue
            prev = toks[i - 1].group() if i else ""
            nxt = toks[i + 1].group() if i + 1 < len(toks) else ""
            if prev in ("model", "data", "pipeline", "cluster") or (nxt in ("=", ",") and prev in ("{", "}", ",", "")):
                kinds["declared" if nxt != "=" or prev in ("model", "data") else "kwarg"].add(t.group())
            elif nxt == "=":
                kinds["kwarg"].add(t.group())
            elif prev == ".":
                kinds["method"].add(t.group())
            elif nxt == "(":
                kinds["func"].add(t.group())
            else:
                kinds["other"].add(t.group())
        self.kinds = {k: sorted(v) for k, v in kinds.items()}
        self.all = sorted(set().union(*kinds.values()))

    def like(self, name: str, rng: random.Random) -> str:
        same = next((v for v in self.kinds.values() if name in v and len(v) > 1), None)
        if same and rng.random() < 0.8:
            return rng.choice(same)
        return rng.choice(self.all + sorted(KEYWORDS))


def _tokens(text: str) -> list[re.Match]:
    return [m for m in _TOKEN.finditer(text) if m.lastgroup != "comment"]


def _splice(text: str, a: int, b: int, new: str) -> str:
    return text[:a] + new + text[b:]


def _kwarg_spans(text: str) -> list[tuple[int, int]]:
    """``name = value`` inside a call's parentheses (with a trailing comma when there is one)."""
    return [m.span() for m in re.finditer(r"\b[A-Za-z_]\w*\s*=\s*(?:\"[^\"\n]*\"|[^,()\n;{}]+)(?:,\s*)?", text)
            if text[:m.start()].count("(") > text[:m.start()].count(")")]


def mutate_once(text: str, rng: random.Random, others: list[str]) -> tuple[str, str]:
    """One grammar-aware edit of ``text``: (new text, what was done)."""
    toks = _tokens(text)
    lines = text.split("\n")
    op = rng.randrange(15)
    if op == 0 and len(lines) > 1:
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i] + lines[i + 1:]), f"delete line {i + 1}"
    if op == 1:
        i = rng.randrange(len(lines))
        return "\n".join(lines[:i + 1] + lines[i:]), f"duplicate line {i + 1}"
    if op == 2 and len(lines) > 1:
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines), f"swap lines {i + 1} and {j + 1}"
    if not toks:
        return text + "\n}", "append a brace"
    t = rng.choice(toks)
    if op == 3:
        return _splice(text, *t.span(), ""), f"delete token {t.group()!r} at {t.start()}"
    if op == 4:
        return _splice(text, t.start(), t.start(), t.group() + " "), f"duplicate token {t.group()!r} at {t.start()}"
    if op == 5:
        i = toks.index(t)
        if i + 1 < len(toks):
            u = toks[i + 1]
            return (text[:t.start()] + u.group() + text[t.end():u.start()] + t.group() + text[u.end():],
                    f"swap tokens {t.group()!r} and {u.group()!r} at {t.start()}")
    numbers = [m for m in toks if m.lastgroup == "number"]
    if op in (6, 7) and numbers:
        n = rng.choice(numbers)
        new = rng.choice(NUMBERS)
        return _splice(text, *n.span(), new), f"number {n.group()!r} at {n.start()} -> {new}"
    names = [m for m in toks if m.lastgroup == "name"]
    if op in (8, 9) and names:
        n = rng.choice(names)
        new = Scope(toks).like(n.group(), rng)
        return _splice(text, *n.span(), new), f"name {n.group()!r} at {n.start()} -> {new}"
    brackets = [m for m in toks if m.group() in "{}()[]"]
    if op == 10 and brackets:
        b = rng.choice(brackets)
        return _splice(text, *b.span(), ""), f"drop {b.group()!r} at {b.start()}"
    strings = [m for m in toks if m.lastgroup == "string"]
    if op == 11 and strings:
        s = rng.choice(strings)
        new = rng.choice(STRINGS)
        return _splice(text, *s.span(), new), f"string {s.group()} at {s.start()} -> {new[:40]}"
    kwargs = _kwarg_spans(text)
    if op == 12 and kwargs:
        a, b = rng.choice(kwargs)
        how = rng.randrange(3)
        if how == 0:
            return _splice(text, a, b, ""), f"delete argument {text[a:b]!r}"
        if how == 1:
            return _splice(text, a, a, text[a:b].rstrip().rstrip(",") + ", "), f"double argument {text[a:b]!r}"
        value = rng.choice(["true", "false", "[1, 2]", "[]", '"x"', "prompts", "actor", "cpu:2", "O2", "-1", "1.5"])
        key = text[a:b].split("=", 1)[0]
        tail = "," if text[a:b].rstrip().endswith(",") else ""
        return _splice(text, a, b, f"{key}= {value}{tail} "), f"argument {key.strip()} = {value}"
    if op == 13 and others:
        donor = rng.choice(others).split("\n")
        line = rng.choice(donor)
        i = rng.randrange(len(lines) + 1)
        return "\n".join(lines[:i] + [line] + lines[i:]), f"insert {line!r} at line {i + 1}"
    # insert a random token from the program somewhere (or a stray character)
    pos = rng.randrange(len(text) + 1)
    new = rng.choice([m.group() for m in toks] + list("{}()[],;:=.-\"#") + ["\x00", "\t", "é", "\r"])
    return _splice(text, pos, pos, new), f"insert {new!r} at {pos}"


def mutate_program(text: str, rng: random.Random, others: list[str]) -> tuple[str, list[str]]:
    """One to three edits."""
    done = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        text, what = mutate_once(text, rng, others)
        done.append(what)
    return text, done


def program_sources() -> list[tuple[str, str]]:
    sources = [(p.name, p.read_text()) for p in EXAMPLES]
    tiny = dict(sources)["ppo_tiny.rlhf"]
    return sources + [("ppo_tiny_jsonl.rlhf", jsonl_variant(tiny))]


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("fuzz_n")
    if "program_chunk" in metafunc.fixturenames:
        metafunc.parametrize("program_chunk", range(max(1, -(-n // CHUNK))))


def test_fuzz_programs(world, program_chunk, request):
    """``rlhfc check`` on CHUNK mutated programs (the last chunk: what is left of --fuzz-n)."""
    n = request.config.getoption("fuzz_n")
    count = min(CHUNK, n - program_chunk * CHUNK)
    rng = random.Random(17_000 + program_chunk)
    sources = program_sources()
    texts = [t for _, t in sources]
    outcomes = {"ok": 0, "error": 0}
    failures = []
    for i in range(count):
        name, original = sources[i % len(sources)]
        text, edits = mutate_program(original, rng, texts)
        outcome, problem = check_program(world, text)
        if outcome == "bug":
            failures.append(f"--- program {i} of chunk {program_chunk} ({name}; {'; '.join(edits)}): {problem}"
                            f"--- program:\n{text}")
        else:
            outcomes[outcome] += 1
    assert not failures, f"{len(failures)} of {count} programs broke `rlhfc check`; first:\n" + "\n".join(failures[:3])
    if count >= 100:   # the edits must exercise both outcomes, or the test proves little
        assert outcomes["error"] > count // 4 and outcomes["ok"] > count // 20, outcomes


def test_unmutated_sources_check(world):
    for name, text in program_sources():
        assert check_program(world, text) == ("ok", None), name


# -- data files ------------------------------------------------------------------------------------------
def _line(prompt) -> bytes:
    return json.dumps({"prompt": prompt}).encode() + b"\n"


def mutate_data(rng: random.Random) -> tuple[bytes, str]:
    """A prompt file as a user (or a crash) might leave it: (bytes, what was done)."""
    lines = [_line(p) for p in GOOD_PROMPTS]
    op = rng.randrange(16)
    i = rng.randrange(len(lines))
    if op == 0:                                                     # the file cut off at some byte
        data = b"".join(lines)
        k = rng.randrange(len(data) + 1)
        return data[:k], f"truncate the file at byte {k}"
    if op == 1:                                                     # one line cut off
        k = rng.randrange(len(lines[i]))
        lines[i] = lines[i][:k] + b"\n"
        return b"".join(lines), f"cut line {i + 1} at byte {k}"
    if op == 2:                                                     # a value of another type
        value = rng.choice([5, -1.5, None, True, [], ["a"], {}, {"prompt": "x"}, 1e300])
        lines[i] = _line(value)
        return b"".join(lines), f"line {i + 1}: prompt {value!r}"
    if op == 3:                                                     # a line that is not an object
        lines[i] = rng.choice([b'"just a string"', b"42", b"[1, 2]", b"null", b"true", b"NaN", b"-Infinity",
                               b"{}", b"{\"text\": \"x\"}", b"{\"prompt\": \"a\"} trailing", b"{\"prompt\": \"a\"}{}"]) + b"\n"
        return b"".join(lines), f"line {i + 1}: {lines[i]!r}"
    if op == 4:                                                     # bytes that are not UTF-8
        bad = rng.choice([b"\xff", b"\xc3", b"\x80", b"\xe9", b"\xed\xa0\x80", b"\xf5\x80\x80\x80"])
        k = rng.randrange(len(lines[i]))
        lines[i] = lines[i][:k] + bad + lines[i][k:]
        return b"".join(lines), f"line {i + 1}: {bad!r} at byte {k}"
    if op == 5:
        return rng.choice([b"", b"\n", b"\n\n  \n", b"\xef\xbb\xbf", b"\x00", b"   "]), "an empty file"
    if op == 6:                                                     # a prompt too long for max_seq
        lines[i] = _line("long prompt " * rng.choice([3, 10, 100, 5000]))
        return b"".join(lines), f"line {i + 1}: a long prompt"
    if op == 7:                                                     # deep nesting
        depth = rng.choice([10, 1000, 100_000])
        lines[i] = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}\n"
        return b"".join(lines), f"line {i + 1}: nested {depth} deep"
    if op == 8:                                                     # escapes JSON allows but text does not
        esc = rng.choice(["\\ud800", "\\udfff", "\\u0000", "\\ud83d\\ude00", "\\uffff", "\\u2028", "\\t\\n"])
        lines[i] = b'{"prompt": "a' + esc.encode() + b'b"}\n'
        return b"".join(lines), f"line {i + 1}: escape {esc}"
    if op == 9:
        return b"".join(ln.rstrip(b"\n") + b"\r\n" for ln in lines), "CRLF line ends"
    if op == 10:
        return b"\xef\xbb\xbf" + b"".join(lines) + b"\xef\xbb\xbf" + lines[0], "byte-order marks"
    if op == 11:                                                    # raw control and odd characters
        ch = rng.choice(["\x00", "\x1b", "\u2028", "\u00a0", "\U0001f600", "\u0301", "\r"])
        lines[i] = json.dumps({"prompt": "a" + ch + "b"}, ensure_ascii=False).encode() + b"\n"
        return b"".join(lines), f"line {i + 1}: character {ch!r}"
    if op == 12:                                                    # an empty prompt
        lines[i] = _line(rng.choice(["", " ", "\n"]))
        return b"".join(lines), f"line {i + 1}: an empty prompt"
    if op == 13:                                                    # a duplicate key
        lines[i] = b'{"prompt": "a", "prompt": ' + rng.choice([b'"b"', b"7", b"null"]) + b"}\n"
        return b"".join(lines), f"line {i + 1}: a duplicate key"
    if op == 14:                                                    # lines deleted, doubled, shuffled
        rng.shuffle(lines)
        return b"".join(lines[:rng.randrange(len(lines) + 1)] * rng.choice([1, 2])), "lines shuffled and cut"
    k = rng.randrange(len(lines[i]))                                # a random byte changed
    line = bytearray(lines[i])
    line[k] = rng.randrange(256)
    lines[i] = bytes(line)
    return b"".join(lines), f"line {i + 1}: byte {k} -> {line[k]:#x}"


@pytest.fixture()
def jsonl_spec(world) -> dict:
    """The data spec a compiled job of the JSONL variant reads (plan.json's ``data.prompts``)."""
    (world / "prog.rlhf").write_text(jsonl_variant((ROOT / "examples" / "ppo_tiny.rlhf").read_text()))
    code, _, err = run_cli(["compile", "prog.rlhf", "-O0", "--emit", "job", "-o", "jsonl_job"])
    assert code == 0, err
    spec = load_plan(str(world / "jsonl_job" / "plan.json")).data["prompts"].as_spec()
    assert spec["kind"] == "jsonl" and spec.get("fit"), spec
    return spec


def test_fuzz_data_files(world, jsonl_spec, request):
    """A mutated prompt file: ``rlhfc check`` reports a bad one at the program's ``jsonl(...)`` with a hint,
    the job's loader raises a DataError, and the two agree on which files are good."""
    from rlhfc.runtime.data.prompts import DataError, prompt_source_from_spec

    n = max(50, request.config.getoption("fuzz_n") // 20)
    rng = random.Random(1717)
    program = jsonl_variant((ROOT / "examples" / "ppo_tiny.rlhf").read_text())
    spec = {**jsonl_spec, "path": str(world / "prompts.jsonl")}
    failures, verdicts = [], {"good": 0, "bad": 0}
    for i in range(n):
        data, what = mutate_data(rng)
        (world / "prompts.jsonl").write_bytes(data)
        outcome, problem = check_program(world, program)
        try:
            prompt_source_from_spec(spec)
            loaded, why = True, None
        except DataError as exc:
            loaded, why = False, exc.message
        except Exception as exc:   # noqa: BLE001 - the job's loader must only raise DataError
            failures.append(f"--- data {i} ({what}): the job's loader raised {type(exc).__name__}: {exc}")
            loaded, why = None, None
        if outcome == "bug":
            failures.append(f"--- data {i} ({what}): check: {problem}")
        elif loaded is not None and (outcome == "ok") != loaded:
            failures.append(f"--- data {i} ({what}): check says {outcome}, the job's loader "
                            f"{'reads it' if loaded else 'refuses it: ' + str(why)}")
        verdicts["good" if loaded else "bad"] += 1
    assert not failures, f"{len(failures)} of {n} data files; first:\n" + "\n".join(failures[:5])
    assert verdicts["good"] > n // 10 and verdicts["bad"] > n // 4, verdicts


# -- command lines ---------------------------------------------------------------------------------------
def _option_values(world: Path) -> dict[str, list[str]]:
    from rlhfc.explain import FORMATS
    from rlhfc.ir.plan import PLACEMENTS
    from rlhfc.passes import registered_passes

    passes = list(registered_passes())
    programs = ["prog.rlhf", "grpo.rlhf", "bad.rlhf", "missing.rlhf", "folder", "job", "prog.rlir", "", "-",
                "prompts.jsonl", "/dev/null", "bad.rlir"]
    outputs = ["o.txt", "outdir", "folder", "missing_dir/o", "prompts.jsonl", "/dev/null", "", "run_a", "run_b"]
    return {
        "file": programs, "target": programs,
        "-O": ["0", "1", "2", "3", "O2", "o1", "4", "-1", "x", "", "O"],
        "--passes": passes + ["dce,stream", "nope", "", ",", "stream{chunk=4}", "stream{chunk=-1}", "stream{x=1}",
                              "placement{strategy=search}", "{", "dce,,dce", "dce{", "clamp-generation{max_new_tokens=4}"],
        "--emit": ["ir", "job", "x", ""],
        "-o": outputs, "--out": outputs,
        "--plugin": ["custom_pass.py", "nope_module_xyz", "json", "missing.py", "boom.py", "rules.py", ""],
        "--print-after": passes + ["nope", "*", ""],
        "--placement": list(PLACEMENTS) + ["x", ""],
        "--steps": ["1", "2", "0", "-1", "abc", "1e3", "99999999999999999999", "50", "51", ""],
        "--ray-address": ["auto", "127.0.0.1:1", ""],
        "--format": list(FORMATS) + ["x", ""],
        "run": ["trained", "missing", "folder", "job", "prog.rlhf", ""],   # export and plot
        "--step": ["2", "1", "0", "-1", "x", ""], "--model": ["actor", "ref", "nope", ""],
        "--job": ["job", "folder", "missing", "trained"],
        "--profile": ["missing.json", "prompts.jsonl", "folder", "empty.jsonl", ""],
        "--response-lengths": ["auto", "max", "geometric:0.5", "geometric:x", "geometric:0", "geometric:1.5",
                               "lognormal:0.25:1.0", "lognormal:", "lognormal:1:-1", "x", ""],
        "--threads": ["1", "0", "-1", "x", ""],
    }


def random_argv(rng: random.Random, commands: dict, values: dict[str, list[str]]) -> list[str]:
    """A command line of a random command (sometimes none, or a misspelt one) with random options."""
    r = rng.random()
    if r < 0.05:
        return rng.choice([[], ["--version"], ["--help"], ["chek", "prog.rlhf"], ["-O2"], ["--nope"], ["--"]])
    name = rng.choice(sorted(commands))
    argv = [name]
    params = commands[name].params
    for p in params:
        if p.param_type_name == "argument" and rng.random() < 0.93:
            argv.append(rng.choice(values.get(p.name, ["prog.rlhf"])))
    options = [p for p in params if p.param_type_name == "option"]
    for _ in range(rng.choice((0, 1, 1, 2, 2, 3, 4))):
        p = rng.choice(options)
        flag = rng.choice(p.opts)
        if p.is_flag:
            argv.append(flag)
            continue
        pool = next((values[o] for o in p.opts if o in values), ["x"])
        if rng.random() < 0.04:             # an option without its value
            argv.append(flag)
        elif flag.startswith("--") and rng.random() < 0.2:
            argv.append(f"{flag}={rng.choice(pool)}")
        else:
            argv += [flag, rng.choice(pool)]
    if rng.random() < 0.08:                 # a stray word or option
        argv.insert(rng.randrange(1, len(argv) + 1), rng.choice(["--nope", "-X", "extra", "--steps", "-O", "--help"]))
    return argv


class _FakeProfile:
    device_kind, device_name, models, host, threads = "cpu", "fuzz", {}, {}, 1

    def save(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("{}")


@pytest.fixture()
def cli_world(world, monkeypatch):
    """The world, plus what command lines name: programs, a job folder, plugins; ``run`` and ``profile``
    stop where the training or the measuring would start."""
    import rlhfc.calibrate
    import rlhfc.runtime.job

    tiny = (ROOT / "examples" / "ppo_tiny.rlhf").read_text()
    (world / "prog.rlhf").write_text(tiny)
    (world / "grpo.rlhf").write_text((ROOT / "examples" / "grpo_tiny.rlhf").read_text())
    (world / "bad.rlhf").write_text(tiny.replace("critic.values", "critic.valuez"))
    (world / "bad.rlir").write_text("module {\n  nonsense\n")
    shutil.copy(ROOT / "examples" / "custom_pass.py", world / "custom_pass.py")
    (world / "boom.py").write_text("raise RuntimeError('this plugin fails on import')\n")
    code, ir, err = run_cli(["compile", "prog.rlhf", "-O1"])
    assert code == 0, err
    (world / "prog.rlir").write_text(ir)
    assert run_cli(["compile", "prog.rlhf", "-O1", "--emit", "job", "-o", "job"])[0] == 0
    _trained_run(world / "trained")
    calls = []
    monkeypatch.setattr(rlhfc.runtime.job, "run_job", lambda job_dir, **kw: calls.append((job_dir, kw)) or [])
    monkeypatch.setattr(rlhfc.calibrate, "run_profile", lambda module, **kw: _FakeProfile())
    monkeypatch.setenv("RLHFC_CACHE_DIR", str(world / "cache"))
    return world, calls


def _trained_run(run: Path) -> None:
    """A run folder ``export`` and ``plot`` can read: metrics and a checkpoint of one tiny policy."""
    from rlhfc.runtime.models.build import build_model, save_weights

    spec = {"arch": "llama", "layers": 1, "hidden": 8, "heads": 2, "vocab": 16, "max_seq": 16, "head": "lm"}
    (run / "checkpoints" / "step_2" / "actor").mkdir(parents=True)
    save_weights(build_model(spec), str(run / "checkpoints" / "step_2" / "actor" / "weights.safetensors"))
    (run / "checkpoints" / "step_2" / "job.json").write_text(json.dumps(
        {"step": 2, "manifest": {"models": {"actor": spec}, "algorithm": {"train": {"actor": []}}}}))
    (run / "checkpoints" / "latest").write_text("step_2\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in range(2)))


def test_fuzz_command_lines(cli_world, request):
    """Random command lines: exit 0, 1 or 2 (with a message when not 0), never an internal error."""
    import typer.main

    world, _ = cli_world
    n = max(40, request.config.getoption("fuzz_n") // 25)
    rng = random.Random(4242)
    commands = typer.main.get_command(app).commands
    values = _option_values(world)
    failures, codes = [], {}
    for i in range(n):
        argv = random_argv(rng, commands, values)
        code, out, err = run_cli(argv)
        codes[code] = codes.get(code, 0) + 1
        if code not in (0, 1, 2) or "Traceback" in err or "internal error" in err:
            failures.append(f"--- argv {i}: rlhfc {' '.join(map(repr, argv))}: exit {code}\n{err[-1500:]}")
        elif code != 0 and not (err.strip() or "Usage:" in out):   # bare `rlhfc`: the help, exit 2
            failures.append(f"--- argv {i}: rlhfc {' '.join(map(repr, argv))}: exit {code} without a message")
        elif code == 1 and not _documented_exit_1(argv, err):
            failures.append(f"--- argv {i}: rlhfc {' '.join(map(repr, argv))}: exit 1 for none of the documented "
                            f"cases (rlhfc.cli.app.EXIT_1)\n{err[-1500:]}")
    assert not failures, f"{len(failures)} of {n} command lines; first:\n" + "\n".join(failures[:8])
    assert codes.get(0, 0) > n // 10 and codes.get(2, 0) > n // 4, codes


def _documented_exit_1(argv: list[str], err: str) -> str | None:
    """Which documented exit-1 case (:data:`rlhfc.cli.app.EXIT_1`) ``err`` of ``rlhfc ARGV`` is, if any."""
    from rlhfc.cli.app import EXIT_1

    for case, (commands, pattern) in EXIT_1.items():
        if (commands is None or (argv and argv[0] in commands)) and re.search(pattern, err, re.M):
            return case
    return None


def test_exit_1_is_one_of_the_documented_cases_each_with_its_own_message(world, monkeypatch):
    """Exit 1 only for a run that failed, a path the file system refused, or input that ended at a prompt —
    each recognised by its own message; an operating system error naming no path is an internal error."""
    import rlhfc.runtime.job
    from rlhfc.runtime.errors import JobError

    (world / "prog.rlhf").write_text((ROOT / "examples" / "ppo_tiny.rlhf").read_text())
    code, _, err = run_cli(["compile", "prog.rlhf", "-o", "missing_dir/o.rlir"])
    assert code == 1 and _documented_exit_1(["compile"], err) == "file refused", err

    def fail(*args, **kwargs):
        raise JobError("stage 'roll' failed: worker 'actor' died", "resume with: rlhfc run prog.rlhf --resume")

    monkeypatch.setattr(rlhfc.runtime.job, "run_job", fail)
    code, _, err = run_cli(["run", "prog.rlhf", "--no-progress", "--out", "r"])
    assert code == 1 and _documented_exit_1(["run"], err) == "run failed", err
    assert _documented_exit_1(["compile"], err) is None   # only a run fails that way

    def no_path(*args, **kwargs):
        raise OSError(28, "No space left on device")   # names no path: not a file the user gave

    monkeypatch.setattr(rlhfc.runtime.job, "run_job", no_path)
    code, _, err = run_cli(["run", "prog.rlhf", "--no-progress", "--out", "r2"])
    assert code == 3 and "internal error" in err, err


# -- what the fuzzers found, one regression test each ------------------------------------------------------
def test_found_deeply_nested_jsonl_is_a_data_error():
    """A JSONL line nested thousands deep made json raise RecursionError: an internal error at check time
    and a traceback when the job read it (tests/bad/jsonl_nested_too_deep.rlhf covers check)."""
    from rlhfc.runtime.data.prompts import DataError, JsonlPrompts

    path = ROOT / "tests" / "bad" / "fixtures" / "deep.jsonl"
    with pytest.raises(DataError, match=r"deep.jsonl:2: JSON nested too deeply to read"):
        JsonlPrompts(str(path))


def test_found_run_out_naming_a_file_is_refused(world):
    """``rlhfc run PROGRAM --out FILE`` was an internal error (NotADirectoryError) after compiling."""
    (world / "prog.rlhf").write_text((ROOT / "examples" / "ppo_tiny.rlhf").read_text())
    (world / "o.txt").write_text("mine\n")
    code, _, err = run_cli(["run", "prog.rlhf", "--out", "o.txt", "--no-progress"])
    assert code == 2 and "run folder o.txt is a file, not a folder; nothing was overwritten" in err, err
    assert "hint: choose a folder with --out" in err and (world / "o.txt").read_text() == "mine\n"


@pytest.mark.parametrize("argv", [["compile", "prog.rlhf", "-o", "folder"],
                                  ["compile", "prog.rlhf", "-o", "missing_dir/o.rlir"],
                                  ["explain", "prog.rlhf", "-o", "folder"],
                                  ["compile", "prog.rlhf", "--emit", "job", "-o", "prompts.jsonl"]])
def test_found_unwritable_output_is_an_error_not_an_internal_one(world, argv):
    """An output path that is a folder, in a missing folder, or a file where a folder is needed was an
    internal error (exit 3): now a one-line error naming the path, with a hint, exit 1."""
    (world / "prog.rlhf").write_text((ROOT / "examples" / "ppo_tiny.rlhf").read_text())
    code, _, err = run_cli(argv)
    assert code == 1 and err.startswith("rlhfc: error: ") and argv[-1] in err, err
    assert "hint: check the path" in err and "internal error" not in err
