"""What lowering reads from the files a program names, when that is cheap: a JSONL prompt file's lines and a
local model folder's tokenizer. Each function returns a problem as ``(message, hint)`` for lowering to
report at the path's position, and never raises for a bad file."""

from __future__ import annotations

import json
import os
from typing import Sequence

from rlhfc.contract.rules import tool_call_format

#: larger data files are not read at check time (the job checks them when it starts)
MAX_CHECKED_BYTES = 64 * 2**20
#: files that hold a Hugging Face tokenizer's vocabulary (one of them must be in a model folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


def read_prompts(path: str, shown: str, field: str, fields: Sequence[str] = ()) \
        -> tuple[tuple[int, str] | None, tuple[str, str] | None]:
    """Check a JSONL prompt file as the job will read it. Returns ``((characters of the longest prompt, where
    it is), None)``, ``(None, (message, hint))`` for a bad file, or ``(None, None)`` when too large to read now.
    ``shown``: the path as the program wrote it; every line must also hold each of ``fields``."""
    try:
        if os.path.getsize(path) > MAX_CHECKED_BYTES:
            return None, None
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return None, (f"cannot read data file '{shown}': {exc.strerror or exc}", "check the file's permissions")
    longest: tuple[int, str] | None = None
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        at = f"data file '{shown}', line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return None, (f"{at}: byte 0x{raw[exc.start]:02x} is not valid UTF-8", "save the data file as UTF-8 text")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            return None, (f"{at}: not valid JSON ({exc.msg}: column {exc.colno})",
                          'each line must be one JSON object, e.g. {"' + field + '": "..."}')
        except RecursionError:   # json's decoder recurses per nesting level
            return None, (f"{at}: JSON nested too deeply to read",
                          'each line must be one JSON object, e.g. {"' + field + '": "..."}')
        if not isinstance(obj, dict) or field not in obj:
            return None, (f"{at}: no field {json.dumps(field)}",
                          f'each line must be a JSON object with the prompt in "{field}" (or set field = "...")')
        if not isinstance(obj[field], str):
            return None, (f"{at}: field {json.dumps(field)} is not a string",
                          f'write the prompt as a JSON string: {{"{field}": "..."}}')
        missing = [k for k in fields if k not in obj]
        if missing:
            return None, (f"{at}: no field {json.dumps(missing[0])} (the program declares fields = "
                          f"[{', '.join(fields)}])", f"every line needs each declared field; add "
                          f"{json.dumps(missing[0])} to that line or remove it from fields")
        if longest is None or len(obj[field]) > longest[0]:
            longest = (len(obj[field]), f"line {lineno} of '{shown}'")
    if longest is None:
        return None, (f"data file '{shown}' holds no prompts", f'add lines like {{"{field}": "..."}}')
    return longest, None


def tokenizer_problem(folder: str, shown: str, vocab) -> tuple[str, str] | None:
    """Why the tokenizer of a local Hugging Face model folder cannot serve a model of ``vocab`` token ids: it
    has none, or (when its size is cheap to read) it has more tokens than the model's vocabulary."""
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, f))]
    if not present:
        return (f"local model folder '{shown}' has no tokenizer",
                f"save the model's tokenizer into the folder (tokenizer.save_pretrained(folder)); rlhfc looks for "
                f"{', '.join(TOKENIZER_FILES[:3])} …, and a model without its tokenizer would read meaningless ids")
    size = _tokenizer_size(folder)
    if size is not None and isinstance(vocab, int) and not isinstance(vocab, bool) and size > vocab:
        return (f"the tokenizer in '{shown}' has {size} tokens but the model's vocabulary has {vocab} "
                "(vocab_size in config.json)",
                f"token ids {vocab} and up would index past the model's embeddings: use the tokenizer the model "
                "was trained with, or resize its embeddings")
    return None


def chat_template_problem(folder: str | None, model: str) -> tuple[str, str] | None:
    """Why model ``model`` (its local folder ``folder``, None for a config-built model) has no chat template
    for ``generate(..., chat = true)``: its tokenizer must store one (``chat_template`` in
    tokenizer_config.json, or a chat_template.jinja / .json file)."""
    hint = ("chat = true formats each prompt with the tokenizer's apply_chat_template: use a model folder whose "
            "tokenizer has one (tokenizer.chat_template = ...; tokenizer.save_pretrained(folder)), or drop chat")
    if not folder:
        return f"model '{model}' has no chat template: it is built from a config, with rlhfc's character tokenizer", hint
    if any(os.path.isfile(os.path.join(folder, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return None
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as fh:
            if json.load(fh).get("chat_template"):
                return None
    except (OSError, ValueError, AttributeError):
        pass
    return f"the tokenizer of model '{model}' has no chat template", hint


def chat_template_text(folder: str | None) -> str:
    """The chat template the tokenizer in ``folder`` stores ("" when none, or several named ones joined)."""
    if not folder:
        return ""
    try:
        path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                return fh.read()
        for name in ("chat_template.json", "tokenizer_config.json"):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.path.getsize(path) <= MAX_CHECKED_BYTES:
                with open(path, encoding="utf-8") as fh:
                    found = json.load(fh).get("chat_template")
                if isinstance(found, list):   # named templates: [{"name": ..., "template": ...}]
                    found = "\n".join(str(t.get("template", "")) for t in found if isinstance(t, dict))
                if found:
                    return str(found)
    except (OSError, ValueError, AttributeError):
        pass
    return ""


def tool_template_problem(folder: str | None, model: str) -> tuple[str, str] | None:
    """Why the chat template of model ``model`` cannot carry tool calls for ``generate(..., tools = [...],
    chat = true)``: rlhfc reads the formats :func:`rlhfc.contract.rules.tool_call_format` names, which the
    template must write."""
    if tool_call_format(chat_template_text(folder)) is not None:
        return None
    return (f"the chat template of model '{model}' has no tool-call format rlhfc reads (it writes neither "
            "<tool_call>...</tool_call> nor {\"name\": ..., \"parameters\": ...} calls with ipython results "
            "nor [TOOL_CALLS] calls)",
            "a chat = true generate with tools needs a template with Hermes-style tool calls (Qwen 2.5/3, Hermes), "
            "Llama 3.1-3.3's JSON calls or Mistral's [TOOL_CALLS]; drop chat to use the plain-text convention "
            "(docs/language.md, tool and env)")


def _tokenizer_size(folder: str) -> int | None:
    """The largest token id + 1 of the folder's tokenizer.json (or vocab.json + added_tokens.json), or None."""
    try:
        ids: list[int] = []
        path = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(path) and os.path.getsize(path) <= MAX_CHECKED_BYTES:
            with open(path, encoding="utf-8") as fh:
                tok = json.load(fh)
            vocab = (tok.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                ids += [int(i) for i in vocab.values()]
            elif isinstance(vocab, list):   # Unigram: [[piece, score], ...]
                ids.append(len(vocab) - 1)
            ids += [int(t["id"]) for t in tok.get("added_tokens") or []]
        elif os.path.isfile(os.path.join(folder, "vocab.json")):
            with open(os.path.join(folder, "vocab.json"), encoding="utf-8") as fh:
                ids += [int(i) for i in json.load(fh).values()]
            added = os.path.join(folder, "added_tokens.json")
            if os.path.isfile(added):
                with open(added, encoding="utf-8") as fh:
                    ids += [int(i) for i in json.load(fh).values()]
        return max(ids) + 1 if ids else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None   # unreadable here: the job checks it when it loads the tokenizer


__all__ = ["read_prompts", "tokenizer_problem", "TOKENIZER_FILES", "MAX_CHECKED_BYTES"]
