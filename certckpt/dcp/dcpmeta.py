"""DCP's ``Metadata`` as data: built into the manifest by the writer, rebuilt from it by the reader.

``FileSystemWriter`` pickles ``Metadata`` into ``.metadata``; here every field becomes JSON-able data
(dtypes by their safetensors code, sizes as lists, ``planner_data`` as a certckpt skeleton node) and
the reader rebuilds the dataclasses from validated values, so loading never unpickles anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from certckpt.errors import NotACheckpointError, PlatformError, UnsupportedObjectError
from certckpt.format.header import printable
from certckpt.format.sharded.composition import compose, hex64, state_fp
from certckpt.format.sharded.manifest import Chunk, Manifest, ShardFile, TensorInfo, ValueInfo
from certckpt.format.tensors import ST_TO_TORCH, TORCH_TO_ST

from .values import decode_value, encode_value

__all__ = ["ShardRef", "ValueRef", "ChunkRef", "build_manifest", "state_mismatch", "to_metadata", "DCP_VERSION"]

DCP_VERSION = "1.0.0"  # the DCP metadata version these fields follow (torch's CURRENT_DCP_VERSION)


@dataclass(frozen=True, slots=True)
class ShardRef:
    """Where a rank stored one chunk (a ``WriteResult.storage_data``, gathered to the coordinator)."""

    file: str
    entry: str
    raw: str
    rank: int
    file_bytes: int
    header_digest: str


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A non-tensor value, as its skeleton node (a ``WriteResult.storage_data``)."""

    node: Any


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """The reader's ``Metadata.storage_data`` value for a chunk: which file and entry hold it."""

    file: int
    entry: str


def _key(fqn: str, offsets: Any) -> tuple[str, tuple[int, ...]]:
    return fqn, tuple(int(o) for o in offsets)


def build_manifest(metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
    """The manifest for DCP's global metadata and every rank's write results.

    Raises:
        UnsupportedObjectError: a dtype safetensors lacks, or planner data that is not plain data.
        PlatformError: a chunk the planner promised was not written by any rank.
    """
    refs: dict[tuple[str, tuple[int, ...]], ShardRef] = {}
    values: dict[str, ValueRef] = {}
    files: dict[str, ShardFile] = {}
    for per_rank in results:
        for wr in per_rank:
            sd = wr.storage_data
            if isinstance(sd, ValueRef):
                values[wr.index.fqn] = sd
            elif isinstance(sd, ShardRef):
                refs[_key(wr.index.fqn, wr.index.offset or ())] = sd
                files[sd.file] = ShardFile(sd.file, sd.rank, sd.file_bytes, sd.header_digest)
            else:
                raise PlatformError(f"write result for `{printable(wr.index.fqn)}` was not made by CertifiedWriter")
    ordered = sorted(files.values(), key=lambda f: (f.rank, f.name))
    index = {f.name: i for i, f in enumerate(ordered)}
    tensors, vals = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if fqn not in values:
                raise PlatformError(f"value `{printable(fqn)}` was planned but no rank wrote it")
            vals.append(ValueInfo(fqn, values[fqn].node))
            continue
        code = TORCH_TO_ST.get(md.properties.dtype)
        if code is None:
            raise UnsupportedObjectError(
                f"`{printable(fqn)}`: dtype {md.properties.dtype} cannot be stored in safetensors; cast it"
            )
        chunks = []
        for c in md.chunks:
            ref = refs.get(_key(fqn, c.offsets))
            if ref is None:
                raise PlatformError(
                    f"chunk of `{printable(fqn)}` at {list(c.offsets)} was planned but no rank wrote it"
                )
            chunks.append(Chunk(tuple(c.offsets), tuple(c.sizes), index[ref.file], ref.entry, ref.raw))
        shape = tuple(md.size)
        fp = hex64(compose((int(c.raw, 16) for c in chunks), code, shape))
        tensors.append(TensorInfo(fqn, code, shape, bool(md.properties.requires_grad), fp, tuple(chunks)))
    planner_data = None
    if metadata.planner_data is not None:
        planner_data = encode_value(metadata.planner_data, "<planner data>")
    sm = metadata.storage_meta
    storage_meta = None
    if sm is not None:
        storage_meta = {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": [str(m) for m in sm.modules],
        }
    return Manifest(
        files=tuple(ordered),
        tensors=tuple(tensors),
        values=tuple(vals),
        state_fp=state_fp({t.fqn: t.fp for t in tensors}),
        dcp={"version": metadata.version or DCP_VERSION, "planner_data": planner_data, "storage_meta": storage_meta},
    )


def state_mismatch(new: Manifest, held: Manifest) -> str | None:
    """Why the state ``new`` describes is not the one ``held`` stores, or None when it is: the same
    tensors (name, dtype, shape, fingerprint) and the same values. How either is sharded, and DCP's
    own ids for the save, do not matter: a retry on another world size saves the same state."""
    if new.state_fp != held.state_fp:
        return f"state fingerprint {held.state_fp}, this save's {new.state_fp}"
    mine = {t.fqn: (t.dtype, t.shape, t.fp) for t in new.tensors}
    theirs = {t.fqn: (t.dtype, t.shape, t.fp) for t in held.tensors}
    if mine != theirs:
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        return f"tensors that differ: {[printable(k) for k in differ[:5]]}"
    values = {v.fqn: v.node for v in new.values}, {v.fqn: v.node for v in held.values}
    if values[0] != values[1]:
        differ = sorted(k for k in values[0].keys() | values[1].keys() if values[0].get(k) != values[1].get(k))
        return f"values that differ: {[printable(k) for k in differ[:5]]}"
    return None


def to_metadata(manifest: Manifest, *, source: str, load_id: str | None) -> Metadata:
    """DCP's ``Metadata`` rebuilt from a validated manifest; ``storage_data`` maps chunks to ``ChunkRef``."""
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for t in manifest.tensors:
        if t.dtype not in ST_TO_TORCH:
            raise NotACheckpointError(
                f"{source}: tensor `{printable(t.fqn)}` has dtype {t.dtype}, which this torch build lacks;"
                " upgrade torch"
            )
        sdm[t.fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=ST_TO_TORCH[t.dtype], requires_grad=t.requires_grad),
            size=torch.Size(t.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in t.chunks],
        )
        for i, c in enumerate(t.chunks):
            storage[MetadataIndex(t.fqn, c.offsets, i)] = ChunkRef(c.file, c.entry)
    for v in manifest.values:
        sdm[v.fqn] = BytesStorageMetadata()
        storage[MetadataIndex(v.fqn)] = v
    d = manifest.dcp
    pd = d["planner_data"]
    sm = d["storage_meta"]
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=None if pd is None else decode_value(pd, "<planner data>", source),
        storage_data=storage,
        storage_meta=StorageMeta(
            checkpoint_id=sm["checkpoint_id"], save_id=sm["save_id"], load_id=load_id, modules=list(sm["modules"])
        )
        if sm is not None
        else StorageMeta(load_id=load_id),
        version=d["version"],
    )
