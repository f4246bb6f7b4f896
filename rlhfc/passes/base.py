"""Pass infrastructure: the ``Pass`` base class, the registry, option parsing and plugins.

A pass is a small frozen dataclass: a ``name``, a one-line ``description``,
whether it is ``exact`` (cannot change what the job computes), and its options
as dataclass fields (``int``, ``float``, ``str``, ``bool``, or one of those
``| None``; ``field(metadata={"doc": ...})`` documents an option for
``rlhfc passes``). ``run(module)`` returns the transformed module (it may
mutate and return its argument) and must leave valid IR: the
:class:`~rlhfc.passes.PassManager` verifies after every pass. A pass validates
its options in ``__post_init__`` by raising ``ValueError``. Passes are
registered by name::

    @register_pass
    @dataclass(frozen=True)
    class ClampGeneration(Pass):
        name = "clamp-generation"
        description = "cap max_new_tokens of every generate stage"
        max_new_tokens: int = field(default=64, metadata={"doc": "the cap"})

        def run(self, module): ...

and named on the command line as ``--passes dce,clamp-generation{max_new_tokens=32}``
(see ``examples/custom_pass.py`` for a complete one). Built-in passes are
registered lazily (:func:`register_lazy`): their module is imported on first use.

Stability: ``Pass``, ``register_pass``, ``get_pass``, ``registered_passes``,
``parse_pipeline`` and ``load_plugin`` are the public pass API.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import ClassVar

from rlhfc.contract.plugins import PluginError, import_plugin
from rlhfc.ir import Module
from rlhfc.ir.diagnostics import did_you_mean, error

#: option types a pipeline string can set
OPTION_TYPES = ("int", "float", "str", "bool")


@dataclass(frozen=True)
class Pass:
    """Base class of every pass. Subclasses set ``name``/``description`` and override :meth:`run`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: True when the pass cannot change what the job trains (verified by end-to-end tests)
    exact: ClassVar[bool] = True
    #: True when an exact pass may still change results in the last bits of floating point
    #: (same math, different order of operations); its end-to-end tests use a stated tolerance
    rounding: ClassVar[bool] = False

    def run(self, module: Module) -> Module:  # pragma: no cover - abstract
        raise NotImplementedError(f"pass {self.name} does not implement run()")

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        """The pass's options: its dataclass fields."""
        return list(dataclasses.fields(cls))

    @classmethod
    def option_help(cls) -> list[tuple[str, str, str, str]]:
        """``(name, type, default, doc)`` of each option, as ``rlhfc passes`` shows them."""
        out = []
        for f in cls.options():
            if f.default is not dataclasses.MISSING:
                default = _format_option(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = _format_option(f.default_factory())
            else:
                default = "(required)"
            out.append((f.name, _type_name(f), default, f.metadata.get("doc", "")))
        return out

    def spec(self) -> str:
        """How this configured pass is written in a pipeline string (options that differ from the default)."""
        opts = []
        for f in self.options():
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                opts.append(f"{f.name}={_format_option(value)}")
        return self.name + ("{" + ",".join(opts) + "}" if opts else "")


def _format_option(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def _type_name(f: dataclasses.Field) -> str:
    t = f.type
    text = t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)
    text = text.replace("typing.", "").strip()
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1] + " | None"
    return text


