"""``CertifiedReader``: a ``torch.distributed.checkpoint`` StorageReader for ``CertifiedWriter``'s output.

It reads the manifest (every byte checked, then validated like any untrusted input) and rebuilds DCP's
``Metadata`` from it as data. Each rank then opens only the shard files it needs, checks that each
is the file the manifest names (size and header digest), reads every chunk it needs whole (straight
into the destination tensor when the chunk is exactly that tensor) and checks it against its xxh3
digest before handing any part of it to the planner: a flipped bit names the file, the stored
tensor and the state entry. Resharding is DCP's: any new sharding reads the boxes it overlaps.
With ``check_fingerprints=True`` the loaded state is then checked, collectively, against the
sharding-independent fingerprints (``statecheck``), each region fingerprinted beside the reads
(``loadfp``).

Example::

    import torch.distributed.checkpoint as dcp
    from certckpt.dcp import CertifiedReader
    dcp.load(state, storage_reader=CertifiedReader("ckpt/step100"))
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import IO, Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from certckpt.errors import (
    ArgumentTypeError,
    CertckptError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
)
from certckpt.format.header import TensorEntry, printable
from certckpt.format.record import check_header
from certckpt.format.sharded.check import verify_checkpoint
from certckpt.format.sharded.layout import join
from certckpt.format.sharded.manifest import Manifest, ShardFile, ValueInfo, read_manifest
from certckpt.format.signing import KEYS_FROM_ENV, TrustedKeys, trusted_keys_for
from certckpt.format.tensors import ST_TO_TORCH, host_bytes
from certckpt.format.verify import digest_problem, read_checkpoint_header, read_tensor
from certckpt.storage import open_read, resolve

from .dcpmeta import ChunkRef, to_metadata
from .loadfp import RegionFingerprints
from .statecheck import Region, compare, exchange
from .values import decode_value, deliver_value

__all__ = ["CertifiedReader"]


def _location(path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ArgumentTypeError(f"a checkpoint directory must be a path or fsspec URL, got {path!r:.80}")
    return path


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[dim]:
            t = t.narrow(dim, o, n)
    return t


def _read_into(fh: IO[bytes], view: memoryview, source: str, e: TensorEntry) -> None:
    got = 0
    while got < len(view):
        # every file open_read yields (a local file, an fsspec file) reads into a buffer; IO[bytes],
        # the type it is declared with, has no readinto
        n = fh.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise CorruptCheckpointError(f"{source}: truncated: tensor `{printable(e.name)}` ends early")
        got += n


class CertifiedReader(StorageReader):
    """Read a checkpoint written by ``CertifiedWriter``, checking every byte it reads.

    Args:
        path: the checkpoint directory (local path or fsspec URL). ``dcp.load(checkpoint_id=...)``
            replaces it.
        check_fingerprints: after loading, compare the loaded state (on any sharding) with the
            manifest's sharding-independent fingerprints. Collective: every rank of
            ``process_group`` must take part in the same ``dcp.load``. Costs one fingerprint pass
            over the loaded data, on a thread beside the reads (``loadfp``).
        process_group: the group for ``check_fingerprints`` (default: the default group when one
            is initialized, else this process alone).
        trusted_keys: public keys (``TrustedKeys`` or key files; default ``$CERTCKPT_TRUSTED_KEYS``;
            None: no keys). With keys, the manifest and every shard file must be signed by one of
            them and every byte must match its signed data digest (BLAKE3, or SHA-256 in older
            files): checked in full, on every rank, before anything is loaded (one more read of
            the checkpoint).
        manifest: the manifest of ``path``, already read by the caller through ``read_manifest``
            (every byte checked): the reader then uses it instead of reading the file again (a
            Megatron load hands over the one its common strategy read). Dropped when ``reset`` names
            another checkpoint, and used for one load only.

    Raises (from ``dcp.load``, wrapped by DCP in a ``CheckpointException`` that carries the text):
        CorruptCheckpointError: a digest mismatch (naming file, tensor and state entry), a missing
            or replaced shard file, a damaged manifest, a fingerprint mismatch.
        CheckpointNotFoundError: no committed checkpoint (no manifest) at ``path``.

    Example:
        >>> dcp.load(state, storage_reader=CertifiedReader("ckpt/step100", check_fingerprints=True))
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        check_fingerprints: bool = False,
        process_group: Any = None,
        trusted_keys: TrustedKeys | str | None = KEYS_FROM_ENV,
        manifest: Manifest | None = None,
    ) -> None:
        super().__init__()
        self.trusted_keys = trusted_keys_for(trusted_keys)
        if manifest is not None and not isinstance(manifest, Manifest):
            raise ArgumentTypeError(f"manifest must be a Manifest from read_manifest, got {type(manifest).__name__}")
        if type(check_fingerprints) is not bool:
            raise ArgumentTypeError(f"check_fingerprints must be True or False, got {check_fingerprints!r}")
        self.path = _location(path)
        self.check_fingerprints = check_fingerprints
        self.process_group = process_group
        self.load_id = str(uuid.uuid4())
        self.manifest: Manifest | None = None
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.checked_tensors = 0  # tensors compared in full by the last check_fingerprints load
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._metadata_error: CertckptError | None = None  # read_metadata's, raised by set_up_storage_reader
        self._given = manifest  # the caller's read of self.path's manifest, used instead of reading it

    # --- StorageReader ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            path = _location(checkpoint_id)
            if path != self.path:
                self._given = None  # the manifest handed over is another checkpoint's
            self.path = path
        self.load_id = str(uuid.uuid4())
        self.manifest = None
        self.storage_data = {}

    def read_metadata(self, *args: Any) -> Metadata:
        # No **kwargs on purpose: DCP then never falls back to per-rank `.metadata` files.
        # An error is kept for set_up_storage_reader rather than raised here: torch 2.11's dcp.load
        # replaces any exception from read_metadata with a bare "metadata is None".
        self._metadata_error = None
        try:
            # the manifest handed over serves one load: a reader used again reads the file again
            given, self._given = self._given, None
            manifest = given if given is not None else read_manifest(self.path)[0]
        except CheckpointNotFoundError as e:
            error = CheckpointNotFoundError(
                f"{self.path}: no committed certified checkpoint here (no manifest: the save never finished,"
                " or the path is wrong)"
            )
            error.__cause__ = e
            self._metadata_error = error
            return Metadata(state_dict_metadata={})
        except CertckptError as e:
            self._metadata_error = e
            return Metadata(state_dict_metadata={})
        self.manifest = manifest
        self._shapes = {t.fqn: t.shape for t in manifest.tensors}
        return to_metadata(manifest, source=self.path, load_id=self.load_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._metadata_error is not None:
            raise self._metadata_error
        if self.manifest is None:
            raise ConfigurationError("CertifiedReader: read_metadata must come first (dcp.load does this)")
        if self.trusted_keys is not None:
            # xxh3 stops accidents, not someone who can write the shards: with keys, every byte is
            # checked against its signed data digest (BLAKE3, SHA-256 in older files) before any
            # of it reaches the caller's state
            report = verify_checkpoint(self.path, trusted_keys=self.trusted_keys)
            if not report.ok:
                raise CorruptCheckpointError(f"{report.problems[0].message}; nothing was loaded")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        regions: list[Region] = []
        error: BaseException | None = None
        try:
            if self.check_fingerprints:
                with RegionFingerprints() as fps:  # beside the reads, on a thread of its own (loadfp)
                    self._read(plan, planner, fps)
                    regions = fps.regions()
            else:
                self._read(plan, planner, None)
        except Exception as e:  # with check_fingerprints every rank must still reach the exchange
            if not self.check_fingerprints:
                raise
            error = e
        if self.check_fingerprints:
            self._check(regions, error)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # --- reading ------------------------------------------------------------------------------

    def _read(self, plan: LoadPlan, planner: LoadPlanner, fps: RegionFingerprints | None) -> None:
        assert self.manifest is not None
        per_file: dict[int, list[tuple[ReadItem, ChunkRef]]] = {}
        for req in plan.items:
            ref = self.storage_data.get(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                if not isinstance(ref, ValueInfo):
                    raise CorruptCheckpointError(
                        f"{self.path}: no stored value for `{printable(req.storage_index.fqn)}`"
                    )
                deliver_value(planner, req, decode_value(ref.node, ref.fqn, self.path))
                continue
            if not isinstance(ref, ChunkRef):
                raise CorruptCheckpointError(
                    f"{self.path}: the manifest has no chunk of `{printable(req.storage_index.fqn)}`"
                    f" at {list(req.storage_index.offset or ())}"
                )
            per_file.setdefault(ref.file, []).append((req, ref))
        for index in sorted(per_file):
            self._read_file(self.manifest.files[index], per_file[index], planner, fps)

    def _read_file(
        self,
        sf: ShardFile,
        reqs: list[tuple[ReadItem, ChunkRef]],
        planner: LoadPlanner,
        fps: RegionFingerprints | None,
    ) -> None:
        target = resolve(join(self.path, sf.name))
        source = target.display
        with contextlib.ExitStack() as stack:
            try:
                fh, size = stack.enter_context(open_read(target))
            except CheckpointNotFoundError as e:
                raise CorruptCheckpointError(
                    f"{self.path}: shard file {sf.name} (rank {sf.rank}), listed in the manifest, is missing;"
                    " restore this checkpoint from a good copy"
                ) from e
            info = read_checkpoint_header(fh, size, source)
            problem = check_header(info.header, info.record)
            if problem:
                raise CorruptCheckpointError(f"{source}: {problem}")
            if info.record.header_digest != sf.header_digest or (size is not None and size != sf.nbytes):
                raise CorruptCheckpointError(
                    f"{source}: not the shard file the manifest names (header digest {info.record.header_digest},"
                    f" {size} bytes; expected {sf.header_digest}, {sf.nbytes} bytes): it was replaced after the"
                    " checkpoint was committed — restore this checkpoint from a good copy"
                )
            entries = {e.name: e for e in info.header.entries}
            by_entry: dict[str, list[ReadItem]] = {}
            for req, ref in reqs:
                by_entry.setdefault(ref.entry, []).append(req)
            missing = [n for n in by_entry if n not in entries]
            if missing:
                raise CorruptCheckpointError(f"{source}: has no tensor `{printable(missing[0])}` the manifest names")
            for name in sorted(by_entry, key=lambda n: entries[n].begin):
                entry = entries[name]
                fh.seek(info.header.data_start + entry.begin)
                self._read_entry(fh, source, entry, info.record.tensors[name]["xxh3"], by_entry[name], planner, fps)

    def _read_entry(
        self,
        fh: IO[bytes],
        source: str,
        e: TensorEntry,
        expected: str,
        reqs: list[ReadItem],
        planner: LoadPlanner,
        fps: RegionFingerprints | None,
    ) -> None:
        dtype = ST_TO_TORCH[e.dtype]
        direct = None
        if len(reqs) == 1 and not any(reqs[0].storage_offsets) and tuple(reqs[0].lengths) == e.shape:
            dest = planner.resolve_tensor(reqs[0]).detach()
            if (
                dest.device.type == "cpu"
                and dest.dtype == dtype
                and dest.is_contiguous()
                and tuple(dest.shape) == e.shape
            ):
                direct = dest  # the chunk is exactly the destination: read straight into it
        if direct is not None:
            if fps is not None:
                fps.guard(direct)
            view = host_bytes(direct)
            _read_into(fh, view, source, e)
            src = direct
        else:
            src, view = read_tensor(fh, e, source)
        found = xxhash.xxh3_128_hexdigest(view)
        del view
        if found != expected:
            req = reqs[0]
            raise CorruptCheckpointError(
                f"{source}: {digest_problem(e, expected, found)} (state entry `{printable(req.storage_index.fqn)}`,"
                f" chunk at {list(req.storage_index.offset or ())})"
            )
        for req in reqs:
            if direct is not None:
                dest = direct
            else:
                dest = planner.resolve_tensor(req).detach()
                piece = _narrow(src, req.storage_offsets, req.lengths)
                if tuple(dest.shape) != tuple(piece.shape):
                    raise CorruptCheckpointError(
                        f"{source}: `{printable(req.dest_index.fqn)}` expects {list(dest.shape)}, the checkpoint"
                        f" holds {list(piece.shape)}"
                    )
                if fps is not None:
                    fps.guard(dest)
                dest.copy_(piece)
            planner.commit_tensor(req, dest)
            if fps is not None:  # what the planner holds once committed, fingerprinted beside the next reads
                offsets = [a + b for a, b in zip(req.storage_index.offset or (), req.storage_offsets)]
                fps.submit(req.storage_index.fqn, offsets, dest, self._shapes[req.storage_index.fqn])

    # --- the fingerprint check ----------------------------------------------------------------

    def _group(self) -> Any:
        if self.process_group is not None:
            return self.process_group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def _check(self, regions: list[Region], error: BaseException | None) -> None:
        assert self.manifest is not None
        payload = {
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "regions": [[r.fqn, list(r.offsets), list(r.sizes), r.raw] for r in regions],
        }
        everyone = exchange(payload, self._group())
        if error is not None:
            raise error
        failed = [(rank, p["error"]) for rank, p in enumerate(everyone) if p["error"]]
        if failed:
            raise CorruptCheckpointError(
                f"{self.path}: the fingerprint check could not run: rank {failed[0][0]} failed to load ({failed[0][1]})"
            )
        every = [Region(f, tuple(o), tuple(s), raw) for p in everyone for f, o, s, raw in p["regions"]]
        problems, self.checked_tensors = compare(self.manifest, every)
        if problems:
            raise CorruptCheckpointError(f"{self.path}: " + "; ".join(problems[:5]))
