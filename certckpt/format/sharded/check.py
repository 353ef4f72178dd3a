"""Verify and inspect a sharded checkpoint directory: the manifest, every shard file, nothing missing,
nothing extra, and (``deep``) every fingerprint recomputed.

Without ``deep`` nothing here imports torch: the manifest and each shard file are checked with the
format layer's streaming verifier (``certckpt verify DIR`` stays as light as ``verify FILE``).
Corruption is reported in a ``ShardedReport``, one line per problem naming the file and tensor;
only "could not verify" conditions (no directory, no manifest, store errors) raise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from certckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    TruncatedCheckpointError,
)
from certckpt.format.companions import check_companions, companions_of
from certckpt.format.header import DTYPE_SIZES, printable
from certckpt.format.record import CheckpointRecord, check_header, state_fingerprint
from certckpt.format.signing import TrustedKeys
from certckpt.format.verify import (
    CheckpointInfo,
    Problem,
    ProblemKind,
    digest_problem,
    read_checkpoint_header,
    read_into,
    verify,
)
from certckpt.storage import LEDGER_DIR, open_read, resolve

from .composition import hex64
from .layout import MANIFEST_NAME, Listing, exists, is_shard_name, join, list_directory
from .manifest import Chunk, Manifest, ShardFile, consistency_problems, read_manifest

__all__ = ["ShardedReport", "verify_checkpoint", "inspect_checkpoint"]

Progress = Callable[[int, int], None]
_PIECE = 16 << 20  # streaming buffer for --deep: a multiple of the fingerprint's chunk (256 KiB)
# A chunk with the tensor it belongs to: ``(fqn, index in the manifest's tensors, chunk)``.
_Owned = tuple[str, int, Chunk]


@dataclass(slots=True)
class ShardedReport:
    """The outcome of ``verify_checkpoint``.

    Attributes:
        source: the directory verified.
        ok: True when every check passed.
        deep: whether fingerprints were recomputed.
        problems: one entry per problem (kinds as ``certckpt.verify``'s, plus ``manifest``,
            ``missing``, ``extra`` and ``mismatch`` (a shard file that is not the one the manifest names)).
        files: shard files checked.
        tensors: global tensors in the manifest.
        chunks: stored chunks.
        nbytes: bytes read.
        seconds: wall time.
        manifest: the parsed manifest, when it could be read.
        record: the manifest file's certckpt record (run, step), when it could be read.
    """

    source: str
    ok: bool = True
    deep: bool = False
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    tensors: int = 0
    chunks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    manifest: Manifest | None = None
    record: CheckpointRecord | None = None

    def fail(self, kind: ProblemKind, message: str, tensor: str | None = None) -> None:
        self.ok = False
        self.problems.append(Problem(kind, message, tensor))

    def to_dict(self) -> dict[str, Any]:
        m, rec = self.manifest, self.record
        return {
            "source": self.source,
            "sharded": True,
            "ok": self.ok,
            "deep": self.deep,
            "files": self.files,
            "tensors": self.tensors,
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "run": rec.run if rec else None,
            "step": rec.step if rec else None,
            "state_fp": m.state_fp if m else None,
            "problems": [{"kind": p.kind, "tensor": p.tensor, "message": p.message} for p in self.problems],
        }


def _not_committed(location: str, listing: Listing | None = None) -> NotACheckpointError:
    if exists(join(location, ".metadata")) and exists(join(location, "metadata.json")):
        # Megatron-Core's torch_dist layout: DCP's pickled .metadata beside its metadata.json
        return NotACheckpointError(
            f"{location}: written by plain Megatron-Core dist_checkpointing (.metadata and common.pt are pickles);"
            " certckpt never unpickles — load it once with plain Megatron in a process you trust and save it"
            " with sharded_strategy=certckpt.integrations.megatron.CertifiedSaveStrategy(...)"
        )
    if exists(join(location, ".metadata")):
        return NotACheckpointError(
            f"{location}: a plain torch.distributed.checkpoint directory (its .metadata is a pickle);"
            " certckpt never unpickles — save with certckpt.dcp.CertifiedWriter to certify it"
        )
    if listing is not None and not any(is_shard_name(n) for n in listing.files):
        if exists(join(location, LEDGER_DIR)):
            return NotACheckpointError(
                f"{location}: a run store, not one checkpoint: `certckpt status {location} --verify-bytes` verifies"
                " every checkpoint in it; give one checkpoint's path to verify only that one"
            )
        return NotACheckpointError(
            f"{location}: a directory, neither a checkpoint file nor a sharded checkpoint (no {MANIFEST_NAME});"
            " give the path of one checkpoint file"
        )
    return NotACheckpointError(
        f"{location}: no {MANIFEST_NAME}: not a committed certified sharded checkpoint (a save that never"
        " finished leaves shard files without a manifest)"
    )


def inspect_checkpoint(location: str) -> tuple[Manifest, CheckpointRecord]:
    """The manifest (every byte of it checked) and its record; no shard data is read.

    Raises:
        NotACheckpointError: no manifest in the directory; CorruptCheckpointError: a damaged one;
        CheckpointNotFoundError, StorageError.
    """
    try:
        manifest, info = read_manifest(location)
    except CheckpointNotFoundError:
        listing = list_directory(location)  # raises when there is no directory at all
        raise _not_committed(location, listing) from None
    return manifest, info.record


def _total(m: Manifest) -> int:
    return sum(f.nbytes for f in m.files)


def _chunks_by_file(m: Manifest) -> dict[int, list[_Owned]]:
    out: dict[int, list[_Owned]] = {}
    for ti, t in enumerate(m.tensors):
        for c in t.chunks:
            out.setdefault(c.file, []).append((t.fqn, ti, c))
    return out


def _check_entries(
    report: ShardedReport, m: Manifest, sf: ShardFile, info: CheckpointInfo, chunks: list[_Owned]
) -> None:
    entries = {e.name: e for e in info.header.entries}
    for fqn, ti, c in chunks:
        e = entries.get(c.entry)
        t = m.tensors[ti]
        if e is None or e.dtype != t.dtype or e.shape != c.sizes:
            found = "nothing" if e is None else f"{e.dtype} {list(e.shape)}"
            report.fail(
                ProblemKind.MISMATCH,
                f"{sf.name}: tensor `{printable(c.entry)}` (chunk of `{printable(fqn)}`) should be {t.dtype}"
                f" {list(c.sizes)}, found {found}",
                fqn,
            )


def _deep_file(
    report: ShardedReport,
    location: str,
    sf: ShardFile,
    chunks: list[_Owned],
    m: Manifest,
    progress: Progress | None,
) -> CheckpointInfo | None:
    """One pass over a shard file: every tensor's xxh3, its own fingerprint, its chunk's contribution."""
    import torch

    from certckpt.format.fingerprinting import StreamingFingerprint
    from certckpt.format.tensors import host_bytes

    from .shardfp import contribution

    target = resolve(join(location, sf.name))
    by_entry: dict[str, list[_Owned]] = {}  # tied weights: one stored tensor, two names
    for fqn, ti, c in chunks:
        by_entry.setdefault(c.entry, []).append((fqn, ti, c))
    with open_read(target) as (fh, size):
        try:
            info = read_checkpoint_header(fh, size, target.display)
        except CorruptCheckpointError as e:
            kind = ProblemKind.TRUNCATED if isinstance(e, TruncatedCheckpointError) else ProblemKind.MALFORMED
            report.fail(kind, str(e))
            return None
        problem = check_header(info.header, info.record)
        if problem:
            report.fail(ProblemKind.HEADER, f"{target.display}: {problem}")
        if state_fingerprint((k, v["fp"]) for k, v in info.record.tensors.items()) != info.record.state_fp:
            report.fail(
                ProblemKind.STATE, f"{target.display}: whole-file fingerprint does not match its tensors' fingerprints"
            )
        buf = torch.empty(_PIECE, dtype=torch.uint8)
        mv = host_bytes(buf)
        for entry in info.header.entries:
            h = xxhash.xxh3_128()
            fp = StreamingFingerprint(entry.dtype, entry.shape)
            owners = by_entry.get(entry.name, [])
            owner = owners[0] if owners else None
            raws = [0] * len(owners)  # each name's contribution (tied weights: one stored tensor, two names)
            done, esize = 0, DTYPE_SIZES[entry.dtype]
            while done < entry.nbytes:
                want = min(entry.nbytes - done, _PIECE)
                got = 0
                while got < want:
                    n = read_into(fh, mv[got:want])
                    if not n:
                        report.fail(
                            ProblemKind.TRUNCATED,
                            f"{target.display}: truncated: tensor `{printable(entry.name)}` ends early",
                        )
                        return info
                    got += n
                h.update(mv[:want])
                fp.update(buf[:want])
                for i, (_, ti, c) in enumerate(owners):
                    raws[i] += contribution(
                        buf[:want],
                        elem_size=esize,
                        offsets=c.offsets,
                        sizes=c.sizes,
                        global_shape=m.tensors[ti].shape,
                        first_element=done // esize,
                    )
                done += want
                if progress:
                    progress(report.nbytes + info.header.data_start + entry.begin + done, _total(m))
            rec = info.record.tensors[entry.name]
            where = f"{target.display}: "
            if h.hexdigest() != rec["xxh3"]:
                report.fail(
                    ProblemKind.DIGEST, where + digest_problem(entry, rec["xxh3"], h.hexdigest()), owner and owner[0]
                )
            if fp.hexdigest() != rec["fp"]:
                report.fail(
                    ProblemKind.FINGERPRINT,
                    f"{where}tensor `{printable(entry.name)}`: device fingerprint mismatch (expected {rec['fp']},"
                    f" found {fp.hexdigest()})",
                    owner and owner[0],
                )
            for (fqn, _, c), raw in zip(owners, raws):
                if hex64(raw) != c.raw:
                    report.fail(
                        ProblemKind.FINGERPRINT,
                        f"{where}tensor `{printable(entry.name)}`: its contribution to `{printable(fqn)}`'s fingerprint"
                        f" is {hex64(raw)}, the manifest says {c.raw}",
                        fqn,
                    )
    report.nbytes += info.nbytes
    return info


def verify_checkpoint(
    location: str, *, deep: bool = False, progress: Progress | None = None, trusted_keys: TrustedKeys | None = None
) -> ShardedReport:
    """Check a sharded checkpoint directory: its manifest, every byte of every shard file, that no
    listed file is missing and no other file is there, and (``deep``) every fingerprint recomputed.

    Args:
        location: the checkpoint directory (local path or fsspec URL).
        deep: recompute every chunk's fingerprint and its contribution to the global ones (torch).
        progress: called as ``progress(bytes_done, bytes_total)``.
        trusted_keys: also require the manifest and every shard file to be signed by one of these
            keys (``docs/signing.md``); with ``deep`` the signed files are read a second time.

    Returns:
        A ``ShardedReport``; ``report.ok`` is False when anything is damaged, missing or extra.

    Raises:
        NotACheckpointError: no manifest (nothing committed); CheckpointNotFoundError: no directory;
        StorageError: the store could not be read.

    Example:
        >>> report = certckpt.dcp.verify_checkpoint("ckpt/step100")
        >>> report.ok
        True
    """
    t0 = time.perf_counter()
    listing = list_directory(location)
    report = ShardedReport(source=location, deep=deep)
    if MANIFEST_NAME not in listing.files:
        raise _not_committed(location, listing)
    try:
        manifest, info = read_manifest(location)
    except CorruptCheckpointError as e:
        report.fail(ProblemKind.MANIFEST, str(e))
        report.seconds = time.perf_counter() - t0
        return report
    _check_manifest(report, location, manifest, info, trusted_keys)
    companions = _check_companion_files(report, location, info, trusted_keys)
    by_file = _chunks_by_file(manifest)
    for i, sf in enumerate(manifest.files):
        chunks = by_file.get(i, [])
        if sf.name not in listing.files:
            _report_missing(report, sf, chunks)
            continue
        report.files += 1
        if deep:
            finfo = _verify_deep(report, location, sf, chunks, manifest, progress, trusted_keys)
        else:
            finfo = _verify_streaming(report, location, sf, chunks, manifest, progress, trusted_keys)
        if finfo is None:
            continue
        _check_identity(report, location, sf, finfo)
        _check_entries(report, manifest, sf, finfo, chunks)
    _report_extra(report, location, listing, manifest, companions)
    report.seconds = time.perf_counter() - t0
    return report


def _check_companion_files(
    report: ShardedReport, location: str, info: CheckpointInfo, trusted_keys: TrustedKeys | None
) -> frozenset[str]:
    """The files beside the shards that the manifest's record lists (``format.companions``: a
    framework's own files, such as Megatron's common state and ``metadata.json``), each checked
    against its size and digest; their names, which are then not extra."""
    try:
        files = companions_of(info.record)
    except (ValueError, RecursionError):
        files = None  # check_companions names the unreadable table
    check = check_companions(join(location, MANIFEST_NAME), info.record, trusted_keys=trusted_keys)
    for problem in check.problems:
        report.fail(ProblemKind.COMPANION, problem)
    report.nbytes += sum(f.nbytes for f in check.verified)
    return frozenset(files or ())


def _check_manifest(
    report: ShardedReport, location: str, manifest: Manifest, info: CheckpointInfo, trusted_keys: TrustedKeys | None
) -> None:
    """Take the manifest's counts into the report, with its signature's and its consistency's problems."""
    report.manifest, report.record = manifest, info.record
    if trusted_keys is not None:
        signed = verify(join(location, MANIFEST_NAME), trusted_keys=trusted_keys)
        for p in signed.problems:
            report.fail(p.kind, p.message)
    report.tensors = len(manifest.tensors)
    report.chunks = sum(len(t.chunks) for t in manifest.tensors)
    report.nbytes = info.nbytes
    for problem in consistency_problems(manifest):
        report.fail(ProblemKind.MANIFEST, f"{location}/{MANIFEST_NAME}: {problem}")


