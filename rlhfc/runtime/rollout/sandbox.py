"""The tool sandbox: runs a user's tool — a function ``f(args: str) -> str`` in a .py file — for a multi-turn,
tool-using rollout, each call in a process of its own with time and memory limits, no network and a working
folder of its own. Whatever goes wrong in a call comes back as an error observation (a :class:`ToolResult`),
never as an exception in the caller.

**A guard against accidents and runaway tools, not a security boundary.** It uses what a process without root
has: resource limits and Python audit hooks (PEP 578). There are no namespaces, seccomp filters or chroot here,
so code that means harm gets out (through ``ctypes``, a C extension, a descriptor it was handed): run untrusted
tools inside a container or VM as well. Linux only (``fork``, ``/proc``, ``RLIMIT_AS``).

Why this file is long: it is also the zygote's script, run by path, so the caller's side, the zygote and the
confined call share one file that imports only the standard library (halves in two modules would need
``sys.path`` set up to find each other in a process that must not see this package's folder).

What each call's process gets, before the tool runs:

* wall clock: SIGKILL (its process group) ``timeout`` s after it started -> kind ``"timeout"``; RLIMIT_CPU of
  ceil(timeout) + 1 s (SIGXCPU -> ``"timeout"``); a SIGALRM at timeout + 1 s ends it should its zygote be gone.
* memory: RLIMIT_AS = the address space of the process with the tool loaded + ``memory_mb`` (what a module
  imported at load, numpy say, maps does not count against a call) -> ``MemoryError`` -> "out of memory".
* files: a fresh working folder under the sandbox's temp root (its cwd and ``TMPDIR``), removed after the call.
  Refused when the path resolves outside it: ``open``/``os.open`` for writing, creating or appending,
  ``os.remove``/``unlink``, ``rename``/``replace``, ``mkdir``, ``rmdir``, ``chmod``, ``chown``, ``utime``,
  ``truncate``, ``symlink``, ``link``, ``setxattr``/``removexattr``, ``shutil.rmtree``, ``sqlite3.connect``,
  ``os.mkfifo``/``mknod`` (these two have no audit event: wrapped). Reading anywhere stays allowed (imports
  need it); ``/dev/null`` may be written. RLIMIT_FSIZE caps every file it writes at 64 MiB.
* network: every ``socket.*`` audit event (``socket.__new__``, ``connect``, ``bind``, ``getaddrinfo``, ...).
* processes: ``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.posix_spawn*``, ``os.fork``,
  ``os.forkpty`` are refused, and ``_posixsubprocess.fork_exec`` (multiprocessing's spawn calls it without an
  audit event) is replaced by a refusal; ``os.kill``/``killpg`` may signal only the call's own process.
* output: stdin is /dev/null; stdout/stderr go to ``.output`` in its folder, Python's writes capped at 1 MiB
  (the rest dropped, so printing megabytes breaks nothing); the returned text is cut to ``max_output``.

A refusal raises :class:`SandboxRefusal` (a ``PermissionError``) in the tool. Not enforced: anything below
the audit hooks (``ctypes``, C extensions, ``mmap`` of an already open file), ``dir_fd=`` arguments (paths are
resolved against the cwd), writes through a descriptor the process already holds, a tool that sets its own
SIGALRM handler (the backstop above), and threads (each counts against RLIMIT_AS and RLIMIT_CPU, no more).

How it runs: :class:`ToolSandbox` starts a zygote per tool — ``python <this file> --zygote <json>`` (the file
imports only the standard library, so it runs by path) — which loads the tool module once and forks a child
per call. Protocol: one JSON line per request on the zygote's stdin (``{"args": [...]}``), one per answer on
its stdout (``{"results": [{"output", "kind", "seconds"}, ...]}``; at start ``{"ready": true}`` or
``{"error": cause}``); the zygote's fd 1 points at its log, so nothing else reaches that pipe. At EOF (the
sandbox closed, or its caller killed outright) the zygote removes the temp root and ends. A zygote that dies is
restarted by the next call (which runs its batch again); one that dies 3 times in one call is a
:class:`ToolSandboxError`.

**Environments** (:class:`EnvSandbox`) are stateful — one instance per trajectory, ``reset`` then ``step`` after
``step`` — so they do not fork per call: ``python <this file> --env <json>`` loads the class and confines
*itself* as a call is confined (its own working folder, the same audit hooks, RLIMIT_AS = its size with the
class loaded + ``memory_mb``, RLIMIT_FSIZE, no core files, stdin its requests), holds the instances, and answers
one JSON line per request line: ``{"ops": [[op, id, method, arg], ...]}`` -> ``{"answers": [...]}``, in order,
each ``{"value": ...}`` or ``{"error": "Type: message", "type": "Type"}`` (ops: ``new`` makes instance ``id``,
``call`` runs its ``method(arg)``, ``clear`` drops every instance) — a rollout's resets or a turn's steps in one
round trip. Each call has ``timeout`` seconds of wall clock
(a SIGALRM in the process raises ``TimeoutError`` in it; no CPU limit: the process lives for the run); a
process silent past every call's time and a grace is killed. Its values cross as JSON (an observation a string, a reward a
number, ``done`` a boolean; a record's fields as read from the data file). An environment that raises, runs
out of memory, is refused something or kills its process makes the call raise, naming what happened: the
generating worker stops the run naming the environment (:class:`rlhfc.runtime.rollout.agent.EnvError`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

#: the file a call's stdout and stderr go to, in its folder, and how much of Python's writes to them is kept
OUTPUT_FILE = ".output"
OUTPUT_FILE_BYTES = 1 << 20
#: RLIMIT_FSIZE of a call: the largest file it may write
FILE_SIZE_LIMIT = 64 << 20
#: seconds the zygote has to load the tool; seconds past a batch's timeout before a silent zygote is killed
START_TIMEOUT = 120.0
ANSWER_GRACE = 30.0
#: zygote deaths within one call before :meth:`ToolSandbox.call` gives up
MAX_DEATHS = 3

_SCRIPT = os.path.abspath(__file__)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                             "os.forkpty", "os.startfile", "pty.spawn"})
#: path events: (argument index, follows symlinks) of each path the event writes
_PATH_EVENTS = {
    "os.remove": ((0, False),), "os.rmdir": ((0, False),), "os.mkdir": ((0, False),),
    "os.rename": ((0, False), (1, False)),  # os.replace raises os.rename
    "os.link": ((0, True), (1, False)), "os.symlink": ((1, False),),
    "os.chmod": ((0, True),), "os.chown": ((0, True),), "os.utime": ((0, True),), "os.truncate": ((0, True),),
    "os.setxattr": ((0, True),), "os.removexattr": ((0, True),), "os.chflags": ((0, True),),
    "os.lchflags": ((0, False),), "shutil.rmtree": ((0, False),),
}


@dataclass(frozen=True)
class ToolSpec:
    """A tool of the program: ``function`` in the file at ``path``, called as ``function(args: str)``.

    ``timeout``: wall-clock seconds per call. ``memory_mb``: the address space a call may map on top of the
    loaded tool's process (its RLIMIT_AS is that size + ``memory_mb``). ``max_output``: characters of the
    returned text kept (a longer text is an error observation holding its first ``max_output`` characters)."""

    name: str
    path: str
    function: str
    timeout: float = 2.0
    memory_mb: int = 256
    max_output: int = 1024

    def __post_init__(self):
        if not self.name or not self.function or not self.path:
            raise ValueError(f"a tool needs a name, a path and a function: {self!r}")
        if not (self.timeout > 0 and self.memory_mb > 0 and self.max_output > 0):
            raise ValueError(f"tool {self.name!r}: timeout, memory_mb and max_output must be positive")


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome. ``output`` is what the policy sees: the tool's text (``str()`` of a value that is
    not a str) when ``kind == "ok"``, else an observation starting ``"error: "``:

    * ``"error: ZeroDivisionError: division by zero"`` — the tool raised (the exception's type and message);
    * ``"error: timed out after 2 s"`` (kind ``"timeout"``; past the CPU limit: ``"error: timed out (CPU
      time limit, 3 s)"``);
    * ``"error: out of memory (256 MB)"`` — a ``MemoryError`` (past RLIMIT_AS);
    * ``"error: network access is not allowed"``, ``"error: starting a process is not allowed"``,
      ``"error: writing outside the tool's folder is not allowed (<path>)"``, ``"error: signalling another
      process is not allowed"`` — a refusal ended the call;
    * ``"error: output too long (5000 characters, limit 1024); its first 1024 characters:\\n<text>"``;
    * ``"error: the tool's process died (signal 11, SIGSEGV)"``, ``"error: the tool's process exited (status
      3) without returning"``, ``"error: the tool's process sent a malformed result"``.

    ``seconds``: the call's wall time, fork to result."""

    output: str
    kind: str  # "ok" | "error" | "timeout"
    seconds: float


