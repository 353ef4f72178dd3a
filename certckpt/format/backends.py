"""The storage interface: what a place that holds checkpoints and ledgers must do, and its three kinds.

Everything that lists, reads or writes a run store or a vault by name goes through a ``Storage``:
``LocalStorage`` (a directory, with ``lstat`` and hard links), ``FsspecStorage`` (any fsspec URL) and
``S3Storage`` (s3fs, adding create-only PUTs, Object Lock and versions). A new backend is one new
subclass here and one line in ``storage_for``; nothing above the format layer changes.

Names are relative to the storage's root and ``/``-separated (``_ledger/checkpoints/abc.json``).

The call order a backend must support (DCP's ``StorageWriter`` docstrings are the model):

* **opening**: ``storage_for(url)``; a vault then calls ``protection()`` once, which also proves the
  location is reachable (a missing bucket or refused credentials are raised there, in one line).
* **writing a record**: ``put_once(name, data)``: create-only, idempotent when the same bytes are
  already there (a retried write), ``CheckpointExistsError`` when different bytes hold the name.
* **writing a large file**: the caller writes and fsyncs a local file, then
  ``put_file(src, name, create_only=True, lock=...)``; nothing is visible under ``name`` until the
  whole file is (a local rename, an S3 PUT that either lands or not).
* **reading a store**: ``walk(prefix)`` (files, and every link, FIFO, device or socket reported as
  such and never followed or opened), then ``get_many(names)`` / ``get(name)``; ``refresh()`` first
  when another process may have written since this one listed.
* **pruning**: ``lock_of(name)`` (what still protects an object), then ``delete(name)``, which
  returns why the store refused instead of raising (a retention lock is an answer, not an error).

Errors: "not there" is ``None`` (``get``, ``stat``, ``lock_of``) or an empty listing; anything else
the store reports leaves as ``StorageError`` with one line that says what to fix
(``remote_error_text``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast

from certckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MissingDependencyError,
    StorageError,
)

__all__ = [
    "Entry",
    "FsspecStorage",
    "LocalStorage",
    "Lock",
    "Protection",
    "S3Storage",
    "Storage",
    "Versions",
    "filesystem",
    "fsync_dir",
    "publish_local",
    "remote_error_text",
    "storage_for",
    "storage_of",
    "temp_name",
]

Kind = Literal["file", "directory", "link", "special"]

_BACKEND_PIP = {
    "s3": "pip install 'certckpt[s3]'  (installs s3fs)",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
}
Extra = dict[str, Any]  # keyword arguments passed through to the fsspec call
_REFUSED = "refused unopened (damaged or hostile store)"
_EXISTS = "a checkpoint already exists under this name; pass overwrite=True to replace it"


@dataclass(frozen=True, slots=True)
class Entry:
    """One object of a listing.

    Attributes:
        name: relative to the storage's root, ``/``-separated.
        kind: ``file``; ``directory`` (only where a walk stopped at its depth); ``link`` or
            ``special`` (a FIFO, a device, a socket): reported, never followed or opened.
        size: bytes, for a file.
        stamp: what changes when the object is rewritten (size, times and inode locally; the ETag
            on an object store): a reader may keep what it derived from an object while it holds.
        what: for a link or special entry, what it is in words ("a FIFO").
    """

    name: str
    kind: Kind
    size: int | None = None
    stamp: str = ""
    what: str = ""


@dataclass(frozen=True, slots=True)
class Protection:
    """What a store enforces by itself (learnt by ``Storage.protection``).

    Attributes:
        object_lock: objects can carry a retention the store enforces (S3 Object Lock).
        versioned: a deleted or replaced object leaves its old versions behind.
        bucket: the S3 bucket, where there is one.
    """

    object_lock: bool = False
    versioned: bool = False
    bucket: str | None = None


@dataclass(frozen=True, slots=True)
class Lock:
    """What protects one stored object now."""

    mode: str  # GOVERNANCE, COMPLIANCE, or "read-only file"
    retain_until: datetime.datetime | None = None
    legal_hold: bool = False
    version_id: str | None = None

    def active(self, now: datetime.datetime | None = None) -> bool:
        """Whether the store would refuse to delete the object now."""
        if self.legal_hold:
            return True
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return self.retain_until is not None and self.retain_until > now


@dataclass(frozen=True, slots=True)
class Versions:
    """An object's stored versions and delete markers; ``deleted``: a delete marker is current."""

    versions: int
    delete_markers: int
    deleted: bool


