"""Where things live in a sharded checkpoint directory, and how to list one (local path or fsspec URL).

A directory holds one certified safetensors file per writing rank (``shard-RRRRR.safetensors``) and
the manifest (``manifest.safetensors``), written last: the commit marker. Hidden names (a writer's
temp files) and the ledger directory are never part of a checkpoint. No torch import here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from certckpt.errors import CheckpointNotFoundError, StorageError
from certckpt.storage import LEDGER_DIR, join, storage_for, storage_of

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_TENSOR",
    "MANIFEST_MARK",
    "SHARD_NAME",
    "shard_name",
    "is_shard_name",
    "Listing",
    "list_directory",
    "is_directory",
    "exists",
    "remove",
    "make_directory",
    "join",
]

MANIFEST_NAME = "manifest.safetensors"
MANIFEST_TENSOR = "certckpt.dcp.manifest"  # the manifest document, a U8 tensor of canonical JSON
MANIFEST_MARK = "certckpt.dcp"  # the manifest file's record.user key (value: the manifest version)
SHARD_NAME = re.compile(r"^shard-[0-9]{5,7}\.safetensors$")


def shard_name(rank: int) -> str:
    """The data file a rank writes."""
    return f"shard-{rank:05d}.safetensors"


def is_shard_name(name: object) -> bool:
    """True for a name a writer gives a shard file (never a path: no separator can match)."""
    return isinstance(name, str) and SHARD_NAME.match(name) is not None


@dataclass(frozen=True, slots=True)
class Listing:
    """The visible top-level entries of a checkpoint directory.

    Attributes:
        files: file names (hidden names excluded).
        dirs: sub-directory names (hidden names and the ledger directory excluded).
    """

    files: frozenset[str]
    dirs: frozenset[str]


def list_directory(location: str) -> Listing:
    """List a checkpoint directory's top level.

    Raises:
        CheckpointNotFoundError: there is no directory at ``location``.
        StorageError: the store could not be listed.
    """
    storage = storage_for(location)
    here = storage.stat("")
    if here is not None and here.kind != "directory":
        raise CheckpointNotFoundError(f"{location}: no such checkpoint directory (it is {here.what or 'a file'})")
    entries = storage.listdir()
    if not entries and not storage.exists():  # an object store lists a missing prefix as empty
        raise CheckpointNotFoundError(f"{location}: no such checkpoint directory")
    files: set[str] = set()
    dirs: set[str] = set()
    for entry in entries:
        name = entry.name.rsplit("/", 1)[-1]
        if name:
            (dirs if entry.kind == "directory" else files).add(name)
    hidden = {n for n in files | dirs if n.startswith(".")}
    return Listing(files=frozenset(files - hidden), dirs=frozenset(dirs - hidden - {LEDGER_DIR}))


def is_directory(location: str) -> bool:
    """True when ``location`` is a directory (local) or a prefix holding a manifest (object stores)."""
    storage = storage_for(location)
    try:
        here = storage.stat("")
        return (here is not None and here.kind == "directory") or storage.exists(MANIFEST_NAME)
    except StorageError:  # then reading it says what is wrong, once
        return False


def exists(location: str) -> bool:
    """True when a file exists at ``location``."""
    storage, name = storage_of(location)
    return storage.exists(name)


def remove(location: str) -> None:
    """Delete the file at ``location`` (already gone is fine)."""
    storage, name = storage_of(location)
    refused = storage.delete(name)
    if refused is not None:
        raise StorageError(f"{location}: cannot delete ({refused})")


def make_directory(location: str) -> None:
    """Create a local checkpoint directory (object stores have no directories to create, and a
    bucket is never created on the way)."""
    storage_for(location).make_root(what="checkpoint")