def _report_missing(report: ShardedReport, sf: ShardFile, chunks: list[_Owned]) -> None:
    names = sorted({fqn for fqn, _, _ in chunks})
    report.fail(
        ProblemKind.MISSING,
        f"shard file {sf.name} (rank {sf.rank}) is missing: it holds {len(chunks)} chunk(s) of"
        f" {', '.join(f'`{printable(n)}`' for n in names[:3])}{' ...' if len(names) > 3 else ''}",
    )


def _verify_deep(
    report: ShardedReport,
    location: str,
    sf: ShardFile,
    chunks: list[_Owned],
    manifest: Manifest,
    progress: Progress | None,
    trusted_keys: TrustedKeys | None,
) -> CheckpointInfo | None:
    """The deep pass over one shard file; with keys, its signature checked in a second read."""
    finfo = _deep_file(report, location, sf, chunks, manifest, progress)
    if trusted_keys is not None:
        for p in verify(join(location, sf.name), trusted_keys=trusted_keys).problems:
            report.fail(p.kind, p.message if sf.name in p.message else f"{location}/{sf.name}: {p.message}")
    return finfo


def _verify_streaming(
    report: ShardedReport,
    location: str,
    sf: ShardFile,
    chunks: list[_Owned],
    manifest: Manifest,
    progress: Progress | None,
    trusted_keys: TrustedKeys | None,
) -> CheckpointInfo | None:
    """One shard file through the format layer's verifier, its problems named by the tensors' fqns."""
    r = verify(
        join(location, sf.name),
        progress=_after(progress, report.nbytes, manifest) if progress else None,
        trusted_keys=trusted_keys,
    )
    owners = {c.entry: fqn for fqn, _, c in chunks}
    for p in r.problems:
        msg = p.message if sf.name in p.message else f"{location}/{sf.name}: {p.message}"
        report.fail(p.kind, msg, owners.get(p.tensor, p.tensor) if p.tensor is not None else None)
    report.nbytes += r.nbytes
    return r.info


