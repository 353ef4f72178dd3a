"""A certified checkpoint directory with a manifest: one certified file, written last, whose record
lists every other file of its directory by size and digest (``certckpt.format.companions``), so that
one commit record covers the whole directory. The Hugging Face Trainer's ``checkpoint-N/``, an
Accelerate ``save_state`` directory and a DeepSpeed tag directory are each one such layout; what
differs between them (the manifest's name, which files must be listed, how a plain, pickled
directory is refused, the words of each message) is a ``ManifestDir``. No torch import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from certckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedObjectError,
)

from .companions import FILES_KEY, LAYOUT_KEY, companion_problems, companions_of, plain_entry
from .record import CheckpointRecord, RecordFields
from .signing import trusted_keys_from_env
from .verify import inspect, verify
from .writer import SaveResult, save_certified

__all__ = [
    "ManifestDir",
    "ManifestDirReport",
    "listed_files",
    "entry_of",
    "files_of",
    "write_manifest",
    "read_manifest",
    "verify_directory",
    "require_intact",
    "leftover_problem",
]

FilesTable = dict[str, dict[str, Any]]


def listed_files(path: str, record: CheckpointRecord) -> FilesTable:
    """The files table of the manifest at ``path`` (``companions_of``), as ``read_manifest`` reads it.

    Raises:
        CorruptCheckpointError: the table is unreadable, or lists no files.
    """
    try:
        files = companions_of(record)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: the manifest's files table is unreadable ({e})") from e
    if files is None:
        raise CorruptCheckpointError(f"{path}: the manifest lists no files")
    return files


@dataclass(frozen=True, kw_only=True, slots=True)
class ManifestDir:
    """One framework's certified directory: what its manifest is, and the words of its refusals.

    Attributes:
        manifest: the manifest's file name in the directory.
        layout: the manifest record's ``user["layout"]``.
        foreign: the refusal of a certified manifest of another layout, formatted with ``path`` and
            ``layout`` (the layout it has).
        refuse_plain: the refusal of an existing directory without a manifest (given the directory).
        must_list: whether a file of that name, unlisted, fails the directory.
        unlisted_note: what an unlisted file's problem adds after ``; `` (nothing when empty).
        uncertified: what follows ``PATH: `` in the refusal to list a file that is not certified.
        pickled: suffixes refused from the listing as pickles (with ``pickle_note``).
        pickle_note: what follows "bypassed certckpt " in a pickle's refusal.
        certified_only: every listed file must be certified (else only ``.safetensors`` ones).
        irregular: the refusal (formatted with ``path``) of a link or a non-file; None skips them.
        missing_dir: the refusal (formatted with ``directory``) of a directory that is not there.
        table: reads the manifest's files table (given its path and record).
        action: what ``require_intact`` refuses to do ("load", "resume from").
        advice: what ``require_intact``'s refusal ends with.
    """

    manifest: str
    layout: str
    foreign: str
    refuse_plain: Callable[[str], NotACheckpointError]
    must_list: Callable[[str], object]
    unlisted_note: str = ""
    uncertified: str
    pickled: tuple[str, ...] = ()
    pickle_note: str = ""
    certified_only: bool = False
    irregular: str | None = None
    missing_dir: str = "{directory}: no such checkpoint directory"
    table: Callable[[str, CheckpointRecord], FilesTable] = listed_files
    action: str = "load"
    advice: str


@dataclass(kw_only=True, slots=True)
class ManifestDirReport:
    """The outcome of ``verify_directory``.

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


R = TypeVar("R", bound=ManifestDirReport)


def entry_of(path: str, kind: ManifestDir) -> dict[str, Any]:
    """What the manifest records about one file: a certified file by its header digest, any other
    file by the digests of its bytes.

    Raises:
        UnsupportedObjectError: a pickle, or a file that should be certified and is not.
    """
    name = os.path.basename(path)
    if kind.pickled and name.endswith(kind.pickled):
        raise UnsupportedObjectError(
            f"{path}: a pickled file in a certified checkpoint; whatever wrote it bypassed certckpt {kind.pickle_note}"
        )
    if kind.certified_only or name.endswith(".safetensors"):
        try:
            info = inspect(path)
        except NotACheckpointError as e:
            raise UnsupportedObjectError(f"{path}: {kind.uncertified}") from e
        return {"bytes": os.path.getsize(path), "header_digest": info.record.header_digest}
    return plain_entry(path)


def files_of(directory: str, kind: ManifestDir) -> FilesTable:
    """The entry of every file of ``directory`` but the manifest and hidden names (writers' temp files).

    Raises:
        UnsupportedObjectError: a file that cannot be listed (``entry_of``), or a link or non-file
            where ``kind.irregular`` refuses them.
    """
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == kind.manifest or name.startswith("."):
            continue  # hidden names are writers' temp files
        if not os.path.isfile(path) or (kind.irregular is not None and os.path.islink(path)):
            if kind.irregular is None:
                continue
            raise UnsupportedObjectError(kind.irregular.format(path=path))
        files[name] = entry_of(path, kind)
    return files


