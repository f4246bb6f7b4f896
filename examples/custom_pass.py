"""A custom rlhfc pass: ``clamp-generation{max_new_tokens=N}``.

It caps the response length of every ``generate`` stage at ``N`` tokens and
changes nothing else: stages that already generate ``N`` tokens or fewer keep
their setting, and no other stage, model or annotation is touched. Use it to
turn a production pipeline into a quick smoke run (short responses make every
stage of a step cheaper) without editing the program.

Because shorter responses change what the job trains on, the pass is not
*exact* (``exact = False``): ``rlhfc passes`` lists it as "changes training",
and it never runs as part of an -O level, only when named.

From the command line (the plugin is a module name or a path to this file)::

    rlhfc compile examples/ppo_tiny.rlhf --plugin examples/custom_pass.py \\
        --passes clamp-generation{max_new_tokens=8}
    rlhfc compile examples/ppo_7b.rlhf --plugin examples/custom_pass.py \\
        --passes 'dce,clamp-generation{max_new_tokens=64}' --print-after clamp-generation
    rlhfc passes --plugin examples/custom_pass.py        # lists it with its option

From Python (run from the repository root)::

    from rlhfc.frontend import load_file
    from rlhfc.ir import print_module
    from rlhfc.passes import PassManager, get_pass, load_plugin, parse_pipeline

    load_plugin("examples/custom_pass.py")          # registers clamp-generation (or import this module)
    module, warnings, text = load_file("examples/ppo_tiny.rlhf")
    passes = parse_pipeline("dce,clamp-generation{max_new_tokens=8}")
    # ... or build the instances directly:
    passes = [get_pass("dce")(), get_pass("clamp-generation")(max_new_tokens=8)]
    module = PassManager(passes).run(module)         # verifies after each pass
    assert module.graph.stage("roll").attrs["max_new_tokens"] == 8
    print(print_module(module))

How to write your own: subclass :class:`rlhfc.passes.Pass` as a frozen
dataclass, give it a ``name`` (used on the command line) and a one-line
``description``, declare options as typed fields (``int``, ``float``, ``str``,
``bool``; ``metadata={"doc": ...}`` documents them), check them in
``__post_init__`` (raise ``ValueError``), and edit the module in ``run``
through the IR API (``module.graph.stages``, ``stage.attrs``,
``stage.annotations``, ``graph.insert/remove/replace_all_uses``; call
``module.refresh_versions()`` if you move, add or remove stages). The pass
manager verifies the IR after your pass and names your pass if it is invalid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.ir import Module
from rlhfc.passes import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class ClampGeneration(Pass):
    """Cap ``max_new_tokens`` of every ``generate`` stage at :attr:`max_new_tokens`."""

    name = "clamp-generation"
    description = "cap max_new_tokens of every generate stage (for quick smoke runs)"
    exact = False

    max_new_tokens: int = field(default=16, metadata={"doc": "the longest response any generate stage may produce"})

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def run(self, module: Module) -> Module:
        for stage in module.graph.stages:
            if stage.op == "generate" and stage.attrs["max_new_tokens"] > self.max_new_tokens:
                stage.attrs["max_new_tokens"] = self.max_new_tokens
        return module
