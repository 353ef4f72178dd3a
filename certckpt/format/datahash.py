"""The data region's cryptographic digest, fed in cache-sized pieces or hashed on another core.

A signature covers a file's data through a digest of its data region (``docs/signing.md``). New
signed files carry BLAKE3 (``data_blake3``); files signed before, or where the ``blake3`` package is
missing, carry SHA-256 (``data_sha256``). Where one pass already touches every byte (a host save's
xxh3, a verify), each 1 MiB piece goes to every digest while it is in this core's cache
(``hash_pieces``): memory is read once (measured on two cores, this beat a digest on other threads,
which competed with the pass for the cores and read memory a second time). ``BackgroundDigest`` is
for a pass with other work to overlap (a load, which also builds tensors; a save of device tensors,
whose host copies appear only in the writer): one worker thread, bounded bytes waiting, the
caller's buffers hashed without copies.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

from certckpt.errors import MissingDependencyError

from .worker import SerialWorker

__all__ = [
    "DIGEST_FIELDS",
    "BackgroundDigest",
    "preferred_digest_field",
    "digest_name",
    "new_hash",
    "hash_pieces",
    "CACHE_PIECE",
    "HashObject",
]

# Bytes hashed per call when one pass feeds several digests: a piece just read or copied is still in
# this core's L2 cache, so the second digest costs a fraction of a pass over memory (measured here on
# 1 GiB: a read plus BLAKE3 in 1 MiB pieces, 0.28 s, against 0.38-0.44 s for 8-16 MiB pieces).
CACHE_PIECE = 1 << 20

# The signature entry's data digest: field name -> algorithm. Both fields have 11 characters and 64
# hex digits, so a header's length never depends on which one a writer uses.
DIGEST_FIELDS = {"data_blake3": "blake3", "data_sha256": "sha256"}
_NAMES = {"blake3": "BLAKE3", "sha256": "SHA-256"}


def digest_name(field: str) -> str:
    """``"data_blake3"`` -> ``"BLAKE3"`` (for messages)."""
    return _NAMES[DIGEST_FIELDS[field]]


def preferred_digest_field() -> str:
    """The digest a new signed file carries: BLAKE3 when the ``blake3`` package is there."""
    try:
        import blake3  # noqa: F401
    except ImportError:
        return "data_sha256"
    return "data_blake3"


def new_hash(algorithm: str, *, threads: bool = True) -> HashObject:
    """A hashlib-style object for ``"blake3"`` or ``"sha256"``.

    Args:
        threads: let BLAKE3 spread one large update over its own threads (for a hash that has a core
            to itself); False for one fed small pieces beside other work.
    """
    if algorithm == "sha256":
        import hashlib  # OpenSSL: loaded only where a signature is made or checked

        return hashlib.sha256()
    try:
        import blake3
    except ImportError as e:
        raise MissingDependencyError(
            f"this file's signature covers its data with BLAKE3: pip install 'certckpt[sign]' (installs blake3) ({e})"
        ) from e
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)


def hash_pieces(view: Any, *hashes: Any) -> None:
    """Feed ``view`` to every hash in ``CACHE_PIECE`` pieces, each piece to all of them in turn: the
    memory is read from DRAM once, whatever the number of digests."""
    view = memoryview(view).cast("B")
    for i in range(0, len(view), CACHE_PIECE):
        piece = view[i : i + CACHE_PIECE]
        for h in hashes:
            h.update(piece)


class HashObject(Protocol):
    """What ``new_hash`` returns: hashlib's interface, which ``blake3`` shares."""

    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


class BackgroundDigest:
    """A digest of the buffers given, in the order given, computed on one worker thread.

    Args:
        field: the signature entry's field (``DIGEST_FIELDS``): which algorithm.
        max_pending: bytes queued at most; ``update`` waits beyond.
        threads: let BLAKE3 spread large updates over its own threads (``new_hash``); False when the
            caller feeds cache-sized pieces and reads the next one on its own core meanwhile.

    Example:
        >>> h = BackgroundDigest("data_sha256")
        >>> h.update(memoryview(b"abc"))  # a tensor's bytes: h.update(host_bytes(t), keep=t)
        >>> h.finish()[:8]
        'ba7816bf'
    """

    def __init__(self, field: str, *, max_pending: int = 256 << 20, threads: bool = True) -> None:
        self.field = field
        self._hash: HashObject = new_hash(DIGEST_FIELDS[field], threads=threads)
        self._pool = SerialWorker("certckpt-digest")
        self._max = max_pending
        self._pending = 0
        self._room = threading.Condition()

    @property
    def name(self) -> str:
        return digest_name(self.field)

    def _consume(self, view: Any, n: int, keep: Any) -> None:
        del keep  # held until now: a view of raw memory does not keep its owner alive
        try:
            self._hash.update(view)
        finally:
            with self._room:
                self._pending -= n
                self._room.notify_all()

    def update(self, view: Any, *, keep: Any = None) -> Future[None]:
        """Queue ``view``; blocks while too much waits.

        Args:
            keep: the object that owns ``view``'s memory (a tensor behind ``host_bytes``), held until
                the view is hashed.

        Returns:
            A future that is done once ``view`` is hashed: a reader that refills its own buffers
            waits on it before reusing the buffer.
        """
        n = memoryview(view).nbytes
        with self._room:
            while self._pending and self._pending + n > self._max:
                self._room.wait()
            self._pending += n
        return self._pool.submit(self._consume, view, n, keep)  # one thread: updates run in submission order

    def finish(self) -> str:
        """Wait for every queued buffer; the hex digest."""
        self._pool.close()
        return self._hash.hexdigest()

    def hexdigest(self) -> str:  # hashlib's name, for callers that take either
        return self.finish()