def write_manifest(
    directory: str,
    kind: ManifestDir,
    state: dict[str, Any],
    fields: RecordFields | None = None,
    **one_by_one: Any,
) -> SaveResult:
    """Describe every file of ``directory`` and write the manifest (create-only), holding ``state``.

    Raises:
        UnsupportedObjectError: a file there cannot be listed (``files_of``).
        CheckpointExistsError: the manifest exists already.
    """
    files = files_of(directory, kind)
    meta = {LAYOUT_KEY: kind.layout, FILES_KEY: json.dumps(files, sort_keys=True, separators=(",", ":"))}
    return save_certified(
        state,
        os.path.join(directory, kind.manifest),
        fields=fields,
        **one_by_one,
        metadata=meta,
        overwrite=False,
    )


def read_manifest(directory: str, kind: ManifestDir) -> tuple[str, FilesTable, int | None]:
    """``(manifest path, files table, step)`` from the manifest's header (no data read).

    Raises:
        CheckpointNotFoundError: no such directory.
        NotACheckpointError: no manifest (``kind.refuse_plain``), or a manifest of another layout.
        CorruptCheckpointError: the manifest's header or its files table is damaged.
    """
    path = os.path.join(directory, kind.manifest)
    if not os.path.isfile(path):
        if not os.path.isdir(directory):
            raise CheckpointNotFoundError(kind.missing_dir.format(directory=directory))
        raise kind.refuse_plain(directory)
    record = inspect(path).record
    if record.user.get(LAYOUT_KEY) != kind.layout:
        raise NotACheckpointError(kind.foreign.format(path=path, layout=record.user.get(LAYOUT_KEY)))
    return path, kind.table(path, record), record.step


def verify_directory(directory: str, kind: ManifestDir, report_type: type[R]) -> R:
    """Check a certified directory as a whole: the manifest's bytes, every file it lists (present,
    same size, same digest), and no file there unlisted that ``kind.must_list``. With
    ``$CERTCKPT_TRUSTED_KEYS``, the manifest and the certified files must be signed by those keys.

    Raises:
        NotACheckpointError, CheckpointNotFoundError: there is nothing certified to check.
    """
    directory = os.fspath(directory)
    report = report_type(directory=directory)
    try:
        path, files, report.step = read_manifest(directory, kind)
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
    note = f"; {kind.unlisted_note}" if kind.unlisted_note else ""
    for name in sorted(os.listdir(directory)):
        if name not in files and name != kind.manifest and kind.must_list(name):
            report.fail(
                f"{os.path.join(directory, name)}: not listed by the checkpoint's manifest (added after the save)"
                + note
            )
    return report


def require_intact(report: R, kind: ManifestDir) -> R:
    """``report`` (from ``verify_directory``) when it is ok.

    Raises:
        CorruptCheckpointError: its first problem, with the count of the others.
    """
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise CorruptCheckpointError(
            f"refusing to {kind.action} {report.directory}: {report.problems[0]}{more}; {kind.advice}"
        )
    return report


def leftover_problem(directory: str, kind: ManifestDir, *, run: str | None, step: int) -> str | None:
    """None when ``directory`` is provably what an uncommitted save of ``run`` at ``step`` left
    (a crash, or a save that failed before its manifest): no manifest, at least one certified file,
    every certified file of that run and step, no pickle, no subdirectory, no link. Otherwise why not.

    Only such a directory may be removed before a save takes its name again: a directory with a
    manifest may be committed to a ledger this caller cannot see (a lost or other one), and one of
    unknown origin is somebody's data. Doubt frees no space. Reads headers only.
    """
    if os.path.islink(directory):
        return "it is a symbolic link"
    names = sorted(os.listdir(directory))
    pickles = [n for n in names if kind.pickled and n.endswith(kind.pickled)]
    if pickles:  # the plainest sign of somebody else's checkpoint: named first
        return f"it holds {pickles[0]}, a pickle, which certckpt never writes"
    ours = 0
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path) or not os.path.isfile(path):
            return f"it holds {name!r}, which is not a plain file"
        if name.startswith("."):
            continue  # writers' temp files
        if name == kind.manifest:
            return f"it holds {name}, a manifest, which may be committed to a ledger other than this one"
        if not (kind.certified_only or name.endswith(".safetensors")):
            continue  # configs, tokenizer files, JSON: written beside the certified files
        try:
            record = inspect(path).record
        except NotACheckpointError:
            return f"it holds {name}, a file certckpt did not write"
        except (CorruptCheckpointError, CheckpointNotFoundError):
            return f"it holds {name}, a certified file that does not read whole"
        if (record.run, record.step) != (run, step):
            return f"it holds {name}, written by run {record.run!r} at step {record.step} (not {run!r} at {step})"
        ours += 1
    return None if ours else f"it holds no certified file of run {run!r} at step {step}"
