"""``certckpt.save`` with a ledger: save a checkpoint and commit it, without the auditor.

A run without the auditor (one process, a Lightning or Hugging Face loop without audits, an
imported file) still gets committed checkpoints: the file is written create-only, then its commit
record (run, branch, step, state fingerprint, header digest) is written to the ledger, create-only,
as the auditor does. Such a checkpoint can reach ``verified``, never ``trusted`` (no audit evidence;
``docs/trust.md``). Without ``ledger`` this is ``certckpt.format.writer.save`` unchanged.

``commit_saved`` is the one path every commit record is written through: this module's saves, the
auditor's, the DCP writer's and every framework integration's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from certckpt.errors import ArgumentTypeError, CheckpointExistsError, ConfigurationError
from certckpt.format.asyncsave import AsyncSaver, SaveFuture, default_saver
from certckpt.format.fingerprinting import fingerprint_many
from certckpt.format.reader import warn_ignored
from certckpt.format.record import RecordFields, state_fingerprint
from certckpt.format.signing import SigningKey, signing_key_for
from certckpt.format.verify import verify
from certckpt.format.writer import SaveJob, SaveResult, save_certified
from certckpt.format.writer import save as plain_save
from certckpt.storage import resolve, storage_of

from .ledger import Ledger, ckpt_id_for, is_ckpt_id

__all__ = ["save", "async_save", "commit_saved", "check_commit_target", "earlier_save", "name_taken"]

_NOT_GIVEN = object()  # torch.save's pickle options: forwarded only when the caller passed them


def save(
    obj: Any,
    f: Any,
    pickle_module: Any = _NOT_GIVEN,
    pickle_protocol: Any = _NOT_GIVEN,
    _use_new_zipfile_serialization: Any = _NOT_GIVEN,
    _disable_byteorder_record: Any = _NOT_GIVEN,
    *,
    step: int | None = None,
    run: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool | None = None,
    ledger: str | Ledger | None = None,
    branch: str = "main",
    parent: str | None = None,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
) -> SaveResult:
    """Save ``obj`` as a certified safetensors checkpoint; with ``ledger``, also commit it there.

    Without ``ledger`` this is ``torch.save``'s drop-in (see ``certckpt.format.writer.save``): an
    existing file is replaced atomically unless it is certified. With ``ledger``, the file is
    create-only and its commit record goes to that run store's ledger, so ``certckpt status`` lists
    it and ``certckpt latest-good --accept verified`` can answer it. Run again after it failed between
    the file and its commit, it finds its own file (this state, these fields) and commits it.

    Args:
        obj: what ``torch.save`` takes (see ``certckpt.format.writer.save``).
        f: a path or fsspec URL (a file object only without ``ledger``: a commit names a location).
        pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record:
            accepted for ``torch.save`` compatibility and ignored (one warning per process).
        step: the optimizer update count; required with ``ledger``.
        run: the training run's name.
        metadata: extra string metadata stored in the certckpt record.
        overwrite: without ``ledger``, replace an existing file (default True, as ``torch.save``);
            with ``ledger`` the save is create-only and ``overwrite=True`` is refused.
        ledger: the run store (path, URL or ``Ledger``) whose ledger records the commit.
        branch: the line of training (default ``main``).
        parent: the checkpoint id this branch resumed from (recorded once per branch).
        signing_key: sign the file and the commit record (``docs/signing.md``); by default the key
            ``CERTCKPT_SIGNING_KEY`` names, if set.

    Returns:
        A ``SaveResult``.

    Raises:
        CheckpointExistsError: the file name, or ``branch@step`` in the ledger, is taken.
        ConfigurationError: ``ledger`` without ``step``, or with ``overwrite=True``.

    Example:
        >>> certckpt.save(model.state_dict(), "runs/r1/step100.safetensors",
        ...               ledger="runs/r1", run="r1", step=100)
    """
    given = {
        name: value
        for name, value in (
            ("pickle_module", pickle_module),
            ("pickle_protocol", pickle_protocol),
            ("_use_new_zipfile_serialization", _use_new_zipfile_serialization),
            ("_disable_byteorder_record", _disable_byteorder_record),
        )
        if value is not _NOT_GIVEN
    }
    if ledger is None:
        if branch != "main" or parent is not None:
            raise ConfigurationError("branch and parent are recorded by a ledger commit: pass ledger=STORE too")
        return plain_save(
            obj,
            f,
            **given,
            step=step,
            run=run,
            metadata=metadata,
            overwrite=True if overwrite is None else overwrite,
            signing_key=signing_key,
        )
    if given:
        warn_ignored(list(given), function="save")
    led, key, location = _ledger_target(
        f, ledger=ledger, step=step, branch=branch, overwrite=overwrite, signing_key=signing_key
    )
    fields = RecordFields(step=step, run=run, branch=branch, parent=parent)
    try:
        result = save_certified(obj, location, fields=fields, metadata=metadata, overwrite=False, signing_key=key)
    except CheckpointExistsError as e:
        # The same save run again after it stopped before its commit (or after it, its answer lost)
        # finds its own file there: committing that completes it. Any other file keeps the name.
        earlier = earlier_save(obj, location, fields=fields, metadata=metadata)
        if earlier is None:
            raise name_taken(location, led.store) from e
        result = earlier
    commit_saved(led, result, fields)
    return result


def earlier_save(
    obj: Any, location: str, *, fields: RecordFields, metadata: dict[str, str] | None
) -> SaveResult | None:
    """The file at ``location`` as a ``SaveResult`` when it is the one saving ``obj`` with these
    fields and metadata writes (the same state fingerprint, the same record fields) and every byte of
    it reads back as written; else None. Reads the whole file and fingerprints ``obj``: a retry's cost."""
    report = verify(location)
    if not report.ok or report.info is None:
        return None
    record = report.info.record
    same = {k: v for k, v in fields.as_kwargs().items() if _data(getattr(record, k)) == _data(v)}
    if len(same) != len(fields.as_kwargs()) or record.user != dict(metadata or {}):
        return None
    job = SaveJob(obj, fields=fields, metadata=metadata)  # the object flattened as a save stores it
    fps = fingerprint_many(s.tensor for s in job.stored)
    if state_fingerprint({s.name: f"{fp:016x}" for s, fp in zip(job.stored, fps)}) != record.state_fp:
        return None
    return SaveResult(
        location=location,
        nbytes=report.info.nbytes,
        state_fp=record.state_fp,
        tensors=len(job.stored),
        seconds=0.0,
        header_digest=record.header_digest,
    )


