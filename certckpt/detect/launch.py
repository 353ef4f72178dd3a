"""Run a function on N local ranks (gloo on 127.0.0.1), one subprocess each, results as JSON.

Used by ``certckpt drill faults``, the tests and the benchmarks. Arguments and results travel as JSON
files: no pickle anywhere, unlike ``torch.multiprocessing.spawn``. The target is a module-level
function (``run_ranks(cases.flipped_weight, 3, {...})``: the ranks import it by its module's name, with
the directory that name is found from put on their path) or a ``"module:function"`` string.

    python -m certckpt.detect.launch TARGET RANK WORLD PORT ARGS_JSON OUT_JSON
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from certckpt.detect import forkserver
from certckpt.errors import ConfigurationError, RanksFailedError

__all__ = ["run_ranks", "importable", "RanksFailedError", "free_port", "follow", "ProgressLog"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _aborted_after_result(p: Any, d: str, rank: int) -> bool:
    # gloo can abort (SIGABRT) while tearing down after the work is done and the result written:
    # that rank succeeded. Any other failure, or an abort before the result, is a failure.
    return p.returncode == -6 and os.path.exists(os.path.join(d, f"out{rank}.json"))


def importable(fn: Callable[..., Any]) -> tuple[str, str | None]:
    """``("module:function", path)`` for a module-level function: what another process imports it by,
    and the directory its module's name is found from (the folder above a package's top), to put on
    that process's path; None where the interpreter finds it anyway (site-packages).

    Raises:
        ConfigurationError: ``fn`` is not a module-level function of an importable module (``__main__``, a
            nested function, a lambda).
    """
    mod_name: str = getattr(fn, "__module__", None) or ""
    name: str = getattr(fn, "__qualname__", "")
    module = sys.modules.get(mod_name)
    path = getattr(module, "__file__", None)
    if module is None or mod_name == "__main__" or not path or "." in name or getattr(module, name, None) is not fn:
        raise ConfigurationError(
            f"{fn!r}: not a module-level function of an importable module (pass 'module:function')"
        )
    root = os.path.dirname(os.path.abspath(path))
    for _ in range(mod_name.count(".") + (os.path.basename(path) == "__init__.py")):
        root = os.path.dirname(root)
    site = {os.path.abspath(p) for p in sysconfig.get_paths().values()}
    return f"{mod_name}:{name}", (None if root in site else root)


def run_ranks(
    target: str | Callable[[Any], Any],
    world: int,
    args: dict[str, Any],
    *,
    timeout: float = 300,
    threads: int = 1,
    extra_path: str | None = None,
) -> list[Any]:
    """Run ``target`` on ``world`` ranks, called as ``target(args)`` on each.

    ``target`` is a module-level function (its module is imported by name on every rank, its folder
    put on their ``PYTHONPATH``: see :func:`importable`) or a ``"module:function"`` string (then
    ``extra_path``, if the ranks need a directory on their path to import it).

    Returns:
        Each rank's return value (JSON-decoded), in rank order.

    Raises:
        RanksFailedError: any rank failed or the group did not finish within ``timeout`` seconds.
        ConfigurationError: ``target`` is a function the ranks cannot import (see :func:`importable`).
    """
    paths = [extra_path]
    if not isinstance(target, str):
        target, root = importable(target)
        paths.insert(0, root)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), CERTCKPT_RANK_THREADS=str(threads))
    for entry in reversed([e for e in paths if e]):
        env["PYTHONPATH"] = entry + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="certckpt-ranks-") as d:
        args_path = os.path.join(d, "args.json")
        with open(args_path, "w", encoding="utf-8") as f:
            json.dump(args, f)
        procs, logs = [], []
        for r in range(world):
            log = open(os.path.join(d, f"rank{r}.log"), "w+b")  # noqa: SIM115 - closed below
            logs.append(log)
            argv = [target, str(r), str(world), str(port), args_path, os.path.join(d, f"out{r}.json")]
            procs.append(_start_rank(argv, env=env, log=log))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(
                    p.returncode not in (None, 0) and not _aborted_after_result(p, d, r) for r, p in enumerate(procs)
                ):
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        tails = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            text = log.read().decode("utf-8", "replace")
            log.close()
            if p.returncode != 0 and not _aborted_after_result(p, d, r):
                tails.append(f"--- rank {r} (exit {p.returncode}) ---\n{text[-3000:]}")
        if tails:
            raise RanksFailedError(f"{target} on {world} ranks failed:\n" + "\n".join(tails))
        out = []
        for r in range(world):
            with open(os.path.join(d, f"out{r}.json"), encoding="utf-8") as f:
                out.append(json.load(f))
        return out


def _start_rank(argv: list[str], *, env: dict[str, str], log: Any) -> Any:
    """``python -m certckpt.detect.launch *argv``: forked by the warm server named by
    ``CERTCKPT_FORKSERVER`` when one answers (``certckpt.detect.forkserver``: torch already imported,
    about two CPU-seconds saved per rank), else a fresh interpreter."""
    address = env.get(forkserver.ENV)
    if address:
        try:
            return forkserver.fork_rank(address, argv, env=env, cwd=os.getcwd(), log=log.name)
        except OSError:
            pass  # gone or never started: a plain process does the same work, slower
    cmd = [sys.executable, "-m", "certckpt.detect.launch", *argv]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _worker(target: str, rank: int, world: int, port: int, args_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("CERTCKPT_RANK_THREADS", "1")))
    with open(args_path, encoding="utf-8") as f:
        args = json.load(f)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mod, fn = target.split(":")
    result = getattr(importlib.import_module(mod), fn)(args)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo's transport threads can abort the process from C++ destructors
    # at exit ("terminate called without an active exception", seen once in seven drill runs here)
    # after all work is done and the result is safely written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def follow(path: str, stop: threading.Event, emit: Callable[[str], None], *, interval: float = 0.25) -> None:
    """Hand each new line of a progress file that ranks append to ``emit`` until ``stop`` is set
    (then once more, so the last lines are not lost). Run it on a thread beside ``run_ranks``."""
    pos = 0
    while True:
        done = stop.is_set()
        try:
            with open(path, encoding="utf-8") as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            for line in chunk.splitlines():
                emit(line)
        except OSError:
            pass
        if done:
            return
        stop.wait(interval)


class ProgressLog:
    """The rank side of ``follow``: rank 0 appends timestamped lines to the progress file; a call on
    another rank, or without a file, does nothing."""

    def __init__(self, path: str | None, *, rank: int):
        self._start = time.perf_counter()
        self._f = open(path, "a", encoding="utf-8") if rank == 0 and path else None  # noqa: SIM115 - closed by close()

    def __call__(self, msg: str) -> None:
        if self._f is not None:
            self._f.write(f"[{time.perf_counter() - self._start:6.1f} s] {msg}\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
