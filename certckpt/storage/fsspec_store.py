"""Any fsspec URL as a ``Storage``, and the one place a URL becomes an fsspec filesystem.

Imported only when a URL is used (``storage_for`` imports it lazily): it imports fsspec, which a
local ``certckpt verify`` must never load. A missing backend (s3fs, gcsfs, adlfs) fails with the pip
command that fixes it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Container, Iterable, Sequence
from typing import Any, cast

import fsspec.core
from fsspec import AbstractFileSystem
from fsspec.callbacks import Callback

from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, MissingDependencyError, StorageError

from .base import (
    EXISTS,
    LEDGER_DIR,
    PROTECT_FIX,
    VAULT_MARK,
    Entry,
    LockRequest,
    Progress,
    Protection,
    Storage,
    committed_names,
    create_once,
    remote_error_text,
)

__all__ = ["FsspecStorage", "filesystem"]

_BACKEND_PIP = {
    "s3": "pip install 'certckpt[s3]'  (installs s3fs)",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
}
Info = dict[str, Any]  # what fsspec's info/ls/find say of a path (keys vary by backend)


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """``(fs, path)`` for an fsspec URL, with a one-line fix when the backend is not installed."""
    scheme = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        fix = _BACKEND_PIP.get(scheme, f"install the fsspec backend for {scheme}://")
        raise MissingDependencyError(f"{url}: the {scheme}:// backend is not installed; {fix}") from e
    except ValueError as e:
        raise StorageError(f"{url}: not a usable URL ({e})") from e
    return fs, cast(str, path)


def upload_callback(progress: Progress, total: int) -> Callback:
    """An fsspec callback reporting ``(done, total)`` to a certckpt ``Progress``."""

    def report(size: int | None, value: int, **_: object) -> None:
        progress(min(value, total), total)

    return Callback(hooks={"progress": report})


class FsspecStorage(Storage):
    """Any fsspec filesystem. Its create-only write is a check then a write: not race-free (the
    docs say so); ``S3Storage`` has the conditional PUT that is."""

    def __init__(self, url: str, fs: AbstractFileSystem, root: str):
        self.url, self.fs, self.root = url, fs, root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def _name(self, path: str) -> str:
        prefix = self.root + "/"
        return path[len(prefix) :] if path.startswith(prefix) else path.rsplit("/", 1)[-1]

    def _failed(self, e: BaseException, name: str, doing: str) -> StorageError:
        return StorageError(f"{self.location(name)}: cannot {doing} ({remote_error_text(e)})")

    def exists(self, name: str = "") -> bool:
        try:
            return bool(self.fs.exists(self._path(name)))
        except Exception as e:  # OSError, and botocore's own types (no credentials, unreachable endpoint)
            raise self._failed(e, name, "read") from e

    def stat(self, name: str) -> Entry | None:
        try:
            info = self.fs.info(self._path(name))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._failed(e, name, "read") from e
        return self._entry(name, info)

    @staticmethod
    def _entry(name: str, info: Info) -> Entry:
        if info.get("type") == "directory":
            return Entry(name, "directory")
        if info.get("islink"):
            return Entry(name, "link", what="a symbolic link")
        # What moves when the object is rewritten: on S3 its ETag (the bytes' MD5 for a plain PUT) and
        # the time the server wrote it, which no writer chooses; a backend that says neither gives no
        # stamp, and nothing derived from the object is kept (every reader cache reads it again).
        moved = [str(info[k]) for k in ("ETag", "LastModified", "mtime", "created") if info.get(k)]
        stamp = ":".join([str(info.get("size")), *moved]) if moved else ""
        size = info.get("size")
        return Entry(name, "file", int(size) if size is not None else None, stamp)

    def walk(
        self,
        prefix: str = "",
        *,
        depth: int = 8,
        hidden: bool = False,
        skip: Container[str] = (),
        detail: bool = True,
        hint: Sequence[str] = (),
    ) -> list[Entry]:
        try:
            found = self._find(self._path(prefix), depth=depth, skip=skip, hint=[self._path(n) for n in hint])
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._failed(e, prefix, "list") from e
        out = []
        start = f"{prefix}/" if prefix else ""
        for path, info in found.items():
            name = self._name(path)
            if not hidden and any(part.startswith(".") for part in name.split("/")):
                continue
            if name.startswith(start) and name[len(start) :].split("/", 1)[0] in skip:
                continue
            out.append(self._entry(name, info))
        return out

    def _find(self, path: str, *, depth: int, skip: Container[str] = (), hint: Sequence[str] = ()) -> dict[str, Info]:
        """Every file under ``path``, ``depth`` levels at most, with what fsspec says of it (those
        under ``skip`` may be left out: ``walk`` drops them; ``hint``: see ``Storage.walk``)."""
        return cast(dict[str, Info], self.fs.find(path, maxdepth=depth, detail=True))

    def listdir(self, prefix: str = "") -> list[Entry]:
        try:
            found: list[Info] = self.fs.ls(self._path(prefix), detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._failed(e, prefix, "list") from e
        return [self._entry(self._name(str(info["name"]).rstrip("/")), info) for info in found]

    def get(self, name: str, *, limit: int | None = None) -> bytes | None:
        try:
            if limit is not None:
                size = self.fs.size(self._path(name))
                if size is not None and size > limit:
                    raise StorageError(
                        f"{self.location(name)}: {size} bytes, more than the {limit} it may hold; refused"
                    )
            return cast(bytes, self.fs.cat_file(self._path(name)))
        except FileNotFoundError:
            return None
        except StorageError:
            raise
        except Exception as e:
            raise self._failed(e, name, "read") from e

    def get_many(self, names: Iterable[str]) -> dict[str, bytes]:
        names = list(names)
        if not names:
            return {}
        paths = {self._path(n): n for n in names}
        try:
            got: dict[str, object] = self.fs.cat(list(paths), on_error="omit")
        except Exception as e:
            raise self._failed(e, "", "read") from e
        return {paths[p]: v for p, v in got.items() if isinstance(v, bytes)}

    def open(self, *, create: bool = False, what: str = "store") -> Protection:
        if not create and not self.exists():
            raise CheckpointNotFoundError(f"{self.url}: no such {what}")
        return Protection()

    def put_once(self, name: str, data: bytes) -> bool:
        fd, tmp = tempfile.mkstemp(prefix=".certckpt-record-")

        def holder(refusal: CheckpointExistsError) -> bool | None:
            self.refresh()  # a listing cached before the other writer's PUT would hide it
            existing = self.get(name)
            if existing is None:
                return None
            if existing == data:
                return False
            raise refusal

        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            written = create_once(
                lambda: self.publish(tmp, name, create_only=True),
                holder,
                gave_up=f"{self.location(name)}: conflicting concurrent writes did not settle; retry",
                pause=0.05,
            )
            return written is None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def staging(self, name: str) -> str:
        # built locally, then one PUT publishes it whole: a fresh name the writer creates exclusively
        fd, tmp = tempfile.mkstemp(prefix=".certckpt-upload-")
        os.close(fd)
        os.unlink(tmp)
        return tmp

    def _put(self, src: str, path: str, *, create_only: bool, lock: LockRequest | None, extra: Info) -> None:
        # Backends without a conditional PUT: check, then write. Not race-free; documented.
        if create_only and self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.put_file(src, path, **extra)

    def publish(
        self,
        src: str,
        name: str,
        *,
        create_only: bool = True,
        staged: bool = False,
        lock: LockRequest | None = None,
        progress: Progress | None = None,
        display: str | None = None,
    ) -> None:
        shown = display or self.location(name)
        extra = {"callback": upload_callback(progress, os.path.getsize(src))} if progress is not None else {}
        try:
            self._put(src, self._path(name), create_only=create_only, lock=lock, extra=extra)
        except FileExistsError as e:
            raise CheckpointExistsError(f"{shown}: {EXISTS}") from e
        except PermissionError as e:
            raise StorageError(f"{shown}: permission denied by the store; check credentials and bucket policy") from e
        except Exception as e:  # OSError, and botocore's own types (unreachable endpoint, no credentials)
            raise StorageError(
                f"{shown}: upload failed ({remote_error_text(e)}); nothing was published under this name"
            ) from e

    def why_protected(self, name: str) -> str | None:
        """Every prefix above the object is checked for a vault mark, and its own prefix for commit
        records (only when the object exists)."""
        if not self.exists(name):
            return None
        ancestor = self.url
        while True:  # every prefix above the object, the bucket itself included
            fs, path = filesystem(ancestor)
            if FsspecStorage(ancestor, fs, path).exists(f"{LEDGER_DIR}/{VAULT_MARK}"):
                return f"the object is inside the vault {ancestor}; {PROTECT_FIX}"
            if "/" not in ancestor.split("://", 1)[-1].strip("/"):
                break
            ancestor = ancestor.rstrip("/").rsplit("/", 1)[0]
        records = [e.name for e in self.walk(f"{LEDGER_DIR}/checkpoints", depth=1) if e.name.endswith(".json")]
        if records and {name, self.location(name)} & committed_names(self.get_many(records).values()):
            return f"a commit record of {self.url} names this object; {PROTECT_FIX}"
        return None

    def delete(self, name: str) -> str | None:
        try:
            self.fs.rm_file(self._path(name))
        except FileNotFoundError:
            pass
        except Exception as e:
            return remote_error_text(e)
        return None

    def refresh(self) -> None:
        self.fs.invalidate_cache()