def _data(value: Any) -> str:
    # a field as the record stores it (JSON: a tuple given is a list read back)
    return json.dumps(value, sort_keys=True)


def _ledger_target(
    f: Any, *, ledger: str | Ledger, step: object, branch: object, overwrite: bool | None, signing_key: Any
) -> tuple[Ledger, SigningKey | None, str]:
    """Check what a ledger commit needs; returns the ledger, the signing key and the file's location."""
    if overwrite:
        raise ConfigurationError(
            "overwrite=True with a ledger: a committed checkpoint is write-once; save under a new name"
        )
    check_commit_target(step=step, branch=branch)
    key = signing_key_for(signing_key)
    led = ledger if isinstance(ledger, Ledger) else Ledger(ledger, signing_key=key)
    target = resolve(f)
    if target.fileobj is not None:
        raise ArgumentTypeError("a ledger commit names the file's location: pass a path or URL, not a file object")
    return led, key, target.display


def async_save(
    obj: Any,
    f: Any,
    *,
    step: int | None = None,
    run: str | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool | None = None,
    ledger: str | Ledger | None = None,
    branch: str = "main",
    parent: str | None = None,
    signing_key: SigningKey | str | os.PathLike[str] | None = None,
    saver: AsyncSaver | None = None,
) -> SaveFuture:
    """``save`` in the background: returns once every tensor is snapshotted (see
    ``certckpt.format.asyncsave`` for what blocks and what the memory costs).

    The file is written, fsync'd and published by a background thread, then, with ``ledger``, its
    commit record is written: ``latest-good`` never names a checkpoint still being written, and a
    crash leaves the previous state or the complete new one. Arguments as ``save``.

    Args:
        saver: the ``AsyncSaver`` to queue on (default: the process's, one save in flight: a second
            ``async_save`` first waits for the previous one).

    Returns:
        A ``SaveFuture`` (a ``concurrent.futures.Future``): ``result()`` waits for the file (and the
        commit) and returns its ``SaveResult`` or raises what failed.

    Raises:
        AsyncSaveError: an earlier asynchronous save failed and nobody asked its future.
        UnsupportedObjectError, ConfigurationError, ArgumentTypeError: before anything is started.

    Example:
        >>> pending = certckpt.async_save(model.state_dict(), "runs/r1/main@100.safetensors",
        ...                               ledger="runs/r1", step=100)
        >>> ...  # training goes on
        >>> pending.result()
    """
    saver = saver or default_saver()
    if ledger is None:
        if branch != "main" or parent is not None:
            raise ConfigurationError("branch and parent are recorded by a ledger commit: pass ledger=STORE too")
        return saver.save(
            obj,
            f,
            step=step,
            run=run,
            metadata=metadata,
            overwrite=True if overwrite is None else overwrite,
            signing_key=signing_key,
        )
    led, key, location = _ledger_target(
        f, ledger=ledger, step=step, branch=branch, overwrite=overwrite, signing_key=signing_key
    )
    storage, name = storage_of(location)
    if storage.exists(name):  # said now, in the caller's thread, rather than by the future
        raise name_taken(location, led.store)
    fields = RecordFields(step=step, run=run, branch=branch, parent=parent)

    def commit(result: SaveResult) -> None:
        commit_saved(led, result, fields)

    return saver.save(obj, location, fields=fields, metadata=metadata, overwrite=False, signing_key=key, then=commit)


