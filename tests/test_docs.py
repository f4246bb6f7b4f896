"""The docs stay true to the code.

* Every ```rlhf block in docs/language.md and docs/runtime.md is a complete
  program and compiles without errors (fragments and wrong programs use plain
  ``` fences).
* Every op of the op table, and every keyword setting of its spec, is documented
  in docs/language.md, in the section whose heading names the op.
"""

from __future__ import annotations

import os
import re

import pytest

from rlhfc.frontend import compile_source
from rlhfc.ir import CompileError, all_ops

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")
PAGES = ("language.md", "runtime.md")


def _read(page: str) -> str:
    with open(os.path.join(DOCS, page), encoding="utf-8") as fh:
        return fh.read()


def _rlhf_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of each ```rlhf fenced block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```rlhf":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"unclosed ```rlhf block at line {start}"
            blocks.append((start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [(page, line, code) for page in PAGES for line, code in _rlhf_blocks(_read(page))]


def test_docs_have_programs():
    assert sum(1 for page, _, _ in BLOCKS if page == "language.md") >= 3   # intro PPO, GRPO, another PPO
    assert any(page == "runtime.md" for page, _, _ in BLOCKS)


@pytest.mark.parametrize("page,line,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_rlhf_block_compiles(page, line, code):
    try:
        module, _warnings = compile_source(code, f"docs/{page}")
    except CompileError as exc:
        pytest.fail(f"```rlhf block at docs/{page}:{line} does not compile:\n{exc}")
    assert module.graph.stages


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every #-heading of the page."""
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    return [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


@pytest.mark.parametrize("op", sorted(all_ops()))
def test_every_op_and_setting_is_documented(op):
    text = _read("language.md")
    spec = all_ops()[op]
    sections = [(h, body) for h, body in _sections(text) if f"`{op}`" in h]
    assert sections, f"docs/language.md has no heading naming op `{op}`"
    heading, body = sections[0]
    for attr in spec.attrs:
        assert f"`{attr.name}`" in body, f"setting `{attr.name}` of op {op} is not documented under '{heading}'"
        row = next((ln for ln in body.splitlines() if ln.startswith(f"| `{attr.name}` |")), None)
        assert row is not None, f"setting `{attr.name}` of op {op} has no table row under '{heading}'"
        cells = [c.strip().strip("`") for c in row.strip("|").split("|")]
        assert cells[1] == attr.kind, f"{op}.{attr.name}: documented type {cells[1]!r}, spec says {attr.kind!r}"
        assert _same_default(cells[2], attr), f"{op}.{attr.name}: documented default {cells[2]!r}, spec says " \
                                              f"{'required' if attr.required else repr(attr.default)}"


def _same_default(cell: str, attr) -> bool:
    if attr.required:
        return cell == "required"
    if attr.default is None:   # an option that falls back on another (ppo_clip's clip_high: clip)
        return cell == "—"
    if attr.kind == "bool":
        return cell == ("true" if attr.default else "false")
    if attr.kind == "str":
        return cell == attr.default
    try:
        return float(cell) == float(attr.default)
    except ValueError:
        return False
