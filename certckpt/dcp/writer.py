"""``CertifiedWriter``: a ``torch.distributed.checkpoint`` StorageWriter that writes certified shards.

Each rank writes its chunks as one certckpt file (``shard-RRRRR.safetensors``: digests and device
fingerprints of the local chunks in its record, with each chunk's offsets and global shape), through
the format layer (temp file, fsync, atomic publish; one create-only PUT on object stores). Before it
writes, or beside the write, each chunk's contribution to its global tensor's fingerprint is worked
out with as few passes over it as its layout allows (``shardfp.sum_plan``). The coordinator then
writes the manifest (DCP's metadata as data, every shard file with its header digest, the
sharding-independent fingerprints), last: until it exists nothing is committed.

Example::

    import torch.distributed.checkpoint as dcp
    from certckpt.dcp import CertifiedWriter
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             storage_writer=CertifiedWriter("ckpt/step100", step=100))
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from certckpt.errors import ArgumentTypeError, CheckpointExistsError, ConfigurationError, StorageError
from certckpt.format.header import canonical_json
from certckpt.format.record import RecordFields
from certckpt.format.sharded.check import verify_checkpoint
from certckpt.format.sharded.composition import finalize, hex64, raw_of
from certckpt.format.sharded.layout import (
    MANIFEST_MARK,
    MANIFEST_NAME,
    MANIFEST_TENSOR,
    exists,
    is_shard_name,
    join,
    list_directory,
    make_directory,
    remove,
    shard_name,
)
from certckpt.format.sharded.manifest import MANIFEST_VERSION, Manifest, read_manifest
from certckpt.format.sharded.shardfp import sum_plan, tensor_contribution, write_sums
from certckpt.format.tensors import TORCH_TO_ST
from certckpt.format.verify import CheckpointInfo, inspect
from certckpt.format.writer import SaveResult, save_certified
from certckpt.storage import refuse_protected
from certckpt.trust.commit import check_commit_target, commit_saved
from certckpt.trust.ledger import Ledger

from .dcpmeta import DCP_VERSION, ShardRef, ValueRef, build_manifest, state_mismatch
from .values import encode_value, value_of

__all__ = ["CertifiedWriter", "SHARDS_KEY"]

SHARDS_KEY = "certckpt.dcp.shards"  # a shard file's record.user key: its chunks' offsets and global shapes


def _location(path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ArgumentTypeError(f"a checkpoint directory must be a path or fsspec URL, got {path!r:.80}")
    return path


def _entry_name(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> str:
    whole = not any(offsets) and sizes == shape
    return fqn if whole else f"{fqn}@{','.join(str(o) for o in offsets)}"


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def _view(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


@dataclass(frozen=True, slots=True)
class _Recheck:
    """A rank's assignment when the directory holds a checkpoint already (a retry): work out its
    chunks' fingerprints for file ``file`` and write nothing (see ``CertifiedWriter.finish``)."""

    file: str


