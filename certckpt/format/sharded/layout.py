"""Where things live in a sharded checkpoint directory, and how to list one (local path or fsspec URL).

A directory holds one certified safetensors file per writing rank (``shard-RRRRR.safetensors``) and
the manifest (``manifest.safetensors``), written last: the commit marker. Hidden names (a writer's
temp files) and the ledger directory are never part of a checkpoint. No torch import here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, cast

from certckpt.errors import CheckpointNotFoundError, StorageError
from certckpt.format.storage import LEDGER_DIR, Target, filesystem, join, remote_error_text, resolve

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


def _remote(target: Target) -> tuple[Any, str]:
    """``(fs, path)`` of a location that is not a local path (fsspec's filesystems are untyped)."""
    # resolve() gives a str location that is not local its URL; storage.filesystem is unannotated
    fs_path: tuple[Any, str] = filesystem(cast(str, target.url))
    return fs_path


def list_directory(location: str) -> Listing:
    """List a checkpoint directory's top level.

    Raises:
        CheckpointNotFoundError: there is no directory at ``location``.
        StorageError: the store could not be listed.
    """
    target = resolve(location)
    files: set[str] = set()
    dirs: set[str] = set()
    if target.local is not None:
        try:
            with os.scandir(target.local) as it:
                for entry in it:
                    (dirs if entry.is_dir(follow_symlinks=False) else files).add(entry.name)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise CheckpointNotFoundError(f"{location}: no such checkpoint directory") from e
        except PermissionError as e:
            raise StorageError(f"{location}: permission denied listing the directory") from e
    else:
        fs, path = _remote(target)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{location}: no such checkpoint directory") from e
        except OSError as e:
            raise StorageError(f"{location}: cannot list ({remote_error_text(e)})") from e
        for listed in entries:
            name = str(listed.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            if name:
                (dirs if listed.get("type") == "directory" else files).add(name)
    hidden = {n for n in files | dirs if n.startswith(".")}
    return Listing(files=frozenset(files - hidden), dirs=frozenset(dirs - hidden - {LEDGER_DIR}))


def is_directory(location: str) -> bool:
    """True when ``location`` is a directory (local) or a prefix holding a manifest (object stores)."""
    target = resolve(location)
    if target.local is not None:
        return os.path.isdir(target.local)
    fs, path = _remote(target)
    try:
        return bool(fs.isdir(path)) or bool(fs.exists(join(path, MANIFEST_NAME)))
    except Exception:  # OSError, and botocore's own types: then reading it says what is wrong, once
        return False


def exists(location: str) -> bool:
    """True when a file exists at ``location``."""
    target = resolve(location)
    if target.local is not None:
        return os.path.exists(target.local)
    fs, path = _remote(target)
    try:
        return bool(fs.exists(path))
    except OSError as e:
        raise StorageError(f"{location}: cannot check the store ({remote_error_text(e)})") from e


def remove(location: str) -> None:
    """Delete the file at ``location`` (already gone is fine)."""
    target = resolve(location)
    try:
        if target.local is not None:
            os.unlink(target.local)
        else:
            fs, path = _remote(target)
            fs.rm_file(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise StorageError(f"{location}: cannot delete ({e})") from e


def make_directory(location: str) -> None:
    """Create a local checkpoint directory (object stores have no directories to create, and a
    bucket is never created on the way)."""
    target = resolve(location)
    if target.local is not None:
        try:
            os.makedirs(target.local, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{location}: cannot create the checkpoint directory ({e.strerror or e})") from e
