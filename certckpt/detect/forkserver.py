"""A warm start for rank processes: a server that has imported torch forks each rank on request.

A rank started as a fresh interpreter spends about two CPU-seconds importing torch before it does
anything; a test suite or a drill that launches hundreds of ranks spends most of its time there. The
server imports the heavy third-party modules once (torch, ``torch.distributed``, numpy, safetensors,
never certckpt, whose modules read the environment when imported) and forks a child per request,
which then runs ``python -m certckpt.detect.launch ...`` as a fresh process would: its own
environment, working directory, ``sys.path`` built from its ``PYTHONPATH``, output to a log file,
stdin from ``/dev/null``. Requests and replies are JSON lines on a Unix socket (no pickle).

    python forkserver.py SOCKET          # prints "ready" once it listens; stops when its parent goes

``certckpt.detect.launch.run_ranks`` uses the server named by ``CERTCKPT_FORKSERVER`` when it answers
and starts plain subprocesses otherwise. Forking is safe here because the server never computes:
no OpenMP pool, no CUDA context, no process group and no other thread exist when it forks.

This file imports the standard library only, and is run by path, not as ``certckpt.detect...``: a
server importing certckpt would hand every child modules that read a stale environment.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

ENV = "CERTCKPT_FORKSERVER"
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.functional",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "numpy",
    "safetensors.torch",
    "fsspec",
)


# --- the client: what run_ranks holds for a forked rank (the subset of Popen it uses) --------------


class ForkedProcess:
    """A rank forked by the server: ``poll``, ``wait``, ``kill`` and ``returncode`` as ``Popen``'s
    (a negative code for a signal). The server, its parent, reports the exit on this connection."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn, self.pid = conn, pid
        self._buf = b""
        self.returncode: int | None = None

    def _take(self, *, block: bool) -> None:
        self._conn.setblocking(block)
        while self.returncode is None and b"\n" not in self._buf:
            try:
                chunk = self._conn.recv(4096)
            except BlockingIOError:
                return
            if not chunk:  # the server went away without a word: the rank is lost with it
                self.returncode = -signal.SIGKILL
                break
            self._buf += chunk
        if self.returncode is None and b"\n" in self._buf:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["exit"])
        if self.returncode is not None:
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self._take(block=True)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def fork_rank(address: str, argv: list[str], *, env: dict[str, str], cwd: str, log: str) -> ForkedProcess:
    """Ask the server at ``address`` to run ``python -m certckpt.detect.launch *argv`` (as ``Popen``
    would, output to the file ``log``).

    Raises:
        OSError: the server does not answer (the caller starts a subprocess instead).
    """
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(30)
        conn.connect(address)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}).encode("utf-8") + b"\n")
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError(f"fork server {address} closed the connection")
            line += chunk
        reply = json.loads(line)
        if "pid" not in reply:
            raise OSError(f"fork server {address}: {reply.get('error', reply)}")
    except BaseException:
        conn.close()
        raise
    return ForkedProcess(conn, int(reply["pid"]))


class ForkServer:
    """A running server (for the process that starts it: a test session, a drill).

    ``wait=False`` returns at once: until the server listens (its imports take seconds), a
    ``fork_rank`` fails and ``run_ranks`` starts a plain subprocess instead.
    """

    def __init__(self, address: str, *, env: dict[str, str] | None = None, wait: bool = True) -> None:
        self.address = address
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), address],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if wait else subprocess.DEVNULL,
            env=env,
        )
        if wait:
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() != b"ready":  # the event: it listens (or it died)
                self.stop()
                raise OSError(f"the fork server did not start (exit {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)


# --- the server -------------------------------------------------------------------------------------


def _child(req: dict[str, Any], base_path: list[str]) -> None:
    """In the forked child: become ``python -m certckpt.detect.launch ARGV`` started with ``env`` in ``cwd``."""
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.setpgid(0, 0)  # its own group, as a rank started by Popen is not in the server's
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # What the interpreter would have put on the path: `-m` puts the working directory first,
        # then PYTHONPATH's entries, then the installation's (site-packages, .pth files).
        extra = [os.path.abspath(e) for e in req["env"].get("PYTHONPATH", "").split(os.pathsep) if e]
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        importlib.invalidate_caches()
        sys.argv = ["-m", *req["argv"]]
        import runpy

        runpy.run_module("certckpt.detect.launch", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _accept(listener: socket.socket, children: dict[int, socket.socket], base_path: list[str]) -> None:
    """One request: fork the rank and tell the client its pid (the exit follows on the connection)."""
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            line += chunk
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            listener.close()
            for c in children.values():
                c.close()
            conn.close()
            _child(req, base_path)
        children[pid] = conn
        conn.sendall(json.dumps({"pid": pid}).encode("utf-8") + b"\n")
    except (OSError, ValueError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(e)}).encode("utf-8") + b"\n")
        conn.close()


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each finished rank's client its exit status (negative: the signal that ended it)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode("utf-8") + b"\n")
            conn.close()


def serve(address: str) -> None:
    # Run by path, the interpreter put this file's folder first on the path, where certckpt's own
    # modules would shadow whatever the preloaded ones import by the same names.
    sys.path.pop(0)
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the client, which kills its ranks
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    # The installation's path, without the server's own PYTHONPATH: each child puts its own in front.
    own = {os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e}
    base_path = [p for p in sys.path if os.path.abspath(p) not in own]
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    while not stop and os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            _accept(listener, children, base_path)
        _reap(children)
    # Going away (told to, or orphaned): no rank outlives the server that reports on it.
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        children.pop(pid, None)
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(address)


if __name__ == "__main__":
    serve(sys.argv[1])