class _Shard:
    """One rank's file in the making: unique tensors by entry name, and which item maps to which."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.chunks: dict[str, dict[str, Any]] = {}  # entry -> fqn, offsets, global shape
        self.item_entry: list[tuple[Any, str]] = []  # (write item, entry name)
        self._views: dict[tuple, str] = {}  # a stored tensor's exact view -> its entry
        self._storages: set[tuple] = set()

    def add(self, item: Any, t: torch.Tensor) -> None:
        td = item.tensor_data
        offsets, sizes, shape = tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size)
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()  # the bytes fingerprinted here are then the very ones the writer stores
        if tuple(t.shape) != sizes:
            raise ConfigurationError(
                f"`{item.index.fqn}`: the planner resolved a tensor of shape {list(t.shape)} for a chunk of"
                f" {list(sizes)}"
            )
        if t.numel() and self._views.get(_view(t)) is not None:  # the same tensor under two names (tied)
            self.item_entry.append((item, self._views[_view(t)]))
            return
        if t.numel() and t.untyped_storage().nbytes() and _storage(t) in self._storages:
            # Another view of a storage already stored: the format would store the two as one entry
            # with views; a chunk must be its own entry, so this one is copied.
            t = t.clone(memory_format=torch.contiguous_format)
        name = base = _entry_name(item.index.fqn, offsets, sizes, shape)
        n = 0
        while name in self.tensors or name in ("", "__metadata__"):
            n += 1
            name = f"{base}~{n}"
        if t.numel():
            self._views[_view(t)] = name
            self._storages.add(_storage(t))
        self.tensors[name] = t
        self.chunks[name] = {"fqn": item.index.fqn, "offsets": list(offsets), "shape": list(shape)}
        self.item_entry.append((item, name))


class CertifiedWriter(StorageWriter):
    """Write a DCP checkpoint as certified shard files plus a certified manifest.

    Args:
        path: the checkpoint directory: a local path or any fsspec URL (``s3://b/run/step100``,
            ``memory://...``). ``dcp.save(checkpoint_id=...)`` replaces it.
        run: the training run's name, recorded in every file.
        step: the optimizer update count, recorded in every file.
        metadata: extra string metadata for the manifest's record.
        overwrite: replace a committed checkpoint in ``path`` (default False: certified checkpoints
            are write-once). Shard files left by an unfinished save (no manifest) are always replaced.
        ledger: a run store (path or URL) whose ledger records the checkpoint once its manifest is
            written (``branch@step``; needs ``step``): ``certckpt status STORE`` lists it. The same
            save run again after a failure completes it: where an earlier attempt's manifest is
            there already (the save stopped before its commit), the state is fingerprinted, nothing
            is written, and the checkpoint there is committed if it is this state and verifies;
            another state there is refused.
        branch: the line of training recorded with a ledger commit (default ``main``, or the evidence's).
        parent: the checkpoint id this branch resumed from (a ledger commit records it once).
        evidence: a ``certckpt.detect.CheckpointEvidence`` of this step (from
            ``ShardedAuditSession.checkpoint_evidence(state)`` with the state being saved): the manifest's
            record and the ledger commit carry its agreed ``consensus_fp``, step range and lineage, and
            its run, step, branch and parent are the defaults of those arguments. The save is refused
            (nothing committed) when the state written is not the state the replicas agreed on.
        consensus_fp: the agreed state fingerprint alone, without the rest of the evidence.

    Non-tensor values (``lr``, ``betas``, ``params`` lists) are stored as data in the manifest, never
    pickled; what certckpt cannot store without pickle is refused, naming it (``docs/format.md``).

    Example:
        >>> dcp.save(state, storage_writer=CertifiedWriter("s3://bucket/run/step100", step=100))
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run: str | None = None,
        step: int | None = None,
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
        ledger: str | os.PathLike | None = None,
        branch: str | None = None,
        parent: str | None = None,
        evidence: Any = None,
        consensus_fp: str | None = None,
    ) -> None:
        super().__init__()
        self.step_range: list[int] | None = None
        self.lineage: dict[str, Any] | None = None
        self.tensor_fps: dict[str, str] = {}
        if evidence is not None:
            if not all(hasattr(evidence, a) for a in ("step", "consensus_fp", "step_range", "lineage")):
                raise ArgumentTypeError(
                    f"evidence must be a CheckpointEvidence (ShardedAuditSession.checkpoint_evidence), got"
                    f" {type(evidence).__name__}"
                )
            if step is not None and step != evidence.step:
                raise ConfigurationError(f"step={step} but the evidence is of step {evidence.step}")
            if consensus_fp is not None and consensus_fp != evidence.consensus_fp:
                raise ConfigurationError("consensus_fp differs from the evidence's; pass one of them")
            step, consensus_fp = evidence.step, evidence.consensus_fp
            run = evidence.run if run is None else run
            branch = evidence.branch if branch is None else branch
            parent = evidence.parent if parent is None else parent
            self.step_range, self.lineage = list(evidence.step_range), dict(evidence.lineage)
            self.tensor_fps = dict(getattr(evidence, "tensor_fps", None) or {})
        if consensus_fp is not None and not (
            isinstance(consensus_fp, str)
            and len(consensus_fp) == 16
            and all(c in "0123456789abcdef" for c in consensus_fp)
        ):
            raise ArgumentTypeError(f"consensus_fp must be 16 lowercase hex digits, got {consensus_fp!r:.40}")
        self.consensus_fp = consensus_fp
        branch = "main" if branch is None else branch
        if type(overwrite) is not bool:
            raise ArgumentTypeError(f"overwrite must be True or False, got {overwrite!r}")
        if step is not None and (type(step) is not int or step < 0):
            raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise ArgumentTypeError("metadata must be a dict of str to str")
        self.ledger = None if ledger is None else _location(ledger)
        if overwrite and self.ledger is not None:
            raise ConfigurationError("overwrite=True with a ledger: a committed checkpoint is write-once")
        if self.ledger is not None:
            check_commit_target(step=step, branch=branch)
        self.branch = branch
        self.parent = parent
        self.ckpt_id: str | None = None  # set on the coordinator when a ledger commit was written
        self.path = _location(path)
        self.run = run
        self.step = step
        self.metadata = dict(metadata or {})
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.is_coordinator = True
        self.manifest: Manifest | None = None  # set on the coordinator by finish()
        # the coordinator's: the checkpoint an earlier attempt of this save left (a retry's)
        self._held: tuple[Manifest, CheckpointInfo] | None = None

    # --- StorageWriter ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = _location(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ConfigurationError(
                "CertifiedWriter needs dcp.save(use_collectives=True): the coordinator writes one manifest"
                " over every rank's shards"
            )
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        make_directory(self.path)
        if self.overwrite and exists(join(self.path, MANIFEST_NAME)):
            # Every rank refuses before the coordinator un-commits anything: a vault's held copy or a
            # checkpoint a ledger committed is never replaced, overwrite or not (docs/format.md).
            refuse_protected(self.path)
            refuse_protected(join(self.path, MANIFEST_NAME))
        if not self.overwrite and self.ledger is None and exists(join(self.path, MANIFEST_NAME)):
            # (with a ledger, the ledger's record commits the directory, and the coordinator tells an
            # earlier attempt of this save from another checkpoint: prepare_global_plan)
            raise CheckpointExistsError(
                f"{self.path}: holds a committed certified checkpoint already; save to a new directory, or pass"
                " CertifiedWriter(..., overwrite=True) to replace it"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        manifest = join(self.path, MANIFEST_NAME)
        if self.overwrite and exists(manifest):
            remove(manifest)  # un-commit first: a crash from here on leaves no checkpoint, never a mix
        self._held = None
        if self.ledger is not None and exists(manifest):
            self._held = self._earlier_attempt()
            return [dataclasses.replace(p, storage_data=_Recheck(shard_name(i))) for i, p in enumerate(plans)]
        return [dataclasses.replace(p, storage_data=shard_name(i)) for i, p in enumerate(plans)]

    def _record_fields(self) -> RecordFields:
        return RecordFields(
            step=self.step,
            run=self.run,
            branch=self.branch if self.ledger is not None else None,
            parent=self.parent if self.ledger is not None else None,
            step_range=self.step_range,
            lineage=self.lineage,
            consensus_fp=self.consensus_fp,
        )

    def _earlier_attempt(self) -> tuple[Manifest, CheckpointInfo]:
        """The checkpoint in the directory, when its manifest's record is the one this save writes
        (an earlier attempt of it, stopped between its manifest and its commit, or after); whether
        it holds this state is known once the ranks have fingerprinted theirs (``finish``)."""
        held, info = read_manifest(self.path)
        rec = info.record
        fields = self._record_fields().as_kwargs()
        differ = [k for k, v in fields.items() if canonical_json(getattr(rec, k)) != canonical_json(v)]
        if rec.user != {**self.metadata, MANIFEST_MARK: str(MANIFEST_VERSION), "state_fp": held.state_fp}:
            differ.append("metadata")
        if differ:
            raise CheckpointExistsError(
                f"{self.path}: holds a certified checkpoint already, not one this save wrote (its {', '.join(differ)}"
                f" differ: {', '.join(f'{k}={getattr(rec, k, None)!r:.40}' for k in differ[:3])}); nothing was"
                " written: save to a new directory"
            )
        return held, info

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        recheck = isinstance(plan.storage_data, _Recheck)
        assigned = plan.storage_data.file if isinstance(plan.storage_data, _Recheck) else plan.storage_data
        file_name = assigned if is_shard_name(assigned) else shard_name(self.rank)
        shard = _Shard()
        results: list[WriteResult] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                node = encode_value(value_of(planner, item), item.index.fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=ValueRef(node)))
            else:
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor)  # an item that is not BYTE_IO resolves to a tensor
                shard.add(item, data)
        if shard.tensors:
            results += self._fingerprint_shard(shard, file_name) if recheck else self._write_shard(shard, file_name)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = metadata.version or DCP_VERSION
        manifest = build_manifest(metadata, results)
        if self.consensus_fp is not None and manifest.state_fp != self.consensus_fp:
            self._refuse_unagreed(manifest)
        fields = self._record_fields()
        if self._held is not None:  # a retry: nothing in the directory is touched
            self._complete(manifest, fields)
            return
        listed = {f.name for f in manifest.files}
        # Shard files of an earlier, larger save in this directory are not part of this checkpoint.
        for name in list_directory(self.path).files:
            if is_shard_name(name) and name not in listed:
                remove(join(self.path, name))
        data = torch.frombuffer(bytearray(manifest.to_bytes()), dtype=torch.uint8)
        saved = save_certified(
            {MANIFEST_TENSOR: data},
            join(self.path, MANIFEST_NAME),
            fields=fields,
            metadata={**self.metadata, MANIFEST_MARK: str(MANIFEST_VERSION), "state_fp": manifest.state_fp},
            overwrite=False,
        )
        metadata.storage_data = {wr.index: wr.storage_data for per_rank in results for wr in per_rank}
        self.manifest = manifest
        if self.ledger is not None:
            self._commit(saved, manifest, fields)

    def _commit(self, saved: SaveResult, manifest: Manifest, fields: RecordFields) -> None:
        """The commit record of the checkpoint directory (with a ledger): it names the directory, with
        the manifest's header digest (which covers every shard file's, and through them every byte),
        state fingerprint and fields, the bytes of every file and the count of global tensors, so
        that the certifier's cross-check of the commit against the manifest's record has something to
        compare. ``certckpt status`` lists it; ``latest-good`` verifies the directory as ``certckpt
        verify DIR`` does; the vault holds it as a directory (``docs/operations.md``)."""
        whole = dataclasses.replace(
            saved,
            location=self.path,
            nbytes=saved.nbytes + sum(f.nbytes for f in manifest.files),
            tensors=len(manifest.tensors),
        )
        assert self.ledger is not None  # finish commits only with a ledger
        self.ckpt_id = commit_saved(Ledger(self.ledger), whole, fields)

    def _complete(self, manifest: Manifest, fields: RecordFields) -> None:
        """A retry's end: the checkpoint an earlier attempt left is committed when it holds the state
        this save fingerprinted (``manifest``, whose files were not written) and reads back whole;
        anything else is refused, and nothing in the directory has changed either way."""
        assert self._held is not None and self.ledger is not None  # prepare_global_plan set it, with a ledger
        held, info = self._held
        why = state_mismatch(manifest, held)
        if why is not None:
            raise CheckpointExistsError(
                f"{self.path}: an earlier save left a certified checkpoint of another state here ({why}); nothing"
                " was written: save this state to a new directory"
            )
        report = verify_checkpoint(self.path)
        if not report.ok:
            raise CheckpointExistsError(
                f"{self.path}: an earlier save of this state is here but does not read back whole"
                f" ({report.problems[0].message}); nothing was written: save to a new directory"
            )
        self.manifest = held
        saved = SaveResult(
            location=join(self.path, MANIFEST_NAME),
            nbytes=info.nbytes,
            state_fp=info.record.state_fp,
            tensors=1,
            seconds=0.0,
            header_digest=info.record.header_digest,
        )
        self._commit(saved, held, fields)

    def _refuse_unagreed(self, manifest: Manifest) -> None:
        # The replicas agreed on one state and another is being written (changed in between, or a
        # different state dict): a checkpoint carrying that agreement would be a false witness.
        written = {t.fqn: t.fp for t in manifest.tensors}
        differ = sorted(k for k in written.keys() & self.tensor_fps.keys() if written[k] != self.tensor_fps[k])
        only = sorted(written.keys() ^ self.tensor_fps.keys()) if self.tensor_fps else []
        named = (f"; tensors that differ: {differ[:5]}" if differ else "") + (
            f"; tensors in one but not the other: {only[:5]}" if only else ""
        )
        raise ConfigurationError(
            f"{self.path}: the state written (state fingerprint {manifest.state_fp}) is not the state the replicas"
            f" agreed on ({self.consensus_fp}){named}; take the evidence from the very state passed to dcp.save,"
            " right before saving"
        )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # --- the shard file -----------------------------------------------------------------------

    def _fingerprint_shard(self, shard: _Shard, file_name: str) -> list[WriteResult]:
        """A retry's part of a rank: each chunk's contribution to its tensor's fingerprint, nothing
        written (the results name no file bytes: the coordinator only compares the state)."""
        raws = {
            name: tensor_contribution(
                t, offsets=shard.chunks[name]["offsets"], global_shape=shard.chunks[name]["shape"]
            )
            for name, t in shard.tensors.items()
        }
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=0,
                storage_data=ShardRef(
                    file=file_name, entry=name, raw=hex64(raws[name]), rank=self.rank, file_bytes=0, header_digest=""
                ),
            )
            for item, name in shard.item_entry
        ]

    def _write_shard(self, shard: _Shard, file_name: str) -> list[WriteResult]:
        # Each chunk needs its own fingerprint (the format writer computes it while it writes) and
        # its contribution to its global tensor's (sum_plan): read back from the fingerprint for a
        # chunk that starts the tensor, computed with the fingerprint in one pass before writing for
        # a chunk on a multiplier-chunk boundary, on a thread beside the write for any other.
        raws: dict[str, int] = {}
        known: dict[tuple, tuple[str, str]] = {}
        own, separate = [], []
        for name, t in shard.tensors.items():
            c = shard.chunks[name]
            plan = sum_plan(t.shape, offsets=c["offsets"], global_shape=c["shape"], elem_size=t.element_size())
            if plan == "own":
                own.append(name)
            elif plan == "dual":
                mine, raws[name] = write_sums(t, offsets=c["offsets"], global_shape=c["shape"])
                fp = finalize(mine, TORCH_TO_ST[t.dtype], t.shape)
                known[(t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), str(t.device))] = (name, hex64(fp))
            else:
                separate.append(name)
        failure: list[BaseException] = []

        def contributions() -> None:
            try:
                for name in separate:
                    c = shard.chunks[name]
                    raws[name] = tensor_contribution(shard.tensors[name], offsets=c["offsets"], global_shape=c["shape"])
            except BaseException as e:  # re-raised on the writing thread
                failure.append(e)

        worker = threading.Thread(target=contributions, name="certckpt-dcp-fp", daemon=True)
        if separate:
            worker.start()
        url = join(self.path, file_name)
        try:
            saved = save_certified(
                shard.tensors,
                url,
                run=self.run,
                step=self.step,
                metadata={SHARDS_KEY: canonical_json(shard.chunks), "rank": str(self.rank)},
                overwrite=True,  # no manifest yet: a file here is a leftover of an unfinished save
                known_fingerprints=known,
            )
        finally:
            if separate:
                worker.join()
        if failure:
            raise failure[0]
        if own:
            # the header just written holds their fingerprints (a small read, and a check that the
            # file committed is the one described)
            record = inspect(url).record
            if record.header_digest != saved.header_digest:
                raise StorageError(f"{url}: the file changed while it was being committed; save again")
            for name in own:
                t = shard.tensors[name]
                raws[name] = raw_of(int(record.tensors[name]["fp"], 16), TORCH_TO_ST[t.dtype], t.shape)
        out = []
        for item, name in shard.item_entry:
            t = shard.tensors[name]
            ref = ShardRef(
                file=file_name,
                entry=name,
                raw=hex64(raws[name]),
                rank=self.rank,
                file_bytes=saved.nbytes,
                header_digest=saved.header_digest,
            )
            out.append(WriteResult(index=item.index, size_in_bytes=t.numel() * t.element_size(), storage_data=ref))
        return out
