"""The benchmarks' tiny mode: ``CERTCKPT_BENCH_TINY=1`` runs a script's whole code path in seconds.

Every script in ``benchmarks/`` reads the variable (``gpu_session.sh`` too, and passes it on to the
scripts it runs): toy sizes, one trial, the shortest waits, and otherwise the same code, the same
table and the same exit status. Its figures mean nothing; it exists so that the suite can run every
benchmark (``tests/project/test_benchmarks_smoke.py``) and a refactor cannot break one unnoticed. Explicit
options still win over the tiny defaults.
"""

from __future__ import annotations

import os
import sys

ENV = "CERTCKPT_BENCH_TINY"


def tiny() -> bool:
    """Whether ``CERTCKPT_BENCH_TINY`` is set (to anything but empty or ``0``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def announce(script: str) -> bool:
    """``tiny()``, and when it is on, one line on stderr saying that the figures mean nothing."""
    on = tiny()
    if on:
        print(f"{script}: tiny mode ({ENV}=1): toy sizes, the figures mean nothing", file=sys.stderr, flush=True)
    return on
