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
from certckpt.format.companions import FILES_KEY, LAYOUT_KEY, companion_problems, companions_of
from certckpt.format.record import RecordFields
from certckpt.format.signing import trusted_keys_from_env
from certckpt.format.verify import inspect, verify
from certckpt.format.writer import SaveResult, save_certified

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


def _listing(directory: str) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == MANIFEST_NAME or name.startswith("."):
            continue  # hidden names are writers' temp files
        if not os.path.isfile(path) or os.path.islink(path):
            raise UnsupportedObjectError(
                f"{path}: not a regular file in a DeepSpeed checkpoint (NVMe-offloaded tensors and links are "
                "not certified); certify_engine supports checkpoints whose files DeepSpeed writes through its "
                "checkpoint engine"
            )
        try:
            info = inspect(path)
        except NotACheckpointError as e:
            raise UnsupportedObjectError(
                f"{path}: not a certified file in a certified DeepSpeed checkpoint (written by something "
                "other than the certified checkpoint engine); remove what writes it"
            ) from e
        files[name] = {"bytes": os.path.getsize(path), "header_digest": info.record.header_digest}
    return files


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
    files = _listing(directory)
    meta = {LAYOUT_KEY: LAYOUT, FILES_KEY: json.dumps(files, sort_keys=True, separators=(",", ":"))}
    return save_certified(
        state,
        os.path.join(directory, MANIFEST_NAME),
        fields=fields,
        **one_by_one,
        metadata=meta,
        overwrite=False,
    )


def manifest_of(directory: str) -> tuple[str, dict[str, dict[str, Any]], int | None]:
    """``(manifest path, files table, step)`` from the manifest's header (no data read).

    Raises:
        CheckpointNotFoundError: no such directory.
        NotACheckpointError: no manifest (plain DeepSpeed's pickles, or not a checkpoint at all).
        CorruptCheckpointError: the manifest's files table is damaged.
    """
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        if not os.path.isdir(directory):
            raise CheckpointNotFoundError(f"{directory}: no such DeepSpeed checkpoint directory")
        pickles = sorted(n for n in os.listdir(directory) if is_pickle(os.path.join(directory, n)))
        if pickles:
            more = f" and {len(pickles) - 1} more" if len(pickles) > 1 else ""
            raise NotACheckpointError(
                f"{directory}: written by plain DeepSpeed ({pickles[0]}{more} are pickles, never unpickled by "
                f"certckpt); {CONVERT_HINT}"
            )
        raise NotACheckpointError(f"{directory}: no {MANIFEST_NAME}: not a certified DeepSpeed checkpoint")
    info = inspect(path)
    if info.record.user.get(LAYOUT_KEY) != LAYOUT:
        raise NotACheckpointError(f"{path}: a certckpt file, but not a DeepSpeed manifest")
    try:
        files = companions_of(info.record)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: the manifest's files table is unreadable ({e})") from e
    if files is None:
        raise CorruptCheckpointError(f"{path}: the manifest lists no files")
    return path, files, info.record.step


@dataclass(kw_only=True, slots=True)
class DirectoryReport:
    """The outcome of ``verify_checkpoint``.

    Attributes:
        directory: the tag directory.
        ok: the manifest verifies, every file it lists is there and matches, and nothing is added.
        step: the step the manifest records (None when unreadable).
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


def verify_checkpoint(directory: str) -> DirectoryReport:
    """Check a certified DeepSpeed tag directory: the manifest's bytes, every rank's file it lists
    (present, same size, same digests, verified whole), and no file added since. With
    ``$CERTCKPT_TRUSTED_KEYS``, signatures are required too.

    Raises:
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.

    Example:
        >>> verify_checkpoint("ckpt/step10").ok
    """
    directory = os.fspath(directory)
    report = DirectoryReport(directory=directory)
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
        if name not in files and name != MANIFEST_NAME and not name.startswith("."):
            report.fail(
                f"{os.path.join(directory, name)}: not listed by the checkpoint's manifest (added after the save)"
            )
    return report


def require_intact(directory: str) -> DirectoryReport:
    """``verify_checkpoint`` that raises on the first problem (one line, with the count of the others).

    Raises:
        CorruptCheckpointError: some rank's file is missing, added or does not match the manifest.
        NotACheckpointError, CheckpointNotFoundError: nothing certified there.
    """
    report = verify_checkpoint(directory)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise CorruptCheckpointError(
            f"refusing to load {directory}: {report.problems[0]}{more}; load another checkpoint "
            "(`certckpt latest-good SAVE_DIR --accept verified`)"
        )
    return report
