"""``certckpt.save``: a drop-in for ``torch.save`` that writes a certified safetensors file.

Write path for local files (the common, fast case): the header's length is known before any hash is
computed (all hashes are fixed-width), so the temp file is preallocated at its final size and tensor
bytes go straight from tensor memory to their final offsets, their writeback started every few tens
of MiB (``writeback``), while a second thread computes the digests and fingerprints; the header is
written last, the file fsync'd, then published with a no-replace hard link and the directory fsync'd. A crash
at any point leaves no file under the final name, or a complete one. Several saves inside
``durable.durable_together()`` fsync their files together and are published when the block ends.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
import xxhash

from certckpt.errors import ArgumentTypeError, PlatformError, StorageError, UnsupportedObjectError
from certckpt.storage import Target, refuse_protected, resolve, storage_of

from .datahash import DIGEST_FIELDS, BackgroundDigest, hash_pieces, new_hash, preferred_digest_field
from .durable import current_batch
from .fingerprinting import SharedFingerprints, fingerprint_many, one_thread
from .header import TensorEntry
from .inventory import writer_inventory
from .reader import warn_ignored
from .record import CheckpointRecord, RecordFields, build_header, state_fingerprint
from .signing import SigningKey, signing_key_for
from .skeleton import StoredTensor, flatten
from .tensors import host_bytes
from .worker import SerialWorker
from .writeback import Writeback, preallocate

__all__ = ["save", "save_certified", "SaveResult", "host_bytes", "TensorIdentity", "prepare", "publish", "SaveJob"]

# A tensor's identity as the auditor records it: ``(data_ptr, dtype, shape, stride, device)``.
TensorIdentity = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], str]


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What ``save`` wrote.

    Attributes:
        location: the path or URL written.
        nbytes: file size in bytes.
        state_fp: whole-state fingerprint (hex).
        tensors: number of stored tensors.
        seconds: wall time of the save.
        header_digest: the record's header digest (identifies this exact file).
    """

    location: str
    nbytes: int
    state_fp: str
    tensors: int
    seconds: float
    header_digest: str = ""


def _plan(stored: list[StoredTensor]) -> tuple[list[StoredTensor], list[TensorEntry]]:
    # safetensors' own order: larger element sizes first, then by name, so every tensor's offset is
    # a multiple of its element size (the header is padded to 8 bytes).
    ordered = sorted(stored, key=lambda s: (-s.tensor.element_size(), s.name))
    entries, offset = [], 0
    for s in ordered:
        entries.append(TensorEntry(s.name, s.dtype_code, tuple(s.tensor.shape), offset, offset + s.nbytes))
        offset += s.nbytes
    return ordered, entries


_WRITE_PIECE = 64 << 20


def _pwrite_all(fd: int, data: memoryview, offset: int, writeback: Writeback | None = None) -> None:
    while len(data):
        n = os.pwrite(fd, data[:_WRITE_PIECE], offset)
        if writeback is not None:
            writeback.written(offset, n)
        data, offset = data[n:], offset + n


@contextlib.contextmanager
def _intraop_threads(limit: int) -> Iterator[None]:
    """Cap torch's intra-op threads while the fingerprint worker runs beside the writing thread.

    On a 2-core machine two fingerprint threads plus the writer oversubscribe the cores (measured
    here: seconds for 1 GiB when the machine was busy). One thread fingerprints 1 GiB in 0.25-0.33 s
    on this VM (2026-12-02), and the save's two threads share that work (``SharedFingerprints``).
    The setting is process-wide, so it is restored right after.
    """
    before = torch.get_num_threads()
    if before > limit:
        torch.set_num_threads(limit)
    try:
        yield
    finally:
        if before > limit:
            torch.set_num_threads(before)


