"""A restored sharded checkpoint as whole tensors, in one process, without torch.distributed: what a
restore drill loads into a freshly built model.

Each shard file is read with the format's reader (every digest checked), each global tensor is put
together from its chunks where the manifest places them, and its fingerprint v1 is recomputed and
matched against the manifest's (which composes from the chunks, whoever wrote them): an assembly
error cannot pass for a good model. Imports torch (the drill imports this module when it runs).
"""

from __future__ import annotations

from typing import Any

import torch

from certckpt.errors import CorruptCheckpointError
from certckpt.format.fingerprinting import fingerprint_hex
from certckpt.format.reader import load
from certckpt.format.sharded.layout import join
from certckpt.format.sharded.manifest import read_manifest

__all__ = ["assemble_sharded", "model_entries"]


def assemble_sharded(directory: str) -> dict[str, torch.Tensor]:
    """Every global tensor of the sharded checkpoint in ``directory``, whole, on the CPU, by fqn.

    Raises:
        CorruptCheckpointError: a chunk is missing from its shard file, has another shape, or a
            put-together tensor's fingerprint is not the manifest's.
    """
    manifest, _ = read_manifest(directory)
    shards: dict[int, dict[str, Any]] = {}
    out: dict[str, torch.Tensor] = {}
    for t in manifest.tensors:
        whole: torch.Tensor | None = None
        for c in t.chunks:
            if c.file not in shards:
                shards[c.file] = load(join(directory, manifest.files[c.file].name), map_location="cpu")
            piece = shards[c.file].get(c.entry)
            if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != tuple(c.sizes):
                raise CorruptCheckpointError(
                    f"{directory}/{manifest.files[c.file].name}: holds no chunk {c.entry!r} of shape {list(c.sizes)}"
                    f" for `{t.fqn}`"
                )
            if len(t.chunks) == 1 and tuple(c.sizes) == tuple(t.shape):
                whole = piece
                break
            if whole is None:
                whole = torch.empty(t.shape, dtype=piece.dtype)
            whole[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = piece
        if whole is None:  # a tensor with no chunks: only an empty one partitions that way
            raise CorruptCheckpointError(f"{directory}: `{t.fqn}` has no stored chunks")
        found = fingerprint_hex(whole)
        if found != t.fp:
            raise CorruptCheckpointError(
                f"{directory}: `{t.fqn}` put together from its chunks has fingerprint {found}, the manifest says {t.fp}"
            )
        out[t.fqn] = whole
    return out


def model_entries(state: dict[str, torch.Tensor], key: str | None) -> dict[str, torch.Tensor]:
    """The model's entries of a flattened state: those under ``key`` (default ``model`` when any
    entry is), with the prefix taken off; else the whole state."""
    prefix = f"{key or 'model'}."
    inner = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if inner or key is not None:
        return inner
    return state
