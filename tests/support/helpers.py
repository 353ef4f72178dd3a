"""What many test files share: the repository's root, the installed console script, a ledger event."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
"""The repository (README.md, docs/, fixtures/, benchmarks/)."""


def console_script(name: str) -> str:
    """The console script installed beside this interpreter (not a pyenv shim), else PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else (shutil.which(name) or name)


def event_dict(branch, step, kind, outcome="pass", **details):
    """An audit event as the ledger stores it (run "r", 3 ranks, nobody suspect, not contained)."""
    return {
        "run": "r",
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "ranks": [0, 1, 2],
        "suspect_ranks": [],
        "contained": False,
        "details": details,
        "inventory": {},
    }
