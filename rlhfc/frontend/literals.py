"""Literals of a ``.rlhf`` program as lowering reads them: the value the IR holds, and the text a message shows."""

from __future__ import annotations

import json

from . import ast

#: how a message names each kind of literal
KIND_NAMES = {"int": "an integer", "float": "a number", "size": "a size", "str": "a string",
              "bool": "a bool", "ident": "a name", "device": "a device count", "list": "a list"}


def value_of(lit: ast.Literal):
    """The value a setting holds in the IR, whatever its kind (the verifier checks it): numbers as numbers,
    names and strings as strings, ``cpu:2`` as the string ``"cpu:2"``."""
    if lit.kind == "size":
        return int(lit.value)
    if lit.kind == "ident":
        return str(lit.value)
    if lit.kind == "device":
        return show(lit)
    if lit.kind == "list":
        return [value_of(x) for x in lit.value]
    return lit.value


def coerce(lit: ast.Literal, kind: str):
    """``lit`` as a stage attribute of ``kind`` (int, float, str or bool), or None when its kind does not fit."""
    if kind == "int":
        return int(lit.value) if lit.kind in ("int", "size") else None
    if kind == "float":
        return float(lit.value) if lit.kind in ("int", "float", "size") else None
    if kind == "str":
        return str(lit.value) if lit.kind in ("str", "ident") else None
    if kind == "bool":
        return lit.value if lit.kind == "bool" else None
    return None


def show(lit: ast.Literal) -> str:
    """A literal as the program wrote it."""
    if lit.kind == "str":
        return json.dumps(lit.value)
    if lit.kind == "bool":
        return "true" if lit.value else "false"
    if lit.kind == "device":
        return f"{lit.value[0]}:{lit.value[1]}"
    if lit.kind == "list":
        return "[" + ", ".join(show(x) for x in lit.value) + "]"
    return str(lit.value)


def size_text(lit: ast.Literal) -> str:
    """A ``size = 7B`` literal as the name of a published size (``7B``, ``1.5B``, ``124M``)."""
    if lit.kind == "size":
        n = lit.value
        for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
            if n >= scale:
                text = f"{n / scale:.3g}"
                return f"{text}{unit}"
        return str(n)
    return show(lit)


#: units a memory setting may use (``memory = "2GB"``), in bytes
MEMORY_UNITS = {"B": 1, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3, "TB": 1000 ** 4,
                "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3, "TiB": 1024 ** 4}


def memory_bytes(lit: ast.Literal) -> int | None:
    """Bytes of a memory setting: a string like ``"2GB"`` / ``"512MiB"``, or a byte count; None if malformed."""
    if lit.kind in ("int", "size") and int(lit.value) > 0:
        return int(lit.value)
    if lit.kind != "str":
        return None
    text = str(lit.value).strip()
    for unit in sorted(MEMORY_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                n = float(text[: -len(unit)].strip())
            except ValueError:
                return None
            return int(n * MEMORY_UNITS[unit]) if n > 0 else None
    return None
