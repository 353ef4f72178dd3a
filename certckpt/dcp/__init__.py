"""Certified sharded checkpoints for ``torch.distributed.checkpoint`` (FSDP2, HSDP, DTensor).

``dcp.save(state, storage_writer=CertifiedWriter(url))`` writes every rank's shards as a certified
safetensors file and, last, a certified manifest; ``dcp.load(state, storage_reader=
CertifiedReader(url))`` checks every byte it reads, on any sharding. ``verify_checkpoint`` /
``inspect_checkpoint`` check and describe such a directory without torch (``deep`` imports it).

Public names are imported on first use: ``certckpt verify DIR`` loads the torch-free checker only.
The layout and the sharding-independent fingerprint are specified in ``docs/format.md``.

Example::

    import torch.distributed.checkpoint as dcp
    from certckpt.dcp import CertifiedReader, CertifiedWriter
    dcp.save(state, storage_writer=CertifiedWriter("ckpt/step100", step=100))
    dcp.load(state, storage_reader=CertifiedReader("ckpt/step100"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it (relative to this package, or the format layer's checker)
_LAZY = {
    "CertifiedWriter": "writer",
    "CertifiedReader": "reader",
    "verify_checkpoint": "certckpt.format.sharded.check",
    "inspect_checkpoint": "certckpt.format.sharded.check",
    "ShardedReport": "certckpt.format.sharded.check",
    "Manifest": "certckpt.format.sharded.manifest",
    "read_manifest": "certckpt.format.sharded.manifest",
    "state_fingerprints": "sharded",
    "StateFingerprints": "sharded",
}

__all__ = [
    "CertifiedWriter",
    "CertifiedReader",
    "verify_checkpoint",
    "inspect_checkpoint",
    "ShardedReport",
    "Manifest",
    "read_manifest",
    "state_fingerprints",
    "StateFingerprints",
]

if TYPE_CHECKING:  # pragma: no cover
    from certckpt.format.sharded.check import ShardedReport, inspect_checkpoint, verify_checkpoint
    from certckpt.format.sharded.manifest import Manifest, read_manifest

    from .reader import CertifiedReader
    from .sharded import StateFingerprints, state_fingerprints
    from .writer import CertifiedWriter


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certckpt.dcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module if "." in module else f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