def filesystem(url: str) -> tuple[Any, str]:
    """``(fs, path)`` for an fsspec URL, with a one-line fix when the backend is not installed."""
    try:
        import fsspec.core
    except ImportError as e:  # pragma: no cover - fsspec is a runtime dependency
        raise MissingDependencyError("fsspec is needed for URLs: pip install fsspec") from e
    scheme = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        fix = _BACKEND_PIP.get(scheme, f"install the fsspec backend for {scheme}://")
        raise MissingDependencyError(f"{url}: the {scheme}:// backend is not installed; {fix}") from e
    except ValueError as e:
        raise StorageError(f"{url}: not a usable URL ({e})") from e
    return fs, cast(str, path)


def remote_error_text(e: BaseException) -> str:
    """One line for an object-store failure, with the fix for the usual causes."""
    name = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else name
    if name in ("NoCredentialsError", "PartialCredentialsError") or "Unable to locate credentials" in text:
        return "no credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
    if isinstance(e, ConnectionRefusedError) or "Connection refused" in text:
        return f"connection refused by the endpoint ({text}); check AWS_ENDPOINT_URL / --endpoint and the network"
    unreachable = (
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ReadTimeoutError",
    )
    if name in unreachable or "Could not connect" in text or "Connect call failed" in text:
        return f"cannot reach the endpoint ({text}); check AWS_ENDPOINT_URL / --endpoint and the network"
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return f"the bucket does not exist ({text}); create it first (with Object Lock enabled for a vault)"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return f"credentials refused ({text}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    return text


def _kind_of(mode: int) -> tuple[Kind, str]:
    if stat.S_ISREG(mode):
        return "file", "a file"
    if stat.S_ISDIR(mode):
        return "directory", "a directory"
    if stat.S_ISLNK(mode):
        return "link", "a symbolic link"
    for test, what in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return "special", what
    return "special", "not a file"


