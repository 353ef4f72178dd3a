"""The certified layout of an Accelerate ``save_state`` directory, and its check.

What plain ``Accelerator.save_state`` pickles, this layout writes as certified safetensors files::

    model.safetensors, model_1.safetensors      weights (each prepared model's state dict)
    optimizer.safetensors, optimizer_1...       optimizer states         (plain: optimizer.bin, pickled)
    scheduler.safetensors, scheduler_1...       scheduler states         (plain: scheduler.bin, pickled)
    custom_checkpoint_<i>.safetensors           register_for_checkpointing objects' state dicts (plain: .pkl)
    random_states_<rank>.safetensors            one per process: Python, numpy, torch (and CUDA) RNG states
    accelerate_state.safetensors                written last, the file the ledger commits: the
                                                accelerator's step, the world size, the samplers',
                                                dataloaders' and gradient scaler's states, and in its
                                                record the size and digest of every other file

One commit record therefore covers the whole directory (``certckpt.format.companions``): the
manifest's bytes verify against its digests, and every other file must match the digest the manifest
gives it. Nothing is pickled and nothing is unpickled; a directory written by plain Accelerate is
refused with the way to convert it. No accelerate import.
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
    "PICKLED_SUFFIXES",
    "indexed_name",
    "rng_file_name",
    "write_manifest",
    "StateDirReport",
    "verify_state_dir",
    "require_intact",
    "manifest_of",
    "plain_accelerate_files",
    "leftover_problem",
]

MANIFEST_NAME = "accelerate_state.safetensors"
LAYOUT = "certckpt-accelerate/1"  # the record's ``user["layout"]``: what this directory is
PICKLED_SUFFIXES = (".bin", ".pkl", ".pt", ".pth", ".pickle", ".ckpt")
# What plain Accelerate's save_state writes with torch.save (pickles): named when such a directory is
# loaded, so that the user learns what it is and how to convert it.
_PLAIN_PREFIXES = (
    "optimizer",
    "scheduler",
    "sampler",
    "random_states_",
    "custom_checkpoint_",
    "scaler",
    "pytorch_model",
    "dl_state_dict",
)


def indexed_name(stem: str, i: int) -> str:
    """Accelerate's naming of the i-th object of a kind, with a certified suffix (``optimizer``,
    ``optimizer_1``...)."""
    return f"{stem}.safetensors" if i == 0 else f"{stem}_{i}.safetensors"


def rng_file_name(process_index: int) -> str:
    """The RNG file of one process (Accelerate's ``random_states_<i>.pkl``, certified)."""
    return f"random_states_{process_index}.safetensors"


def plain_accelerate_files(directory: str) -> list[str]:
    """The pickled files plain Accelerate writes that are in ``directory`` (sorted)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(PICKLED_SUFFIXES) and n.startswith(_PLAIN_PREFIXES))


def write_manifest(
    directory: str,
    state: dict[str, Any],
    fields: RecordFields | None = None,
    **one_by_one: Any,
) -> SaveResult:
    """Describe every file of ``directory`` and write the manifest (create-only), holding ``state``.

    Call it last, once every rank's files are written: a file written after it is not covered.

    Args:
        fields: the record's fields (``RecordFields``: step, run, branch, parent, ...), or give them
            one by one, as ``save_certified`` takes them.

    Raises:
        UnsupportedObjectError: a pickle or an uncertified safetensors file is in the directory.
        CheckpointExistsError: the manifest exists already.
    """
    return _write(directory, _DIR, state, fields, **one_by_one)


def _refuse_plain(directory: str) -> NotACheckpointError:
    plain = plain_accelerate_files(directory)
    if plain:
        shown = ", ".join(plain[:4]) + (f" and {len(plain) - 4} more" if len(plain) > 4 else "")
        return NotACheckpointError(
            f"{directory}: written by plain Accelerate ({shown} are pickles, and certckpt never unpickles); "
            "to convert a directory you trust, load it once with a plain `Accelerator().load_state(DIR)` and "
            "save it with `CertifiedAccelerator(...).save_state(NEW_DIR)` (single files: `certckpt certify FILE "
            "NEW.safetensors`)"
        )
    return NotACheckpointError(
        f"{directory}: no {MANIFEST_NAME}: not a certified Accelerate checkpoint; load only directories written by "
        "certckpt.integrations.accelerate.CertifiedAccelerator.save_state"
    )


def manifest_of(directory: str) -> tuple[str, dict[str, dict[str, Any]], int | None]:
    """``(manifest path, files table, step)`` from the manifest's header (no data read).

    Raises:
        CheckpointNotFoundError: no such directory.
        NotACheckpointError: no manifest (a plain Accelerate directory: its pickles are named), or a
            certified file that is not an Accelerate manifest.
        CorruptCheckpointError: the manifest's header or its files table is damaged.
    """
    return read_manifest(directory, _DIR)


class StateDirReport(ManifestDirReport):
    """The outcome of ``verify_state_dir`` (its attributes: ``ManifestDirReport``)."""

    __slots__ = ()


def verify_state_dir(directory: str) -> StateDirReport:
    """Check a certified Accelerate checkpoint directory as a whole: the manifest's bytes, every file
    it lists (present, same size, same digest: a missing rank's RNG file, a swapped or edited file
    fails), and no pickle or safetensors file there that it does not list. With
    ``$CERTCKPT_TRUSTED_KEYS``, the manifest and the certified files must be signed by those keys.

    Raises:
        NotACheckpointError, CheckpointNotFoundError: there is nothing certified to check.

    Example:
        >>> report = verify_state_dir("proj/checkpoints/checkpoint_3")
        >>> report.ok, report.problems
    """
    return verify_directory(directory, _DIR, StateDirReport)


def require_intact(directory: str) -> StateDirReport:
    """``verify_state_dir`` that raises on the first problem (one line, with the count of the others).

    Raises:
        CorruptCheckpointError: some file does not match the manifest, or is missing.
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.
    """
    return _require(verify_state_dir(directory), _DIR)


def leftover_problem(directory: str, *, run: str | None, step: int) -> str | None:
    """None when a ``save_state`` directory is what an uncommitted save of ``run`` at ``step`` left
    (no manifest, every certified file of that run and step); otherwise why it is not this run's."""
    return _leftover_problem(directory, _DIR, run=run, step=step)


_DIR = ManifestDir(
    manifest=MANIFEST_NAME,
    layout=LAYOUT,
    foreign="{path}: a certckpt file, but not an Accelerate manifest (layout {layout!r})",
    refuse_plain=_refuse_plain,
    must_list=lambda name: name.endswith((".safetensors", *PICKLED_SUFFIXES)),
    unlisted_note="a load would read it unchecked",
    pickled=PICKLED_SUFFIXES,
    pickle_note="(a save-state pre-hook, or plain Accelerate): write it with certckpt.save, or as JSON, or outside "
    "the checkpoint",
    uncertified="a safetensors file without a certckpt record in a certified checkpoint; write it with certckpt.save",
    advice="nothing was loaded: load another checkpoint (`certckpt latest-good STORE --dir`)",
)
