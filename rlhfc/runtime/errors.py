"""The one error type of a running job (shared by the driver, cluster start-up and worker groups)."""

from __future__ import annotations


class JobError(Exception):
    """A failure the user can act on; printed as ``error: ...`` + ``hint: ...`` without a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint


def out_of_memory(exc: BaseException) -> bool:
    """Whether a failure is a worker running out of memory (torch's allocators, Ray's memory monitor)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(k in text for k in ("outofmemoryerror", "out of memory", "can't allocate memory",
                                   "not enough memory", "memory monitor"))