def check_commit_target(*, step: object, branch: object) -> None:
    """Refuse, before anything is written, the step and branch a commit would refuse after the save.

    Raises:
        ConfigurationError: ``step`` is not a non-negative int, or ``branch`` not a valid name.
    """
    if type(step) is not int or step < 0:
        raise ConfigurationError(f"a ledger commit needs step=N (a non-negative int), got {step!r}")
    if not isinstance(branch, str) or not is_ckpt_id(ckpt_id_for(branch, step)):
        raise ConfigurationError(f"branch {branch!r}: use 1-100 letters, digits, '.', '_' or '-'")


def name_taken(location: str, store: str) -> CheckpointExistsError:
    """What to say when a checkpoint meant for a run store's ledger finds its name taken: replacing it
    is never the fix there (a committed checkpoint is write-once), a new store or a resume is."""
    return CheckpointExistsError(
        f"{location}: a checkpoint already exists under this name, and the run store {store} keeps every"
        f" committed checkpoint as written: train into a new run store (an empty directory), or resume from"
        f" `certckpt latest-good {store}` on a new branch (certckpt.plan_resume)"
    )


def commit_saved(
    ledger: Ledger,
    result: SaveResult,
    fields: RecordFields,
    *,
    flush: Callable[[], object] | None = None,
    branch_started: bool = False,
) -> str:
    """Commit a checkpoint just saved: the one path every commit record is written through.

    In this order: ``flush`` (the caller's audit events reach the ledger before the commit record),
    the branch's start when ``fields.parent`` is set (create-only: written once, sealed again), then
    the commit record (create-only) from ``result`` (location, state fingerprint, header digest,
    bytes) and ``fields`` (branch, step, run, parent, consensus fingerprint, step range; the lineage
    stays in the file's record).

    Args:
        ledger: the run store's ledger.
        result: what the save returned. For a checkpoint of several files (a DCP directory), the
            summary of the whole: its location and every file's bytes, e.g. the manifest's
            ``SaveResult`` through ``dataclasses.replace``.
        fields: the checkpoint's ``RecordFields``; ``branch`` and ``step`` are required.
        flush: writes the caller's audit events to the ledger; None when it has none, or flushed
            them already (before a background write).
        branch_started: the caller recorded the branch's start itself (at its start-up or resume),
            so it is not written again here.

    Returns:
        The commit's id, ``branch@step``.

    Raises:
        ConfigurationError: ``fields`` has no branch or no step.
        CheckpointExistsError: ``branch@step`` has a commit record of another checkpoint; the file
            just written stays uncommitted (``certckpt status`` lists it, ``certckpt gc`` ignores it).
            A record of this very checkpoint (an earlier attempt of this commit, killed before its
            chain entry) is completed instead (``Ledger.commit_checkpoint``).

    Example:
        >>> commit_saved(ledger, result, RecordFields(step=100, run="r1", branch="main"), flush=sink.flush)
        'main@100'
    """
    branch, step = fields.branch, fields.step
    if branch is None or step is None:
        raise ConfigurationError(
            f"{result.location}: a commit needs the checkpoint's branch and step, got branch={branch!r},"
            f" step={step!r}; pass them in the RecordFields"
        )
    with ledger.one_listing():  # one page of the chains directory for the whole commit
        return _commit(ledger, result, fields, flush=flush, branch_started=branch_started)


def _commit(
    ledger: Ledger,
    result: SaveResult,
    fields: RecordFields,
    *,
    flush: Callable[[], object] | None,
    branch_started: bool,
) -> str:
    branch, step = fields.branch, fields.step
    assert branch is not None and step is not None  # commit_saved refused them
    if flush is not None:
        flush()
    if fields.parent is not None and not branch_started:
        ledger.start_branch(branch, parent=fields.parent)  # idempotent for the same parent
    try:
        return ledger.commit_checkpoint(
            branch=branch,
            step=step,
            location=result.location,
            run=fields.run,
            parent=fields.parent,
            consensus_fp=fields.consensus_fp,
            state_fp=result.state_fp,
            header_digest=result.header_digest,
            step_range=fields.step_range,
            nbytes=result.nbytes,
        )
    except CheckpointExistsError as e:
        raise CheckpointExistsError(f"{e} ({result.location} was written but is not committed)") from e
