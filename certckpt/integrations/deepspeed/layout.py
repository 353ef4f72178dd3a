"""The certified layout of a DeepSpeed checkpoint directory (``SAVE_DIR/<tag>/``), and its check.

DeepSpeed names the files of a tag and finds them again by those names, so they keep them; each is a
certified safetensors file (the ``.pt`` suffix is DeepSpeed's; nothing in them is pickled)::

    mp_rank_00_model_states.pt                     ZeRO-1/2: the module's weights, the scheduler, the
                                                   engine's counters (written by data-parallel rank 0)
    zero_pp_rank_<r>_mp_rank_00_model_states.pt    ZeRO-3: one per rank (the module's placeholders,
                                                   the scheduler, the counters)
    zero_pp_rank_<r>_mp_rank_00_optim_states.pt    every stage: rank r's partition of the fp32 master
                                                   weights and of the optimizer state
    certckpt-deepspeed.safetensors                 written last, once every rank's files are on disk:
                                                   the manifest, the file the ledger commits; its
                                                   record lists every other file of the tag by size
                                                   and header digest

So one commit record covers every rank's files: a missing, added or edited rank file fails the whole
directory. ``SAVE_DIR/latest`` and ``SAVE_DIR/zero_to_fp32.py`` lie outside the tag and are not part
of it (a certified load never reads ``latest``: it takes latest-good). No torch import.
"""

from __future__ import annotations

import os
from typing import Any

from certckpt.errors import NotACheckpointError
from certckpt.format.manifestdir import ManifestDir, ManifestDirReport, read_manifest, verify_directory
from certckpt.format.manifestdir import leftover_problem as _leftover_problem
from certckpt.format.manifestdir import require_intact as _require
from certckpt.format.manifestdir import write_manifest as _write
from certckpt.format.record import RecordFields
from certckpt.format.writer import SaveResult

__all__ = [
    "MANIFEST_NAME",
    "LAYOUT",
    "CONVERT_HINT",
    "DirectoryReport",
    "write_manifest",
    "manifest_of",
    "verify_checkpoint",
    "require_intact",
    "is_pickle",
    "leftover_problem",
]

MANIFEST_NAME = "certckpt-deepspeed.safetensors"
LAYOUT = "certckpt-deepspeed/1"
CONVERT_HINT = (
    "to convert it, load it once with plain DeepSpeed in a process you trust (engine.load_checkpoint "
    "before certify_engine(engine)), then certify_engine(engine) and engine.save_checkpoint(NEW_DIR)"
)
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip container; a legacy pickle's PROTO opcode


def is_pickle(path: str) -> bool:
    """Whether the file starts as ``torch.save`` output does (read 4 bytes; never unpickled)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return any(head.startswith(m) for m in _PICKLE_MAGIC)


def write_manifest(
    directory: str,
    state: dict[str, Any],
    fields: RecordFields | None = None,
    **one_by_one: Any,
) -> SaveResult:
    """List every file of the tag directory and write the manifest (create-only), holding ``state``.

    Args:
        fields: the record's fields (``RecordFields``: step, run, branch, parent, ...), or give them
            one by one, as ``save_certified`` takes them.

    Raises:
        UnsupportedObjectError: a file there is not certified, or not a regular file.
        CheckpointExistsError: the manifest exists already.
    """
    return _write(directory, _DIR, state, fields, **one_by_one)


def _refuse_plain(directory: str) -> NotACheckpointError:
    pickles = sorted(n for n in os.listdir(directory) if is_pickle(os.path.join(directory, n)))
    if pickles:
        more = f" and {len(pickles) - 1} more" if len(pickles) > 1 else ""
        return NotACheckpointError(
            f"{directory}: written by plain DeepSpeed ({pickles[0]}{more} are pickles, never unpickled by "
            f"certckpt); {CONVERT_HINT}"
        )
    return NotACheckpointError(f"{directory}: no {MANIFEST_NAME}: not a certified DeepSpeed checkpoint")


def manifest_of(directory: str) -> tuple[str, dict[str, dict[str, Any]], int | None]:
    """``(manifest path, files table, step)`` from the manifest's header (no data read).

    Raises:
        CheckpointNotFoundError: no such directory.
        NotACheckpointError: no manifest (plain DeepSpeed's pickles, or not a checkpoint at all).
        CorruptCheckpointError: the manifest's files table is damaged.
    """
    return read_manifest(directory, _DIR)


class DirectoryReport(ManifestDirReport):
    """The outcome of ``verify_checkpoint`` (its attributes: ``ManifestDirReport``)."""

    __slots__ = ()


def verify_checkpoint(directory: str) -> DirectoryReport:
    """Check a certified DeepSpeed tag directory: the manifest's bytes, every rank's file it lists
    (present, same size, same digests, verified whole), and no file added since. With
    ``$CERTCKPT_TRUSTED_KEYS``, signatures are required too.

    Raises:
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.

    Example:
        >>> verify_checkpoint("ckpt/step10").ok
    """
    return verify_directory(directory, _DIR, DirectoryReport)


def require_intact(directory: str) -> DirectoryReport:
    """``verify_checkpoint`` that raises on the first problem (one line, with the count of the others).

    Raises:
        CorruptCheckpointError: some rank's file is missing, added or does not match the manifest.
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.
    """
    return _require(verify_checkpoint(directory), _DIR)


def leftover_problem(directory: str, *, run: str | None, step: int) -> str | None:
    """None when a tag directory is what an uncommitted save of ``run`` at ``step`` left (no manifest,
    every file certified, of that run and step); otherwise why it is not this run's to remove."""
    return _leftover_problem(directory, _DIR, run=run, step=step)


_DIR = ManifestDir(
    manifest=MANIFEST_NAME,
    layout=LAYOUT,
    missing_dir="{directory}: no such DeepSpeed checkpoint directory",
    foreign="{path}: a certckpt file, but not a DeepSpeed manifest",
    refuse_plain=_refuse_plain,
    must_list=lambda name: not name.startswith("."),
    certified_only=True,
    uncertified="not a certified file in a certified DeepSpeed checkpoint (written by something other than the "
    "certified checkpoint engine); remove what writes it",
    irregular="{path}: not a regular file in a DeepSpeed checkpoint (NVMe-offloaded tensors and links are not "
    "certified); certify_engine supports checkpoints whose files DeepSpeed writes through its checkpoint engine",
    advice="load another checkpoint (`certckpt latest-good SAVE_DIR --accept verified`)",
)
