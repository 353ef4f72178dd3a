"""``CertifiedCheckpointIO``: Lightning's checkpoints as certified files, committed to a ledger.

``Trainer(plugins=[CertifiedCheckpointIO()])`` routes every checkpoint Lightning writes or reads
through certckpt: ``ModelCheckpoint``'s files, ``trainer.save_checkpoint(path)``, resuming with
``Trainer.fit(ckpt_path=...)``. Each file is a certified safetensors file (nothing pickled: the
hyper-parameters, callback states, loops, optimizer and scheduler states all travel as data) whose
record carries the global step and the epoch, and is committed to the ledger of its run store (by
default the checkpoint's directory), so that ``certckpt status DIR`` and ``certckpt latest-good DIR``
answer for it: ``verified`` on its own, ``trusted`` once ``AuditCallback``'s audits vouch for it.

Lightning writes some names more than once (``last.ckpt`` at every save, a ``filename`` without the
step in it) and deletes others (``save_top_k``). A committed file is never edited in place: the new
file is written whole beside the old one, the old checkpoint is *retired* in the ledger (its file
is gone; its evidence stays), and the new file takes the name atomically (on a local disk; on an
object store the old object is deleted first). A second file at a step already committed (the
``last.ckpt`` written right after a ``ModelCheckpoint`` file at the same step) is written certified
but not committed: the ledger knows one checkpoint per step, and ``latest-good`` names the first.
A removal that would delete the run's latest-good is refused (kept on disk, with a warning):
Lightning's ``save_top_k`` then forgets it, certckpt does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from certckpt.detect.session import CheckpointEvidence
from certckpt.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    NotACheckpointError,
)
from certckpt.format.reader import load
from certckpt.format.record import RecordFields
from certckpt.format.verify import inspect
from certckpt.format.writer import SaveResult, save_certified
from certckpt.log import enable as enable_log
from certckpt.storage import Target, fsync_dir, join, resolve, temp_name
from certckpt.storage.fsspec_store import filesystem
from certckpt.trust.commit import commit_saved
from certckpt.trust.gate import rotation_keeps
from certckpt.trust.ledger import Ledger, LedgerSnapshot, ckpt_id_for
from certckpt.trust.resume import ResumePoint, branch_after_load, recorded_branches
from certckpt.trust.runstore import certify_store

from .compat import CHECKPOINT_IO_BASES, version_text, warn_outside

__all__ = ["CertifiedCheckpointIO"]


def _location(path: Any) -> str:
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ArgumentTypeError(f"a checkpoint path must be a str or os.PathLike, got {type(path).__name__}")
    return path


def _key(location: str) -> str:
    """One spelling per file: local paths absolute, URLs as given."""
    target = resolve(location)
    return os.path.abspath(target.local) if target.local is not None else location.rstrip("/")


def _directory(location: str) -> str:
    target = resolve(location)
    if target.local is not None:
        return os.path.dirname(os.path.abspath(target.local))
    return location.rstrip("/").rsplit("/", 1)[0]


def _remote(target: Target) -> tuple[Any, str]:
    """``(fs, path)`` of a location that is not a local path (``resolve`` of a ``str`` sets ``url`` then)."""
    if target.url is None:  # pragma: no cover - resolve() of a str sets local or url
        raise ArgumentTypeError(f"{target.display}: neither a local path nor a URL")
    return filesystem(target.url)


def _exists(location: str) -> bool:
    target = resolve(location)
    if target.local is not None:
        return os.path.exists(target.local)
    fs, p = _remote(target)
    return fs.exists(p)


@dataclass(kw_only=True, slots=True)
class _Store:
    """What this process knows of one run store's commits (read once, kept current by its writes).

    Lightning writes checkpoints from one process (global rank 0), so the records it adds are the
    only ones that change while it trains.
    """

    ledger: Ledger
    committed: set[str] = field(default_factory=set)  # checkpoint ids with a commit record
    named: dict[str, str] = field(default_factory=dict)  # file -> id of the unretired commit naming it
    branches: set[str] = field(default_factory=set)  # branch records written by this process
    kept: dict[str, str] = field(default_factory=dict)  # id -> file a rotation moved aside (unretired)
    deferred: list[str] = field(default_factory=list)  # files save_top_k let go that were latest-good then
    # files being written and not committed yet: under AsyncCheckpointIO the training thread may let
    # one go between its rename into place and its commit record
    writing: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, ledger: Ledger) -> _Store:
        try:
            snap = ledger.snapshot()
        except CheckpointNotFoundError:
            snap = LedgerSnapshot()
        store = cls(ledger=ledger, committed=set(snap.records))
        for cid, record in snap.records.items():
            if cid not in snap.retired:
                where = ledger.url_of(snap.kept.get(cid) or record)
                store.named[_key(where)] = cid
                if cid in snap.kept:
                    store.kept[cid] = where
        return store


def _files_model_checkpoint_keeps(checkpoint: dict[str, Any]) -> set[str] | None:
    """The files the ``ModelCheckpoint`` states in a Lightning checkpoint dict still name (their
    best-k files, best, k-th best and last), by ``_key``; None when it holds no such state."""
    states = checkpoint.get("callbacks")
    if not isinstance(states, dict):
        return None
    found: set[str] | None = None
    for state in states.values():
        if not isinstance(state, dict) or not isinstance(state.get("best_k_models"), dict):
            continue
        found = found if found is not None else set()
        names = [
            *state["best_k_models"],
            *(state.get(k) for k in ("best_model_path", "kth_best_model_path", "last_model_path")),
        ]
        found |= {_key(str(n)) for n in names if isinstance(n, str | os.PathLike) and str(n)}
    return found


# The bases are every installed Lightning's CheckpointIO, found at import time (compat.py); mypy cannot
# follow a starred base list and takes the class as deriving from Any.
class CertifiedCheckpointIO(*CHECKPOINT_IO_BASES):  # type: ignore[misc]
    """Lightning's ``CheckpointIO``, writing certified, ledger-committed checkpoints.

    Args:
        ledger: the run store to commit to (path or URL); default: each checkpoint's directory.
            With ``AuditCallback`` the callback's store is used (they must be one store).
        run: the run's name in records (default: the resumed checkpoint's, else the store's name).
        branch: the branch to record on. Default ``main``; after resuming from a checkpoint, a new
            branch forked from it, ``main-r1``, ``main-r2``, ... (``certckpt.trust.resume.next_branch``;
            given, the resumed run's branch, which must be new to the store).
        keep_latest_good: refuse to delete the run's latest-good when ``ModelCheckpoint`` rotates it
            out (``save_top_k``); the file stays, with a warning.

    Example:
        >>> trainer = L.Trainer(plugins=[CertifiedCheckpointIO()],
        ...                     callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=100)])
        >>> trainer.fit(model)                         # then: certckpt status ckpt
        >>> trainer.fit(model, ckpt_path=certckpt_latest_good)
    """

    def __init__(
        self,
        *,
        ledger: str | None = None,
        run: str | None = None,
        branch: str | None = None,
        keep_latest_good: bool = True,
    ):
        super().__init__()
        if ledger is not None:
            ledger = _location(ledger)
        self.ledger_store = ledger
        self._run = run
        self._branch = branch
        self.keep_latest_good = keep_latest_good
        # Under Lightning's AsyncCheckpointIO, saves run on its thread while rotations run on the
        # training thread: the bookkeeping of both is done under this lock (the writes are not).
        self._lock = threading.RLock()
        self.resume_point: ResumePoint | None = None  # set when a checkpoint is loaded
        self._resumed_run: str | None = None
        self._origin_let_go = False  # the resumed-from file was handed to the rotation (once)
        self._rotated = False  # Lightning's rotation removed a file of this run (save_top_k at work)
        self._lightning_keeps: set[str] | None = None  # what ModelCheckpoint kept at the last save
        self._audit_store: str | None = None
        self._flush: Callable[[], None] | None = None
        # by step: under AsyncCheckpointIO the next checkpoint's evidence may be offered (training
        # thread) before this one's file is written (saver thread)
        self._evidence: dict[int, CheckpointEvidence] = {}
        self._stores: dict[str, _Store] = {}

    # --- identity -----------------------------------------------------------------------------

    @property
    def branch(self) -> str:
        """The branch new checkpoints are recorded on."""
        if self.resume_point is not None:
            return self.resume_point.branch
        return self._branch or "main"

    @property
    def parent(self) -> str | None:
        """The checkpoint the branch forked from (None for a first branch, and after loading a file
        that is not the one its store committed)."""
        return self.resume_point.parent if self.resume_point is not None else None

    def store_for(self, location: str) -> str:
        """The run store whose ledger commits the checkpoint at ``location``."""
        return self.ledger_store or self._audit_store or _directory(location)

    def run_name(self, store: str) -> str:
        if self._run:
            return self._run
        if self._resumed_run:
            return self._resumed_run
        return os.path.basename(store.rstrip("/")) or "run"

    # --- the AuditCallback's side ----------------------------------------------------------------

    def bind_audits(self, *, store: str, run: str, flush: Callable[[], None]) -> None:
        """Called by ``AuditCallback`` on every rank at the start of training: commit to the audits'
        store, under their run name, and flush their events before each commit."""
        if self.ledger_store is not None and _key(self.ledger_store) != _key(store):
            raise ConfigurationError(
                f"CertifiedCheckpointIO(ledger={self.ledger_store!r}) and AuditCallback(ledger={store!r}) name two"
                " run stores; checkpoints and audit events must share one: give the same ledger to both"
            )
        self._audit_store, self._run, self._flush = store, run, flush

    def offer_evidence(self, evidence: CheckpointEvidence) -> None:
        """Called by ``AuditCallback`` on every rank as Lightning builds a checkpoint: the consensus
        fingerprints and lineage of the step the next file is written at."""
        with self._lock:
            self._evidence[evidence.step] = evidence

    # --- CheckpointIO -----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write ``checkpoint`` (Lightning's dict) as a certified file at ``path`` and commit it.

        Raises:
            UnsupportedObjectError: something in the checkpoint cannot be stored without pickle
                (every such value named, with its fix); nothing was written.
            ArgumentTypeError: ``storage_options`` given (Lightning's own ``TorchCheckpointIO``
                refuses them too).
        """
        if storage_options is not None:
            raise ArgumentTypeError(
                f"Trainer.save_checkpoint(..., storage_options=...) is not supported by {type(self).__name__}"
            )
        enable_log()  # Lightning saves from global rank 0 only: its resume and kept-file lines
        url = _location(path)
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"{url}: the checkpoint has no global_step (got {step!r}); is it Lightning's?")
        self._makedirs(url)
        store = self._store(self.store_for(url))
        branch, parent, run = self.branch, self.parent, self.run_name(store.ledger.store)
        cid, key = ckpt_id_for(branch, step), _key(url)
        holder = store.named.get(key)
        if holder == cid:
            warn_outside(
                f"certckpt: {url} is committed as {cid} already; the file was kept (Lightning saved the same step"
                " to the same name twice)"
            )
            return
        with self._lock:
            evidence = self._evidence.get(step)
            for older in [s for s in self._evidence if s < step]:
                del self._evidence[older]  # a step saved no file (or saved it already): never used again
        fields = (
            dataclasses.replace(evidence.record_fields(), run=run)
            if evidence is not None
            else RecordFields(step=step, run=run, branch=branch, parent=parent)
        )
        known = evidence.known_fingerprints if evidence is not None else None
        metadata = {
            "epoch": str(checkpoint.get("epoch")),
            "global_step": str(step),
            "framework": version_text(),
        }
        with self._lock:
            store.writing.add(key)
        try:
            result = self._write(
                checkpoint, url, fields, metadata, known=known, store=store, replaces=holder, step=step
            )
            with self._lock:
                self._commit(store, result, fields, step=step, audited=evidence is not None, key=key)
                self._lightning_keeps = _files_model_checkpoint_keeps(checkpoint)
                self._let_go_of_origin()
        finally:
            with self._lock:
                store.writing.discard(key)

    def _commit(
        self,
        store: _Store,
        result: SaveResult,
        fields: RecordFields,
        *,
        step: int,
        audited: bool,
        key: str,
    ) -> None:
        """The commit record of a file just written (after the audit events up to it, when
        ``audited``), then what rotations left for later."""
        branch, parent, cid = self.branch, self.parent, ckpt_id_for(self.branch, step)
        if cid in store.committed:
            return  # a second file at a committed step (last.ckpt after the ModelCheckpoint file): not committed
        commit_saved(
            store.ledger,
            result,
            dataclasses.replace(fields, branch=branch, parent=parent),  # this CheckpointIO's line of training
            flush=self._flush if audited else None,
            branch_started=branch in store.branches,  # the branch record, once per process and store
        )
        if parent is not None:
            store.branches.add(branch)
        store.committed.add(cid)
        store.named[key] = cid
        self._release_kept(store)
        self._retry_deferred(store, just=cid)

    def _let_go_of_origin(self) -> None:
        """Hand the file this run resumed from to the rotation once Lightning's would have deleted
        it. Lightning never deletes the checkpoint it resumed from (its ``ckpt_path``), even after
        ``save_top_k`` dropped it; certckpt does, through the deletion gate like any rotated file: it
        stays while it is latest-good and goes at the first save or rotation after a checkpoint of
        the new branch is trusted (docs/integrations.md, "What happens to your disk"). Only a
        committed file of this store, only once Lightning's rotation has removed a file of this run
        (``save_top_k=-1`` never does), and only when no ``ModelCheckpoint`` state of the last save
        still lists it."""
        origin = self.resume_point
        if origin is None or self._origin_let_go or not self.keep_latest_good or not self._rotated:
            return
        kept = self._lightning_keeps
        if kept is None or _key(origin.url) in kept:
            return
        store = self._store(self.store_for(origin.url))
        if origin.parent is None or store.named.get(_key(origin.url)) != origin.parent:
            return  # not the commit it resumed from (an uncommitted or replaced file): never deleted here
        self._origin_let_go = True
        self._remove(origin.url)

    def _retry_deferred(self, store: _Store, *, just: str) -> None:
        """Delete the files ``save_top_k`` let go before they could be: not written yet, or the
        run's latest-good then. Under Lightning's ``AsyncCheckpointIO`` both happen at every
        rotation: Lightning lets the previous file go before its own save (or the newer one) has run.
        Never the file of the checkpoint ``just`` committed."""
        pending, store.deferred = store.deferred, []
        for url in pending:
            if store.named.get(_key(url)) == just:
                store.deferred.append(url)
            else:
                self._remove(url, warn=False)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict[str, Any]:
        """Read a certified checkpoint (digests checked; nothing unpickled) and plan where training
        resumes (``resume_point``: new checkpoints go on a new branch forked from this one).

        Args:
            map_location: as ``torch.load``'s, Lightning's callable included; default: the CPU, as
                Lightning's ``TorchCheckpointIO`` loads.
            weights_only: accepted for Lightning's signature; a certified file is always data only.

        Raises:
            CheckpointNotFoundError: no such file (a ``FileNotFoundError``).
            NotACheckpointError: not a certified file (a ``torch.save`` one: convert it with
                ``certckpt certify``).
            CorruptCheckpointError: its bytes do not verify.
            ConfigurationError: ``branch=`` names a branch the run store already has.
        """
        del weights_only
        url = _location(path)
        try:
            record = inspect(url).record
        except NotACheckpointError as e:
            raise NotACheckpointError(
                f"{e}; CertifiedCheckpointIO reads certified files only: convert a torch.save checkpoint with"
                f" `certckpt certify {url} NEW.ckpt` and resume from NEW.ckpt"
            ) from e
        checkpoint = load(url, map_location if map_location is not None else "cpu")
        step = record.step if record.step is not None else checkpoint.get("global_step")
        if type(step) is int:
            self.resume_point = self._resume_point(url, record, step)
            self._resumed_run = record.run
        return checkpoint

    def _resume_point(self, url: str, record: Any, step: int) -> ResumePoint:
        """Where training goes on from the checkpoint at ``url``: always a new branch (as
        ``certckpt.plan_resume`` decides for the auditor), so that no id or file name collides with
        what the earlier run recorded after it, and what it left unproven there is superseded.

        The branch has a parent only when this very file is the one the store committed (the same
        header digest, ``branch_after_load``); the parent's consensus fingerprint is then what
        ``AuditCallback`` proves the replicas hold before the first step."""
        store = self.store_for(url)
        try:
            status = certify_store(store, write_certificates=False)
        except CheckpointNotFoundError:
            status = None
        snap = status.snapshot if status is not None else LedgerSnapshot()
        recorded = recorded_branches(Ledger(store)) if status else set()
        wanted = self._branch
        try:
            choice = branch_after_load(
                branch=record.branch,
                step=step,
                header_digest=record.header_digest,
                records=snap.records,
                branch_parents=snap.branch_parents,
                # the branches audit events name are taken too (events may precede any commit)
                recorded={b for b in recorded | snap.event_branches() if b},
                requested=wanted,
                store=store,
            )
        except ConfigurationError as e:
            raise ConfigurationError(f"CertifiedCheckpointIO(branch={wanted!r}): {e}") from None
        parent = choice.parent
        verdict = status.certification.verdicts.get(parent) if status is not None and parent is not None else None
        if parent is None:
            level = "not committed in this store"
            warn_outside(
                f"certckpt: {url} is not the checkpoint {choice.source} committed to {store}; branch {choice.branch}"
                f" starts without a parent and its descendants cannot be trusted; `certckpt latest-good {store}`"
                " names the newest trusted checkpoint"
            )
        else:
            level = verdict.label if verdict is not None else "not committed in this store"
            if level not in ("trusted", "verified"):
                reasons = f" ({', '.join(verdict.reasons)})" if verdict is not None and verdict.reasons else ""
                warn_outside(
                    f"certckpt: resuming from {parent} ({url}), which is {level}{reasons}; its descendants cannot be"
                    f" trusted; `certckpt latest-good {store}` names the newest trusted checkpoint"
                )
        return ResumePoint(
            parent=parent,
            url=url,
            step=step,
            branch=choice.branch,
            consensus_fp=record.consensus_fp if parent is not None else None,
            level=level,
        )

    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint Lightning no longer keeps, and retire its commit; the run's
        latest-good is kept (with a warning) unless ``keep_latest_good=False``."""
        url = _location(path)
        with self._lock:
            self._remove(url)
            if self.resume_point is not None and _key(url) != _key(self.resume_point.url):
                self._rotated = True
                self._let_go_of_origin()

    def _remove(self, url: str, *, warn: bool = True) -> None:
        store = self._store(self.store_for(url))
        if _key(url) in store.writing or not _exists(url):
            if url not in store.deferred:
                # a save queued by AsyncCheckpointIO may write it yet, or has written it and not
                # committed it: deleted then, the commit would name a missing file and never retire
                store.deferred.append(url)
            return
        cid = store.named.get(_key(url))
        why = self._keep_reason(store, cid) if cid is not None else None
        if why is not None:
            if url not in store.deferred:
                store.deferred.append(url)
            if warn:
                warn_outside(
                    f"certckpt: kept {url} ({cid}): {why}; it is deleted after a later save of this run, once a"
                    " newer checkpoint is latest-good and nothing is in doubt"
                )
            return
        target = resolve(url)
        if target.local is not None:
            os.unlink(target.local)
        else:
            fs, p = _remote(target)
            fs.rm(p)
        if cid is not None:
            reason = "Lightning removed the file (ModelCheckpoint save_top_k)"
            why = store.ledger.retire_gone(cid, reason=reason, policy="lightning")
            if why is not None:
                warn_outside(f"certckpt: {why}")
            store.named.pop(_key(url), None)

    # --- keeping the latest-good through rotations ---------------------------------------------

    def _keep_reason(self, store: _Store, cid: str) -> str | None:
        """Why the deletion gate keeps ``cid`` (latest-good, or doubt: a tampered ledger, a verdict
        resting on doubt); None when Lightning may delete it or ``keep_latest_good=False``."""
        if not self.keep_latest_good:
            return None
        status = certify_store(store.ledger.store, write_certificates=False)
        verdicts = status.certification.verdicts
        return rotation_keeps(cid, snap=status.snapshot, verdicts=verdicts, latest_good=status.latest_good)

    def _is_latest_good(self, store: _Store, cid: str) -> bool:
        return self._keep_reason(store, cid) is not None

    def _let_go(self, store: _Store, cid: str, url: str, *, reason: str, keep: bool) -> None:
        """Before a new file takes ``url``: ``cid``, the checkpoint there, is kept aside (``keep``:
        the gate keeps it) or retired. A retirement the ledger refuses (a record of another writer
        holds the name) keeps the file aside too: what cannot be recorded as gone is not let go."""
        if not keep:
            why = None
            try:
                store.ledger.retire(cid, reason=reason, policy="lightning")
            except CheckpointExistsError as e:
                why = str(e)
            if why is None:
                store.named.pop(_key(url), None)
                return
            self._keep_aside(store, cid, url, why=f"its retirement cannot be recorded ({why})")
            return
        self._keep_aside(store, cid, url)

    def _keep_aside(self, store: _Store, cid: str, url: str, *, why: str = "it is the run's latest-good") -> None:
        """Lightning is about to write over ``url``, which holds ``cid``, the run's latest-good: the
        file gets a second name in the store first (a hard link on a local disk, a copy on an object
        store), the ledger records where it is now, and only then does the new file take ``url``."""
        name = f"certckpt-kept-{cid}{os.path.splitext(url)[1]}"
        kept = join(store.ledger.store, name)
        target, dest = resolve(url), resolve(kept)
        if target.local is not None and dest.local is not None:
            final = os.path.abspath(dest.local)
            tmp = temp_name(final)
            try:
                try:
                    os.link(target.local, tmp)
                except OSError as e:
                    if e.errno != errno.EXDEV:  # the store on another file system: a copy there
                        raise
                    shutil.copyfile(target.local, tmp)
                    with open(tmp, "rb") as fh:
                        os.fsync(fh.fileno())
                # whatever holds the name (a crash's leftover, a planted file) is replaced: the record
                # below must name this very file
                os.replace(tmp, final)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            fsync_dir(os.path.dirname(final))
        else:
            fs, p = filesystem(target.url or url)
            fs.copy(p, filesystem(kept)[1])
        store.ledger.keep(cid, url=name, replaced=url, reason="the run's latest-good when Lightning replaced its file")
        store.named.pop(_key(url), None)
        store.named[_key(kept)] = cid
        store.kept[cid] = kept
        warn_outside(
            f"certckpt: kept {cid} as {kept}: {why}, and Lightning is writing over {url}; it is deleted once a"
            " newer checkpoint is trusted and nothing is in doubt (until then it costs one more checkpoint of disk)"
        )

    def _release_kept(self, store: _Store) -> None:
        """Delete the files kept aside whose checkpoint is no longer the run's latest-good (a newer
        one is trusted), and retire them."""
        if not store.kept:
            return
        status = certify_store(store.ledger.store, write_certificates=False)
        latest = status.latest_good
        for cid, kept in list(store.kept.items()):
            verdicts = status.certification.verdicts
            if rotation_keeps(cid, snap=status.snapshot, verdicts=verdicts, latest_good=latest) is not None:
                continue
            target = resolve(kept)
            with contextlib.suppress(FileNotFoundError):
                if target.local is not None:
                    os.unlink(target.local)
                else:
                    fs, p = _remote(target)
                    fs.rm(p)
            why = store.ledger.retire_gone(
                cid, reason=f"kept while it was the latest-good; {latest} is trusted now", policy="lightning"
            )
            if why is not None:
                warn_outside(f"certckpt: {why}")
            store.named.pop(_key(kept), None)
            del store.kept[cid]

    # --- helpers ------------------------------------------------------------------------------

    def _store(self, location: str) -> _Store:
        key = _key(location)
        if key not in self._stores:
            self._stores[key] = _Store.read(Ledger(location))
        return self._stores[key]

    @staticmethod
    def _makedirs(url: str) -> None:
        target = resolve(url)
        if target.local is not None:
            os.makedirs(os.path.dirname(os.path.abspath(target.local)), exist_ok=True)
        else:
            fs, p = _remote(target)
            parent = p.rstrip("/").rsplit("/", 1)[0]
            with contextlib.suppress(FileExistsError):
                fs.makedirs(parent, exist_ok=True)

    def _write(
        self,
        checkpoint: dict[str, Any],
        url: str,
        fields: RecordFields,
        metadata: dict[str, str],
        *,
        known: dict[tuple, tuple[str, str]] | None,
        store: _Store,
        replaces: str | None,
        step: int,
    ) -> SaveResult:
        """Write the file under ``url``: create-only when the name is free; otherwise the new file is
        written whole first, the checkpoint that held the name (if committed) retired, then the name
        taken over atomically (a local rename; on an object store, delete then create-only PUT)."""

        def write(to: str) -> SaveResult:
            return save_certified(
                checkpoint, to, overwrite=False, metadata=metadata, fields=fields, known_fingerprints=known
            )

        if not _exists(url):
            return write(url)
        reason = f"superseded: Lightning saved step {step} under the same name"
        keep = replaces is not None and self._is_latest_good(store, replaces)
        target = resolve(url)
        if target.local is None:
            if replaces is not None:
                self._let_go(store, replaces, url, reason=reason, keep=keep)
            fs, p = _remote(target)
            fs.rm(p)
            return write(url)
        final = os.path.abspath(target.local)
        tmp = temp_name(final)
        try:
            result = write(tmp)
            if replaces is not None:
                self._let_go(store, replaces, url, reason=reason, keep=keep)
            # certckpt's own save never replaces a file a commit record names, retired or not; the
            # ledger now says this one is gone, so the new file takes its name here, atomically.
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return dataclasses.replace(result, location=url)
