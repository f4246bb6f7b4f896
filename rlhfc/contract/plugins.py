"""Plugins: modules that register passes, ops or engines, imported by the compiler and by the job alike.

A plugin is a module name (importable where the job runs: on ``PYTHONPATH``) or a path to a ``.py`` file,
imported under a name derived from its absolute path (:func:`module_name`), so a registry entry that names
its class as ``f"{__name__}:Class"`` resolves in every process that imported the plugin. ``rlhfc compile
--plugin P`` records each plugin in the plan (``plugins``, file paths absolute); the job's driver imports
them when it reads the plan, and every worker before it builds its train backend and rollout engine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


class PluginError(ImportError):
    """A plugin that cannot be imported: ``hint`` says what to do."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


def is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def module_name(path: str) -> str:
    """The module name a ``.py`` plugin is imported under."""
    return "rlhfc_plugin_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.abspath(path))[0])


def recorded(spec: str) -> str:
    """How the plan records plugin ``spec``: a module name as given, a file path made absolute."""
    return os.path.abspath(spec) if is_path(spec) else spec


def import_plugin(spec: str):
    """Import plugin ``spec`` once per process (a module name or a ``.py`` path); returns the module.
    A missing module or file is a :class:`PluginError`; an error inside the plugin propagates."""
    if not is_path(spec):
        try:
            return importlib.import_module(spec)
        except ModuleNotFoundError as exc:
            if exc.name != spec and not spec.startswith(f"{exc.name}."):
                raise
            raise PluginError(f"cannot import plugin '{spec}': {exc}", "the module must be importable (on "
                              "PYTHONPATH), or pass a path to a .py file") from None
    name = module_name(spec)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(spec):
        raise PluginError(f"plugin file not found: {spec}", "give a module name or a path to a .py file")
    loader_spec = importlib.util.spec_from_file_location(name, spec)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