_REGISTRY: dict[str, type[Pass]] = {}
_LAZY: dict[str, str] = {}   # pass name -> module that registers it (imported on first use)


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available by its name.

    Registering another class under a taken name is an error (pick another
    name); registering the same class again (a plugin loaded twice) replaces it.
    """
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise TypeError(f"register_pass expects a Pass subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name: set `name = \"my-pass\"` in the class body")
    if not dataclasses.is_dataclass(cls) or "__dataclass_fields__" not in cls.__dict__:
        raise ValueError(f"pass {cls.name}: decorate {cls.__name__} with @dataclass(frozen=True) "
                         "(below @register_pass)")
    old = _REGISTRY.get(cls.name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__) \
            and not _same_plugin(old, cls):
        raise ValueError(f"pass name '{cls.name}' is already registered by {old.__module__}.{old.__qualname__}; "
                         "choose another name")
    lazy = _LAZY.get(cls.name)
    if old is None and lazy is not None and lazy != cls.__module__:
        raise ValueError(f"pass name '{cls.name}' is reserved by the built-in pass in {lazy}; choose another name")
    _REGISTRY[cls.name] = cls
    return cls


def _same_plugin(old: type, new: type) -> bool:
    """The same plugin file loaded twice (under different module names) defines the same class."""
    old_file = getattr(sys.modules.get(old.__module__), "__file__", None)
    new_file = getattr(sys.modules.get(new.__module__), "__file__", None)
    return bool(old_file) and old_file == new_file and old.__qualname__ == new.__qualname__


def unregister_pass(name: str) -> None:
    """Forget a registered pass (tests and interactive sessions)."""
    _REGISTRY.pop(name, None)


def register_lazy(name: str, module: str) -> None:
    """Register a built-in pass by the module that defines it, imported only when needed."""
    _LAZY.setdefault(name, module)


def _load_lazy() -> None:
    for name, mod in list(_LAZY.items()):
        if name not in _REGISTRY:
            importlib.import_module(mod)


def registered_passes() -> dict[str, type[Pass]]:
    """Every registered pass (built-in and plugin), by name."""
    _load_lazy()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> type[Pass]:
    """The pass class registered as ``name`` (raises a CompileError with a hint if none)."""
    if name not in _REGISTRY and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _REGISTRY:
        passes = registered_passes()
        close = did_you_mean(name, passes)
        raise error(f"unknown pass '{name}'", None,
                    (close + " " if close else "") +
                    f"passes: {', '.join(passes)} (`rlhfc passes` lists them; --plugin adds your own)")
    return _REGISTRY[name]


def _convert(cls: type[Pass], field: dataclasses.Field, text: str):
    kind = _type_name(field)
    optional = kind.endswith("| None")
    base = kind.removesuffix("| None").strip()
    if optional and text.lower() == "none":
        return None
    try:
        if base == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        if base == "str":
            return text
    except ValueError:
        example = {"bool": "true", "int": "8", "float": "0.5"}[base]
        raise error(f"pass {cls.name}: option '{field.name}' expects {base}, got {text!r}", None,
                    f"write a{'n' if base == 'int' else ''} {base}, e.g. {cls.name}{{{field.name}={example}}}") from None
    raise error(f"pass {cls.name}: option '{field.name}' has type {kind}, which cannot be set from a pipeline string",
                None, f"settable option types: {', '.join(OPTION_TYPES)} (or one of them | None)")


def parse_pipeline(text: str) -> list[Pass]:
    """``"dce,clamp-generation{max_new_tokens=32}"`` -> configured pass instances.

    Raises a CompileError (with a hint) for an unknown pass, an unknown option,
    a value of the wrong type, an option the pass rejects, or bad syntax.
    """
    passes: list[Pass] = []
    for item in _split(text):
        name, brace, rest = item.partition("{")
        name = name.strip()
        if not name:
            raise error(f"pass options without a pass name: {item!r}", None, "write name{opt=value}")
        cls = get_pass(name)
        kwargs = {}
        if brace:
            if not rest.endswith("}") or "{" in rest[:-1] or "}" in rest[:-1]:
                raise error(f"bad options for pass '{name}': {item!r}", None,
                            "write name{opt=value,other=value} (no nested braces)")
            fields = {f.name: f for f in cls.options()}
            for pair in filter(None, (p.strip() for p in rest[:-1].split(","))):
                key, eq, val = pair.partition("=")
                key = key.strip()
                if key not in fields:
                    close = did_you_mean(key, fields)
                    raise error(f"pass {name} has no option '{key}'", None,
                                (close + " " if close else "") +
                                (f"options: {', '.join(fields)}" if fields else f"{name} takes no options"))
                if not eq:
                    raise error(f"pass {name}: option '{key}' needs a value", None, f"write {key}=VALUE")
                if key in kwargs:
                    raise error(f"pass {name}: option '{key}' given twice", None, "give each option once")
                kwargs[key] = _convert(cls, fields[key], val.strip())
        try:
            passes.append(cls(**kwargs))
        except (TypeError, ValueError) as exc:
            missing = [f.name for f in cls.options() if f.name not in kwargs and
                       f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
            if missing:
                raise error(f"pass {name} needs option '{missing[0]}'", None,
                            f"write {name}{{{missing[0]}=...}}") from None
            raise error(f"pass {name}: {exc}", None, f"`rlhfc passes` shows the options of {name}") from None
    return passes


def _split(text: str) -> list[str]:
    """Split a pipeline string at top-level commas (commas inside ``{...}`` separate options)."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise error(f"unbalanced '}}' in pass pipeline {text!r}", None, "e.g. --passes dce,name{opt=1}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise error(f"unclosed '{{' in pass pipeline {text!r}", None, "e.g. --passes dce,name{opt=1}")
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def load_plugin(spec: str) -> None:
    """Import a plugin that registers passes (or ops): a module name (``my_passes``) or a ``.py`` path.

    Errors while importing it become CompileErrors naming the plugin.
    """
    try:
        import_plugin(spec)
    except PluginError as exc:
        raise error(exc.message, None, exc.hint) from None
    except Exception as exc:
        raise error(f"plugin '{spec}' failed to load: {type(exc).__name__}: {exc}", None,
                    "fix the plugin; RLHFC_DEBUG=1 shows the traceback") from exc
