"""Torch threads per call: cores follow the work.

A worker starts with one torch thread per core of its mesh (``plan.json``: ``threads``), what a stage
running alone uses. When the plan overlaps stages of several workers on the same cores (parallel forwards,
a stream's consumers beside generation), the driver's call says so with ``threads=N``
(:func:`rlhfc.ir.schedule.stage_threads` decides, the simulator prices the same numbers), and the worker
runs that call with N threads, then goes back to its own count.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .trace import recorded


@contextlib.contextmanager
def call_threads(own: int, threads: int | None):
    """Run the body with ``threads`` torch threads (the worker's ``own`` count when None), then restore.
    The count is the calling thread's: in a process hosting several models (:mod:`.host`) another model's
    call may have left this thread at its own count."""
    want = max(1, int(own if threads is None else threads))
    if want == torch.get_num_threads():
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(max(1, int(own)))


def stage_call(fn):
    """Decorate a worker's stage method: it takes ``threads=N`` (see the module docstring), and is timed
    while the job traces (:func:`rlhfc.runtime.worker.trace.recorded`). A generator method (a Ray streaming
    generator) stays a generator, holding the threads while it runs."""
    generator = inspect.isgeneratorfunction(fn)
    if generator:
        def threaded(self, *args, threads: int | None = None, **kwargs):
            with call_threads(getattr(self, "threads", 1), threads):
                yield from fn(self, *args, **kwargs)
    else:
        def threaded(self, *args, threads: int | None = None, **kwargs):
            with call_threads(getattr(self, "threads", 1), threads):
                return fn(self, *args, **kwargs)
    wrapper = functools.wraps(fn)(recorded(threaded, fn.__name__, generator))
    wrapper.stage = True   # a stage of the plan: a shared process swaps in the model's random state (.host)
    # Ray checks a call's arguments against the method's signature, after unwrapping: no __wrapped__, and
    # the signature given is the wrapped one plus ``threads``
    del wrapper.__wrapped__
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    extra = inspect.Parameter("threads", inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, q in enumerate(params) if q.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    wrapper.__signature__ = sig.replace(parameters=params[:at] + [extra] + params[at:])
    return wrapper
