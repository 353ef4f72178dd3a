"""The certified layout of a Hugging Face ``Trainer`` checkpoint directory, and its check.

``checkpoint-N/`` holds, beside what ``save_pretrained`` writes as plain data (``config.json``,
``generation_config.json``, tokenizer files)::

    model.safetensors            certified (or model-0000k-of-0000n.safetensors + their index):
                                 any safetensors reader, from_pretrained included, loads them
    rng_state.safetensors        certified: Python, numpy, torch (and CUDA) RNG states; one per
                                 process under DDP, rng_state_<rank>.safetensors
    trainer_state.json           the Trainer's own JSON, unchanged (the Trainer reads it on resume)
    training_args.json           TrainingArguments.to_json_string(): data, never pickled
    trainer.safetensors          written last, and the file the ledger commits: the optimizer,
                                 scheduler and gradient-scaler states, and in its certified record
                                 the size and digest of every other file of the directory

So one commit record covers the whole directory: the manifest's own bytes verify against its digests,
and every other file must match the digest the manifest gives it (a certified file by its header
digest, which covers each tensor's xxh3-128; any other file by the xxh3-128 of its bytes). Nothing
here is pickled; a pickle in the directory is refused before the commit. No transformers import.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from certckpt.errors import CorruptCheckpointError, NotACheckpointError
from certckpt.format.companions import FILES_KEY
from certckpt.format.manifestdir import ManifestDir, ManifestDirReport, entry_of, read_manifest, verify_directory
from certckpt.format.manifestdir import leftover_problem as _leftover_problem
from certckpt.format.manifestdir import require_intact as _require
from certckpt.format.manifestdir import write_manifest as _write
from certckpt.format.record import CheckpointRecord, RecordFields
from certckpt.format.writer import SaveResult

__all__ = [
    "MANIFEST_NAME",
    "ARGS_NAME",
    "LAYOUT",
    "PICKLED_SUFFIXES",
    "rng_file_name",
    "file_entry",
    "write_manifest",
    "CheckpointReport",
    "verify_checkpoint",
    "require_intact",
    "manifest_of",
    "leftover_problem",
]

MANIFEST_NAME = "trainer.safetensors"
ARGS_NAME = "training_args.json"
LAYOUT = "certckpt-hf-trainer/1"  # the record's ``user["layout"]``: what this directory is
_FILES_KEY = FILES_KEY  # the record's ``user["files"]``: JSON {name: entry} of every other file
PICKLED_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
# What the plain Trainer writes with torch.save: named when someone resumes from such a directory.
_PLAIN_TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")


def rng_file_name(process_index: int, world_size: int) -> str:
    """The RNG file of one process (the Trainer's own naming, with a certified suffix)."""
    return "rng_state.safetensors" if world_size <= 1 else f"rng_state_{process_index}.safetensors"


def file_entry(path: str) -> dict[str, Any]:
    """What the manifest records about one file: a certified file by its header digest, any other
    file by the digest of its bytes.

    Raises:
        UnsupportedObjectError: the file is a pickle, or a safetensors file that is not certified.
    """
    return entry_of(path, _DIR)


def write_manifest(
    directory: str,
    state: dict[str, Any],
    fields: RecordFields | None = None,
    **one_by_one: Any,
) -> SaveResult:
    """Describe every file of ``directory`` and write the manifest (create-only), holding ``state``.

    Call it last: a file written after it is not covered (and not listed).

    Args:
        fields: the record's fields (``RecordFields``: step, run, branch, parent, ...), or give them
            one by one, as ``save_certified`` takes them.

    Raises:
        UnsupportedObjectError: a pickle or an uncertified safetensors file is in the directory.
        CheckpointExistsError: the manifest exists already.
    """
    return _write(directory, _DIR, state, fields, **one_by_one)


class CheckpointReport(ManifestDirReport):
    """The outcome of ``verify_checkpoint`` (its attributes: ``ManifestDirReport``)."""

    __slots__ = ()


def manifest_of(directory: str) -> tuple[str, dict[str, dict[str, Any]], int | None]:
    """``(manifest path, files table, step)`` from the manifest's header (no data read).

    Raises:
        NotACheckpointError: no manifest (a plain Trainer checkpoint, or not a checkpoint at all), or
            a certified file that is not a Trainer manifest.
        CorruptCheckpointError: the manifest's header or its files table is damaged.
    """
    return read_manifest(directory, _DIR)


def _refuse_plain(directory: str) -> NotACheckpointError:
    plain = [n for n in _PLAIN_TRAINER_FILES if os.path.exists(os.path.join(directory, n))]
    what = (
        f"it was written by the plain Trainer ({', '.join(plain)} are pickles)"
        if plain
        else "not a certified Trainer checkpoint"
    )
    return NotACheckpointError(
        f"{directory}: no {MANIFEST_NAME}: {what}; resume only from checkpoints written by "
        "certckpt.integrations.transformers.CertifiedTrainer"
    )


def _files_table(path: str, record: CheckpointRecord) -> dict[str, dict[str, Any]]:
    try:
        files = json.loads(record.user[_FILES_KEY])
        ok = isinstance(files, dict) and all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("bytes"), int) for k, v in files.items()
        )
    except (KeyError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: the manifest's files table is unreadable ({e})") from e
    if not ok:
        raise CorruptCheckpointError(f"{path}: the manifest's files table is malformed")
    for name in files:
        # Names read from a file are input: each must be a plain name inside this directory.
        if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise CorruptCheckpointError(f"{path}: the manifest lists {name[:80]!r}, which is not a plain file name")
    return files


# Files a Trainer (or from_pretrained) resume would read if they were there: weights, their indexes,
# optimizer, scheduler, scaler and RNG state, configs. One the manifest does not list was added after
# the save (or by someone else): a resume refuses the directory rather than load it unchecked.
_LOADER_READS = re.compile(
    r".*\.(safetensors|bin|pt|pth|ckpt|index\.json)$|(config|generation_config|trainer_state)\.json$"
)


def verify_checkpoint(directory: str) -> CheckpointReport:
    """Check a certified Trainer checkpoint directory: the manifest's bytes, every file it lists
    (present, same size, same digest), and that no file a resume would read is there unlisted. With
    ``$CERTCKPT_TRUSTED_KEYS``, the manifest and the certified files must be signed by those keys.

    Raises:
        NotACheckpointError, CheckpointNotFoundError: there is nothing certified to check.

    Example:
        >>> report = verify_checkpoint("out/checkpoint-500")
        >>> report.ok, report.problems
    """
    return verify_directory(directory, _DIR, CheckpointReport)


def require_intact(directory: str) -> CheckpointReport:
    """``verify_checkpoint`` that raises on the first problem (one line, with the count of the others).

    Raises:
        CorruptCheckpointError: some file does not match the manifest.
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.
    """
    return _require(verify_checkpoint(directory), _DIR)


def leftover_problem(directory: str, *, run: str | None, step: int) -> str | None:
    """None when ``checkpoint-N/`` is what an uncommitted save of ``run`` at ``step`` left (no
    manifest, every certified file of that run and step); otherwise why it is not this run's to remove."""
    return _leftover_problem(directory, _DIR, run=run, step=step)


_DIR = ManifestDir(
    manifest=MANIFEST_NAME,
    layout=LAYOUT,
    foreign="{path}: a certckpt file, but not a Trainer manifest (layout {layout!r})",
    refuse_plain=_refuse_plain,
    table=_files_table,
    must_list=_LOADER_READS.fullmatch,
    unlisted_note="a resume would read it unchecked",
    pickled=PICKLED_SUFFIXES,
    pickle_note="(the certified Trainer writes none): remove what writes it, or save it as safetensors or JSON",
    uncertified="a safetensors file without a certckpt record in a certified checkpoint; write it with "
    "certckpt.save (or certckpt.integrations.transformers.save_pretrained for a model)",
    action="resume from",
    advice="resume from another checkpoint (`certckpt latest-good STORE --accept verified`)",
)
