"""Pass infrastructure: the ``Pass`` base class, the registry and option parsing.

A pass is a small frozen dataclass: a ``name``, a one-line ``description``,
whether it is ``exact`` (cannot change what the job computes), and its options
as dataclass fields. ``run(module)`` returns the transformed module (it may
mutate and return its argument). Passes are registered by name::

    @register_pass
    @dataclass(frozen=True)
    class ClampGeneration(Pass):
        name = "clamp-generation"
        description = "cap max_new_tokens of every generate stage"
        max_new_tokens: int = 64

        def run(self, module): ...

and named on the command line as ``--passes dce,clamp-generation{max_new_tokens=32}``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import ClassVar

from rlhfc.ir import Module
from rlhfc.ir.diagnostics import did_you_mean, error


@dataclass(frozen=True)
class Pass:
    """Base class of every pass. Subclasses set ``name``/``description`` and override :meth:`run`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True when the pass cannot change what the job trains (verified by end-to-end tests)
    exact: ClassVar[bool] = True

    def run(self, module: Module) -> Module:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    def spec(self) -> str:
        """How this configured pass is written in a pipeline string."""
        opts = [f"{f.name}={getattr(self, f.name)}" for f in self.options()
                if getattr(self, f.name) != f.default]
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


_REGISTRY: dict[str, type[Pass]] = {}
_LAZY: dict[str, str] = {}   # pass name -> module that registers it (imported on first use)


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by its name."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def register_lazy(name: str, module: str) -> None:
    """Register a built-in pass by the module that defines it, imported only when needed."""
    _LAZY.setdefault(name, module)


def _load_lazy() -> None:
    for name, mod in list(_LAZY.items()):
        if name not in _REGISTRY:
            importlib.import_module(mod)


def registered_passes() -> dict[str, type[Pass]]:
    _load_lazy()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> type[Pass]:
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _REGISTRY:
        passes = registered_passes()
        raise error(f"unknown pass '{name}'", None,
                    did_you_mean(name, passes) or f"passes: {', '.join(passes)} (list them with `rlhfc passes`)")
    return _REGISTRY[name]


def _convert(cls: type[Pass], field: dataclasses.Field, text: str):
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        return text
    except ValueError:
        raise error(f"pass {cls.name}: option '{field.name}' expects {kind}, got {text!r}") from None


def parse_pipeline(text: str) -> list[Pass]:
    """``"dce,clamp-generation{max_new_tokens=32}"`` -> configured pass instances."""
    passes: list[Pass] = []
    for item in _split(text):
        name, _, rest = item.partition("{")
        name = name.strip()
        if not name:
            continue
        cls = get_pass(name)
        kwargs = {}
        if rest:
            if not rest.endswith("}"):
                raise error(f"pass options for '{name}' must end with '}}'", None, "e.g. name{opt=1,other=x}")
            fields = {f.name: f for f in cls.options()}
            for pair in filter(None, (p.strip() for p in rest[:-1].split(","))):
                key, eq, val = pair.partition("=")
                key = key.strip()
                if not eq or key not in fields:
                    raise error(f"pass {name} has no option '{key}'", None,
                                did_you_mean(key, fields) or
                                (f"options: {', '.join(fields)}" if fields else "it takes no options"))
                kwargs[key] = _convert(cls, fields[key], val.strip())
        passes.append(cls(**kwargs))
    return passes


def _split(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def load_plugin(spec: str) -> None:
    """Import a plugin that registers passes: a module name (``my_passes``) or a ``.py`` path."""
    if spec.endswith(".py") or os.sep in spec:
        if not os.path.isfile(spec):
            raise error(f"plugin file not found: {spec}", None, "give a module name or a path to a .py file")
        mod_name = "rlhfc_plugin_" + os.path.splitext(os.path.basename(spec))[0]
        loader_spec = importlib.util.spec_from_file_location(mod_name, spec)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
        return
    try:
        importlib.import_module(spec)
    except ImportError as exc:
        raise error(f"cannot import plugin '{spec}': {exc}", None,
                    "the module must be importable (on PYTHONPATH), or pass a path to a .py file") from None
