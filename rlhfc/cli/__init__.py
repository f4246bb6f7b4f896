"""The ``rlhfc`` command line.

Layers, each importing only those before it (no cycle):

- :mod:`.app`: the typer app, diagnostics on stderr, exit statuses, :func:`main` and the console entry.
- :mod:`.load`: plugins, then a ``.rlhf`` or ``.rlir`` program.
- :mod:`.optimise`: the pass pipeline of ``--passes`` / ``-O`` (levels named by :func:`rlhfc.ir.plan.opt_level`).
- :mod:`.compile`: ``check``, ``compile``, ``run``, ``passes``.
- :mod:`.explain`: ``explain`` and ``profile``.
- :mod:`.compare`: ``compare`` (a run folder beside the prediction for its plan; imports :mod:`.explain`).
- :mod:`.outputs`: ``export`` and ``plot`` (read a run folder; import only :mod:`.app`).

Importing this package registers every command on :data:`app`.
"""

from __future__ import annotations

from . import compare, compile, explain, outputs  # noqa: F401  (register the commands)
from .app import _entry, app, main, print_diagnostics

__all__ = ["app", "main", "print_diagnostics", "_entry"]
