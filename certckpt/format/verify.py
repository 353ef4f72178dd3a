"""Verify and inspect a checkpoint: header, digests, and (``deep``) device fingerprints.

Without ``deep`` this module never imports torch: it parses the header, then streams the data once,
hashing each tensor's bytes with xxh3-128. Corruption is reported in a ``VerifyReport`` (one readable
line per problem); only "could not verify" conditions (missing file, not a checkpoint, store errors)
raise.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol, cast

import xxhash

from certckpt.errors import CorruptCheckpointError, NotACheckpointError, StorageError, TruncatedCheckpointError
from certckpt.storage import open_read, resolve

from .datahash import DIGEST_FIELDS, HashObject, new_hash
from .header import (
    MAX_HEADER_BYTES,
    Header,
    TensorEntry,
    gc_paused,
    parse_header,
    printable,
    read_header_length,
)
from .record import (
    CheckpointRecord,
    canonical_form,
    check_header,
    parse_record,
    signature_problem,
    state_fingerprint,
)
from .signing import TrustedKeys, trusted_keys_for
from .trustconfig import NO_MMAP_ENV, TrustConfig, mmap_from_env

if TYPE_CHECKING:
    import torch

__all__ = [
    "verify",
    "inspect",
    "VerifyReport",
    "Problem",
    "ProblemKind",
    "CheckpointInfo",
    "read_checkpoint_header",
    "read_into",
    "digest_problem",
    "read_tensor",
    "fill_view",
    "maps_files",
    "NO_MMAP_ENV",
]

_CHUNK = 16 << 20  # streaming buffer: bounded memory whatever the file size
# The digest pass reads pieces that stay in this core's cache while xxh3 hashes them (1 GiB in the
# page cache: 0.16-0.18 s in 1 MiB pieces, 0.23-0.28 s in 16 MiB pieces).
_PIECE = 1 << 20
# A mapped digest maps and hashes this much at a time: large enough for BLAKE3 to spread it over
# every core (1 GiB: 0.10-0.11 s in 16, 64 or 256 MiB windows alike), small enough to bound the
# process's resident pages and let progress move.
_MAP_SLICE = 64 << 20

Progress = Callable[[int, int], None]
# The operator's switch for mounts where a mapped read's I/O error would end the process (SIGBUS).


if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # certckpt supports 3.10, which has no StrEnum: the same behaviour (str() and format() give the value)
    from enum import Enum

    class StrEnum(str, Enum):
        __str__ = str.__str__


class ProblemKind(StrEnum):
    """What a ``Problem`` is about (a member compares equal to its string: ``"truncated"``)."""

    TRUNCATED = "truncated"  # the file ends early, or goes on after the last tensor
    MALFORMED = "malformed"  # the header or the record cannot be read
    HEADER = "header"  # the header disagrees with its record
    DIGEST = "digest"  # a tensor's bytes changed
    FINGERPRINT = "fingerprint"  # a tensor's device fingerprint changed (``deep``)
    STATE = "state"  # the whole-state fingerprint disagrees with the tensors'
    SIGNATURE = "signature"  # unsigned, another key, or changed after signing
    MANIFEST = "manifest"  # a sharded checkpoint's manifest (``format.sharded.check``)
    EXTRA = "extra"  # a file a sharded checkpoint's manifest does not list
    MISSING = "missing"  # a shard file a sharded checkpoint's manifest lists is not there
    MISMATCH = "mismatch"  # a shard file's tensor is not the dtype, shape or chunk its manifest says
    COMPANION = "companion"  # a companion file a record lists (`certckpt verify`)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint.

    Attributes:
        kind: what it is about (a ``ProblemKind``; ``to_dict`` writes its string).
        message: one readable line naming the item, what was expected and what was found.
        tensor: the tensor concerned, when there is one.
    """

    kind: ProblemKind
    message: str
    tensor: str | None = None


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """What the header says: the tensor table and the certckpt record."""

    source: str
    header: Header
    record: CheckpointRecord

    @property
    def nbytes(self) -> int:
        return self.header.file_length