class Storage(ABC):
    """A place that holds objects under ``/``-separated names (see the module docstring for the
    call order). ``url`` is the root as the user spelled it; ``location(name)`` is what to show."""

    url: str

    def location(self, name: str = "") -> str:
        """The object's URL or path, as messages and records name it."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    @abstractmethod
    def exists(self, name: str = "") -> bool:
        """Whether anything (a file, a directory, a prefix) is there."""

    @abstractmethod
    def stat(self, name: str) -> Entry | None:
        """The object itself, never what a link points to; None when nothing is there."""

    @abstractmethod
    def walk(
        self, prefix: str = "", *, depth: int = 8, hidden: bool = False, skip: Container[str] = (), detail: bool = True
    ) -> list[Entry]:
        """Every object under ``prefix``, ``depth`` levels at most (a directory deeper than that is
        an entry of kind ``directory``); links and special files are entries, never followed.

        Args:
            hidden: include names starting with ``.`` (writers' temp files).
            skip: names directly under ``prefix`` not to descend into.
            detail: sizes and stamps (False: names and kinds only, which a local walk learns without
                one ``stat`` per file).
        """

    def listdir(self, prefix: str = "") -> list[Entry]:
        """The entries directly under ``prefix``, directories included, hidden names included."""
        return self.walk(prefix, depth=1, hidden=True, detail=False)

    @abstractmethod
    def get(self, name: str, *, limit: int | None = None) -> bytes | None:
        """The whole object (None when missing). Refuses a link or special file; refuses an object
        larger than ``limit`` bytes without reading it (``StorageError``)."""

    def get_many(self, names: Iterable[str]) -> dict[str, bytes]:
        """Several objects at once (backends batch the requests); a missing one is left out."""
        out = {}
        for n in names:
            data = self.get(n)
            if data is not None:
                out[n] = data
        return out

    @abstractmethod
    def put_once(self, name: str, data: bytes) -> bool:
        """Write a small object that must never be replaced. True when written; False when the
        same bytes were already there. Raises ``CheckpointExistsError`` for different bytes."""

    @abstractmethod
    def put_file(
        self,
        src: str,
        name: str,
        *,
        create_only: bool = True,
        lock: dict[str, Any] | None = None,
        callback: Any = None,
    ) -> None:
        """Publish a finished local file under ``name``, whole or not at all.

        Args:
            create_only: refuse an existing name (``CheckpointExistsError``).
            lock: Object Lock parameters for the new object (S3 only; ignored elsewhere).
            callback: an fsspec progress ``Callback``.
        """

    @abstractmethod
    def delete(self, name: str) -> str | None:
        """Delete an object (on a versioned store, every version); returns why the store refused,
        or None when it is gone."""

    def protection(self) -> Protection:
        """What this store enforces by itself; also proves it is reachable."""
        return Protection()

    def lock_of(self, name: str) -> Lock | None:
        """What protects the object now (read from the store, so that racing writers agree)."""
        return None

    def versions(self, name: str) -> Versions | None:
        """The object's versions; None where the store keeps none."""
        return None

    def refresh(self) -> None:  # noqa: B027 - a store that caches nothing has nothing to forget
        """Forget cached listings: another process may have written since this one listed."""


class LocalStorage(Storage):
    """A local directory: ``lstat`` everywhere, create-only publishing by hard link."""

    def __init__(self, url: str, path: str | None = None):
        self.url = url
        self.root = os.path.abspath(path if path is not None else url)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/")) if name else self.root

    def exists(self, name: str = "") -> bool:
        return os.path.lexists(self._path(name))

    def stat(self, name: str) -> Entry | None:
        try:
            # the root may be a link the user chose (a data directory mounted elsewhere); what is
            # inside it is never followed
            st = os.lstat(self._path(name)) if name else os.stat(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StorageError(f"{self.location(name)}: cannot read ({e.strerror or e})") from e
        return self._entry(name, st)

    @staticmethod
    def _entry(name: str, st: os.stat_result) -> Entry:
        kind, what = _kind_of(st.st_mode)
        # a change detector no writer can forge whole: ctime moves on every change of the file
        stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        return Entry(name, kind, st.st_size if kind == "file" else None, stamp, what)

    def walk(
        self, prefix: str = "", *, depth: int = 8, hidden: bool = False, skip: Container[str] = (), detail: bool = True
    ) -> list[Entry]:
        out: list[Entry] = []
        try:
            entries = list(os.scandir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return out
        except OSError as e:
            raise StorageError(f"{self.location(prefix)}: cannot list ({e.strerror or e})") from e
        for d in entries:
            if (d.name.startswith(".") and not hidden) or d.name in skip:
                continue
            name = f"{prefix}/{d.name}" if prefix else d.name
            try:
                entry = self._entry(name, d.stat(follow_symlinks=False)) if detail else self._bare_entry(name, d)
            except FileNotFoundError:
                continue  # gone since the listing (a temp file renamed away)
            if entry.kind == "directory" and depth > 1:
                out.extend(self.walk(name, depth=depth - 1, hidden=hidden, detail=detail))
            else:
                out.append(entry)
        return out

    @staticmethod
    def _bare_entry(name: str, d: os.DirEntry[str]) -> Entry:
        # the directory entry's own type: no stat call (a chain of thousands of entries lists fast)
        if d.is_symlink():
            return Entry(name, "link", what="a symbolic link")
        if d.is_dir(follow_symlinks=False):
            return Entry(name, "directory", what="a directory")
        if d.is_file(follow_symlinks=False):
            return Entry(name, "file")
        return LocalStorage._entry(name, d.stat(follow_symlinks=False))

    def get(self, name: str, *, limit: int | None = None) -> bytes | None:
        path = self._path(name)
        try:
            # O_NOFOLLOW: a link planted under a record's name is refused, never followed; O_NONBLOCK:
            # opening a FIFO must not wait for a writer (the fstat below then refuses it).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            entry = self.stat(name)
            if entry is not None and entry.kind != "file":
                raise StorageError(
                    f"{path}: is {entry.what}, not a file; refused unopened (damaged or hostile store)"
                ) from e
            raise StorageError(f"{path}: cannot read ({e.strerror or e})") from e
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                _, what = _kind_of(st.st_mode)
                raise StorageError(f"{path}: is {what}, not a file; {_REFUSED}")
            if limit is not None and st.st_size > limit:
                raise StorageError(f"{path}: {st.st_size} bytes, more than the {limit} it may hold; refused")
            data = f.read() if limit is None else f.read(limit + 1)
            if limit is not None and len(data) > limit:  # it grew while being read
                raise StorageError(f"{path}: more than the {limit} bytes it may hold; refused")
            return data

    def put_once(self, name: str, data: bytes) -> bool:
        final = self._path(name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            publish_local(tmp, final, create_only=True, display=self.location(name))
        except CheckpointExistsError:
            if self.get(name) == data:
                return False
            raise
        return True

    def put_file(
        self,
        src: str,
        name: str,
        *,
        create_only: bool = True,
        lock: dict[str, Any] | None = None,
        callback: Any = None,
    ) -> None:
        final = self._path(name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            publish_local(tmp, final, create_only=create_only, display=self.location(name))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def delete(self, name: str) -> str | None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot delete ({e.strerror or e})"
        return None

    def lock_of(self, name: str) -> Lock | None:
        entry = self.stat(name)
        if entry is None:
            return None
        return Lock(mode="read-only file")


class FsspecStorage(Storage):
    """Any fsspec filesystem. Its create-only write is a check then a write: not race-free (the
    docs say so); ``S3Storage`` has the conditional PUT that is."""

    def __init__(self, url: str, fs: Any, root: str):
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
    def _entry(name: str, info: dict[str, Any]) -> Entry:
        if info.get("type") == "directory":
            return Entry(name, "directory")
        if info.get("islink"):
            return Entry(name, "link", what="a symbolic link")
        stamp = f"{info.get('size')}:{info.get('ETag') or info.get('LastModified') or info.get('mtime')}"
        size = info.get("size")
        return Entry(name, "file", int(size) if size is not None else None, stamp)

    def walk(
        self, prefix: str = "", *, depth: int = 8, hidden: bool = False, skip: Container[str] = (), detail: bool = True
    ) -> list[Entry]:
        try:
            found: dict[str, dict[str, Any]] = self.fs.find(self._path(prefix), maxdepth=depth, detail=True)
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

    def listdir(self, prefix: str = "") -> list[Entry]:
        try:
            found: list[dict[str, Any]] = self.fs.ls(self._path(prefix), detail=True)
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
            got: dict[str, Any] = self.fs.cat(list(paths), on_error="omit")
        except Exception as e:
            raise self._failed(e, "", "read") from e
        return {paths[p]: v for p, v in got.items() if isinstance(v, bytes)}

    def put_once(self, name: str, data: bytes) -> bool:
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix=".certckpt-record-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            for attempt in range(8):
                try:
                    self.put_file(tmp, name, create_only=True)
                    return True
                except CheckpointExistsError:
                    # A racing writer's PUT can be refused (412/409) before its object is readable:
                    # wait for it, and if it never appears (that writer failed), try again.
                    self.refresh()  # a listing cached before the other writer's PUT would hide it
                    existing = self.get(name)
                    if existing is None:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    if existing == data:
                        return False
                    raise
            raise StorageError(f"{self.location(name)}: conflicting concurrent writes did not settle; retry")
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _put(
        self, src: str, path: str, *, create_only: bool, lock: dict[str, Any] | None, extra: dict[str, Any]
    ) -> None:
        # Backends without a conditional PUT: check, then write. Not race-free; documented.
        if create_only and self.fs.exists(path):
            raise FileExistsError(path)
        self.fs.put_file(src, path, **extra)

    def put_file(
        self,
        src: str,
        name: str,
        *,
        create_only: bool = True,
        lock: dict[str, Any] | None = None,
        callback: Any = None,
    ) -> None:
        display = self.location(name)
        extra = {"callback": callback} if callback is not None else {}
        try:
            self._put(src, self._path(name), create_only=create_only, lock=lock, extra=extra)
        except FileExistsError as e:
            raise CheckpointExistsError(f"{display}: {_EXISTS}") from e
        except PermissionError as e:
            raise StorageError(f"{display}: permission denied by the store; check credentials and bucket policy") from e
        except Exception as e:  # OSError, and botocore's own types (unreachable endpoint, no credentials)
            raise StorageError(
                f"{display}: upload failed ({remote_error_text(e)}); nothing was published under this name"
            ) from e

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


class S3Storage(FsspecStorage):
    """An S3 bucket through s3fs: conditional create-only PUTs (``If-None-Match: *``), Object Lock
    retention carried by each PUT, and versions (a locked bucket is always versioned)."""

    def __init__(self, url: str, fs: Any, root: str):
        super().__init__(url, fs, root)
        self.bucket = self.root.split("/", 1)[0]
        self._versioned: bool | None = None

    def _key(self, name: str) -> str:
        return self._path(name).split("/", 1)[1]

    def _s3(self, method: str, **kwargs: Any) -> dict[str, Any]:
        return cast(dict[str, Any], self.fs.call_s3(method, Bucket=self.bucket, **kwargs))

    def _put(
        self, src: str, path: str, *, create_only: bool, lock: dict[str, Any] | None, extra: dict[str, Any]
    ) -> None:
        if create_only:
            # If-None-Match: * — the server refuses an existing key; s3fs aborts a failed multipart upload
            self.fs.put_file(src, path, mode="create", **(lock or {}), **extra)
        else:
            # A versioned, locked bucket keeps the replaced version; the new one gets its own lock.
            self.fs.put_file(src, path, **(lock or {}), **extra)

    def protection(self) -> Protection:
        bucket = self.bucket
        try:
            self._s3("head_bucket")
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{self.url}: bucket {bucket!r} does not exist; create it with Object Lock enabled "
                f"(aws s3api create-bucket --bucket {bucket} --object-lock-enabled-for-bucket)"
            ) from e
        except PermissionError as e:
            raise StorageError(
                f"{self.url}: access to bucket {bucket!r} denied; check credentials and bucket policy"
            ) from e
        except Exception as e:  # botocore: no credentials, unreachable endpoint
            raise StorageError(f"{self.url}: {remote_error_text(e)}") from e
        try:
            conf = self._s3("get_object_lock_configuration")
            lock = conf.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
        except Exception:  # ObjectLockConfigurationNotFoundError: a bucket without Object Lock
            lock = False
        try:
            versioned = self._s3("get_bucket_versioning").get("Status") == "Enabled"
        except Exception:
            versioned = lock
        self._versioned = versioned
        return Protection(object_lock=lock, versioned=versioned, bucket=bucket)

    def lock_of(self, name: str, *, version_id: str | None = None) -> Lock | None:
        """Raises ``StorageError`` when the object cannot be read (a missing one: None)."""
        extra = {"VersionId": version_id} if version_id else {}
        try:
            head = self._s3("head_object", Key=self._key(name), **extra)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._failed(e, name, "read its lock") from e
        hold = head.get("ObjectLockLegalHoldStatus") == "ON"
        if not head.get("ObjectLockMode") and not hold:
            return None
        until = head.get("ObjectLockRetainUntilDate")
        return Lock(
            mode=str(head.get("ObjectLockMode") or ""),
            retain_until=until.astimezone(datetime.timezone.utc) if until else None,
            legal_hold=hold,
            version_id=head.get("VersionId"),
        )

    def versions(self, name: str) -> Versions | None:
        if not self._is_versioned():
            return None
        key = self._key(name)
        versions = markers = 0
        deleted = False
        for page in self._version_pages(key):
            versions += sum(1 for v in page.get("Versions", []) if v.get("Key") == key)
            for m in page.get("DeleteMarkers", []):
                if m.get("Key") == key:
                    markers += 1
                    deleted = deleted or bool(m.get("IsLatest"))
        return Versions(versions=versions, delete_markers=markers, deleted=deleted)

    def _is_versioned(self) -> bool:
        if self._versioned is None:
            self.protection()
        return bool(self._versioned)

    def _version_pages(self, key: str) -> Iterable[dict[str, Any]]:
        kwargs: dict[str, str] = {}
        while True:
            try:
                page = self._s3("list_object_versions", Prefix=key, **kwargs)
            except Exception as e:
                raise StorageError(f"{self.url}/{key}: cannot list its versions ({remote_error_text(e)})") from e
            yield page
            if not page.get("IsTruncated"):
                return
            kwargs = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "VersionIdMarker": page.get("NextVersionIdMarker", ""),
            }

    def delete(self, name: str) -> str | None:
        if not self._is_versioned():
            return super().delete(name)
        # A versioned (Object Lock) bucket: deleting the key only hides it behind a delete marker and
        # frees nothing; delete each version, which the server refuses while its retention holds.
        key = self._key(name)
        try:
            for page in self._version_pages(key):
                for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
                    if v["Key"] != key:
                        continue
                    try:
                        self._s3("delete_object", Key=key, VersionId=v["VersionId"])
                    except PermissionError:
                        held = self.lock_of(name, version_id=v["VersionId"])
                        until = held.retain_until.isoformat() if held and held.retain_until else "?"
                        mode = f" {held.mode}" if held and held.mode else ""
                        return f"Object Lock{mode} retention until {until}"
        except StorageError as e:
            return str(e)
        except Exception as e:
            return remote_error_text(e)
        self.fs.invalidate_cache(self._path(name))
        return None


def storage_for(url: str) -> Storage:
    """The storage rooted at ``url`` (a local path, ``file://``, or any fsspec URL)."""
    if "://" not in url:
        return LocalStorage(url)
    scheme = url.split("://", 1)[0]
    if scheme == "file":
        return LocalStorage(url, url[len("file://") :])
    fs, path = filesystem(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a"):
        return S3Storage(url, fs, path)
    if protocol in ("file", "local"):
        return LocalStorage(url, path)
    return FsspecStorage(url, fs, path)


def storage_of(location: str) -> tuple[Storage, str]:
    """The storage holding one object and the object's name in it (its parent directory or prefix)."""
    local = location[len("file://") :] if location.startswith("file://") else location
    if "://" not in local:
        parent, name = os.path.split(local.rstrip("/") or "/")
        return LocalStorage(parent or ".", os.path.abspath(parent or ".")), name
    parent, _, name = location.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise StorageError(f"{location}: not an object inside a store")
    return storage_for(parent), name


def temp_name(final: str) -> str:
    """A temp-file name in the final file's directory, hidden, unique, recognisably ours."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{base}.certckpt-tmp-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_local(tmp: str, final: str, *, create_only: bool, display: str) -> None:
    """Publish a fully written, fsync'd temp file under its final name, then fsync the directory.

    Create-only is a hard link, which fails when the name exists, so two writers can never replace
    each other's file; otherwise ``os.replace`` (atomic). The temp name is gone afterwards.
    """
    try:
        if not create_only:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            except FileExistsError as e:
                raise CheckpointExistsError(f"{display}: {_EXISTS}") from e
            except OSError as e:
                if e.errno not in (1, 38, 95):  # EPERM/ENOSYS/EOPNOTSUPP: no hard links here
                    raise
                _exclusive_rename(tmp, final, display)
        fsync_dir(os.path.dirname(final))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _exclusive_rename(tmp: str, final: str, display: str) -> None:
    # For file systems without hard links: renameat2(RENAME_NOREPLACE) is not reachable from the
    # standard library, so claim the name with O_EXCL and then replace the empty claim atomically.
    try:
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError as e:
        raise CheckpointExistsError(f"{display}: {_EXISTS}") from e
    os.close(fd)
    os.replace(tmp, final)
