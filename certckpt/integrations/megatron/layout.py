"""What a certified Megatron-Core checkpoint directory holds, and the reading of its companion files.

A directory that ``dist_checkpointing.save(..., sharded_strategy=CertifiedSaveStrategy(...))`` wrote:

- ``shard-RRRRR.safetensors`` and ``manifest.safetensors``: the ShardedTensors, as a certified DCP
  checkpoint (``certckpt.dcp``): each rank's chunks, and the manifest with every global tensor's
  sharding-independent fingerprint, written last;
- ``common.safetensors`` (rank 0): the common state Megatron would have pickled into ``common.pt``;
- ``objects-RRRRR.safetensors``: rank R's ShardedObjects (main replicas), by their unique keys;
- ``metadata.json``: Megatron's own marker (which strategy reads the directory), plain JSON.

The manifest's record lists the last three kinds as companion files (``format.companions``: a certified
file by its header digest, ``metadata.json`` by its size and digests), so ``certckpt verify DIR``,
``status`` and ``latest-good`` check them with the shards. No torch import here.
"""

from __future__ import annotations

import json
from typing import Any

from certckpt.errors import CertckptError, CorruptCheckpointError, NotACheckpointError
from certckpt.format.companions import FILES_KEY, LAYOUT_KEY, check_companions, companions_of
from certckpt.format.sharded.check import ShardedReport, verify_checkpoint
from certckpt.format.sharded.layout import MANIFEST_NAME, exists, join
from certckpt.format.sharded.manifest import Manifest, read_manifest
from certckpt.format.verify import inspect

__all__ = [
    "BACKEND",
    "VERSION",
    "LAYOUT",
    "COMMON_NAME",
    "CONFIG_NAME",
    "OBJECTS_KEY",
    "objects_name",
    "plain_megatron_refusal",
    "Companions",
    "read_companions",
    "verify_checkpoint",
    "ShardedReport",
]

BACKEND = "certckpt_dist"  # the sharded backend metadata.json names: Megatron looks its load strategy up by it
VERSION = 1
LAYOUT = "megatron-dist"  # the manifest record's companion layout
COMMON_NAME = "common.safetensors"
CONFIG_NAME = "metadata.json"
OBJECTS_KEY = "certckpt.megatron.objects"  # manifest record key: {ShardedObject unique key: file name}


def objects_name(rank: int) -> str:
    """The file rank ``rank`` writes its ShardedObjects to."""
    return f"objects-{rank:05d}.safetensors"


def plain_megatron_refusal(where: str, backend: str) -> NotACheckpointError:
    """The one line for a directory plain Megatron wrote (``torch_dist``: DCP's pickled ``.metadata``,
    ``common.pt``): what it is, that certckpt never unpickles it, and how to bring it in."""
    return NotACheckpointError(
        f"refusing to load: {where} was written by plain Megatron-Core dist_checkpointing (backend {backend!r}:"
        " .metadata and common.pt are pickles, never unpickled by certckpt); to bring it in, load it once with"
        " plain Megatron in a process you trust (dist_checkpointing.load without a certckpt strategy) and save it"
        " with sharded_strategy=CertifiedSaveStrategy(...)"
    )


class Companions:
    """The companion table of a committed directory, checked: which file holds the common state, which
    holds each ShardedObject, and the header digest each certified one must have; and the manifest
    it was read from (parsed, every byte checked), which the DCP reader can reuse (``handoff``)."""

    def __init__(
        self, location: str, files: dict[str, dict[str, Any]], objects: dict[str, str], *, manifest: Manifest
    ) -> None:
        self.location = location
        self.files = files
        self.objects = objects
        self.manifest = manifest

    def certified(self, name: str) -> str:
        """The path of the listed certified file ``name``, after checking it is the file the manifest
        names (its header digest and size; the reader then checks every tensor's digest).

        Raises:
            CorruptCheckpointError: not listed, missing, or another file.
        """
        want = self.files.get(name)
        path = join(self.location, name)
        if want is None or "header_digest" not in want:
            raise CorruptCheckpointError(f"{path}: the manifest does not list it; the checkpoint is incomplete")
        try:
            record = inspect(path).record
        except CorruptCheckpointError:
            raise
        except CertckptError as e:  # missing or unreadable: the store says which
            raise CorruptCheckpointError(
                f"{path}: listed in the manifest, cannot be read ({e}); restore this checkpoint from a good copy"
            ) from e
        if record.header_digest != want["header_digest"]:
            raise CorruptCheckpointError(
                f"{path}: not the file the manifest names (header digest {record.header_digest}, expected"
                f" {want['header_digest']}): it was replaced after the checkpoint was committed"
            )
        return path


def read_companions(location: str, *, check: bool) -> Companions | None:
    """The companion table of the certified directory at ``location``; None when it holds no manifest.
    With ``check``, every companion is first checked whole (``format.companions``), one error naming
    the first problem.

    Raises:
        CorruptCheckpointError: a damaged manifest, table, or (``check``) companion file.
    """
    if not exists(join(location, MANIFEST_NAME)):
        return None
    manifest, info = read_manifest(location)
    record = info.record
    try:
        files = companions_of(record) or {}
        objects = json.loads(record.user.get(OBJECTS_KEY, "{}"))
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{location}/{MANIFEST_NAME}: its table of Megatron files is unreadable ({e})"
        ) from e
    if record.user.get(LAYOUT_KEY) != LAYOUT or FILES_KEY not in record.user:
        raise NotACheckpointError(
            f"{location}: a certified sharded checkpoint, but not one written through Megatron's"
            " dist_checkpointing (no common state); load it with certckpt.dcp.CertifiedReader"
        )
    if not (isinstance(objects, dict) and all(isinstance(k, str) and v in files for k, v in objects.items())):
        raise CorruptCheckpointError(f"{location}/{MANIFEST_NAME}: its ShardedObject index names unlisted files")
    if check:
        problems = check_companions(join(location, MANIFEST_NAME), record).problems
        if problems:
            raise CorruptCheckpointError(f"{problems[0]}; nothing was loaded")
    return Companions(location, files, objects, manifest=manifest)
