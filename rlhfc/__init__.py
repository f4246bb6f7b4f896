"""rlhfc — a compiler for RLHF training jobs.

Stages: ``frontend`` (.rlhf → IR), ``ir`` (stage graph, text form, verifier),
``passes`` (optimisations), ``cost`` (cost model, simulator), ``codegen``
(job emitter) and ``runtime`` (what a compiled job imports).
"""

__version__ = "0.1.0"
