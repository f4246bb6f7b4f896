"""The tool sandbox (rlhfc/runtime/rollout/sandbox.py): each call of a user's tool in its own forked process,
with a timeout, a memory limit, no network, no processes, writes only in its own folder — and every failure
an error observation, never an exception in the caller."""

from __future__ import annotations

import ast
import gc
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from rlhfc.runtime.rollout import sandbox as sandbox_module
from rlhfc.runtime.rollout.sandbox import (
    OUTPUT_FILE,
    OUTPUT_FILE_BYTES,
    ToolResult,
    ToolSandbox,
    ToolSandboxError,
    ToolSpec,
)


@pytest.fixture
def roots(tmp_path, monkeypatch):
    """The sandboxes' temp roots go here (to check that closing removes them)."""
    folder = tmp_path / "roots"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def make(tmp_path, roots):
    """``make(source, **spec)``: a sandbox over a tool file holding ``source`` (function ``f``, tool 'calc')."""
    made = []

    def make(source: str, function: str = "f", name: str = "calc", **kw) -> ToolSandbox:
        path = tmp_path / f"tool_{len(made)}.py"
        path.write_text(textwrap.dedent(source))
        sb = ToolSandbox(ToolSpec(name=name, path=str(path), function=function, **kw))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()
    assert not list(roots.iterdir()), "a sandbox left its temp folder"


