"""Streaming write-once copies: a checkpoint copied under a name that is never replaced, and verified.

Local and mounted file systems get a temp file verified *before* it is published with ``os.link``
(which fails when the name exists) and a read-only mode; S3 gets create-only PUTs (``If-None-Match: *``),
with Object Lock retention when the caller passes it, read back and verified after.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from certckpt.format.signing import TrustedKeys
from certckpt.format.verify import verify
from certckpt.storage import LockRequest, Progress, create_once, join, open_read, resolve, storage_of
from certckpt.trust.runstore import check_file

from .bundles import Bundle, member_check

__all__ = ["Check", "Progress", "copy_once", "copy_bundle", "repair_copy", "repair_bundle", "whole_of"]

_CHUNK = 8 << 20
Check = Callable[[str], "str | None"]  # check(url): None when the file there is the right copy, else why


def _stream(src_url: str, out, progress: Progress | None) -> int:
    with open_read(resolve(src_url)) as (fh, size):
        total, done = size or 0, 0
        while chunk := fh.read(_CHUNK):
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return done


def _verified_temp(
    src_url: str,
    tmp: str,
    dst: str,
    *,
    read_only: bool,
    progress: Progress | None,
    check: Check,
    what: str = "nothing was published",
) -> int:
    """Stream ``src_url`` into the new local file ``tmp`` (fsync'd, read-only if asked) and check it
    before anyone can see it under its final name; returns its bytes."""
    with open(tmp, "xb") as out:
        n = _stream(src_url, out, progress)
        out.flush()
        os.fsync(out.fileno())
    if read_only:
        os.chmod(tmp, 0o444)
    problem = check(tmp)
    if problem:
        raise CorruptCheckpointError(f"copy of {src_url} to {dst} does not verify ({problem}); {what}")
    return n


def _local_source(src_url: str) -> tuple[str, str | None]:
    """A local path to upload from: the source itself, or a spooled copy of a remote one (fsspec
    uploads from local files); the second value is the spool to delete afterwards."""
    src = resolve(src_url)
    if src.local is not None:
        return src.local, None
    fd, spool = tempfile.mkstemp(prefix=".certckpt-copy-")
    with os.fdopen(fd, "wb") as out:
        _stream(src_url, out, None)
    return spool, spool


def copy_once(
    src_url: str,
    dst: str,
    *,
    header_digest: str | None,
    put_options: LockRequest | None = None,
    read_only: bool = True,
    progress: Progress | None = None,
    trusted_keys: TrustedKeys | None = None,
    check: Check | None = None,
) -> tuple[bool, int]:
    """Copy a checkpoint under a name that must never be replaced, verifying the copy.

    Local destinations are verified before the name is published (a bad copy never appears);
    remote ones are read back after the upload. When the name already holds a verified copy of the
    same checkpoint this is a no-op.

    Args:
        check: ``check(url)`` → None when the file at ``url`` is the right copy, else why not
            (default: it verifies as a checkpoint with ``header_digest``); a member of a multi-file
            checkpoint that is not itself certified passes its own check (size and xxh3).

    Returns:
        ``(written, bytes)``: written is False when an identical copy was already there.

    Raises:
        CheckpointExistsError: the name holds different content (nothing was changed).
        CorruptCheckpointError: the copy does not verify (local: nothing was published).
    """
    checked = check or (lambda u: check_file(u, header_digest, trusted_keys=trusted_keys))
    present = check or (lambda u: check_file(u, header_digest))
    storage, name = storage_of(dst)
    if storage.in_place:  # a local disk: checked under a temp name, then linked into place
        tmp = storage.staging(name)
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        try:
            n = _verified_temp(src_url, tmp, dst, read_only=read_only, progress=progress, check=checked)
            storage.publish(tmp, name, create_only=True, staged=True, display=dst)
            return True, n
        except CheckpointExistsError:
            written = _already_there(dst, present)
            held = storage.stat(name)
            return written, held.size if held is not None and held.size is not None else 0
        except OSError as e:
            if isinstance(e, CertckptError):
                raise
            raise StorageError(f"{dst}: cannot write ({e.strerror or e}); nothing was published") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    local, spool = _local_source(src_url)
    try:
        size = os.path.getsize(local)

        def holder(refusal: CheckpointExistsError) -> bool | None:
            storage.refresh()  # a listing cached before the racing promoter's PUT would hide it
            try:
                return _already_there(dst, present)
            except CheckpointNotFoundError:
                return None

        found = create_once(
            lambda: storage.publish(local, name, create_only=True, lock=put_options, progress=progress, display=dst),
            holder,
            gave_up=f"{dst}: concurrent uploads under this name did not settle; retry",
            pause=0.1,
        )
        if found is not None:
            return found, size
        problem = checked(dst)
        if problem:
            raise CorruptCheckpointError(
                f"{dst}: the uploaded copy does not verify when read back ({problem}); it is not recorded as held"
            )
        return True, size
    finally:
        if spool and os.path.exists(spool):
            os.unlink(spool)


def _already_there(dst: str, check: Check) -> bool:
    """True when ``dst`` holds a verified copy of this checkpoint; raises when it holds something else
    (``CheckpointNotFoundError`` when nothing is readable there yet)."""
    if not _exists(dst):
        raise CheckpointNotFoundError(f"{dst}: not readable yet")
    problem = check(dst)
    if problem:
        raise CheckpointExistsError(
            f"{dst}: already holds different content ({problem}); write-once: nothing was changed"
        )
    return False


def _exists(url: str) -> bool:
    storage, name = storage_of(url)
    return storage.exists(name)


def repair_copy(
    src_url: str,
    dst: str,
    *,
    header_digest: str | None,
    put_options: LockRequest | None = None,
    trusted_keys: TrustedKeys | None = None,
    check: Check | None = None,
) -> int:
    """Replace a damaged or missing vault copy with a verified copy of ``src_url``; returns its bytes.

    The one place a vault name is written twice, and only over a copy that no longer verifies: a
    local copy is verified under a temp name, then renamed over the damaged one (read-only again);
    an S3 copy is uploaded again (in a versioned, locked bucket the damaged version stays, locked,
    and the new one becomes current) and read back.

    Raises:
        CorruptCheckpointError: the source or the new copy does not verify (a local vault is unchanged).
    """
    checked = check or (lambda u: check_file(u, header_digest, trusted_keys=trusted_keys))
    problem = checked(src_url)
    if problem:
        raise CorruptCheckpointError(f"{src_url}: the source does not verify ({problem}); nothing repaired")
    storage, name = storage_of(dst)
    if storage.in_place:  # a local disk: checked under a temp name, then renamed over the damaged copy
        tmp = storage.staging(name)
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        try:
            n = _verified_temp(src_url, tmp, dst, read_only=True, progress=None, check=checked, what="nothing repaired")
            storage.publish(tmp, name, create_only=False, staged=True, display=dst)
            return n
        except OSError as e:
            if isinstance(e, CertckptError):
                raise
            raise StorageError(f"{dst}: cannot write ({e.strerror or e}); nothing repaired") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    local, spool = _local_source(src_url)
    try:
        storage.publish(local, name, create_only=False, lock=put_options, display=dst)
        storage.refresh()
        problem = checked(dst)
        if problem:
            raise CorruptCheckpointError(f"{dst}: the repaired copy does not verify when read back ({problem})")
        return os.path.getsize(local)
    finally:
        if spool and os.path.exists(spool):
            os.unlink(spool)


def whole_of(bundle: Bundle, directory: str) -> str:
    """The url a check of the whole copy in ``directory`` takes: the directory itself (sharded) or
    the marker file (whose check covers its companions)."""
    return directory if bundle.kind == "sharded" else join(directory, bundle.marker)


def _offset(progress: Progress | None, base: int, total: int) -> Progress | None:
    if progress is None:
        return None
    return lambda done, _t: progress(base + done, max(total, base + done))


def copy_bundle(
    bundle: Bundle,
    directory: str,
    *,
    header_digest: str | None,
    committed: dict[str, Any] | None = None,
    put_options: LockRequest | None = None,
    read_only: bool = True,
    progress: Progress | None = None,
    trusted_keys: TrustedKeys | None = None,
) -> tuple[bool, int]:
    """Copy a multi-file checkpoint into ``directory``: every member write-once and verified, the
    marker (manifest or listing file) last, so that a copy cut short is never a committed checkpoint;
    then the whole copy is checked as its commit record says.

    Returns:
        ``(written, bytes)``: written is False when every file was already there, verified.

    Raises:
        CheckpointExistsError: a name holds different content (nothing there was changed).
        CorruptCheckpointError: a member or the whole copy does not verify.
    """
    total = sum(m.nbytes for m in bundle.members)
    written, done = False, 0
    for m in bundle.members:
        w, n = copy_once(
            join(bundle.directory, m.name),
            join(directory, m.name),
            header_digest=m.header_digest,
            put_options=put_options,
            read_only=read_only,
            progress=_offset(progress, done, total),
            check=member_check(m, trusted_keys=trusted_keys),
        )
        written, done = written or w, done + n
    w, n = copy_once(
        join(bundle.directory, bundle.marker),
        join(directory, bundle.marker),
        header_digest=header_digest,
        put_options=put_options,
        read_only=read_only,
        progress=_offset(progress, done, total),
        trusted_keys=trusted_keys,
    )
    written, done = written or w, done + n
    whole = whole_of(bundle, directory)
    problem = check_file(whole, header_digest, committed=committed, trusted_keys=trusted_keys)
    if problem:
        raise CorruptCheckpointError(f"{whole}: the copy does not verify as a whole checkpoint ({problem})")
    return written, done


def repair_bundle(
    bundle: Bundle,
    directory: str,
    *,
    header_digest: str | None,
    put_options: LockRequest | None = None,
    trusted_keys: TrustedKeys | None = None,
) -> int:
    """Replace each damaged or missing file of a held multi-file copy from ``bundle`` (the run's
    copy, each file checked first), members first and the marker last; returns the bytes written.

    Raises:
        CorruptCheckpointError: a source file, a new copy, or the repaired whole does not verify.
    """
    nbytes = 0
    for m in bundle.members:
        check = member_check(m, trusted_keys=trusted_keys)
        dst = join(directory, m.name)
        if check(dst) is not None:
            nbytes += repair_copy(
                join(bundle.directory, m.name), dst, header_digest=m.header_digest, put_options=put_options, check=check
            )
    marker = join(directory, bundle.marker)
    # the marker alone: a file whose record matches (its companions were checked above)
    if _marker_problem(marker, header_digest, trusted_keys) is not None:
        nbytes += repair_copy(
            join(bundle.directory, bundle.marker),
            marker,
            header_digest=header_digest,
            put_options=put_options,
            check=lambda u: _marker_problem(u, header_digest, trusted_keys),
        )
    whole = whole_of(bundle, directory)
    problem = check_file(whole, header_digest, trusted_keys=trusted_keys)
    if problem:
        raise CorruptCheckpointError(f"{whole}: still does not verify after its files were repaired ({problem})")
    return nbytes


def _marker_problem(url: str, header_digest: str | None, trusted_keys: TrustedKeys | None) -> str | None:
    try:
        rep = verify(url, trusted_keys=trusted_keys)
    except CertckptError as e:
        return str(e)
    if not rep.ok or rep.info is None:
        return rep.problems[0].message if rep.problems else f"{url}: unreadable"
    if header_digest and rep.info.record.header_digest != header_digest:
        return f"{url}: not the committed file (header digest {rep.info.record.header_digest})"
    return None
