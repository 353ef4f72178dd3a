"""Runs the code blocks of a Markdown file as a reader would: in order, in one fresh directory.

A block's behaviour is set by ``<!-- doctest: ... -->`` comments on the lines right above its fence
(invisible on GitHub, next to the code they describe, so a change to one shows in review beside the
other):

- ``skip REASON``: not run (needs a GPU, S3 credentials, several nodes...); the reason is required.
- ``prelude`` followed by lines of code up to ``-->``: run first (Python in the block's namespace,
  or shell lines before a ``bash`` block): what a fragment takes for granted (a model, a run store).
- ``torchrun N as FILE``: a Python block written to FILE and run with ``torchrun --nproc-per-node N``.
- ``file FILE``: a block written to FILE, not run (a later block runs it).
- ``slow``: the file's test joins the slow set.
- ``in DIR``: the block runs in the subdirectory DIR of the file's directory (examples that are
  alternatives, not steps, each get their own).
- ``setup NAME``: ``tests/support/docsetup/NAME.py`` runs first, as a prelude does (a set-up shared by the
  fragments of several blocks: a process group, a model, a loader).

Python blocks share one namespace per file (as one interpreter session would). ``bash`` blocks run
with ``bash -euo pipefail``. ``console`` blocks are ``$ command`` lines each followed by the output it
prints (stdout and stderr as they interleave, compared line by line); ``# exit N`` after a command is its expected exit
status (default 0). Any other language must be skipped with its reason.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

_FENCE = re.compile(r"^```([a-z]*)\s*$")
_DIRECTIVE = re.compile(r"^<!-- doctest: (.*?)(-->)?\s*$")
_SETUPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docsetup")


@dataclass
class Block:
    path: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None = None
    prelude: str = ""
    torchrun: tuple[int, str] | None = None
    file: str | None = None
    slow: bool = False
    subdir: str = ""
    setup: str = ""

    @property
    def source(self) -> str:
        """What runs: the shared set-up, the prelude, then the block as shown."""
        return self.setup + self.prelude + self.code

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.path)}:{self.line}"


@dataclass
class Doc:
    path: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def slow(self) -> bool:
        return any(b.slow for b in self.blocks)


def parse(path: str) -> Doc:
    """The blocks of one Markdown file with their directives."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    doc = Doc(path)
    pending: dict = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _DIRECTIVE.match(line)
        if m:
            body, closed = m.group(1).strip(), m.group(2) is not None
            word, _, rest = body.partition(" ")
            if word == "prelude":
                code = []
                i += 1
                while not lines[i].startswith("-->"):
                    code.append(lines[i])
                    i += 1
                pending["prelude"] = "\n".join(code) + "\n"
            elif not closed:
                raise ValueError(f"{path}:{i + 1}: a doctest directive must end with --> on its line")
            elif word == "skip":
                pending["skip"] = rest.strip()
            elif word == "torchrun":
                n, _, name = rest.partition(" as ")
                pending["torchrun"] = (int(n), name.strip())
            elif word == "file":
                pending["file"] = rest.strip()
            elif word == "slow":
                pending["slow"] = True
            elif word == "in":
                pending["subdir"] = rest.strip()
            elif word == "setup":
                name = rest.strip()
                with open(os.path.join(_SETUPS, f"{name}.py"), encoding="utf-8") as f:
                    pending["setup"] = f.read()
            else:
                raise ValueError(f"{path}:{i + 1}: unknown doctest directive {word!r}")
            i += 1
            continue
        m = _FENCE.match(line)
        if m:  # every fenced block, with a language or without
            start, code = i + 1, []
            i += 1
            while not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            doc.blocks.append(Block(path, start, m.group(1), "\n".join(code) + "\n", **pending))
            pending = {}
        elif line.strip() and pending and not line.startswith("<!--"):
            raise ValueError(f"{path}:{i + 1}: a doctest directive must sit right above a code block")
        i += 1
    return doc


def _env(cwd: str) -> dict[str, str]:
    bindir = os.path.dirname(sys.executable)  # the console scripts beside this interpreter
    # HOME is the doc's directory: a command that writes under ~ writes there
    return dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), HOME=cwd)


def _shell(script: str, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def console_steps(code: str) -> list[tuple[str, int, list[str]]]:
    """``(command, expected exit status, expected output lines)`` of a console block."""
    steps: list[tuple[str, int, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            cmd, status = line[2:], 0
            m = re.search(r"\s+# exit (\d+)\s*$", cmd)
            if m:
                cmd, status = cmd[: m.start()], int(m.group(1))
            steps.append((cmd.strip(), status, []))
        elif steps:
            steps[-1][2].append(line.rstrip())
    return steps


def run(doc: Doc, cwd: str, *, timeout: float = 300) -> list[str]:
    """Run every block of ``doc`` in ``cwd``, in order; returns the blocks skipped (``where: why``).

    Raises:
        AssertionError: naming the block (file:line) that failed, with its output.
    """
    namespace: dict = {"__name__": "__doc__"}
    skipped = []
    here = os.getcwd()
    logger = logging.getLogger("certckpt")  # a block may set its level: given back after
    level, handlers = logger.level, list(logger.handlers)
    try:
        for b in doc.blocks:
            if b.skip is not None:
                assert b.skip, f"{b.where}: a skipped block needs its reason"
                skipped.append(f"{b.where}: {b.skip}")
                continue
            where = os.path.join(cwd, b.subdir)
            os.makedirs(where, exist_ok=True)
            os.chdir(where)
            if b.file or b.torchrun:
                name = b.file or b.torchrun[1]
                with open(os.path.join(where, name), "w", encoding="utf-8") as f:
                    f.write(b.source)
                if b.torchrun:
                    n, _ = b.torchrun
                    torchrun = f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone"
                    cmd = f"{torchrun} --nproc-per-node {n} {name}"
                    r = _shell(cmd, where, timeout)
                    # torch 2.13's gloo transport sometimes aborts in interpreter teardown, after the
                    # script finished (plain DDP too): the one failure tolerated, when nothing raised
                    teardown = "SIGABRT" in r.stderr and not re.search(r"\[rank\d+\]: Traceback", r.stderr)
                    assert r.returncode == 0 or teardown, (
                        f"{b.where}: torchrun exited {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
                    )
                continue
            if b.lang == "python":
                try:
                    exec(compile(b.source, b.where, "exec"), namespace)
                except Exception as e:
                    raise AssertionError(f"{b.where}: the block raised {type(e).__name__}: {e}") from e
            elif b.lang == "bash":
                r = _shell(b.source, where, timeout)
                assert r.returncode == 0, f"{b.where}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            elif b.lang == "console":
                for cmd, status, want in console_steps(b.code):
                    r = _shell(f"{{ {cmd}\n}} 2>&1", where, timeout)  # both streams, in the order printed
                    got = [ln.rstrip() for ln in r.stdout.splitlines()]
                    assert r.returncode == status, f"{b.where}: `{cmd}` exited {r.returncode}, shown {status}\n{got}"
                    assert got == want, (
                        f"{b.where}: `{cmd}` printed\n" + "\n".join(got) + "\nthe docs show\n" + "\n".join(want)
                    )
            else:
                raise AssertionError(f"{b.where}: a {b.lang or 'plain'} block is neither run nor skipped with a reason")
    finally:
        os.chdir(here)
        logger.setLevel(level)
        logger.handlers[:] = handlers
    return skipped
