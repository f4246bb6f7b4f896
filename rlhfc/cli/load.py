"""Reading a program for a command: plugins first, then the ``.rlhf`` or ``.rlir`` file."""

from __future__ import annotations

from rlhfc.ir import Module

from .app import print_diagnostics


def load_plugins(plugins: list[str] | None) -> None:
    """Import each ``--plugin`` (a module name or a ``.py`` file) so its passes and ops register."""
    from rlhfc.passes import load_plugin

    for p in plugins or []:
        load_plugin(p)


def load(path: str, plugins: list[str] | None = None) -> tuple[Module, str]:
    """The verified module of ``path`` and its source text; warnings go to stderr, errors raise
    :class:`~rlhfc.ir.CompileError`."""
    from rlhfc.frontend import load_file

    load_plugins(plugins)
    module, warnings, text = load_file(path)
    print_diagnostics(warnings, text)
    return module, text
