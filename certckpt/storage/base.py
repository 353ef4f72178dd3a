"""The storage interface: what a place that holds checkpoints and ledgers must do, and the names a
location resolves to.

Everything that lists, reads or writes a run store or a vault by name goes through a ``Storage``:
``LocalStorage`` (a directory, with ``lstat`` and hard links), ``FsspecStorage`` (any fsspec URL) and
``S3Storage`` (s3fs, adding create-only PUTs, Object Lock and versions). A new backend is one new
subclass and one line in ``storage_for``; nothing above the storage layer changes.

Names are relative to the storage's root and ``/``-separated (``_ledger/checkpoints/abc.json``).
Paths stay ``str`` (``pathlib`` would collapse the ``//`` in ``s3://``).

The call order a backend must support (DCP's ``StorageWriter`` docstrings are the model):

* **opening**: ``storage_for(url)``; a vault then calls ``open()`` once, which also proves the
  location is reachable (a missing bucket or refused credentials are raised there, in one line) and
  says what the store enforces (``Protection``).
* **writing a record**: ``put_once(name, data)``: create-only, idempotent when the same bytes are
  already there (a retried write), ``CheckpointExistsError`` when different bytes hold the name.
* **writing a large file**: the caller writes and fsyncs a local file (at ``staging(name)`` when it
  may be moved into place), then ``publish(src, name, create_only=True, lock=...)``; nothing is
  visible under ``name`` until the whole file is (a local rename, an S3 PUT that either lands or
  not). Before replacing a name, ``why_protected(name)`` says whether it holds something certified.
* **reading a store**: ``walk(prefix)`` (files, and every link, FIFO, device or socket reported as
  such and never followed or opened), then ``get_many(names)`` / ``get(name)``; ``refresh()`` first
  when another process may have written since this one listed.
* **pruning**: ``lock_of(name)`` (what still protects an object), then ``delete(name)``, which
  returns why the store refused instead of raising (a retention lock is an answer, not an error),
  then ``remove_empty(prefix)``.

Errors: "not there" is ``None`` (``get``, ``stat``, ``lock_of``) or an empty listing; anything else
the store reports leaves as ``StorageError`` with one line that says what to fix
(``remote_error_text``).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Literal, Protocol, TypeVar

from certckpt.errors import ArgumentTypeError, CheckpointExistsError, StorageError

__all__ = [
    "EXISTS",
    "LEDGER_DIR",
    "VAULT_MARK",
    "Entry",
    "Lock",
    "LockRequest",
    "Progress",
    "Protection",
    "Storage",
    "Target",
    "Versions",
    "create_once",
    "fsync_dir",
    "is_missing_bucket",
    "join",
    "remote_error_text",
    "resolve",
    "temp_name",
]

Kind = Literal["file", "directory", "link", "special"]

# The ledger's layout as far as the storage layer must respect it (trust/ledger.py writes the ledger
# and takes these names from here: a lower layer cannot import upwards).
LEDGER_DIR = "_ledger"
VAULT_MARK = "vault.json"
EXISTS = "a checkpoint already exists under this name; pass overwrite=True to replace it"
REFUSED = "refused unopened (damaged or hostile store)"
PROTECT_FIX = "save under a new name (certified files are write-once)"
_T = TypeVar("_T")


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
    """What a store enforces by itself (learnt by ``Storage.open``).

    Attributes:
        object_lock: objects can carry a retention the store enforces (S3 Object Lock).
        versioned: a deleted or replaced object leaves its old versions behind.
        bucket: the S3 bucket, where there is one.
        local: a directory on this machine: a copy is checked before it is published, and a
            read-only mode is what protects it.
    """

    object_lock: bool = False
    versioned: bool = False
    bucket: str | None = None
    local: bool = False


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
class LockRequest:
    """The retention a new object is written with (S3 Object Lock; a store without it has none).

    The request carries a duration, not a date: each object's retain-until date is fixed when that
    object is written. A date fixed once, before a long promotion, would give the last objects less
    than was asked for, and one already past by the time of the PUT is refused by the store.

    Attributes:
        mode: ``GOVERNANCE`` (a privileged caller may lift it) or ``COMPLIANCE`` (nobody may).
        retain_for: the store refuses to delete the object for this long after it is written.
    """

    mode: Literal["GOVERNANCE", "COMPLIANCE"]
    retain_for: datetime.timedelta

    def until(self, now: datetime.datetime | None = None) -> datetime.datetime:
        """The retain-until date of an object written ``now`` (default: the current time, UTC)."""
        return (now or datetime.datetime.now(datetime.timezone.utc)) + self.retain_for


@dataclass(frozen=True, slots=True)
class Versions:
    """An object's stored versions and delete markers; ``deleted``: a delete marker is current."""

    versions: int
    delete_markers: int
    deleted: bool


