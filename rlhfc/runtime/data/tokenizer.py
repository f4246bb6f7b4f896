"""Tokenizers behind one small interface.

Every tokenizer the runtime hands out has::

    encode(text: str, add_bos: bool = False) -> list[int]
    decode(ids: Sequence[int]) -> str          # special tokens are skipped
    pad_id: int, bos_id: int | None, eos_id: int, vocab_size: int

``CharTokenizer`` is the built-in one for config-built (random-weight) models.
Its vocabulary convention:

* id 0 = pad, id 1 = bos, id 2 = eos;
* ids 3, 4, ... = characters, in this priority order:
  the 26 lowercase letters, space, the 10 digits, the 11 common punctuation
  marks ``. , ! ? ' - : ; " ( )``, the 26 uppercase letters, and the remaining
  21 printable ASCII punctuation marks (95 printable characters in all).
* A vocab of ``3 + 95 = 98`` or more holds every printable ASCII character;
  ids from 98 up to ``vocab - 1`` are unused and decode to nothing.
* A smaller vocab keeps the first ``vocab - 3`` characters of the order above
  (vocab 96 drops the last two, ``}`` and ``~``; see ``CHAR_ORDER``;
  vocab 64 keeps lowercase, space, digits, the 11 common marks and ``A``-``M``).
* Encoding a character outside the vocabulary: an uppercase letter falls back to
  its lowercase form; anything else (newline, tab, non-ASCII, dropped
  punctuation) becomes a space when space is in the vocabulary, and is dropped
  otherwise. ``decode(encode(s)) == s`` exactly when every character of ``s`` is
  in the vocabulary.
* The smallest vocab accepted is 4 (one character).

``load_tokenizer(spec)`` returns ``CharTokenizer(spec["vocab"])`` for config
models, and wraps ``transformers.AutoTokenizer.from_pretrained(folder,
local_files_only=True)`` in ``HFTokenizer`` for ``source`` folders. A folder
without a tokenizer, or with one of more tokens than the model's ``vocab``
(ids past the embeddings), is a ``ValueError``.
"""

from __future__ import annotations

import os
import string
from typing import Any, Mapping, Protocol, Sequence

__all__ = ["Tokenizer", "CharTokenizer", "HFTokenizer", "load_tokenizer", "CHAR_ORDER", "TOKENIZER_FILES"]

#: files that hold a Hugging Face tokenizer's vocabulary (a model folder needs one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

_COMMON_PUNCT = ".,!?'-:;\"()"
_OTHER_PUNCT = "".join(c for c in string.punctuation if c not in _COMMON_PUNCT)
CHAR_ORDER = string.ascii_lowercase + " " + string.digits + _COMMON_PUNCT + string.ascii_uppercase + _OTHER_PUNCT
assert len(CHAR_ORDER) == 95 and len(set(CHAR_ORDER)) == 95


class Tokenizer(Protocol):
    """What the runtime needs from a tokenizer."""

    pad_id: int
    bos_id: int | None
    eos_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str: ...


