"""Rules the compiler prices and the runtime follows: one home each, imported by both sides.

* :data:`GROUP_COST_TOKENS` — what one more length group of a packed forward or training call costs, in
  computed tokens (a call's fixed overhead: kernel launches, Python). Measured on a 2-core CPU for 1-25M
  parameter models: a call costs about as much as 64-256 tokens; fewer, wider groups past that gain little.
  The runtime groups rows by it (:func:`rlhfc.runtime.train.packing.length_groups`); the cost model prices the
  groups it makes (:func:`rlhfc.cost.lengths.packed_tokens`).
* :data:`DECODE_COMPACT_FRACTION` — the torch decoder drops finished rows (and their KV cache) from the
  decode batch once this fraction of the batch has finished; the cost model prices the live rows by it.
* :func:`op_key` — the name a block's k-th call of an aten op has in a recompute decision
  (``mm.default#3``): the recompute pass writes these names, the runtime's selective checkpoint counts them.
* :func:`tool_call_format` — which tool-call format a chat template writes (``hermes``, ``json`` or
  ``mistral``): the
  compiler checks a ``chat = true`` generate with tools has one, the runtime parses the policy's calls by it.
* :func:`tokenizer_fingerprint` — which tokenizer a Hugging Face folder holds, by content: models whose
  folders hold the same tokenizer exchange token ids (the verifier's check, the runtime's rollouts), wherever
  the folders are.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

GROUP_COST_TOKENS = 128

DECODE_COMPACT_FRACTION = 0.25


def tool_call_format(template: str) -> str | None:
    """The tool-call format chat template ``template`` writes: ``hermes`` (Qwen 2.5/3, Hermes:
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in the assistant's turn, several a turn), ``json``
    (Llama 3.1-3.3: the assistant's turn is ``{"name": ..., "parameters": ...}``, one call, results as
    ``ipython`` turns), ``mistral`` (Mistral 7B v0.3, Nemo, Small: ``[TOOL_CALLS] [{"name": ..., "arguments":
    ..., "id": ...}, ...]`` in the assistant's turn, results as ``[TOOL_RESULTS] ... [/TOOL_RESULTS]`` naming the
    call's id), or None (none of them)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template and "ipython" in template:
        return "json"
    return None


def op_key(op_name: str, k: int) -> str:
    """``mm.default#3``: the k-th call (from 0) of aten op ``op_name`` (``aten.mm.default`` or ``mm.default``)."""
    return f"{op_name[5:] if op_name.startswith('aten.') else op_name}#{k}"


#: the files of a Hugging Face folder that make its tokenizer (what ``AutoTokenizer`` reads)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")
#: tokenizer_config.json keys that say where a tokenizer was saved from, not what it is
_PLACE_KEYS = ("name_or_path", "_name_or_path", "tokenizer_file", "auto_map", "_commit_hash")


@functools.lru_cache(maxsize=64)   # the verifier asks for every pair of models that exchange token ids
def tokenizer_fingerprint(folder: str) -> str | None:
    """A digest of the tokenizer files in ``folder`` (their names and bytes; the JSON configs without the keys
    that name where they were saved): equal for folders holding the same tokenizer. None when the folder holds
    none of :data:`TOKENIZER_FILES` or cannot be read (the caller reports that)."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        if name in ("tokenizer_config.json", "special_tokens_map.json"):
            try:
                obj = json.loads(data)
                if isinstance(obj, dict):
                    obj = {k: v for k, v in obj.items() if k not in _PLACE_KEYS}
                data = json.dumps(obj, sort_keys=True).encode()
            except ValueError:
                pass   # hashed as written
        found = True
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()[:16] if found else None