class Progress(Protocol):
    """``progress(done, total)``: bytes written so far, of ``total``."""

    def __call__(self, done: int, total: int, /) -> None: ...


@dataclass(frozen=True, slots=True)
class Target:
    """A resolved checkpoint location.

    Attributes:
        display: how to name it in messages (the user's own spelling).
        local: a local filesystem path, when the location is one.
        url: the fsspec URL otherwise.
        fileobj: a caller's open binary file object, when given one.
    """

    display: str
    local: str | None = None
    url: str | None = None
    fileobj: IO[bytes] | None = None

    @property
    def location(self) -> str | None:
        """The path or URL a ``storage_of`` takes (None for a file object)."""
        return self.local if self.local is not None else self.url


def resolve(f: object) -> Target:
    """Classify what the caller passed, as ``torch.save`` / ``torch.load`` accept it."""
    if hasattr(f, "read") or hasattr(f, "write"):
        name = getattr(f, "name", None)
        fileobj: IO[bytes] = f  # type: ignore[assignment]  # duck-typed, as torch.save takes it
        return Target(display=name if isinstance(name, str) else "<file object>", fileobj=fileobj)
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if isinstance(f, bytes):
        f = os.fsdecode(f)
    if not isinstance(f, str):
        raise ArgumentTypeError(f"expected a path, an fsspec URL or a binary file object, got {type(f).__name__}")
    if "://" not in f:
        return Target(display=f, local=f)
    scheme = f.split("://", 1)[0]
    if scheme == "file":
        return Target(display=f, local=f[len("file://") :])
    return Target(display=f, url=f)


def join(base: str, *parts: str) -> str:
    """Join path or URL parts with ``/`` (never ``os.path``: it would mangle ``s3://``)."""
    out = base.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


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


def is_missing_bucket(e: BaseException) -> bool:
    """The one test for "no such bucket": s3fs reports it as ``FileNotFoundError`` (or in botocore's
    text); it is a store problem to fix, not a missing file."""
    text = str(e)
    return "NoSuchBucket" in text or "bucket does not exist" in text.lower()


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
    if is_missing_bucket(e):
        return f"the bucket does not exist ({text}); create it first (with Object Lock enabled for a vault)"
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
        return f"credentials refused ({text}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    return text


def create_once(
    write: Callable[[], None],
    holder: Callable[[CheckpointExistsError], _T | None],
    *,
    gave_up: str,
    pause: float,
    tries: int = 8,
) -> _T | None:
    """Run the create-only ``write``, settling a race with another writer of the same name.

    When the store refuses the write because the name is taken, ``holder(refusal)`` says what holds
    it: a value ends the race (the caller decides whether that is its own copy), None means nothing
    is readable there yet. A racing writer's PUT can be refused (412/409) before its object is
    readable: wait for it, and if it never appears (that writer failed), write again.

    Returns:
        None when ``write`` published; else what ``holder`` found.

    Raises:
        StorageError: ``gave_up``, when ``tries`` writes were refused and nothing ever appeared.
    """
    for attempt in range(tries):
        try:
            write()
            return None
        except CheckpointExistsError as refusal:
            found = holder(refusal)
            if found is not None:
                return found
            time.sleep(pause * (attempt + 1))
    raise StorageError(gave_up)