class CharTokenizer:
    """Character-level tokenizer over printable ASCII (see module docstring)."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    num_special = 3

    def __init__(self, vocab_size: int):
        if vocab_size < self.num_special + 1:
            raise ValueError(f"CharTokenizer needs vocab_size >= 4 (pad, bos, eos + 1 char), got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.chars = CHAR_ORDER[: self.vocab_size - self.num_special]
        self._to_id = {c: i + self.num_special for i, c in enumerate(self.chars)}
        self._ids = _CharIds(self)   # every character seen: its id or None (dropped)

    def _char_id(self, c: str) -> int | None:
        if c in self._to_id:
            return self._to_id[c]
        if c.isupper() and c.lower() in self._to_id:
            return self._to_id[c.lower()]
        return self._to_id.get(" ")

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        ids.extend(i for i in map(self._ids.__getitem__, text) if i is not None)
        return ids

    def encode_chat(self, text: str) -> list[int]:
        raise ValueError("the built-in character tokenizer has no chat template (generate(..., chat = true) needs "
                         "a model from a local HF folder whose tokenizer has one)")

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        n = len(self.chars)
        out = []
        for i in ids:
            i = int(i)
            j = i - self.num_special
            if 0 <= j < n:
                out.append(self.chars[j])
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class _CharIds(dict):
    """Character -> its id in a :class:`CharTokenizer` (None: dropped), each character looked up once."""

    def __init__(self, tok: CharTokenizer):
        super().__init__()
        self.tok = tok

    def __missing__(self, c: str) -> int | None:
        self[c] = i = self.tok._char_id(c)
        return i


class HFTokenizer:
    """A Hugging Face tokenizer behind the runtime's interface.

    ``pad_id`` falls back to the eos id when the tokenizer has no pad token (the
    usual convention for decoder-only checkpoints). ``encode`` never adds the
    tokenizer's own special tokens; ``add_bos=True`` prepends ``bos_id`` if it exists.
    """

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        eos = hf_tokenizer.eos_token_id
        pad = hf_tokenizer.pad_token_id
        if eos is None:
            raise ValueError("the tokenizer has no eos token; generation cannot stop per sample")
        self.eos_id = int(eos)
        self.pad_id = int(pad) if pad is not None else self.eos_id
        bos = hf_tokenizer.bos_token_id
        self.bos_id = int(bos) if bos is not None else None
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=not keep_special)

    def chat_ids(self, messages: list[dict], *, tools: list[dict] | None = None,
                 add_generation_prompt: bool = True) -> list[int]:
        """``messages`` rendered by the chat template (with ``tools``' schemas where the template shows them)."""
        out = self.hf.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def chat_suffix(self, messages: list[dict]) -> list[int]:
        """The tokens the chat template writes for ``messages`` (tools' results, ``role = "tool"``, one per call
        of the turn; or a user turn) after an assistant turn that ended with EOS, up to the opening of the next
        assistant turn: the template's rendering of the conversation with and without them, cut at the
        assistant turn's EOS."""
        tools = [m for m in messages if m.get("role") == "tool"]
        if tools:   # the assistant turn that made the calls (by their ids, where the template names them)
            calls = [{"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}},
                      **({"id": m["tool_call_id"]} if "tool_call_id" in m else {})} for m in tools]
            before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        else:
            before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        prefix = self.chat_ids(before, add_generation_prompt=False)
        full = self.chat_ids(before + list(messages), add_generation_prompt=True)
        ends = [i for i, t in enumerate(prefix) if t == self.eos_id]
        if ends:   # the template may write a newline after the turn's EOS: the policy's turn ends at the EOS
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders an assistant turn differently when a message follows it: "
                             "it cannot append a tool's result to a trajectory token for token")
        return full[len(prefix):]

    def encode_chat(self, text: str) -> list[int]:
        """``text`` as a user turn in the tokenizer's chat template, ending with the assistant's turn opening
        (``apply_chat_template(..., add_generation_prompt=True)``); the template writes its own BOS."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (generate(..., chat = true) needs one)")
        out = self.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: Mapping[str, Any]) -> CharTokenizer | HFTokenizer:
    """The tokenizer for a model spec (see module docstring)."""
    source = spec.get("source")
    vocab = spec.get("vocab")
    if source:
        from transformers import AutoTokenizer

        if not any(os.path.isfile(os.path.join(source, f)) for f in TOKENIZER_FILES):
            raise ValueError(f"model folder {source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
                             "the model's tokenizer into it (tokenizer.save_pretrained(folder))")
        tok = HFTokenizer(AutoTokenizer.from_pretrained(source, local_files_only=True))
        if isinstance(vocab, int) and tok.vocab_size > vocab:
            raise ValueError(f"the tokenizer in {source} has {tok.vocab_size} tokens but the model's vocabulary has "
                             f"{vocab}: ids {vocab} and up would index past its embeddings")
        return tok
    if not isinstance(vocab, int):
        raise ValueError(f"a config model spec needs an int 'vocab' for the built-in tokenizer, got {vocab!r}")
    return CharTokenizer(vocab)