@dataclass(slots=True)
class VerifyReport:
    """The outcome of ``verify``.

    Attributes:
        source: the path or URL verified.
        ok: True when every check passed.
        deep: whether device fingerprints were recomputed.
        problems: what failed, one entry per problem.
        tensors: number of tensors checked.
        nbytes: bytes read.
        seconds: wall time.
        info: the parsed header and record, when the header itself could be parsed.
    """

    source: str
    ok: bool = True
    deep: bool = False
    problems: list[Problem] = field(default_factory=list)
    tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    info: CheckpointInfo | None = None

    def fail(self, kind: ProblemKind, message: str, tensor: str | None = None) -> None:
        """Record a problem."""
        self.ok = False
        self.problems.append(Problem(kind, message, tensor))

    def to_dict(self) -> dict[str, Any]:
        rec = self.info.record if self.info else None
        return {
            "source": self.source,
            "ok": self.ok,
            "deep": self.deep,
            "tensors": self.tensors,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "run": rec.run if rec else None,
            "step": rec.step if rec else None,
            "state_fp": rec.state_fp if rec else None,
            "problems": [{"kind": p.kind, "tensor": p.tensor, "message": p.message} for p in self.problems],
        }


def _read_exact(fh: IO[bytes], n: int) -> bytes:
    chunks, left = [], n
    while left:
        b = fh.read(min(left, _CHUNK))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _refuse_damaged_first_byte(fh: IO[bytes], prefix: bytes, size: int | None, source: str) -> None:
    """A certckpt file whose header's opening ``{`` is damaged is corrupt (exit 1), not foreign (exit 2).

    Only a length that fits the file is followed, and only a bounded read is made; the caller re-raises
    "not a checkpoint" when the bytes hold no certckpt record.
    """
    # No sniffing for foreign formats first: a header of 0x580 bytes starts with b"\x80\x05", a
    # pickle's opening, and the bounds and markers below already keep a foreign file out.
    if len(prefix) < 9:
        return
    (n,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= n <= MAX_HEADER_BYTES or (size is not None and 8 + n > size):
        return
    rest = _read_exact(fh, n - 1)
    if len(rest) == n - 1 and b'"__metadata__"' in rest and b"header_digest" in rest:
        raise CorruptCheckpointError(
            f"{source}: malformed header: the header's first byte is damaged (it is not '{{');"
            " restore the file from a good copy"
        )


def read_checkpoint_header(
    fh: IO[bytes], size: int | None, source: str, *, keep_skeleton: bool = True
) -> CheckpointInfo:
    """Read, bound and validate the header and the certckpt record; the stream is left at the data.

    ``keep_skeleton=False``: the record's skeleton is checked and dropped (``parse_record``), for a
    reader that never rebuilds the object.

    Raises:
        CorruptCheckpointError, NotACheckpointError
    """
    prefix = _read_exact(fh, 9)
    try:
        n = read_header_length(prefix, file_length=size, source=source)
    except NotACheckpointError:
        _refuse_damaged_first_byte(fh, prefix, size, source)
        raise
    rest = _read_exact(fh, n - 1)
    if len(rest) != n - 1:
        raise TruncatedCheckpointError(f"{source}: truncated: the header declares {n} bytes but the file ends early")
    raw = prefix[8:] + rest
    del rest  # (one copy of a header that may be 100 MB)
    with gc_paused():
        header = parse_header(raw, source=source, file_length=size)
        del raw
        # The canonical form is made now, before the record is parsed: making it frees the parsed
        # tensor table, so the two never sit in memory together (100,000 tensors: 300 -> 230 MB peak).
        canonical_form(header)
        record = parse_record(header, source=source, keep_skeleton=keep_skeleton)
        return CheckpointInfo(source=source, header=header, record=record)


def digest_problem(e: TensorEntry, expected: str, found: str) -> str:
    return (
        f"tensor `{printable(e.name)}`: xxh3 digest mismatch (expected {expected}, found {found}); "
        "the bytes changed after writing — restore this checkpoint from a good copy"
    )


def truncated_problem(source: str, e: TensorEntry, left: int) -> str:
    return f"{source}: truncated: tensor `{printable(e.name)}` ends {left} bytes early"


class _ReadsInto(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_into(fh: IO[bytes], view: memoryview) -> int:
    """``fh.readinto(view)``: the bytes read, 0 at the end. typing's ``IO`` does not declare
    ``readinto``, yet every stream ``storage.open_read`` yields has it (``io.BufferedReader``,
    fsspec's buffered files).

    Raises:
        StorageError: a non-blocking stream with nothing ready (its None would otherwise slice a
            whole stale buffer into the digests).
    """
    n = cast(_ReadsInto, fh).readinto(view)
    if n is None:
        raise StorageError(
            f"{getattr(fh, 'name', 'the file object')}: a non-blocking stream had no data ready; "
            "pass a blocking binary file object or a path"
        )
    return n


def read_tensor(
    fh: IO[bytes], e: TensorEntry, source: str, *, hashes: tuple[Any, ...] = ()
) -> tuple[torch.Tensor, memoryview]:
    """Read one tensor's bytes from the stream into a new CPU tensor (imports torch).

    Args:
        hashes: hashlib-style objects fed each piece as soon as it is read (``fill_view``).

    Returns:
        ``(tensor, memoryview of its bytes)``; keep the tensor alive while using the view.

    Raises:
        CorruptCheckpointError: the stream ends before the tensor does.
    """
    import torch

    from .tensors import ST_TO_TORCH, host_bytes

    t = torch.empty(e.shape, dtype=ST_TO_TORCH[e.dtype])
    view = host_bytes(t)
    fill_view(fh, view, e, source, hashes=hashes)
    return t, view


def fill_view(fh: IO[bytes], view: memoryview, e: TensorEntry, source: str, *, hashes: tuple[Any, ...] = ()) -> None:
    """Read tensor ``e``'s bytes from the stream into ``view``; with ``hashes``, in 1 MiB pieces, each
    fed to every hash as soon as it is read, while it is still in this core's cache (a second pass
    over the tensor would read it from memory again).

    Raises:
        CorruptCheckpointError: the stream ends before the tensor does.
    """
    got = 0
    while got < e.nbytes:
        n = read_into(fh, view[got : got + _PIECE] if hashes else view[got:])
        if not n:
            raise CorruptCheckpointError(truncated_problem(source, e, e.nbytes - got))
        for h in hashes:
            h.update(view[got : got + n])
        got += n


def _check_data(
    fh: IO[bytes],
    info: CheckpointInfo,
    report: VerifyReport,
    progress: Progress | None,
    data_hash: HashObject | None = None,
) -> None:
    """Every tensor's xxh3, and ``data_hash`` (the signed digest, when a keyed verify cannot seek
    back) fed the same pieces: each piece is hashed by both while it is in this core's cache."""
    size = min(_PIECE, max(info.header.data_length, 1))
    mv = memoryview(bytearray(size))
    total, done = info.header.data_length, 0
    for e in info.header.entries:
        h = xxhash.xxh3_128()
        left = e.nbytes
        while left:
            chunk = mv[: read_into(fh, mv[: min(left, size)])]
            n = len(chunk)
            if not n:
                report.fail(ProblemKind.TRUNCATED, truncated_problem(info.source, e, left), e.name)
                return
            h.update(chunk)
            if data_hash is not None:
                data_hash.update(chunk)
            left -= n
            done += n
            if progress:
                progress(done, total)
        report.tensors += 1
        expected = info.record.tensors[e.name]["xxh3"]
        if h.hexdigest() != expected:
            report.fail(ProblemKind.DIGEST, digest_problem(e, expected, h.hexdigest()), e.name)
    if fh.read(1):
        report.fail(ProblemKind.TRUNCATED, f"{info.source}: unexpected trailing bytes after the last tensor")


def _signed_digest_matches(
    fh: IO[bytes],
    info: CheckpointInfo,
    progress: Progress | None,
    signed: tuple[str, str],
    *,
    mapped: bool,
) -> bool:
    """One pass over the data region hashing only the signed digest: True when every byte is there,
    nothing trails it, and the digest is the one signed.

    A signature the trusted keys accept covers the header, hence every tensor's xxh3, and the data
    through this digest: when it matches, the bytes are the signer's and the per-tensor digests hold
    by construction, so they are not recomputed. A local file is mapped when ``mapped`` (see
    ``_mapped_digest``); anything else is read in 1 MiB pieces, each hashed on this thread as soon
    as it is read (0.22-0.26 s per GiB in the page cache here, every time; the same pieces handed to
    a worker through a ring of buffers took 0.20-0.50 s, depending on the machine's mood).
    """
    field, expected = signed
    if mapped:
        got = _mapped_digest(fh, info, field, progress)
        if got is not None:
            return got == expected
    digest = new_hash(DIGEST_FIELDS[field], threads=False)
    total = left = info.header.data_length
    buf = memoryview(bytearray(min(_PIECE, max(total, 1))))
    while left:
        n = read_into(fh, buf[: min(left, len(buf))])
        if not n:
            return False
        digest.update(buf[:n])
        left -= n
        if progress:
            progress(total - left, total)
    return not fh.read(1) and digest.hexdigest() == expected


def _mapped_digest(fh: IO[bytes], info: CheckpointInfo, field: str, progress: Progress | None) -> str | None:
    """The data region's BLAKE3 digest hashed straight from the page cache through a read-only map,
    every core on it; None when ``fh`` is not a local regular file that ends exactly where the
    header says the data does (the reading path then says what is missing or trailing) or the
    digest is not BLAKE3. ``fh`` stands at the data region's first byte, which is where the map
    starts: a caller's file object may hold the checkpoint after other bytes.

    No copy into a buffer, and BLAKE3's tree spreads each 64 MiB slice over its threads. Measured on
    1 GiB in the page cache, 2 cores, 2026-12-02: 0.09-0.10 s, against 0.26 s read in 1 MiB pieces
    and hashed inline (0.19 s mapped but on one thread). The cost is a mapped read's: a file another
    process shrinks while it is being hashed, or an I/O error under a network mount, ends this
    process with SIGBUS instead of a one-line message; ``verify(..., mmap=False)`` reads instead.
    """
    if DIGEST_FIELDS[field] != "blake3":
        return None  # SHA-256 (older files) has no tree to spread: the reading path is as fast
    try:
        fd = fh.fileno()
        st = os.fstat(fd)
        start = fh.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None
    length = info.header.data_length
    if not stat.S_ISREG(st.st_mode) or st.st_size != start + length or not length:
        return None
    digest = new_hash("blake3", threads=True)
    end = start + length
    for at in range(start, end, _MAP_SLICE):
        # one window per slice, unmapped once hashed: the process never holds more than a slice of
        # the file's pages (a whole-file map showed the file's size as peak resident memory)
        window = at - at % mmap.ALLOCATIONGRANULARITY
        stop = min(at + _MAP_SLICE, end)
        try:
            region = mmap.mmap(fd, stop - window, access=mmap.ACCESS_READ, offset=window)
        except (OSError, ValueError):
            return None  # a filesystem that cannot map: the reading path hashes it from the start
        try:
            with memoryview(region) as view:
                digest.update(view[at - window :])
        finally:
            region.close()
        if progress:
            progress(stop - start, length)
    return digest.hexdigest()


def _fill(fh: IO[bytes], view: memoryview) -> int:
    """Read until ``view`` is full or the stream ends; returns the bytes read."""
    got = 0
    while got < len(view):
        n = read_into(fh, view[got:])
        if not n:
            break
        got += n
    return got


def _check_deep(
    fh: IO[bytes],
    info: CheckpointInfo,
    report: VerifyReport,
    progress: Progress | None,
    data_hash: HashObject | None = None,
) -> None:
    import torch

    from .fingerprinting import StreamingFingerprint
    from .tensors import host_bytes

    # One reusable piece buffer (a multiple of the fingerprint's chunk): memory stays bounded
    # whatever the largest tensor.
    buf = torch.empty(min(_CHUNK, max(info.header.data_length, 1)), dtype=torch.uint8)
    mv = host_bytes(buf)
    total, done = info.header.data_length, 0
    for e in info.header.entries:
        h = xxhash.xxh3_128()
        fp = StreamingFingerprint(e.dtype, e.shape)
        left = e.nbytes
        while left:
            want = min(left, len(mv))
            n = _fill(fh, mv[:want])
            if n < want:
                report.fail(ProblemKind.TRUNCATED, truncated_problem(info.source, e, left - n), e.name)
                return
            h.update(mv[:n])
            if data_hash is not None:
                data_hash.update(mv[:n])
            fp.update(buf[:n])
            left -= n
            done += n
            if progress:
                progress(done, total)
        report.tensors += 1
        rec = info.record.tensors[e.name]
        if h.hexdigest() != rec["xxh3"]:
            report.fail(ProblemKind.DIGEST, digest_problem(e, rec["xxh3"], h.hexdigest()), e.name)
        if fp.hexdigest() != rec["fp"]:
            report.fail(
                ProblemKind.FINGERPRINT,
                f"tensor `{printable(e.name)}`: device fingerprint mismatch "
                f"(expected {rec['fp']}, found {fp.hexdigest()});"
                " the stored values differ from those fingerprinted when saving",
                e.name,
            )


def _position(fh: IO[bytes]) -> int | None:
    """The stream's offset when it can seek back to it, else None."""
    try:
        return fh.tell() if fh.seekable() else None
    except (OSError, AttributeError, ValueError):
        return None


def maps_files() -> bool:
    """Whether a keyed verify maps local files by default: yes unless ``CERTCKPT_NO_MMAP`` is set to
    anything but ``0`` (read at each call, so an operator's setting reaches every verify)."""
    return mmap_from_env()


def _changed_after_signing(source: str, field: str) -> str:
    from .datahash import digest_name

    return f"{source}: the data's {digest_name(field)} differs from the one signed: the tensors changed after signing"


def verify(
    f: Any,
    *,
    deep: bool = False,
    progress: Progress | None = None,
    trusted_keys: TrustedKeys | str | os.PathLike[str] | None = None,
    mmap: bool | None = None,
    trust: TrustConfig | None = None,
) -> VerifyReport:
    """Check every byte of a checkpoint against its embedded digests.

    Args:
        f: path, fsspec URL or readable binary file object.
        deep: also recompute each tensor's device fingerprint (imports torch; slower).
        progress: called as ``progress(bytes_done, bytes_total)`` while data is read.
        trusted_keys: also require a signature by one of these keys over the header and the data's
            cryptographic digest (``docs/signing.md``). The forms ``load`` takes: ``TrustedKeys``,
            public key files (``PUB[,PUB...]``), ``KEYS_FROM_ENV`` for ``$CERTCKPT_TRUSTED_KEYS``, or
            None (the default here: no keys). An unsigned file, or one forged with
            recomputed digests or an xxh3 second preimage, fails. The signed digest (BLAKE3, or
            SHA-256 in older files) is then what the one read of the data checks; the per-tensor xxh3
            digests are recomputed only to name what changed when it fails.
        mmap: with ``trusted_keys``, hash a local file's data through a read-only map, every core
            on the BLAKE3 tree (about 2.5x faster than reading it here). As with any mapped read, a
            file shrunk by another process meanwhile, or an I/O error under a network mount, ends
            the process with SIGBUS; False reads it instead. None (the default): map, unless the
            environment sets ``CERTCKPT_NO_MMAP=1``, which reaches every verify certckpt runs
            (latest-good, resume, restore, companions, shards; ``certckpt verify --no-mmap`` sets it).
        trust: a ``TrustConfig``: its keys and its ``mmap`` stand where ``trusted_keys`` and ``mmap``
            are not given.

    Returns:
        A ``VerifyReport``; ``report.ok`` is False for corrupt, truncated or tampered files.

    Raises:
        CheckpointNotFoundError, NotACheckpointError, StorageError: it could not be verified at all.
        ConfigurationError: ``trusted_keys`` names no key, or a file that is not an Ed25519 public key.

    Example:
        >>> report = certckpt.verify("ckpt/step100.safetensors")
        >>> report.ok
        True
    """
    t0 = time.perf_counter()
    if trust is not None:
        trusted_keys = trust.trusted_keys if trusted_keys is None else trusted_keys
        mmap = trust.mmap if mmap is None else mmap
    keys = trusted_keys_for(trusted_keys)  # the one normalizer load uses: the same forms, the same errors
    target = resolve(f)
    report = VerifyReport(source=target.display, deep=deep)
    with open_read(target) as (fh, size):
        try:
            info = read_checkpoint_header(fh, size, target.display, keep_skeleton=False)
        except CorruptCheckpointError as e:
            kind = ProblemKind.TRUNCATED if isinstance(e, TruncatedCheckpointError) else ProblemKind.MALFORMED
            report.fail(kind, str(e))
            report.seconds = time.perf_counter() - t0
            return report
        report.info = info
        problem = check_header(info.header, info.record)
        if problem:
            report.fail(ProblemKind.HEADER, f"{target.display}: {problem}")
        if state_fingerprint((k, v["fp"]) for k, v in info.record.tensors.items()) != info.record.state_fp:
            report.fail(
                ProblemKind.STATE,
                f"{target.display}: whole-state fingerprint does not match the per-tensor fingerprints",
            )
        signed = None
        if keys is not None:
            problem, signed = signature_problem(info.header, keys)
            if problem:
                report.fail(ProblemKind.SIGNATURE, f"{target.display}: {problem}")
        data_start = _position(fh)
        if signed is not None and report.ok and not deep and data_start is not None:
            # Keyed and sound so far: the signed digest alone decides. Only a file that fails it is
            # read again, tensor by tensor, to name what changed (a forgery that keeps every xxh3
            # names nothing, and the signature line says why it fails).
            if _signed_digest_matches(fh, info, progress, signed, mapped=maps_files() if mmap is None else mmap):
                report.tensors = len(info.header.entries)
            else:
                fh.seek(data_start)
                _check_data(fh, info, report, None)
                if report.ok:
                    report.fail(ProblemKind.SIGNATURE, _changed_after_signing(target.display, signed[0]))
        else:
            data_hash = new_hash(DIGEST_FIELDS[signed[0]], threads=False) if signed is not None else None
            (_check_deep if deep else _check_data)(fh, info, report, progress, data_hash)
            if signed is not None and data_hash is not None and report.ok and data_hash.hexdigest() != signed[1]:
                report.fail(ProblemKind.SIGNATURE, _changed_after_signing(target.display, signed[0]))
        report.nbytes = info.header.file_length
    report.seconds = time.perf_counter() - t0
    return report


def inspect(f: Any) -> CheckpointInfo:
    """Read and validate only the header: tensor table and certckpt record (no data is read).

    Raises:
        CheckpointNotFoundError, NotACheckpointError, CorruptCheckpointError, StorageError
    """
    target = resolve(f)
    with open_read(target) as (fh, size):
        return read_checkpoint_header(fh, size, target.display)