def committed_names(records: Iterable[bytes]) -> set[str]:
    """The file names a store's commit records name (an unreadable record names nothing here)."""
    names = set()
    for data in records:
        try:
            url = json.loads(data).get("url")
        except (ValueError, AttributeError):
            continue  # an unreadable record protects nothing here; the certifier reports it
        if isinstance(url, str):
            names.add(url)
    return names


def kind_of(mode: int) -> tuple[Kind, str]:
    """An ``st_mode``'s kind of entry, and what it is in words."""
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

    @property
    def in_place(self) -> bool:
        """Whether a file written at ``staging(name)`` becomes the object itself when published (a
        rename on a local disk); elsewhere it is uploaded, and only a copy of it is stored."""
        return False

    @abstractmethod
    def open(self, *, create: bool = False, what: str = "store") -> Protection:
        """Check that the root is usable (``create``: make it, where the store has directories) and
        learn what the store enforces.

        Raises:
            CheckpointNotFoundError: nothing there ("no such {what}"), or the bucket is missing.
            StorageError: no credentials, endpoint unreachable, access refused (one line, the fix).
        """

    def make_root(self, *, what: str = "store") -> None:  # noqa: B027 - object stores have no directories
        """Create the root directory where the store has directories (a bucket is never created)."""

    @abstractmethod
    def exists(self, name: str = "") -> bool:
        """Whether anything (a file, a directory, a prefix) is there."""

    @abstractmethod
    def stat(self, name: str) -> Entry | None:
        """The object itself, never what a link points to; None when nothing is there."""

    @abstractmethod
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
        """Every object under ``prefix``, ``depth`` levels at most (a directory deeper than that is
        an entry of kind ``directory``); links and special files are entries, never followed.

        Args:
            hidden: include names starting with ``.`` (writers' temp files).
            skip: names directly under ``prefix`` not to descend into.
            detail: sizes and stamps (False: names and kinds only, which a local walk learns without
                one ``stat`` per file).
            hint: names an earlier listing found here, sorted: a store that lists a page at a time
                (S3) splits the listing at every page's worth of them and lists the parts at once.
                What is listed is the same with any hint or none.
        """

    def listdir(self, prefix: str = "") -> list[Entry]:
        """The entries directly under ``prefix``, directories included, hidden names included."""
        return self.walk(prefix, depth=1, hidden=True, detail=False)

    def names_after(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """Up to ``limit`` names of the files under ``prefix`` that sort after ``after``, in order,
        hidden names included: a growing directory read a page at a time, at a cost that does not
        grow with it where the store can list from a key (S3: one request; here, a walk sliced).
        A page shorter than ``limit`` is the end of the listing; the caller picks the names it reads
        (filtering before the slice would let planted names end a page early)."""
        found = self.walk(prefix, detail=False, hidden=True)
        names = sorted(e.name for e in found if e.kind == "file" and e.name > after)
        return names[:limit]

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
    def staging(self, name: str) -> str:
        """A new local path to write ``name``'s file at before ``publish(..., staged=True)``: beside
        the final name on a local disk (no directory is created), a temp file elsewhere."""

    @abstractmethod
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
        """Publish a finished, fsync'd local file under ``name``, whole or not at all.

        Args:
            create_only: refuse an existing name (``CheckpointExistsError``).
            staged: ``src`` is a ``staging(name)`` path the store may move into place; it is gone
                from there afterwards when the store moved it.
            lock: the retention the new object carries (stores with Object Lock; ignored elsewhere).
            progress: ``progress(done, total)`` during an upload.
            display: how messages name the object (default ``location(name)``).
        """

    def why_protected(self, name: str) -> str | None:
        """Why replacing the existing object ``name`` would replace something certified (a vault
        copy, a committed checkpoint, a read-only file), or None. A check before a replacing write,
        not a lock: a vault's own copies are also written create-only."""
        return None

    @abstractmethod
    def delete(self, name: str) -> str | None:
        """Delete an object (on a versioned store, every version); returns why the store refused,
        or None when it is gone."""

    def remove_empty(self, prefix: str) -> None:  # noqa: B027 - object stores have no directories
        """Remove the directory ``prefix`` once its objects are deleted, where the store has
        directories; one that is not empty (a file appeared meanwhile) stays."""

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