class ToolSandboxError(RuntimeError):
    """The sandbox itself cannot run the tool: it does not load, or its zygote keeps dying."""


class SandboxRefusal(PermissionError):
    """What a refused operation raises inside a call; ``observation`` is the text the policy sees."""

    def __init__(self, observation: str, detail: str = ""):
        super().__init__(f"{observation} in a tool sandbox{f' ({detail})' if detail else ''}")
        self.observation = observation


# ----------------------------------------------------------------------------------------------- the caller


class _Live:
    """The zygote of a sandbox, shared with its finalizer (which must not hold the sandbox)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None


def _stop(proc: subprocess.Popen | None, grace: float = 1.0) -> None:
    """End a zygote: with a ``grace``, by EOF on its stdin (it removes the temp root then, as when its caller
    dies), SIGKILL past it; without, by SIGKILL at once (a restart: the root stays for the next zygote)."""
    if proc is None:
        return
    try:
        if grace > 0:
            proc.stdin.close()
            proc.wait(grace)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def _cleanup(live: _Live, root: str, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked copy of the caller (a data-loader worker, ...) ending: the zygote is not its own
    _stop(live.proc)
    live.proc = None
    _rmtree(root)


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # a tool took away its folder's write permission
        for top, dirs, _ in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(top, d), 0o700)
        shutil.rmtree(path, ignore_errors=True)


class _Died(Exception):
    """The zygote died or went silent (the message says which)."""


class ToolSandbox:
    """A tool's zygote and its calls. ``call(args)`` runs one call per string, all at once, each in its own
    forked process, and returns their results in order; ``close()`` (or leaving a ``with`` block) ends the
    zygote and removes the temp folders."""

    def __init__(self, spec: ToolSpec, root: str | None = None):
        self.spec = spec
        self.path = os.path.abspath(spec.path)
        self._lock = threading.Lock()
        self._closed = False
        self._buf = bytearray()
        self._live = _Live()
        if root:   # the calls' folders under ``root`` (a job's run folder: nothing is left in /tmp)
            os.makedirs(root, exist_ok=True)
        self._root = tempfile.mkdtemp(prefix=f"rlhfc-tool-{''.join(c for c in spec.name if c.isalnum())[:20]}-",
                                      dir=root or None)
        self._finalizer = weakref.finalize(self, _cleanup, self._live, self._root, os.getpid())
        try:
            self._start()
        except _Died as e:
            self.close()
            raise ToolSandboxError(f"tool {spec.name!r}: its sandbox did not start for {self.path}: {e}") from None
        except BaseException:
            self.close()
            raise

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._live.proc

    def call(self, args: list[str]) -> list[ToolResult]:
        """Run ``function(a)`` for each ``a`` in ``args``, concurrently; the results in order. A zygote found
        dead is restarted; :class:`ToolSandboxError` after it died :data:`MAX_DEATHS` times in this call."""
        given, args = args, [] if isinstance(args, (str, bytes)) else list(args)
        if isinstance(given, (str, bytes)) or not all(isinstance(a, str) for a in args):
            raise TypeError(f"tool {self.spec.name!r}: call() takes a list of str, one per call, got {given!r:.200}")
        if not args:
            return []
        with self._lock:
            deaths = []
            while True:
                if self._closed:
                    raise ToolSandboxError(f"tool {self.spec.name!r}: the sandbox is closed")
                try:
                    if self._proc is None or self._proc.poll() is not None:
                        self._start()
                    return self._exchange(args)
                except _Died as e:
                    deaths.append(str(e))
                    _stop(self._live.proc, grace=0)
                    self._live.proc = None
                    if len(deaths) >= MAX_DEATHS:
                        raise ToolSandboxError(
                            f"tool {self.spec.name!r} keeps killing its sandbox: the sandbox process died "
                            f"{len(deaths)} times during one call (last: {deaths[-1]})") from None

    def close(self) -> None:
        """End the zygote and remove the temp folders; safe to call twice."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ToolSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()

    def _start(self) -> None:
        _stop(self._live.proc, grace=0)
        self._live.proc, self._buf = None, bytearray()
        cfg = {"name": self.spec.name, "path": self.path, "function": self.spec.function,
               "timeout": self.spec.timeout, "memory_mb": self.spec.memory_mb,
               "max_output": self.spec.max_output, "root": self._root}
        log_path = os.path.join(self._root, "zygote.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, _SCRIPT, "--zygote", json.dumps(cfg)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, bufsize=0, start_new_session=True)
        self._live.proc = proc
        line = self._read_line(START_TIMEOUT, "ready line")
        try:
            msg = json.loads(line)
        except ValueError:
            raise _Died(f"it started with something else than a ready line: {line[:200]!r}") from None
        if "error" in msg:
            _stop(proc, grace=0)
            self._live.proc = None
            raise ToolSandboxError(f"tool {self.spec.name!r}: cannot load function {self.spec.function!r} from "
                                   f"{self.path}: {msg['error']}")

    def _exchange(self, args: list[str]) -> list[ToolResult]:
        proc = self._live.proc
        data = memoryview((json.dumps({"args": args}) + "\n").encode())
        try:
            while data:
                data = data[os.write(proc.stdin.fileno(), data):]
        except OSError as e:
            raise _Died(f"it no longer reads its requests ({type(e).__name__})") from None
        line = self._read_line(self.spec.timeout + ANSWER_GRACE, "answer")
        try:
            answers = json.loads(line)["results"]
            return [ToolResult(str(a["output"]), str(a["kind"]), float(a["seconds"])) for a in answers]
        except (ValueError, KeyError, TypeError) as e:
            raise _Died(f"it answered something else than results ({e})") from None

    def _read_line(self, seconds: float, what: str) -> bytes:
        try:
            return _next_line(self._live.proc, self._buf, seconds)
        except TimeoutError:
            raise _Died(f"no {what} from it within {seconds:g} s") from None
        except EOFError:
            raise _Died(self._death(self._live.proc)) from None

    def _death(self, proc: subprocess.Popen) -> str:
        try:
            rc = proc.wait(5)
        except subprocess.TimeoutExpired:
            rc = None
        how = (f"signal {-rc} ({_signame(-rc)})" if rc is not None and rc < 0 else f"exit status {rc}")
        if not rc or rc < 0:
            return f"it ended with {how}"
        try:  # a Python error in the zygote: its traceback's last line
            with open(os.path.join(self._root, "zygote.log"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 2000))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"it ended with {how}" + (f": {lines[-1].strip()}" if lines else "")


def _next_line(proc: subprocess.Popen, buf: bytearray, seconds: float) -> bytes:
    """The next line ``proc`` writes on its stdout (``buf`` keeps what was read past it); ``TimeoutError`` past
    ``seconds``, ``EOFError`` when the pipe closes first."""
    deadline, fd = time.monotonic() + seconds, proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not sel.select(left):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "?"


@dataclass(frozen=True)
class EnvSpec:
    """An environment of the program: class ``cls`` in the file at ``path``; ``timeout``: wall-clock seconds of
    each ``reset``/``step`` (and of building an instance); ``memory_mb``: what its process may map on top of
    its size with the class loaded."""

    name: str
    path: str
    cls: str
    timeout: float = 10.0
    memory_mb: int = 512

    def __post_init__(self):
        if not (self.timeout > 0 and self.memory_mb > 0):
            raise ValueError(f"environment {self.name!r}: timeout and memory_mb must be positive")


class EnvCallError(RuntimeError):
    """What an environment's call raised in its sandbox (``kind``: the exception's type name there, or
    ``TimeoutError``/``ProcessDied``)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class EnvSandbox:
    """The process holding an environment's instances (module docstring). ``new()`` gives an instance's handle
    (made in the process with its first call), whose ``reset(record)`` and ``step(action)`` run there;
    :meth:`batch` runs many calls in one exchange, in order (a rollout's resets, a turn's steps: one round trip
    instead of one per row); ``clear()`` drops every instance (after a rollout); ``close()`` ends the process
    and removes its folder. A process that died or timed out is started again by the next call; the instances
    it held are gone (their calls raise)."""

    def __init__(self, spec: EnvSpec, root: str | None = None):
        self.spec = spec
        self.path = os.path.abspath(spec.path)
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._live = _Live()
        self._epoch = 0   # bumped at each start: handles of an earlier process are stale
        self._made = 0
        if root:
            os.makedirs(root, exist_ok=True)
        self._root = tempfile.mkdtemp(prefix=f"rlhfc-env-{''.join(c for c in spec.name if c.isalnum())[:20]}-",
                                      dir=root or None)
        self._finalizer = weakref.finalize(self, _cleanup, self._live, self._root, os.getpid())

    def new(self) -> "_EnvHandle":
        with self._lock:
            if self._live.proc is None or self._live.proc.poll() is not None:
                self._start()
            self._made += 1
            return _EnvHandle(self, self._made, self._epoch)

    def batch(self, calls: list[tuple["_EnvHandle", str, object]]) -> list:
        """Run ``handle.method(arg)`` for each call, in order, in one exchange; each result is the call's value or
        the :class:`EnvCallError` it raised (a process killed past its time or dead fails the calls it had not
        answered)."""
        if not calls:
            return []
        with self._lock:
            ops = []
            for handle, method, arg in calls:
                if handle.epoch != self._epoch or self._live.proc is None or self._live.proc.poll() is not None:
                    return [EnvCallError("ProcessDied", "the environment's process was restarted since this "
                                                        "instance was made")] * len(calls)
                if not handle.made:
                    ops.append(["new", handle.id, "__init__", None])
                    handle.made = True
                ops.append(["call", handle.id, method, arg])
            answers = self._exchange(ops, calls[0][1])
        out, pending = [], None
        for op, answer in zip(ops, answers):
            failed = EnvCallError(str(answer.get("type", "Error")), str(answer["error"])) if "error" in answer else None
            if op[0] == "new":
                pending = failed   # an instance that could not be made fails its call
                continue
            out.append(failed or pending or answer.get("value"))
            pending = None
        return out

    def clear(self) -> None:
        with self._lock:
            if self._live.proc is not None and self._live.proc.poll() is None:
                self._exchange([["clear", 0, "clear", None]], "clear")

    def close(self) -> None:
        self._finalizer()

    def __del__(self):
        fin = getattr(self, "_finalizer", None)
        if fin is not None:
            fin()

    def _start(self) -> None:
        _stop(self._live.proc, grace=0)
        self._live.proc, self._buf = None, bytearray()
        self._epoch += 1
        cfg = {"name": self.spec.name, "path": self.path, "cls": self.spec.cls, "timeout": self.spec.timeout,
               "memory_mb": self.spec.memory_mb, "root": self._root}
        with open(os.path.join(self._root, "env.log"), "ab") as log:
            self._live.proc = subprocess.Popen([sys.executable, _SCRIPT, "--env", json.dumps(cfg)],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
                                               start_new_session=True)
        msg = self._answer(START_TIMEOUT, "start")
        if "error" in msg:
            self._kill()
            raise EnvCallError("LoadError", f"cannot load class {self.spec.cls!r} from {self.path}: {msg['error']}")

    def _exchange(self, ops: list, what: str) -> list[dict]:
        """Send ``ops`` in one request; their answers, in order. The process times each call itself (SIGALRM);
        past ``timeout`` per call (and a grace) without an answer it is killed."""
        proc = self._live.proc
        data = memoryview((json.dumps({"ops": ops}, default=_plain) + "\n").encode())
        try:
            while data:
                data = data[os.write(proc.stdin.fileno(), data):]
        except OSError:
            self._kill()
            return [{"error": "the environment's process is gone", "type": "ProcessDied"}] * len(ops)
        try:
            answers = self._answer(self.spec.timeout * len(ops) + ANSWER_GRACE, what).get("answers")
        except EnvCallError as e:
            return [{"error": str(e), "type": e.kind}] * len(ops)
        if not isinstance(answers, list) or len(answers) != len(ops):
            self._kill()
            return [{"error": "the environment's process sent a malformed answer", "type": "ProcessDied"}] * len(ops)
        return answers

    def _answer(self, seconds: float, what: str) -> dict:
        proc = self._live.proc
        try:
            line = _next_line(proc, self._buf, seconds)
        except TimeoutError:
            self._kill()
            raise EnvCallError("TimeoutError", f"{what}() timed out: no answer within {seconds:g} s (its process "
                                               "was killed)") from None
        except EOFError:
            rc = proc.wait()
            self._kill()
            how = f"signal {-rc} ({_signame(-rc)})" if rc < 0 else f"exit status {rc}"
            raise EnvCallError("ProcessDied", f"the environment's process died in {what}() ({how})") from None
        try:
            return json.loads(line)
        except ValueError:
            self._kill()
            raise EnvCallError("ProcessDied", f"the environment's process sent a malformed answer: {line[:200]!r}") \
                from None

    def _kill(self) -> None:
        _stop(self._live.proc, grace=0)
        self._live.proc = None


class _EnvHandle:
    """One environment instance in its sandbox, called as the instance would be (``batch``: many calls of its
    sandbox's instances in one exchange, :meth:`EnvSandbox.batch`)."""

    def __init__(self, box: EnvSandbox, ident: int, epoch: int):
        self.box, self.id, self.epoch, self.made = box, ident, epoch, False
        self.batch = box.batch

    def _one(self, method: str, arg):
        (out,) = self.box.batch([(self, method, arg)])
        if isinstance(out, EnvCallError):
            raise out
        return out

    def reset(self, record):
        return self._one("reset", record)

    def step(self, action):
        out = self._one("step", action)
        return tuple(out) if isinstance(out, list) else out


def _plain(value):
    """JSON for what an environment gives or gets besides JSON's own types (numpy scalars, tuples of them)."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"an environment's values cross as JSON: {type(value).__name__} is not JSON")


# ----------------------------------------------------------------------------------------------- the zygote


def _serve(cfg: dict) -> int:
    """The zygote: load the tool, answer ``{"ready": true}``, then one answer line per request line."""
    here = os.path.dirname(_SCRIPT)
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.realpath(here):
        del sys.path[0]  # this package's modules (vllm.py, ...) must not shadow the tool's imports
    answers = os.dup(1)
    os.dup2(2, 1)  # the tool's prints (at import) go to the log, never into the answers
    try:
        fn = _load(cfg["path"], cfg["function"])
    except _LoadError as e:
        _send(answers, {"error": str(e)})
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()  # fewer pages copied on write in the children
    cfg["root"] = os.path.realpath(cfg["root"])
    _send(answers, {"ready": True})
    seq = iter(range(1 << 62))
    for line in sys.stdin.buffer:
        results = _run_batch(fn, cfg, json.loads(line)["args"], seq)
        try:
            _send(answers, {"results": results})
        except BrokenPipeError:
            break
    _rmtree(cfg["root"])  # EOF: the sandbox was closed, or its caller is gone (killed: no finalizer ran)
    return 0


class _LoadError(Exception):
    pass


def _load(path: str, function: str):
    if not os.path.isfile(path):
        raise _LoadError("the file does not exist" if not os.path.exists(path) else "it is not a file")
    sys.path.insert(0, os.path.dirname(path))
    name = "_rlhfc_tool_" + "".join(c if c.isalnum() else "_" for c in os.path.basename(path)[:-3])
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise _LoadError(f"SyntaxError: {e.msg} (line {e.lineno})") from None
    except BaseException as e:  # noqa: BLE001 — an import raising SystemExit is a load failure too
        raise _LoadError(f"importing it raised {type(e).__name__}: {_one_line(str(e))}") from None
    if not hasattr(module, function):
        raise _LoadError(f"it defines no {function!r}")
    fn = getattr(module, function)
    if not callable(fn):
        raise _LoadError(f"{function!r} is not callable (it is a {type(fn).__name__})")
    return fn


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _send(fd: int, msg: dict) -> None:
    data = memoryview((json.dumps(msg) + "\n").encode())
    while data:
        data = data[os.write(fd, data):]


class _Call:
    def __init__(self, pid: int, r: int, folder: str, start: float):
        self.pid, self.r, self.folder, self.start, self.data = pid, r, folder, start, bytearray()


def _run_batch(fn, cfg: dict, args: list[str], seq) -> list[dict]:
    """Fork a child per call, all at once; collect each result or kill it at its deadline."""
    timeout, results, calls = cfg["timeout"], [None] * len(args), {}
    for i, arg in enumerate(args):
        folder = os.path.join(cfg["root"], f"call-{os.getpid()}-{next(seq)}")
        r = w = None
        start = time.monotonic()
        try:
            os.mkdir(folder, 0o700)
            r, w = os.pipe()
            pid = os.fork()
        except OSError as e:  # too many processes or descriptors: this call fails, the others run
            for fd in (r, w):
                if fd is not None:
                    os.close(fd)
            _rmtree(folder)
            results[i] = {"kind": "error", "output": f"error: the sandbox could not start the call ({e})",
                          "seconds": 0.0}
            continue
        if pid == 0:
            _child(fn, cfg, arg, folder, w)  # never returns
        os.close(w)
        os.set_blocking(r, False)
        calls[i] = _Call(pid, r, folder, start)
    cap = 16 * cfg["max_output"] + 65536
    with selectors.DefaultSelector() as sel:
        for i, c in calls.items():
            sel.register(c.r, selectors.EVENT_READ, i)
        while calls:
            now = time.monotonic()
            for i in [i for i, c in calls.items() if c.start + timeout <= now]:
                sel.unregister(calls[i].r)
                results[i] = _finish(calls.pop(i), cfg, timed_out=True)
            if not calls:
                break
            wait = min(c.start for c in calls.values()) + timeout - time.monotonic()
            for key, _ in sel.select(max(wait, 0.0)):
                c = calls[key.data]
                try:
                    chunk = os.read(c.r, 1 << 16)
                except BlockingIOError:
                    continue
                if chunk and len(c.data) + len(chunk) <= cap:
                    c.data += chunk
                    continue
                sel.unregister(c.r)
                results[key.data] = _finish(calls.pop(key.data), cfg, timed_out=False, overflow=bool(chunk))
    return results


def _finish(c: _Call, cfg: dict, *, timed_out: bool, overflow: bool = False) -> dict:
    os.close(c.r)
    for kill in (os.killpg, os.kill):  # the call and anything it left behind
        try:
            kill(c.pid, signal.SIGKILL)
        except OSError:
            pass
    _, status = os.waitpid(c.pid, 0)
    seconds = time.monotonic() - c.start
    _rmtree(c.folder)
    out = {"kind": "error", "output": "error: the tool's process sent a malformed result", "seconds": seconds}
    if timed_out:
        return {**out, "kind": "timeout", "output": f"error: timed out after {cfg['timeout']:g} s"}
    if c.data and not overflow:
        try:
            got = json.loads(c.data)
            if got.get("kind") in ("ok", "error") and isinstance(got.get("output"), str):
                return {**out, "kind": got["kind"], "output": got["output"]}
        except ValueError:
            pass
        return out
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {**out, "kind": "timeout",
                    "output": f"error: timed out (CPU time limit, {math.ceil(cfg['timeout']) + 1} s)"}
        if sig == signal.SIGALRM:
            return {**out, "kind": "timeout", "output": f"error: timed out after {cfg['timeout']:g} s"}
        return {**out, "output": f"error: the tool's process died (signal {sig}, {_signame(sig)})"}
    return {**out, "output": f"error: the tool's process exited (status {os.waitstatus_to_exitcode(status)}) "
                             "without returning"}


# ----------------------------------------------------------------------------------------------- a call


def _child(fn, cfg: dict, arg: str, folder: str, w: int) -> None:
    """The forked call: confine itself, run the tool, send the result as JSON on ``w``, ``os._exit``."""
    code = 70
    try:
        os.dup2(w, 3)  # the result's pipe, at a known fd (the zygote's fd 3 is its answers pipe: replaced here)
        try:
            _confine(cfg, folder)
            result = _invoke(fn, arg, cfg)
        except BaseException as e:  # noqa: BLE001 — whatever happens, the child must end here
            result = {"kind": "error", "output": f"error: the sandbox could not run the call ({type(e).__name__})"}
        data = memoryview(json.dumps(result).encode())
        while data:
            data = data[os.write(3, data):]
        code = 0
    finally:
        os._exit(code)


def _confine(cfg: dict, folder: str) -> None:
    os.setpgid(0, 0)
    os.chdir(folder)
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(OUTPUT_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
    try:  # the zygote's pipes, the other calls' pipes (listed: closing up to a huge RLIMIT_NOFILE is slow)
        fds = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 3]
    except OSError:
        fds = range(4, 65536)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, gone already
    budget = [OUTPUT_FILE_BYTES]
    sys.stdout, sys.stderr = _CappedOutput(1, budget), _CappedOutput(2, budget)
    sys.dont_write_bytecode = True
    with open("/proc/self/statm", "rb") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cpu, memory = math.ceil(cfg["timeout"]) + 1, mapped + cfg["memory_mb"] * (1 << 20)
    for which, soft, hard in ((resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT, FILE_SIZE_LIMIT),
                              (resource.RLIMIT_AS, memory, memory)):
        now = resource.getrlimit(which)[1]
        if now != resource.RLIM_INFINITY:
            soft, hard = min(soft, now), min(hard, now)
        resource.setrlimit(which, (soft, hard))
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, cfg["timeout"] + 1.0)
    _install_guards(os.path.realpath(folder))


class _CappedOutput:
    """sys.stdout/sys.stderr of a call: the first bytes (shared ``budget``) go to the fd, the rest is dropped."""

    encoding, errors, closed = "utf-8", "backslashreplace", False

    def __init__(self, fd: int, budget: list):
        self._fd, self._budget = fd, budget

    def write(self, s):
        data = s.encode("utf-8", "backslashreplace") if isinstance(s, str) else bytes(s)
        if self._budget[0] > 0:
            data = data[:self._budget[0]]
            self._budget[0] -= len(data)
            try:
                os.write(self._fd, data)
            except OSError:
                pass
        return len(s)

    def writelines(self, lines):
        for s in lines:
            self.write(s)

    buffer = property(lambda self: self)

    def flush(self):
        pass

    def fileno(self):
        return self._fd

    def isatty(self):
        return False

    def writable(self):
        return True


def _install_guards(folder: str) -> None:
    """Wrap what has no audit event, then add the audit hook (it stays for the rest of the process)."""
    me = os.getpid()

    def inside(path, follow: bool) -> bool:
        if isinstance(path, int):
            return True  # an open descriptor: its opening was checked
        try:
            path = os.path.abspath(os.fsdecode(path))
            real = (os.path.realpath(path) if follow else
                    os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)))
        except (TypeError, ValueError, OSError):
            return False
        return real == folder or real.startswith(folder + os.sep) or real == os.devnull

    def refuse_write(path) -> None:
        raise SandboxRefusal(f"writing outside the tool's folder is not allowed ({os.fsdecode(path)})")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            if ((isinstance(mode, str) and any(ch in mode for ch in "wax+")) or (flags or 0) & _WRITE_FLAGS) \
                    and not inside(path, True):
                refuse_write(path)
        elif event in _PATH_EVENTS:
            for index, follow in _PATH_EVENTS[event]:
                if len(args) > index and not inside(args[index], follow):
                    refuse_write(args[index])
        elif event.startswith("socket."):
            raise SandboxRefusal("network access is not allowed", event)
        elif event in _PROCESS_EVENTS:
            raise SandboxRefusal("starting a process is not allowed", event)
        elif event in ("os.kill", "os.killpg"):
            if args[0] not in ((0, me, -me) if event == "os.kill" else (0, me)):
                raise SandboxRefusal("signalling another process is not allowed", f"{event} {args[0]}")
        elif event == "sqlite3.connect":
            db = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
            db = db[5:].split("?")[0] if db.startswith("file:") else db
            if db not in ("", ":memory:") and not inside(db, True):
                refuse_write(db)

    def guarded(fn, index: int):
        def wrapper(*a, **kw):
            path = a[index] if len(a) > index else kw.get("path")
            if not inside(path, False):
                refuse_write(path)
            return fn(*a, **kw)
        return wrapper

    os.mkfifo, os.mknod = guarded(os.mkfifo, 0), guarded(os.mknod, 0)

    def no_fork_exec(*a, **kw):
        raise SandboxRefusal("starting a process is not allowed", "_posixsubprocess.fork_exec")

    import _posixsubprocess
    _posixsubprocess.fork_exec = no_fork_exec
    sys.addaudithook(hook)


def _invoke(fn, arg: str, cfg: dict) -> dict:
    limit = cfg["max_output"]
    try:
        value = fn(arg)
        text = value if isinstance(value, str) else str(value)
    except BaseException as e:  # noqa: BLE001 — SystemExit and KeyboardInterrupt are the tool's errors too
        return {"kind": "error", "output": "error: " + _describe(e, cfg)[:limit]}
    if len(text) > limit:
        return {"kind": "error", "output": f"error: output too long ({len(text)} characters, limit {limit}); "
                                           f"its first {limit} characters:\n{text[:limit]}"}
    return {"kind": "ok", "output": text}


def _describe(e: BaseException, cfg: dict) -> str:
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for x in chain:
        if isinstance(x, SandboxRefusal):
            return x.observation
    if any(isinstance(x, MemoryError) for x in chain):
        return f"out of memory ({cfg['memory_mb']} MB)"
    try:
        text = _one_line(str(chain[0]), cfg["max_output"])
    except Exception:  # noqa: BLE001 — a __str__ that raises
        text = ""
    return f"{type(chain[0]).__name__}: {text}" if text else type(chain[0]).__name__


def _serve_env(cfg: dict) -> int:
    """An environment's process: load the class, confine itself, answer ``{"ready": true}``, then one answer
    line per request line (module docstring)."""
    here = os.path.dirname(_SCRIPT)
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.realpath(here):
        del sys.path[0]
    answers, requests = os.dup(1), os.dup(0)
    os.dup2(2, 1)
    try:
        cls = _load(cfg["path"], cfg["cls"])
    except _LoadError as e:
        _send(answers, {"error": str(e)})
        return 1
    folder = tempfile.mkdtemp(prefix="env-", dir=cfg["root"])
    os.chdir(folder)
    out = os.open(OUTPUT_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0), os.dup2(out, 1), os.dup2(out, 2)
    budget = [OUTPUT_FILE_BYTES]
    sys.stdout, sys.stderr = _CappedOutput(1, budget), _CappedOutput(2, budget)
    sys.dont_write_bytecode = True
    gc.collect()
    with open("/proc/self/statm", "rb") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    memory = mapped + cfg["memory_mb"] * (1 << 20)
    for which, soft, hard in ((resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT, FILE_SIZE_LIMIT),
                              (resource.RLIMIT_AS, memory, memory)):
        now = resource.getrlimit(which)[1]
        if now != resource.RLIM_INFINITY:
            soft, hard = min(soft, now), min(hard, now)
        resource.setrlimit(which, (soft, hard))
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = folder
    _install_guards(os.path.realpath(folder))
    _send(answers, {"ready": True})
    instances: dict[int, object] = {}
    cfg = {**cfg, "max_output": 500}   # how much of an error's text is kept
    timeout = float(cfg["timeout"])

    def expired(signum, frame):
        raise TimeoutError(f"timed out after {timeout:g} s")

    signal.signal(signal.SIGALRM, expired)
    with os.fdopen(requests, "rb") as stream:
        for line in stream:
            replies = []
            for op, ident, method, arg in json.loads(line)["ops"]:
                try:
                    if op == "clear":
                        instances.clear()
                        gc.collect()
                        answer = {"value": None}
                    else:
                        signal.setitimer(signal.ITIMER_REAL, timeout)
                        try:
                            if op == "new":
                                instances[ident] = cls()
                                value = None
                            else:
                                value = getattr(instances[ident], method)(arg)
                        finally:
                            signal.setitimer(signal.ITIMER_REAL, 0)
                        answer = {"value": value}
                        json.dumps(answer, default=_plain)   # a value that is not JSON fails its call here
                except BaseException as e:  # noqa: BLE001 — the environment's errors go back to the caller
                    why = _describe(e, cfg)
                    if isinstance(e, TimeoutError) and str(e).startswith("timed out after"):
                        why = f"{method}() {e}"
                    answer = {"error": why, "type": type(e).__name__}
                replies.append(answer)
            data = json.dumps({"answers": replies}, default=_plain)
            payload = memoryview((data + "\n").encode())
            try:
                while payload:
                    payload = payload[os.write(answers, payload):]
            except BrokenPipeError:
                break
    instances.clear()
    _rmtree(folder)   # EOF: its caller closed it or is gone (its own folder, from inside: the guards allow it)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("--zygote", "--env"):
        sys.exit(f"usage: {sys.argv[0]} --zygote|--env <json spec>  (started by rlhfc's ToolSandbox, EnvSandbox)")
    sys.exit((_serve if sys.argv[1] == "--zygote" else _serve_env)(json.loads(sys.argv[2])))