class SaveJob:
    """One save in progress: the plan, the record, and the hashing of each stored tensor."""

    def __init__(
        self,
        obj: Any,
        *,
        fields: RecordFields,
        metadata: dict[str, str] | None,
        known_fingerprints: dict[TensorIdentity, tuple[str, str]] | None = None,
        signer: SigningKey | None = None,
    ):
        self.signer = signer
        step, run = fields.step, fields.run
        if step is not None and (type(step) is not int or step < 0):
            raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
        if run is not None and not isinstance(run, str):
            raise ArgumentTypeError(f"run must be a str, got {type(run).__name__}")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise UnsupportedObjectError("metadata must be a dict of str to str (as safetensors metadata is)")
        flat = flatten(obj)
        self.stored, self.entries = _plan(flat.stored)
        self.data_length = self.entries[-1].end if self.entries else 0
        devices = {str(s.tensor.device) for s in self.stored}
        self.record = CheckpointRecord(
            **fields.as_kwargs(),
            skeleton=flat.skeleton,
            writer=writer_inventory(devices),
            user=dict(metadata or {}),
        )
        # Fingerprints the caller already holds (the auditor's weight consensus at this step):
        # reused, never computed twice.
        self.known: dict[int, str] = {}
        mapping: dict[str, str] = {}
        for i, s in enumerate(self.stored):
            t = s.tensor
            hit = (known_fingerprints or {}).get((t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), str(t.device)))
            if hit is not None:
                self.known[i] = hit[1]
                mapping[hit[0]] = s.name
        if mapping and isinstance(self.record.lineage, dict) and isinstance(self.record.lineage.get("consensus"), dict):
            # a new dict: the caller's lineage (which it may reuse for its next file) stays as it was
            lineage = self.record.lineage
            self.record.lineage = {**lineage, "consensus": {**lineage["consensus"], "tensors": mapping}}
        # Header length is value-independent; build once with placeholders to learn it.
        self.record.tensors = {s.name: {"fp": "0" * 16, "xxh3": "0" * 32} for s in self.stored}
        self.digest_field = preferred_digest_field()  # the signature's data digest (BLAKE3 when installed)
        self.header_length = len(
            build_header(self.entries, self.record, signer=signer, data_digest=(self.digest_field, None))
        )

    def host(self, s: StoredTensor) -> torch.Tensor:
        return s.tensor if s.tensor.device.type == "cpu" else s.tensor.cpu()

    def data_hasher(self) -> BackgroundDigest | None:
        """The digest of the data region that a signature covers, hashed on another core beside the
        write; None when unsigned."""
        return BackgroundDigest(self.digest_field) if self.signer is not None else None

    def finish(self, fps: list[int], digests: list[str], data_digest: str | None = None) -> bytes:
        """The final header: ``data_digest`` is the signed data digest's hex value (None unsigned)."""
        self.record.tensors = {s.name: {"fp": f"{fp:016x}", "xxh3": d} for s, fp, d in zip(self.stored, fps, digests)}
        self.record.state_fp = state_fingerprint({k: v["fp"] for k, v in self.record.tensors.items()})
        header = build_header(
            self.entries, self.record, signer=self.signer, data_digest=(self.digest_field, data_digest)
        )
        if len(header) != self.header_length:  # would silently corrupt the data region
            raise PlatformError("certckpt: header length changed between planning and writing")
        return header

    def _todo(self) -> list[int]:
        """The stored tensors whose fingerprints the caller did not already hold."""
        return [i for i in range(len(self.stored)) if i not in self.known]

    def _all_fingerprints(self, computed: dict[int, int]) -> list[int]:
        """Every stored tensor's fingerprint: the ones held already, and ``computed`` for the rest."""
        return [int(self.known[i], 16) if i in self.known else computed[i] for i in range(len(self.stored))]

    def fingerprints(self) -> list[int]:
        todo = self._todo()
        return self._all_fingerprints(dict(zip(todo, fingerprint_many([self.stored[i].tensor for i in todo]))))

    def _fingerprint_plan(self) -> tuple[list[int], list[int], SharedFingerprints]:
        """(device tensors to fingerprint on their devices, host ones, their shared slices)."""
        todo = self._todo()
        on_device = [i for i in todo if self.stored[i].tensor.device.type != "cpu"]
        on_host = [i for i in todo if self.stored[i].tensor.device.type == "cpu"]
        return on_device, on_host, SharedFingerprints([self.stored[i].tensor for i in on_host])

    def _hash_worker(
        self, data_hash: Any, on_device: list[int], shared: SharedFingerprints
    ) -> tuple[list[int], list[str | None]]:
        """Off the writing thread: device tensors' fingerprints (on their devices), the xxh3 digests
        of host tensors, then host fingerprint slices shared with the writer. Device tensors are
        digested from the host copy the writer makes anyway. ``data_hash`` (a signed save whose
        tensors are all in host memory) is fed the same pieces as xxh3, in data order: one read of
        memory for both digests."""
        device_fps = fingerprint_many([self.stored[i].tensor for i in on_device])
        digests: list[str | None] = []
        for s in self.stored:
            if s.tensor.device.type != "cpu":
                digests.append(None)
            elif data_hash is None:
                digests.append(xxhash.xxh3_128_hexdigest(host_bytes(s.tensor)))
            else:
                h = xxhash.xxh3_128()
                hash_pieces(host_bytes(s.tensor), h, data_hash)
                digests.append(h.hexdigest())
        with one_thread():
            shared.work()
        return device_fps, digests

    def write_fd(self, fd: int, *, cap_threads: bool = True, drop_cache: bool = False, sync: bool = True) -> None:
        """Data first (hashes computed alongside on a worker thread), header last, fsync (``sync``;
        without it the caller makes the file durable: ``certckpt.format.durable``)."""
        base = self.header_length
        host_digests: dict[int, str] = {}
        # A signed save of host tensors hashes its data digest in the worker's xxh3 pass (measured on
        # 1 GiB: a separate BLAKE3 pass, on its own threads beside the write, made the save 1.4-2.3x
        # slower than unsigned; fused, the worker reads memory once for both). Device tensors reach
        # host memory only in the writer's copies, which feed a background digest instead.
        # Host fingerprints are cut into slices that both threads take once their ordered work is
        # done: BLAKE3 (0.2-0.27 s per GiB on one core here) makes the worker's share longer than
        # the writer's, and the writer helps instead of waiting (1 GiB in tmpfs, alternating runs of
        # 7 trials: the fastest signed save took 0.50-0.53 s shared, 0.52-0.65 s with the worker
        # fingerprinting alone; unsigned saves, writer-bound, did not change).
        fused = self.signer is not None and all(s.tensor.device.type == "cpu" for s in self.stored)
        fused_hash = new_hash(DIGEST_FIELDS[self.digest_field], threads=False) if fused else None
        data_hash = None if fused else self.data_hasher()
        capped = _intraop_threads(1) if cap_threads else contextlib.nullcontext()
        on_device, on_host, shared = self._fingerprint_plan()
        # The file's blocks reserved at once, and its data's writeback started every few tens of MiB
        # as it is written, so the fsync (still the durability point) finds little left to do.
        preallocate(fd, base + self.data_length)
        writeback = Writeback(fd, first=base)
        with capped, SerialWorker("certckpt-hash") as pool:
            hashed = pool.submit(self._hash_worker, fused_hash, on_device, shared)
            try:
                for i, (s, e) in enumerate(zip(self.stored, self.entries)):
                    h = self.host(s)
                    view = host_bytes(h)
                    if h is not s.tensor:
                        host_digests[i] = xxhash.xxh3_128_hexdigest(view)
                    _pwrite_all(fd, view, base + e.begin, writeback)
                    if data_hash is not None:  # entries are contiguous and in data order
                        data_hash.update(view, keep=h)
                    del view, h
            except BaseException:
                shared.cancel()  # the save has failed: the worker need not fingerprint the rest
                raise
            # The writes are done: fingerprint beside the worker (which may still be hashing)
            # instead of waiting for it to fingerprint alone. Each thread sums on itself alone
            # (one_thread: numpy widening and one int64 mv per chunk, the same bits): 384 MiB in
            # 0.091-0.107 s of one core against 0.107-0.24 s eager, on this VM (2026-12-03).
            with one_thread():
                shared.work()
            device_fps, worker_digests = hashed.result()
        fps = self._all_fingerprints(dict(zip(on_device, device_fps)) | dict(zip(on_host, shared.results())))
        digests = [d if d is not None else host_digests[i] for i, d in enumerate(worker_digests)]
        data_digest = fused_hash.hexdigest() if fused_hash is not None else None
        if data_hash is not None:
            data_digest = data_hash.finish()
        _pwrite_all(fd, memoryview(self.finish(fps, digests, data_digest)), 0)
        if not sync:
            return
        os.fsync(fd)
        if drop_cache and hasattr(os, "posix_fadvise"):
            # Durable now: its pages leave the page cache, and the next save reuses them instead of
            # growing the cache (measured on a VM: 0.72 -> 0.11 CPU-seconds per 288 MiB written).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def write_stream(self, f: IO[bytes]) -> None:
        """For a caller's file object: hash first, then write front to back (no seeking needed)."""
        fps = self.fingerprints()
        hosts = []
        digests = []
        data_hash = None if self.signer is None else new_hash(DIGEST_FIELDS[self.digest_field], threads=False)
        for s in self.stored:
            h = self.host(s)
            x = xxhash.xxh3_128()
            hash_pieces(host_bytes(h), x, *([data_hash] if data_hash is not None else []))
            digests.append(x.hexdigest())
            hosts.append(h if h is s.tensor else None)  # keep only zero-copy views alive
        f.write(self.finish(fps, digests, data_hash.hexdigest() if data_hash is not None else None))
        for s, kept in zip(self.stored, hosts):
            h = kept if kept is not None else self.host(s)
            f.write(host_bytes(h))
        f.flush()


