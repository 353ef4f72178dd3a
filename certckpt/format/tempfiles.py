"""Temp files that killed writers leave behind: find them in a local store, and remove stale ones.

Every local write goes through a hidden temp file beside its final name (``storage.temp_name``:
``.NAME.certckpt-tmp-PID-HEX``), linked into place only once complete. A writer killed in between
leaves the temp file: it never becomes a checkpoint or a record (hidden names are ignored), but it
takes space until removed. A temp file younger than the age limit may belong to a write in
progress, so only older ones count as stale. Remote stores publish with one PUT from a local spool
and leave none in the store.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from certckpt.errors import CheckpointNotFoundError
from certckpt.storage import resolve

__all__ = ["TEMP_MARK", "TempFile", "find_temps", "remove_temps"]

TEMP_MARK = ".certckpt-tmp-"
_MAX_DEPTH = 3  # the store, _ledger, _ledger/<kind>: temp files are never deeper


@dataclass(frozen=True, slots=True)
class TempFile:
    path: str
    nbytes: int
    age_s: float


def find_temps(store: str, *, older_than_s: float, now: float | None = None) -> list[TempFile]:
    """The certckpt temp files in a local store (and its ledger) older than ``older_than_s`` seconds.

    Raises:
        CheckpointNotFoundError: the store does not exist.
    """
    root = resolve(store).local
    if root is None:
        return []
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{store}: no such run store")
    now = time.time() if now is None else now
    out = []
    base_depth = root.rstrip(os.sep).count(os.sep)
    for d, dirs, files in os.walk(root):
        if d.count(os.sep) - base_depth >= _MAX_DEPTH:
            dirs[:] = []
        for name in files:
            if name.startswith(".") and TEMP_MARK in name:
                path = os.path.join(d, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # its writer finished (or gave up) meanwhile
                if now - st.st_mtime >= older_than_s:
                    out.append(TempFile(path=path, nbytes=st.st_size, age_s=now - st.st_mtime))
    return sorted(out, key=lambda t: t.path)


def remove_temps(temps: list[TempFile]) -> list[str]:
    """Delete these temp files; returns the paths removed (one already gone is not an error)."""
    removed = []
    for t in temps:
        try:
            os.unlink(t.path)
        except FileNotFoundError:
            continue
        removed.append(t.path)
    return removed
