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

import json
import os
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedObjectError,
)
from certckpt.format.companions import FILES_KEY, LAYOUT_KEY, companion_problems, companions_of, plain_entry
from certckpt.format.record import RecordFields
from certckpt.format.signing import trusted_keys_from_env
from certckpt.format.verify import inspect, verify
from certckpt.format.writer import SaveResult, save_certified

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


def _file_entry(path: str) -> dict[str, Any]:
    """What the manifest records about one file: a certified file by its header digest, any other by
    the digests of its bytes.

    Raises:
        UnsupportedObjectError: a pickle, or a safetensors file that is not certified.
    """
    name = os.path.basename(path)
    if name.endswith(PICKLED_SUFFIXES):
        raise UnsupportedObjectError(
            f"{path}: a pickled file in a certified checkpoint; whatever wrote it bypassed certckpt (a save-state "
            "pre-hook, or plain Accelerate): write it with certckpt.save, or as JSON, or outside the checkpoint"
        )
    if name.endswith(".safetensors"):
        try:
            info = inspect(path)
        except NotACheckpointError as e:
            raise UnsupportedObjectError(
                f"{path}: a safetensors file without a certckpt record in a certified checkpoint; write it with "
                "certckpt.save"
            ) from e
        return {"bytes": os.path.getsize(path), "header_digest": info.record.header_digest}
    return plain_entry(path)


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
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == MANIFEST_NAME or name.startswith(".") or not os.path.isfile(path):
            continue  # hidden names are writers' temp files
        files[name] = _file_entry(path)
    meta = {LAYOUT_KEY: LAYOUT, FILES_KEY: json.dumps(files, sort_keys=True, separators=(",", ":"))}
    return save_certified(
        state,
        os.path.join(directory, MANIFEST_NAME),
        fields=fields,
        **one_by_one,
        metadata=meta,
        overwrite=False,
    )


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
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        if not os.path.isdir(directory):
            raise CheckpointNotFoundError(f"{directory}: no such checkpoint directory")
        raise _refuse_plain(directory)
    record = inspect(path).record
    if record.user.get(LAYOUT_KEY) != LAYOUT:
        raise NotACheckpointError(
            f"{path}: a certckpt file, but not an Accelerate manifest (layout {record.user.get(LAYOUT_KEY)!r})"
        )
    try:
        files = companions_of(record)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: the manifest's files table is unreadable ({e})") from e
    if files is None:
        raise CorruptCheckpointError(f"{path}: the manifest lists no files")
    return path, files, record.step


@dataclass(kw_only=True, slots=True)
class StateDirReport:
    """The outcome of ``verify_state_dir``.

    Attributes:
        directory: the checkpoint directory.
        ok: the manifest verifies, every file it lists is there and matches, nothing unlisted.
        step: the step the manifest records (None when it could not be read).
        files: the names the manifest lists.
        problems: one line per problem.
    """

    directory: str
    ok: bool = True
    step: int | None = None
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def fail(self, message: str) -> None:
        self.ok = False
        self.problems.append(message)


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
    directory = os.fspath(directory)
    report = StateDirReport(directory=directory)
    try:
        path, files, report.step = manifest_of(directory)
    except CorruptCheckpointError as e:
        report.fail(str(e))
        return report
    report.files = sorted(files)
    keys = trusted_keys_from_env()
    mine = verify(path, trusted_keys=keys)
    for p in mine.problems:
        report.fail(p.message if p.message.startswith(path) else f"{path}: {p.message}")
    if mine.info is not None:
        for problem in companion_problems(path, mine.info.record, trusted_keys=keys):
            report.fail(problem)
    for name in sorted(os.listdir(directory)):
        if name not in files and name != MANIFEST_NAME and name.endswith((".safetensors", *PICKLED_SUFFIXES)):
            report.fail(
                f"{os.path.join(directory, name)}: not listed by the checkpoint's manifest (added after the save);"
                " a load would read it unchecked"
            )
    return report


def require_intact(directory: str) -> StateDirReport:
    """``verify_state_dir`` that raises on the first problem (one line, with the count of the others).

    Raises:
        CorruptCheckpointError: some file does not match the manifest, or is missing.
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.
    """
    report = verify_state_dir(directory)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise CorruptCheckpointError(
            f"refusing to load {directory}: {report.problems[0]}{more}; nothing was loaded: load another "
            "checkpoint (`certckpt latest-good STORE --dir`)"
        )
    return report
