"""One read of the manifest per Megatron load, handed from the common strategy to the sharded one.

``dist_checkpointing.load`` calls the common strategy's ``load_common`` first (certckpt's reads
``manifest.safetensors`` to find and check the common state), then, in strict modes, the sharded
strategy's ``load_sharded_metadata``, then its ``load``, which hands the directory to the DCP reader:
each used to read the manifest again, every byte checked each time (three reads per rank in a default
load). Now ``load_common`` keeps what it read here (one slot: the last directory), and the later steps
of the same load reuse it: the metadata calls look, ``load`` takes it (the slot is emptied).

Reused only while ``manifest.safetensors`` is still the file that was read: its ``os.stat`` identity
(device, inode, size, modification and change times), taken *before* the read, must be unchanged when
it is reused, so a manifest replaced or rewritten since (a committed one never is) is read again.
A location that is not a local path (an fsspec URL) is never kept. No torch import here.
"""

from __future__ import annotations

import os
import threading

from certckpt.format.sharded.layout import MANIFEST_NAME

from .layout import Companions, read_companions

__all__ = ["read_and_keep", "kept"]

_lock = threading.Lock()
_slot: tuple[str, tuple[int, ...], Companions] | None = None  # (directory, manifest identity, what was read)


def _identity(location: str) -> tuple[str, tuple[int, ...]] | None:
    """``(the directory's absolute path, the manifest file's stat identity)``; None for a URL or when
    the file cannot be stat'ed (the read that follows then says why)."""
    local = location[len("file://") :] if location.startswith("file://") else location
    if "://" in local:
        return None
    try:
        st = os.stat(os.path.join(local, MANIFEST_NAME))
    except OSError:
        return None
    return os.path.abspath(local), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_and_keep(location: str, *, check: bool) -> Companions | None:
    """``read_companions(location, check=check)``, kept for the rest of this load."""
    global _slot
    ident = _identity(location)  # before the read: a file replaced during it no longer matches
    companions = read_companions(location, check=check)
    with _lock:
        _slot = None if companions is None or ident is None else (ident[0], ident[1], companions)
    return companions


def kept(location: str, *, take: bool) -> Companions | None:
    """What ``read_and_keep`` read of ``location`` if its manifest is unchanged since, else None;
    ``take`` empties the slot (the last step of a load)."""
    global _slot
    ident = _identity(location)
    with _lock:
        slot = _slot
        if slot is None or ident is None or slot[0] != ident[0]:
            return None
        if take or slot[1] != ident[1]:
            _slot = None
        return slot[2] if slot[1] == ident[1] else None
