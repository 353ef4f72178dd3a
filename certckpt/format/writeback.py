"""Start the kernel's writeback of a file while it is still being written (Linux ``sync_file_range``).

A certified file is durable only once fsync'd. Written whole and then fsync'd, its every byte waits in
the page cache until that fsync, which then pays for all of them at once. Here, every ``every`` bytes
written, ``sync_file_range(fd, start, n, SYNC_FILE_RANGE_WRITE)`` asks the kernel to start writing that
range to the disk and returns without waiting (the technique databases use, e.g. RocksDB's
``bytes_per_sync``): the disk works while the rest of the file is written, and the final fsync finds
little left to do. It is a hint, never the durability point: it neither waits for the disk nor flushes
the disk's cache nor the file's metadata, so the fsync still makes the file durable and still reports
a write error (errors stay recorded on the file until an fsync reads them).

Where the call does not exist (not Linux, or a libc without it) a ``Writeback`` does nothing. The
range calls run on the writing thread: on ext4 they allocate the ranges' blocks and queue their I/O,
work the fsync would do later on some thread anyway.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["Writeback", "WRITEBACK_BYTES", "Starter", "system_starter", "preallocate"]

# Start writeback every 32 MiB written: large enough that the calls cost nothing next to the copy,
# small enough that the disk starts early and a 100 MiB file is mostly on its way when written.
WRITEBACK_BYTES = 32 << 20

SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, don't wait

# (fd, offset, nbytes, flags) -> 0, or -1 with errno set (ignored: a hint that fails costs nothing)
Starter = Callable[[int, int, int, int], int]


def _load_starter() -> Starter | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # no such symbol in this libc (musl has it; some builds may not)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYSTEM = _load_starter()


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def system_starter() -> Starter | None:
    """This platform's ``sync_file_range``, or None where it has none."""
    return _SYSTEM


class Writeback:
    """Tracks how far a file has been written, front to back, and starts writeback of each ``every``
    bytes as they complete.

    ``written(offset, n)`` after each write; writes need not be contiguous (the range started runs
    from the first byte not yet started to the end of the furthest write, so a gap is covered once it
    is filled, or left to the fsync). A write before the range already started (the header, written
    last at offset 0) is left to the fsync.

    Example:
        >>> wb = Writeback(fd)
        >>> for offset, piece in pieces:
        ...     os.pwrite(fd, piece, offset)
        ...     wb.written(offset, len(piece))
        >>> os.fsync(fd)  # still the durability point
    """

    __slots__ = ("_fd", "_every", "_start", "_end", "_starter", "calls")

    def __init__(
        self, fd: int, *, first: int = 0, every: int | None = None, starter: Starter | None | bool = True
    ) -> None:
        """
        Args:
            first: the first byte written in order (a file whose header is written last: where its
                data begins); writes before it are left to the fsync.
            every: start writeback once this many bytes past the last start are written (default
                ``WRITEBACK_BYTES``).
            starter: True for the platform's ``sync_file_range`` (None where it has none); None or
                False for none; or a callable with its signature (tests).
        """
        self._fd = fd
        self._every = WRITEBACK_BYTES if every is None else every
        self._start = first  # the first byte whose writeback was not started
        self._end = first  # the end of the furthest write
        self._starter: Starter | None = _SYSTEM if starter is True else (starter or None)
        self.calls = 0

    @property
    def active(self) -> bool:
        """Whether writeback is started at all here (False: every call is a no-op)."""
        return self._starter is not None

    def written(self, offset: int, n: int) -> None:
        """``n`` bytes were written at ``offset``: start writeback if ``every`` bytes are pending."""
        if self._starter is None:
            return
        end = offset + n
        if end <= self._start:
            return  # behind what was started already (a header): the fsync takes it
        self._end = max(self._end, end)
        if self._end - self._start >= self._every:
            self._starter(self._fd, self._start, self._end - self._start, SYNC_FILE_RANGE_WRITE)
            self.calls += 1
            self._start = self._end


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve the blocks of a file about to be written whole, ``nbytes`` long (Linux ``fallocate``).

    ext4 otherwise reserves and allocates blocks page by page as the file is written and as its
    writeback runs; one reservation up front makes both cheaper. Only the system call, never
    ``posix_fallocate``, whose fallback on a file system without it writes zeros over the whole file.
    A hint: where it fails (not Linux, a file system without it, a full disk) the write goes on as it
    would have, and meets the same errors. Returns whether the blocks were reserved.
    """
    if _FALLOCATE is None or nbytes <= 0:
        return False
    return _FALLOCATE(fd, 0, 0, nbytes) == 0
