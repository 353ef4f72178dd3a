"""A local directory as a ``Storage``: ``lstat`` everywhere, create-only publishing by hard link.

Also the local-file helpers the other layers share: publishing a temp file under its final name,
refusing a FIFO or a device before opening it, and replacing a report file atomically.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Container, Sequence

from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError

from .base import (
    EXISTS,
    LEDGER_DIR,
    PROTECT_FIX,
    REFUSED,
    VAULT_MARK,
    Entry,
    Lock,
    LockRequest,
    Progress,
    Protection,
    Storage,
    committed_names,
    fsync_dir,
    kind_of,
    temp_name,
)

__all__ = ["LocalStorage", "publish_local", "refuse_special", "write_atomic"]


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
        kind, what = kind_of(st.st_mode)
        # a change detector no writer can forge whole: ctime moves on every change of the file
        stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
        return Entry(name, kind, st.st_size if kind == "file" else None, stamp, what)

    def walk(
        self,
        prefix: str = "",
        *,
        depth: int = 8,
        hidden: bool = False,
        skip: Container[str] = (),
        detail: bool = True,
        hint: Sequence[str] = (),  # a directory is read whole: nothing to split
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
                _, what = kind_of(st.st_mode)
                raise StorageError(f"{path}: is {what}, not a file; {REFUSED}")
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

    @property
    def in_place(self) -> bool:
        return True

    def open(self, *, create: bool = False, what: str = "store") -> Protection:
        if create:
            self.make_root(what=what)
        elif not os.path.isdir(self.root):
            raise CheckpointNotFoundError(f"{self.url}: no such {what} (directory not found)")
        return Protection(local=True)

    def make_root(self, *, what: str = "store") -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StorageError(f"{self.url}: cannot create the {what} directory ({e.strerror or e})") from e

    def staging(self, name: str) -> str:
        return temp_name(self._path(name))

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
        final = self._path(name)
        shown = display or self.location(name)
        if staged:  # written beside its final name: a rename, never a copy
            publish_local(src, final, create_only=create_only, display=shown)
            return
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            publish_local(tmp, final, create_only=create_only, display=shown)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def why_protected(self, name: str) -> str | None:
        final = self._path(name)
        try:
            st = os.stat(final)
        except FileNotFoundError:
            return None  # nothing to replace
        except OSError:
            return None  # let the write itself report it
        if not st.st_mode & 0o222:
            return "the file is read-only; it is not replaced; make it writable first or save under a new name"
        d = os.path.dirname(final)
        while True:
            if os.path.exists(os.path.join(d, LEDGER_DIR, VAULT_MARK)):
                return f"the file is inside the vault {d}; {PROTECT_FIX}"
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        records_dir = os.path.join(os.path.dirname(final), LEDGER_DIR, "checkpoints")
        if os.path.isdir(records_dir):
            records = []
            for record in os.listdir(records_dir):
                if record.endswith(".json") and not record.startswith("."):
                    with contextlib.suppress(OSError), open(os.path.join(records_dir, record), "rb") as fh:
                        records.append(fh.read())
            if {os.path.basename(final), final} & committed_names(records):
                return f"a commit record in {records_dir} names this file; {PROTECT_FIX}"
        return None

    def delete(self, name: str) -> str | None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot delete ({e.strerror or e})"
        return None

    def remove_empty(self, prefix: str) -> None:
        try:
            os.rmdir(self._path(prefix))
        except OSError:
            pass  # a file that appeared meanwhile keeps the directory

    def lock_of(self, name: str) -> Lock | None:
        entry = self.stat(name)
        if entry is None:
            return None
        return Lock(mode="read-only file")


def publish_local(tmp: str, final: str, *, create_only: bool, display: str, sync_dir: bool = True) -> None:
    """Publish a fully written, fsync'd temp file under its final name, then fsync the directory.

    Create-only is a hard link, which fails when the name exists, so two writers can never replace
    each other's file; otherwise ``os.replace`` (atomic). The temp name is gone afterwards.
    ``sync_dir=False``: the caller fsyncs the directory itself, once for several files
    (``certckpt.format.durable``).
    """
    try:
        if not create_only:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            except FileExistsError as e:
                raise CheckpointExistsError(f"{display}: {EXISTS}") from e
            except OSError as e:
                if e.errno not in (1, 38, 95):  # EPERM/ENOSYS/EOPNOTSUPP: no hard links here
                    raise
                _exclusive_rename(tmp, final, display)
        if sync_dir:
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
        raise CheckpointExistsError(f"{display}: {EXISTS}") from e
    os.close(fd)
    os.replace(tmp, final)


def refuse_special(path: str, display: str) -> None:
    """Refuse, before opening it, a local path that is not a regular file: opening a FIFO blocks until a
    writer comes, a device is never done being read, and neither is a checkpoint.

    Raises:
        StorageError: a FIFO, a device or a socket (also behind a symbolic link), one line naming it.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: opening it says which, in the caller's words
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise StorageError(f"{display}: is {what}, not a file; {REFUSED}")


def write_atomic(path: str, data: bytes) -> None:
    """Replace a local output file (a report, a picture) atomically: a temp file beside it, then a
    rename, with the permissions an ordinary ``open()`` would have given it."""
    tmp = temp_name(os.path.abspath(path))
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
