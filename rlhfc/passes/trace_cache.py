"""A traced block's ops as polynomials in the micro-batch shape, and the disk cache that keeps them.

:mod:`rlhfc.passes.recompute_trace` traces a model's block once, at two primes no other dimension shares, and
keeps each op's sizes as sums of monomials ``c · rows^a · seq^b`` (:class:`RawOp`); a micro-batch shape
evaluates them. They are kept on disk (``<cache>/traces/``, :func:`rlhfc.cost.profile.cache_dir`; keyed by the
model's shape and the installed torch and transformers versions), so a compile in a new process neither imports
them nor traces again; ``RLHFC_TRACE_CACHE=0`` turns that off.

Traces of the built-in size presets (:data:`rlhfc.ir.arch.PRESETS`, in bfloat16 with sdpa and eager attention:
what a GPU cluster's plan traces) ship with rlhfc in ``rlhfc/passes/traces/``, made by ``python -m
rlhfc.passes.recompute_trace`` (:func:`rlhfc.passes.recompute_trace.bundle`) under the torch and transformers
versions ``constraints.txt`` pins. They are read when the cache has no trace of the key and the installed versions
are those (so the first compile on a machine of a program using the presets imports neither torch nor
transformers); under other versions they are not used.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import metadata

from rlhfc.cost.profile import cache_dir
from rlhfc.ir.arch import PRESETS

#: bump when what a cached trace holds changes (files of another format are ignored)
FORMAT = 1


def value_at(poly: tuple, rows: int, seq: int) -> int:
    """A polynomial ``((c, a, b), ...)`` (see :class:`RawOp`) at ``rows x seq``."""
    return sum(c * rows ** a * seq ** b for c, a, b in poly)


@dataclass(frozen=True)
class RawOp:
    """One aten call of a traced block with its sizes as polynomials in the micro-batch's ``rows`` and ``seq``:
    each of ``fresh`` (bytes of the storages it allocates), ``needed`` (of those, what autograd saves),
    ``moved`` (bytes its outputs and inputs span) and ``flops`` is ``((coefficient, rows power, seq power),
    ...)``: a sum of monomials, every tensor's size being one (rows enter once, as the batch; seq once, or twice
    in attention's scores)."""

    name: str
    target: str
    fresh: tuple
    needed: tuple
    moved: tuple
    flops: tuple
    core_attention: bool
    saves: bool

    def at(self, rows: int, seq: int) -> tuple:
        """``(name, target, fresh, needed, moved, flops, core_attention, saves)`` at ``rows x seq``."""
        return (self.name, self.target, value_at(self.fresh, rows, seq), value_at(self.needed, rows, seq),
                float(value_at(self.moved, rows, seq)), float(value_at(self.flops, rows, seq)), self.core_attention,
                self.saves)


def primes_above(n: int, count: int) -> list[int]:
    out, k = [], n + 1
    while len(out) < count:
        if k > 1 and all(k % d for d in range(2, int(k ** 0.5) + 1)):
            out.append(k)
        k += 1
    return out


def monomials(values, rows: int, seq: int) -> tuple:
    """``values`` (sizes traced at ``rows x seq``) as ``((c, a, b), ...)`` with value = c · rows^a · seq^b."""
    out: dict[tuple, int] = {}
    for v in values:
        v, a, b = int(v), 0, 0
        if v == 0:
            continue
        while rows > 1 and v % rows == 0:
            v, a = v // rows, a + 1
        while seq > 1 and v % seq == 0:
            v, b = v // seq, b + 1
        out[(a, b)] = out.get((a, b), 0) + v
    return tuple((c, a, b) for (a, b), c in sorted(out.items()))


def load(key: tuple):
    """The cached ``(ops, autograd)`` of the block ``key``, or None (no file, another format, unreadable)."""
    path = _path(key)
    if path is not None and not os.path.exists(path):   # not traced on this machine: shipped with rlhfc?
        path = os.path.join(BUNDLED, os.path.basename(path))
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != FORMAT or data.get("key") != list(key):
            return None
        ops = [RawOp(o[0], o[1], *(tuple(tuple(t) for t in o[k]) for k in range(2, 6)), o[6], o[7])
               for o in data["ops"]]
        return ops, tuple(tuple(t) for t in data["autograd"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None   # unreadable: traced again and written anew


def save(key: tuple, ops: list, autograd: tuple, folder: str | None = None) -> str | None:
    """Keep the trace of ``key`` on disk (written whole, then renamed: readers never see half a file); in
    ``folder`` instead of the cache when given (:func:`rlhfc.passes.recompute_trace.bundle`). Returns the file
    written (None when the cache is off or cannot be written)."""
    path = _path(key)
    if path is None:
        return None
    if folder is not None:
        path = os.path.join(folder, os.path.basename(path))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"format": FORMAT, "key": list(key), "versions": list(_versions()), "autograd": autograd,
                       "ops": [[o.name, o.target, o.fresh, o.needed, o.moved, o.flops, o.core_attention, o.saves]
                               for o in ops]}, fh)
        os.replace(tmp, path)
    except OSError:
        return None   # a read-only cache only costs the next process a trace
    return path


#: the traces shipped with rlhfc (see the module docstring)
BUNDLED = os.path.join(os.path.dirname(__file__), "traces")


def bundled_keys() -> list[tuple]:
    """The keys of the traces that ship with rlhfc: every size preset, bfloat16, sdpa and eager attention."""
    return [(arch, p["hidden"], p["heads"], p["kv_heads"], p["ffn"], p["vocab"], "bfloat16", attn)
            for arch, sizes in PRESETS.items() for p in sizes.values() for attn in ("sdpa", "eager")]


def _versions() -> tuple[str, str] | None:
    """The installed torch and transformers versions (None when either is missing)."""
    try:
        return metadata.version("torch"), metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _path(key: tuple) -> str | None:
    """Where the trace of ``key`` is kept on disk (None when the cache is off or the versions are unknown)."""
    if os.environ.get("RLHFC_TRACE_CACHE", "1") == "0":
        return None
    versions = _versions()
    if versions is None:
        return None
    name = "-".join(map(str, (*key, *versions, FORMAT)))
    return os.path.join(cache_dir(), "traces", hashlib.sha1(name.encode()).hexdigest()[:20] + ".json")

