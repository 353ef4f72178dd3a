"""Several local files made durable together: one wait for the disk per save, not one per file.

A certified file is fsync'd under its temp name, linked to its final name, and its directory fsync'd
(``storage.local.publish_local``), one file after the other: a save of N files pays N waits for the
disk's journal and N directory fsyncs in series. Inside ``durable_together()`` a local save writes
its temp file and hands it here: its fsync starts at once on a small pool of threads (it runs while
the next file is being written; the journal commits fsyncs that arrive together as one), and when
the block ends, once every fsync has returned, each file is linked to its final name and each
directory fsync'd once.

What stays true: nothing appears under a final name before its bytes are durable (a crash leaves no
file there, or a complete one), and the names are durable when the block returns, so a commit
record written after it never points at bytes a crash could lose. On an error in the block or in an
fsync nothing is published and the temp files are removed. A save inside the block returns before
its file is under its final name: read files back only after the block.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from certckpt.errors import StorageError
from certckpt.storage import fsync_dir
from certckpt.storage.local import publish_local

__all__ = ["DurableBatch", "durable_together", "current_batch", "joining"]

# Enough fsyncs in flight for the block device to queue them together; each thread mostly waits.
_THREADS = 4

_CURRENT: contextvars.ContextVar[DurableBatch | None] = contextvars.ContextVar("certckpt_durable", default=None)


def current_batch() -> DurableBatch | None:
    """The batch of the innermost ``durable_together()`` block of this thread, if any."""
    return _CURRENT.get()


@dataclass(slots=True)
class _Pending:
    tmp: str
    final: str
    create_only: bool
    display: str
    synced: Future[None]


class DurableBatch:
    """The temp files of one ``durable_together()`` block: their fsyncs in flight, their names to link."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._pool: ThreadPoolExecutor | None = None

    def add(self, fd: int, tmp: str, final: str, *, create_only: bool, display: str, drop_cache: bool = False) -> None:
        """Take over a fully written temp file: fsync it now (on a pool thread), link it to ``final``
        when the block ends.

        Args:
            fd: the descriptor it was written through (duplicated here, so that the fsync reports
                the errors of those very writes; the caller still closes its own).
            drop_cache: drop its pages once durable.
        """
        own = os.dup(fd)
        self._pending.append(_Pending(tmp, final, create_only, display, self._fsync_later(own, drop_cache)))

    def add_existing(self, path: str) -> None:
        """Make a file already under its name durable with the others (one a caller's code wrote
        without an fsync), its directory fsync'd when the block ends."""
        fd = os.open(path, os.O_RDONLY)  # as fsync_dir: POSIX systems fsync a read-only descriptor
        self._pending.append(_Pending("", path, False, path, self._fsync_later(fd, False)))

    def _fsync_later(self, fd: int, drop_cache: bool) -> Future[None]:
        """``fd`` fsync'd (then closed) on a pool thread."""
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="certckpt-fsync")
            return self._pool.submit(_fsync_close, fd, drop_cache)
        except RuntimeError:  # the interpreter is shutting down: no new threads, so fsync it here
            synced: Future[None] = Future()
            try:
                _fsync_close(fd, drop_cache)
                synced.set_result(None)
            except OSError as e:
                synced.set_exception(e)
            return synced

    def _wait(self) -> BaseException | None:
        """Wait for every fsync; the first failure, if any."""
        failure: BaseException | None = None
        for p in self._pending:
            try:
                p.synced.result()
            except BaseException as e:  # every fsync is waited for before a temp file is unlinked
                if failure is None:
                    failure = StorageError(
                        f"{p.display}: making it durable failed ({getattr(e, 'strerror', None) or e}); nothing of "
                        "this save was published"
                    )
                    failure.__cause__ = e
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return failure

    def publish(self) -> None:
        """Every file durable, then linked to its name, then every directory fsync'd once.

        Raises:
            StorageError: an fsync failed (nothing published).
            CheckpointExistsError: a create-only name is taken (the files before it are published).
        """
        failure = self._wait()
        if failure is not None:
            self.discard()
            raise failure
        linked: set[str] = set()
        try:
            for p in self._pending:
                if p.tmp:  # else a file under its name already (add_existing)
                    publish_local(p.tmp, p.final, create_only=p.create_only, display=p.display, sync_dir=False)
                linked.add(os.path.dirname(p.final))
        finally:
            self.discard()  # the temp names of what was not linked
            for d in sorted(linked):
                fsync_dir(d)

    def discard(self) -> None:
        """Remove the temp files still there (nothing is published)."""
        self._wait()
        for p in self._pending:
            if p.tmp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p.tmp)


def _fsync_close(fd: int, drop_cache: bool) -> None:
    try:
        os.fsync(fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def durable_together() -> Iterator[DurableBatch]:
    """Local certified saves in this block are made durable together when it ends (see the module).

    Saves to object stores and to file objects are not deferred. Nested blocks join the outer one.

    Raises:
        StorageError: a file could not be made durable; nothing of the block was published.
        CheckpointExistsError: a create-only name was taken meanwhile.

    Example:
        >>> with durable_together():
        ...     certckpt.save(model.state_dict(), "ckpt/model.safetensors")
        ...     certckpt.save(optimizer.state_dict(), "ckpt/optimizer.safetensors")
        >>> # both files are durable under their names here, and only here
    """
    outer = _CURRENT.get()
    if outer is not None:
        yield outer
        return
    batch = DurableBatch()
    token = _CURRENT.set(batch)
    try:
        yield batch
    except BaseException:
        _CURRENT.reset(token)
        batch.discard()
        raise
    _CURRENT.reset(token)
    batch.publish()


@contextlib.contextmanager
def joining(batch: DurableBatch) -> Iterator[DurableBatch]:
    """Local certified saves in this block join ``batch``, which its owner publishes (or discards)
    later: for the files of one checkpoint that arrive through separate calls, not inside one block
    (a framework's per-file save hook between its own start and commit, as DeepSpeed's checkpoint
    engine). Nothing is published when the block ends; a save's file is under its name only once
    the owner's ``batch.publish()`` returned.

    Example:
        >>> batch = DurableBatch()
        >>> with joining(batch):
        ...     certckpt.save(model.state_dict(), "ckpt/model.safetensors")
        >>> batch.publish()   # durable under its name here
    """
    token = _CURRENT.set(batch)
    try:
        yield batch
    finally:
        _CURRENT.reset(token)