def _write_temp(
    job: SaveJob,
    tmp: str,
    display: str,
    *,
    cap_threads: bool = True,
    drop_cache: bool = False,
    then: Callable[[int], None] | None = None,
) -> None:
    """Write the file at ``tmp`` and fsync it, or, given ``then``, hand ``then`` its descriptor
    instead of the fsync (``then`` raising removes the file as a failed write does)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError as e:
        raise StorageError(f"{display}: the directory does not exist; create it first") from e
    except PermissionError as e:
        raise StorageError(f"{display}: permission denied creating a file in its directory") from e
    try:
        try:
            job.write_fd(fd, cap_threads=cap_threads, drop_cache=drop_cache, sync=then is None)
            if then is not None:
                then(fd)
        finally:
            os.close(fd)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, StorageError):
            raise StorageError(
                f"{display}: write failed ({e.strerror or e}); "
                "nothing was published, the previous checkpoint is untouched"
            ) from e
        raise


_TORCH_DEFAULT = object()  # "not passed": torch.save's pickle options are only warned about when given


def save(
    obj: Any,
    f: Any,
    pickle_module: Any = _TORCH_DEFAULT,
    pickle_protocol: Any = _TORCH_DEFAULT,
    _use_new_zipfile_serialization: Any = _TORCH_DEFAULT,
    _disable_byteorder_record: Any = _TORCH_DEFAULT,
    *,
    step: int | None = None,
    run: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = True,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
) -> SaveResult:
    """Save ``obj`` as a certified safetensors checkpoint; ``torch.save``'s signature, never pickles.

    Like ``torch.save``, an existing file is replaced, atomically: the new file is written and
    fsync'd under a temp name beside it and renamed over the old one, so a crash or a full disk
    leaves the previous file intact. What is certified stays create-only whatever ``overwrite``
    says: a file inside a vault (a directory with ``_ledger/vault.json``), a file a ledger's commit
    record names, and a read-only file are never replaced (``ProtectedCheckpointError``).

    Args:
        obj: what ``torch.save`` takes in practice: nested dicts (str, int, float, bool, None, tuple
            keys), lists, tuples, tensors, numbers, strings, numpy arrays and scalars, sets, paths,
            datetimes, bytes, namedtuples, dataclasses, enums, ``argparse.Namespace``... (the full
            list is in ``docs/format.md`` section 6).
        f: a path, ``os.PathLike``, fsspec URL (``file://``, ``memory://``, ``s3://``...) or a
            writable binary file object.
        pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record:
            accepted for ``torch.save`` compatibility and ignored (one warning per process).
        step: the optimizer update count these weights follow.
        run: the training run's name.
        metadata: extra string metadata stored in the certckpt record.
        overwrite: replace an existing file (default, as ``torch.save``); False makes the save
            create-only (``CheckpointExistsError`` when the name is taken).
        signing_key: sign the file (``docs/signing.md``): a ``SigningKey`` or a private key file;
            by default the key named by ``CERTCKPT_SIGNING_KEY``, if set.

    Returns:
        A ``SaveResult``.

    Raises:
        UnsupportedObjectError: before anything is written, listing every value it cannot store.
        CheckpointExistsError: the name is taken and ``overwrite`` is False;
            ``ProtectedCheckpointError`` (a subclass) when the file is certified or read-only.
        StorageError: the store refused the write; nothing was published.

    Example:
        >>> certckpt.save({"model": model.state_dict(), "optim": opt.state_dict()},
        ...               "ckpt/step100.safetensors", step=100)
    """
    given = [
        name
        for name, value in (
            ("pickle_module", pickle_module),
            ("pickle_protocol", pickle_protocol),
            ("_use_new_zipfile_serialization", _use_new_zipfile_serialization),
            ("_disable_byteorder_record", _disable_byteorder_record),
        )
        if value is not _TORCH_DEFAULT
    ]
    if given:
        warn_ignored(given, function="save")
    fields = RecordFields(step=step, run=run)
    return _save(obj, f, fields=fields, metadata=metadata, overwrite=overwrite, signing_key=signing_key)


def save_certified(
    obj: Any,
    f: Any,
    *,
    step: int | None = None,
    run: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    branch: str | None = None,
    step_range: list[int] | None = None,
    parent: str | None = None,
    lineage: dict[str, Any] | None = None,
    consensus_fp: str | None = None,
    known_fingerprints: dict[TensorIdentity, tuple[str, str]] | None = None,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
    fields: RecordFields | None = None,
) -> SaveResult:
    """``save`` plus the audit fields the auditor fills in (see ``docs/format.md``, section 2).

    ``known_fingerprints`` maps a tensor's identity ``(data_ptr, dtype, shape, stride, device)`` to
    ``(parameter name, fingerprint hex)``; those tensors are not fingerprinted again. The record's
    fields (``step`` to ``consensus_fp``) come one by one or together as ``fields`` (a
    ``RecordFields``), not both.

    Certified files are create-only by default (``overwrite=False``), and even with
    ``overwrite=True`` a vault copy, a committed or a read-only file is never replaced.
    """
    one_by_one = {
        "step": step,
        "run": run,
        "branch": branch,
        "step_range": step_range,
        "parent": parent,
        "lineage": lineage,
        "consensus_fp": consensus_fp,
    }
    return _save(
        obj,
        f,
        fields=fields_given(fields, one_by_one),
        metadata=metadata,
        overwrite=overwrite,
        known_fingerprints=known_fingerprints,
        signing_key=signing_key,
    )


def fields_given(fields: RecordFields | None, one_by_one: dict[str, Any]) -> RecordFields:
    """The record's fields as a caller gave them: ``fields`` whole, or ``one_by_one`` (never both).

    Raises:
        ArgumentTypeError: ``fields`` and one of the fields given one by one.
    """
    if fields is None:
        return RecordFields(**one_by_one)
    both = sorted(name for name, value in one_by_one.items() if value is not None)
    if both:
        raise ArgumentTypeError(
            f"the record's fields were given twice: fields= and {', '.join(both)}=; pass them either together"
            " (fields=RecordFields(...)) or one by one"
        )
    return fields


def _save(
    obj: Any,
    f: Any,
    *,
    fields: RecordFields,
    metadata: dict[str, str] | None,
    overwrite: bool,
    known_fingerprints: dict[TensorIdentity, tuple[str, str]] | None = None,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
) -> SaveResult:
    t0 = time.perf_counter()
    job, target = prepare(
        obj,
        f,
        fields=fields,
        metadata=metadata,
        overwrite=overwrite,
        known_fingerprints=known_fingerprints,
        signing_key=signing_key,
    )
    return publish(job, target, overwrite=overwrite, started=t0)


def prepare(
    obj: Any,
    f: Any,
    *,
    fields: RecordFields,
    metadata: dict[str, str] | None,
    overwrite: bool,
    known_fingerprints: dict[TensorIdentity, tuple[str, str]] | None = None,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
) -> tuple[SaveJob, Target]:
    """Everything a save checks and plans before it reads a tensor's bytes: the arguments, the
    flattened object and the file's layout. Raises before anything is written."""
    if type(overwrite) is not bool:
        raise ArgumentTypeError(f"overwrite must be True or False, got {overwrite!r}")
    target = resolve(f)
    job = SaveJob(
        obj,
        fields=fields,
        metadata=metadata,
        known_fingerprints=known_fingerprints,
        signer=signing_key_for(signing_key),
    )
    return job, target


def publish(
    job: SaveJob,
    target: Target,
    *,
    overwrite: bool,
    started: float,
    cap_threads: bool = True,
    drop_cache: bool = False,
) -> SaveResult:
    """Write a prepared save's file (hashes beside the write), fsync it, publish it whole (a local
    file inside ``durable_together()``: fsync'd beside the block's others, published at its end).

    Args:
        cap_threads: cap torch's intra-op threads while writing (a synchronous save owns the
            process; a background one must not change a setting the training thread uses).
        drop_cache: once durable, drop a local file's pages from the page cache (a background save:
            a checkpoint is read rarely, and training keeps the memory and the CPU the cache's growth
            would cost).
    """
    if target.fileobj is not None:
        job.write_stream(target.fileobj)
    else:
        # A local file is written beside its name and renamed into place; an object store's is built
        # locally, then one create-only PUT publishes it whole (Storage.staging, Storage.publish).
        storage, name = storage_of(cast(str, target.location))  # resolve(): a path or URL without a file object
        if overwrite:
            refuse_protected(cast(str, target.location), display=target.display)  # before writing: costs nothing
        tmp = storage.staging(name)
        batch = current_batch() if storage.in_place else None
        try:
            if batch is not None:
                # inside durable_together(): the block fsyncs it beside the others and links it at its end
                final, written = os.path.join(os.path.dirname(tmp), name), tmp
                _write_temp(
                    job,
                    tmp,
                    target.display,
                    cap_threads=cap_threads,
                    then=lambda fd: batch.add(
                        fd, written, final, create_only=not overwrite, display=target.display, drop_cache=drop_cache
                    ),
                )
                tmp = ""  # the batch's now
            else:
                # drop_cache only where the file written is the one kept: an upload still reads it
                _write_temp(
                    job, tmp, target.display, cap_threads=cap_threads, drop_cache=drop_cache and storage.in_place
                )
                storage.publish(tmp, name, create_only=not overwrite, staged=True, display=target.display)
        finally:
            if tmp and os.path.exists(tmp):
                os.unlink(tmp)
    return SaveResult(
        location=target.display,
        nbytes=job.header_length + job.data_length,
        state_fp=job.record.state_fp,
        tensors=len(job.stored),
        seconds=time.perf_counter() - started,
        header_digest=job.record.header_digest,
    )