def _after(progress: Progress, base: int, manifest: Manifest) -> Progress:
    """``progress`` for one file's verify: its bytes counted after the ``base`` bytes already read."""
    return lambda done, _total_of_file: progress(base + done, _total(manifest))


def _check_identity(report: ShardedReport, location: str, sf: ShardFile, finfo: CheckpointInfo) -> None:
    if finfo.record.header_digest != sf.header_digest or finfo.nbytes != sf.nbytes:
        report.fail(
            ProblemKind.MISMATCH,
            f"{location}/{sf.name}: not the shard file the manifest names (header digest"
            f" {finfo.record.header_digest}, {finfo.nbytes} bytes; expected {sf.header_digest}, {sf.nbytes}"
            " bytes): it was replaced after the checkpoint was committed",
        )


def _report_extra(
    report: ShardedReport, location: str, listing: Listing, manifest: Manifest, companions: frozenset[str]
) -> None:
    listed = {f.name for f in manifest.files} | {MANIFEST_NAME} | companions
    for name in sorted(listing.files - listed):
        report.fail(
            ProblemKind.EXTRA, f"{location}/{name}: not part of this checkpoint (the manifest does not list it)"
        )
    for name in sorted(listing.dirs):
        report.fail(
            ProblemKind.EXTRA, f"{location}/{name}/: a directory inside the checkpoint (the manifest does not list it)"
        )