def running(pid) -> bool:
    """Whether process ``pid`` runs (a zombie no init reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def outputs(results: list[ToolResult]) -> list[tuple[str, str]]:
    return [(r.kind, r.output) for r in results]


def test_an_ok_call_returns_the_text_and_prints_never_reach_the_answers(make):
    sb = make("""
        print("printed while the tool loads")
        def f(args):
            print("printed by a call")
            return args.upper()
        """)
    results = sb.call(["abc", "", "é ✓"])
    assert outputs(results) == [("ok", "ABC"), ("ok", ""), ("ok", "É ✓")]
    assert all(0 < r.seconds < 5 for r in results)
    assert sb.call([]) == []
    for wrong in ("abc", ["a", 1]):
        with pytest.raises(TypeError, match="a list of str"):
            sb.call(wrong)


def test_a_value_that_is_not_a_str_is_converted(make):
    sb = make("def f(args):\n    return {'n': len(args)} if args else None\n")
    assert outputs(sb.call(["abcd", ""])) == [("ok", "{'n': 4}"), ("ok", "None")]


def test_a_raising_tool_is_an_error_observation_and_the_sandbox_goes_on(make):
    sb = make("def f(args):\n    return str(1 / int(args))\n")
    assert outputs(sb.call(["0", "2", "x"])) == [
        ("error", "error: ZeroDivisionError: division by zero"), ("ok", "0.5"),
        ("error", "error: ValueError: invalid literal for int() with base 10: 'x'")]
    assert outputs(sb.call(["4"])) == [("ok", "0.25")]


def test_past_its_timeout_a_call_is_killed_while_the_others_return(make):
    sb = make("""
        import time
        def f(args):
            if args == "sleep":
                time.sleep(30)
            if args == "spin":
                while True:
                    pass
            return "quick"
        """, timeout=0.5)
    t = time.monotonic()
    results = sb.call(["sleep", "quick", "spin"])
    elapsed = time.monotonic() - t
    assert outputs(results) == [("timeout", "error: timed out after 0.5 s"), ("ok", "quick"),
                                ("timeout", "error: timed out after 0.5 s")]
    assert 0.5 <= results[0].seconds < 2.5 and results[1].seconds < 0.5
    assert elapsed < 0.5 + 2
    assert outputs(sb.call(["again"])) == [("ok", "quick")]


def test_allocating_past_the_memory_limit_is_out_of_memory(make):
    sb = make("""
        def f(args):
            if args == "one":
                return len(bytearray(8 << 30))
            chunks = [bytearray(1 << 20) for _ in range(int(args))]
            return str(len(chunks))
        """, memory_mb=64)
    assert outputs(sb.call(["one", "1000", "16"])) == [
        ("error", "error: out of memory (64 MB)"), ("error", "error: out of memory (64 MB)"), ("ok", "16")]


def test_network_access_is_refused(make):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.3)
    port = server.getsockname()[1]
    sb = make(f"""
        import socket
        def f(args):
            if args == "connect":
                socket.create_connection(("127.0.0.1", {port}), timeout=1)
            elif args == "socket":
                socket.socket(socket.AF_UNIX).close()
            elif args == "resolve":
                socket.getaddrinfo("localhost", 80)
            return "connected"
        """)
    try:
        assert outputs(sb.call(["connect", "socket", "resolve"])) == \
            [("error", "error: network access is not allowed")] * 3
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the listening socket
    finally:
        server.close()


def test_writes_outside_the_calls_folder_are_refused_inside_allowed(make, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "victim_dir").mkdir()
    sb = make("""
        import os, shutil, sqlite3, tempfile
        def f(args):
            op, _, path = args.partition(" ")
            if op == "write":
                with open(path, "w") as fh:
                    fh.write("x")
                return open(path).read()
            if op == "append":
                open(path, "a").close()
            if op == "os.open":
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT))
            if op == "remove":
                os.remove(path)
            if op == "rename":
                os.rename(path, path + ".moved")
            if op == "mkdir":
                os.makedirs(path)
            if op == "rmtree":
                shutil.rmtree(path)
            if op == "chmod":
                os.chmod(path, 0o600)
            if op == "symlink":
                os.symlink("/etc", path)
            if op == "mkfifo":
                os.mkfifo(path)
            if op == "sqlite":
                sqlite3.connect(path).close()
            if op == "read":
                return open(path).read()
            if op == "tempfile":
                fd, name = tempfile.mkstemp()
                os.close(fd)
                return str(os.path.dirname(name) == os.getcwd())
            if op == "cwd":
                return os.getcwd() + " " + str(os.path.exists("notes.txt"))
            return "done"
        """)
    refused = "error: writing outside the tool's folder is not allowed"
    out = tmp_path / "escape.txt"
    ops = [f"write {out}", f"append {out}", f"os.open {out}", f"remove {victim}", f"rename {victim}",
           f"mkdir {tmp_path / 'new' / 'dir'}", f"rmtree {tmp_path / 'victim_dir'}", f"chmod {victim}",
           f"symlink {tmp_path / 'link'}", f"mkfifo {tmp_path / 'fifo'}", f"sqlite {tmp_path / 'db.sqlite'}",
           "write ../../escape.txt"]
    results = sb.call(ops)
    assert all(r.kind == "error" and r.output.startswith(refused) for r in results), outputs(results)
    assert str(out) in results[0].output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["roots", "victim.txt", "victim_dir", "tool_0.py"]), list(tmp_path.iterdir())
    assert victim.read_text() == "keep me" and (victim.stat().st_mode & 0o777) != 0o600
    # inside its own folder (relative paths, TMPDIR) writing works; reading anywhere works
    assert outputs(sb.call(["write notes.txt", "mkdir sub/dir", "sqlite local.db", "tempfile", f"read {victim}",
                            "write /dev/null"])) == \
        [("ok", "x"), ("ok", "done"), ("ok", "done"), ("ok", "True"), ("ok", "keep me"), ("ok", "")]
    # a fresh folder per call, removed after it
    (a, b) = [r.output.split() for r in sb.call(["cwd", "cwd"])]
    assert a[0] != b[0] and a[1] == b[1] == "False"
    assert not os.path.exists(a[0]) and not os.path.exists(b[0])


def test_printing_megabytes_breaks_nothing_and_its_file_is_capped(make):
    sb = make(f"""
        import os, sys
        def f(args):
            for _ in range(8):
                print("x" * 1_000_000)
                sys.stderr.write("y" * 100_000)
            sys.stdout.buffer.write(b"z" * 1000)
            sys.stdout.flush()
            return "done " + str(os.path.getsize({OUTPUT_FILE!r}))
        """)
    assert outputs(sb.call(["a", "b"])) == [("ok", f"done {OUTPUT_FILE_BYTES}")] * 2


def test_a_huge_return_value_is_an_error_holding_its_first_max_output_characters(make):
    sb = make("def f(args):\n    return 'a' * int(args)\n", max_output=1024)
    long, exact = sb.call(["5000", "1024"])
    assert long.kind == "error"
    head, _, kept = long.output.partition("\n")
    assert head == "error: output too long (5000 characters, limit 1024); its first 1024 characters:"
    assert kept == "a" * 1024
    assert (exact.kind, exact.output) == ("ok", "a" * 1024)


def test_a_process_that_exits_or_crashes_is_an_error_and_the_sandbox_goes_on(make):
    sb = make("""
        import os, signal
        def f(args):
            if args == "exit":
                os._exit(3)
            if args == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if args == "exit0":
                os._exit(0)
            if args == "parent":
                os.kill(os.getppid(), signal.SIGKILL)
            return "alive"
        """)
    pid = sb._proc.pid
    assert outputs(sb.call(["exit", "segv", "exit0", "parent", "x"])) == [
        ("error", "error: the tool's process exited (status 3) without returning"),
        ("error", "error: the tool's process died (signal 11, SIGSEGV)"),
        ("error", "error: the tool's process exited (status 0) without returning"),
        ("error", "error: signalling another process is not allowed"),
        ("ok", "alive")]
    assert outputs(sb.call(["x"])) == [("ok", "alive")] and sb._proc.pid == pid


def test_starting_a_process_is_refused(make, tmp_path):
    marker = tmp_path / "spawned"
    sb = make(f"""
        import multiprocessing, os, subprocess
        def f(args):
            if args == "run":
                subprocess.run(["touch", {str(marker)!r}])
            elif args == "system":
                os.system("touch " + {str(marker)!r})
            elif args == "exec":
                os.execv("/usr/bin/touch", ["touch", {str(marker)!r}])
            elif args == "posix_spawn":
                os.posix_spawn("/usr/bin/touch", ["touch", {str(marker)!r}], os.environ)
            elif args == "fork":
                os.fork()
            elif args == "spawn":
                multiprocessing.get_context("spawn").Process(target=os.getpid).start()
            return "started"
        """)
    ops = ["run", "system", "exec", "posix_spawn", "fork", "spawn"]
    assert outputs(sb.call(ops)) == [("error", "error: starting a process is not allowed")] * len(ops)
    assert not marker.exists()


def test_calls_run_concurrently_and_a_trivial_call_is_cheap(make):
    sb = make("import time\ndef f(args):\n    time.sleep(float(args))\n    return args\n")
    sb.call(["0"])
    t = time.monotonic()
    assert outputs(sb.call(["0"] * 16)) == [("ok", "0")] * 16
    assert time.monotonic() - t < 1.0
    t = time.monotonic()
    assert outputs(sb.call(["0.3"] * 16)) == [("ok", "0.3")] * 16
    assert time.monotonic() - t < 1.5


def test_a_killed_zygote_is_restarted_by_the_next_call(make):
    sb = make("def f(args):\n    return args * 2\n")
    assert outputs(sb.call(["a"])) == [("ok", "aa")]
    old = sb._proc.pid
    os.kill(old, signal.SIGKILL)  # not waited for: the call finds it dead, or its pipe closed
    assert outputs(sb.call(["b", "c"])) == [("ok", "bb"), ("ok", "cc")]
    assert sb._proc.pid != old
    sb._proc.kill()
    sb._proc.wait()
    assert outputs(sb.call(["d"])) == [("ok", "dd")]


def test_a_tool_that_keeps_killing_its_zygote_is_a_sandbox_error(make):
    # ctypes goes below the audit hooks (the sandbox is no security boundary): it kills the zygote every time
    sb = make("import ctypes, os\ndef f(args):\n    ctypes.CDLL(None).kill(os.getppid(), 9)\n    return 'x'\n",
              name="killer")
    with pytest.raises(ToolSandboxError, match=r"tool 'killer' keeps killing its sandbox.*3 times"):
        sb.call(["a"])


@pytest.mark.parametrize("source, function, cause", [
    ("def g(args):\n    return args\n", "f", "it defines no 'f'"),
    ("f = 3\n", "f", "'f' is not callable (it is a int)"),
    ("def f(args)\n    return args\n", "f", "SyntaxError: expected ':' (line 1)"),
    ("import no_such_module_for_the_sandbox\n", "f",
     "importing it raised ModuleNotFoundError: No module named 'no_such_module_for_the_sandbox'"),
    (None, "f", "the file does not exist"),
])
def test_a_tool_that_does_not_load_raises_naming_the_tool_the_file_and_the_cause(tmp_path, roots, source,
                                                                                  function, cause):
    path = tmp_path / "broken.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ToolSandboxError) as err:
        ToolSandbox(ToolSpec(name="calc", path=str(path), function=function))
    message = str(err.value)
    assert message == f"tool 'calc': cannot load function {function!r} from {path}: {cause}"
    assert "\n" not in message
    assert not list(roots.iterdir())


def test_close_ends_the_zygote_and_removes_the_temp_folders(tmp_path, roots):
    path = tmp_path / "tool.py"
    path.write_text("def f(args):\n    return args\n")
    with ToolSandbox(ToolSpec(name="calc", path=str(path), function="f")) as sb:
        assert outputs(sb.call(["x"])) == [("ok", "x")]
        proc, root = sb._proc, sb._root
        assert os.path.isdir(root)
    assert proc.poll() is not None and not os.path.exists(root) and not list(roots.iterdir())
    sb.close()  # idempotent
    with pytest.raises(ToolSandboxError, match="closed"):
        sb.call(["x"])
    # dropping the last reference does the same
    sb = ToolSandbox(ToolSpec(name="calc", path=str(path), function="f"))
    proc, root = sb._proc, sb._root
    del sb
    gc.collect()
    assert proc.poll() is not None and not os.path.exists(root)


def test_a_caller_killed_outright_leaves_no_zygote_and_no_temp_folder(tmp_path, roots):
    """SIGKILL runs no finalizer: the zygote sees EOF, removes the temp root and ends."""
    (tmp_path / "tool.py").write_text("def f(args):\n    return args\n")
    script = textwrap.dedent(f"""
        import importlib.util, os, signal, sys
        spec = importlib.util.spec_from_file_location("sandbox", {sandbox_module.__file__!r})
        sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sandbox)
        sb = sandbox.ToolSandbox(sandbox.ToolSpec("calc", {str(tmp_path / "tool.py")!r}, "f"))
        assert sb.call(["x"])[0].output == "x"
        print(sb._proc.pid, sb._root, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    caller = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "TMPDIR": str(roots)})
    assert caller.returncode == -signal.SIGKILL, caller.stderr
    pid, root = caller.stdout.split()
    assert root.startswith(str(roots))
    deadline = time.monotonic() + 10
    while (os.path.exists(root) or running(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(root) and not running(pid)


def test_the_module_imports_only_the_standard_library():
    """It runs by path as the zygote: no rlhfc, torch or other third-party import."""
    with open(sandbox_module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)
