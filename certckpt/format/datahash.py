"""The data region's SHA-256, hashed on a second core while the caller reads or writes.

A signature covers a file's data through the SHA-256 of its data region (``docs/signing.md``). One
SHA-256 pass costs about as much as the read or the write itself on these machines, so it runs on a
worker thread: hashlib releases the GIL for large buffers, and the buffers are the caller's own
(nothing is copied). The bytes waiting to be hashed are bounded, so a writer that stages device
tensors through host copies never holds more than ``max_pending`` of them for the hash.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["BackgroundSha256"]


class BackgroundSha256:
    """SHA-256 of the buffers given, in the order given, computed on one worker thread.

    Example:
        >>> h = BackgroundSha256()
        >>> h.update(memoryview(b"abc"))  # a tensor's bytes: h.update(host_bytes(t), keep=t)
        >>> h.finish()[:8]
        'ba7816bf'
    """

    def __init__(self, *, max_pending: int = 256 << 20) -> None:
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="certckpt-sha256")
        self._max = max_pending
        self._pending = 0
        self._room = threading.Condition()

    def _consume(self, view: Any, n: int, keep: Any) -> None:
        del keep  # held until now: a view of raw memory does not keep its owner alive
        try:
            self._hash.update(view)
        finally:
            with self._room:
                self._pending -= n
                self._room.notify_all()

    def update(self, view: Any, *, keep: Any = None) -> None:
        """Queue ``view``; blocks while too much waits.

        Args:
            keep: the object that owns ``view``'s memory (a tensor behind ``host_bytes``), held until
                the view is hashed.
        """
        n = memoryview(view).nbytes
        with self._room:
            while self._pending and self._pending + n > self._max:
                self._room.wait()
            self._pending += n
        self._pool.submit(self._consume, view, n, keep)  # one worker: updates run in submission order

    def finish(self) -> str:
        """Wait for every queued buffer; the hex digest."""
        self._pool.shutdown(wait=True)
        return self._hash.hexdigest()

    def hexdigest(self) -> str:  # hashlib's name, for callers that take either
        return self.finish()
