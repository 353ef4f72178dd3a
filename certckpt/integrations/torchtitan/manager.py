"""``CertifiedCheckpointManager``: TorchTitan's ``CheckpointManager`` writing and reading certified DCP.

TorchTitan's manager passes ``dcp.save``/``dcp.async_save``/``dcp.load`` a ``checkpoint_id`` and no
storage writer or reader, so DCP falls back to its file-system writer (pickled ``.metadata``) and
reader (unpickles it). There is no configuration hook for the writer: the subclass overrides the
hooks that TorchTitan's own subclasses override (``dcp_save``, ``dcp_load``, ``_load``,
``_find_load_step``, ``_create_checkpoint_id``, ``_purge_stale_checkpoints``) and leaves the public
entry points, their guards and the async bookkeeping (``save_future``, the staging future) to
TorchTitan.

Example::

    config.checkpoint = CertifiedCheckpointManager.Config(enable=True, folder="ckpt", interval=100,
                                                          async_mode="async", keep_latest_k=3)
    checkpointer = config.checkpoint.build(dataloader=dl, model_parts=[model], optimizers=opts,
                                           lr_schedulers=scheds, states={}, sd_adapter=None)
    checkpointer.load()            # the run's latest-good, every byte checked; a fresh start when none
    ...
    checkpointer.save(step)        # certified, committed to the run store in the folder
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.components.checkpointer.base import purge_thread
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from certckpt.dcp.reader import CertifiedReader
from certckpt.dcp.writer import CertifiedWriter
from certckpt.errors import ConfigurationError
from certckpt.format.sharded.layout import MANIFEST_NAME, join
from certckpt.format.verify import inspect
from certckpt.log import enable as enable_log
from certckpt.trust.certify import accept_level
from certckpt.trust.gate import rotation_keeps
from certckpt.trust.ledger import Ledger
from certckpt.trust.resume import branch_after_loading, plan_resume
from certckpt.trust.runstore import StoreStatus, certify_store, snapshot_or_empty

from .layout import refuse_plain, step_directories, step_directory_name

__all__ = ["CertifiedCheckpointManager"]

logger = logging.getLogger("certckpt.torchtitan")


def _materialized(state: dict[str, Any]) -> dict[str, Any]:
    # What dcp.save does to a Stateful value, done once here so that the audit's consensus and the
    # writer see the very same tensors (the evidence must be of the state written).
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _directory_of(url: str) -> str:
    # a DCP commit names the checkpoint directory; older records named its manifest
    return os.path.dirname(url) if url.rstrip("/").endswith(MANIFEST_NAME) else url.rstrip("/")


def _key(path: str) -> str:
    return path.rstrip("/") if "://" in path else os.path.abspath(path)


class CertifiedCheckpointManager(CheckpointManager):
    """TorchTitan's checkpoint manager, every checkpoint certified, verified on load and committed.

    Args (besides TorchTitan's):
        audit: a ``certckpt.detect.ShardedAuditSession`` on the same model (or ``attach`` it later):
            each checkpoint then carries the fingerprint every replica agreed on.

    Attributes:
        store: the run store the checkpoints are committed to.
        branch: the line of training new checkpoints go on (``main``; ``main-r1``... after a resume).
        parent: the checkpoint id the current branch resumed from (None on ``main``).
        resumed_step: the step of the checkpoint loaded (None before a load).
        resumed_consensus_fp: the agreed fingerprint that checkpoint carries (None without audits):
            pass it to the resumed ``ShardedAuditSession(expect_consensus_fp=...)``.
        last_ckpt_id: the id the last save committed (the coordinator only; after an async save,
            once it has finished).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        ledger: str = ""
        """Run store (path or fsspec URL) the checkpoints are committed to; empty: the checkpoint folder."""

        run: str = ""
        """The run's name, recorded in every checkpoint (empty: none)."""

        accept: Literal["trusted", "verified"] = "verified"
        """The lowest verdict a resume takes: ``verified`` (intact, committed; runs without audits) or
        ``trusted`` (audited). ``keep_latest_k`` never deletes the newest checkpoint at this level."""

        check_fingerprints: bool = False
        """On load, also compare the loaded state with the checkpoint's sharding-independent
        fingerprints (one more pass over the state; every byte read is checked in any case)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            try:
                accept_level(self.accept)
            except (ValueError, TypeError) as e:
                raise ConfigurationError(
                    f"checkpoint.accept must be 'trusted' or 'verified', got {self.accept!r}"
                ) from e
            if self.last_save_in_hf:
                # HuggingFaceStorageWriter writes plain safetensors without a record or a commit
                raise ConfigurationError(
                    "checkpoint.last_save_in_hf writes an uncertified Hugging Face export; keep it False and"
                    " publish the final weights with `certckpt release`"
                )

    def __init__(self, config: Config, *, audit: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.store = config.ledger or self.folder
        self.run = config.run or None
        self.accept = config.accept
        self.check_fingerprints = config.check_fingerprints
        self.audit = audit
        self.branch = "main"
        self.parent: str | None = None
        self.resumed_step: int | None = None
        self.resumed_consensus_fp: str | None = None
        self._last_writer: CertifiedWriter | None = None
        self._saving_step: int | None = None
        self._retiring: dict[str, str] = {}
        theirs: threading.Thread | None = getattr(self, "purge_thread", None)
        if theirs is not None:
            # TorchTitan's purge thread only removes the directory; certckpt's also records the
            # retirement in the ledger, after the delete, so `certckpt status` says where it went.
            self.purge_queue.put(None)
            theirs.join()
            ours = threading.Thread(
                target=purge_thread, args=(self.purge_queue, self._remove), daemon=True, name="certckpt-titan-purge"
            )
            ours.start()
            setattr(self, "purge_thread", ours)  # noqa: B010 - TorchTitan's attribute, untyped for mypy
        enable_log()

    def resumed_state(self) -> dict[str, Any]:
        """The training state as a save hands it to the audits (``checkpoint_evidence``): after
        ``load()``, the state loaded, for ``ShardedAuditSession(resume_state=...,
        expect_consensus_fp=self.resumed_consensus_fp)`` to prove it is the parent's."""
        return _materialized(self._flattened_model_states_sd())

    def attach(self, audit: Any) -> None:
        """Carry ``audit``'s evidence (a ``ShardedAuditSession``) into every checkpoint saved from now on."""
        if not hasattr(audit, "checkpoint_evidence"):
            raise ConfigurationError(f"attach takes a certckpt.detect.ShardedAuditSession, got {type(audit).__name__}")
        self.audit = audit

    # --- saving ---------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # dcp_save is not told the step; TorchTitan calls it from here, synchronously
        self._saving_step = curr_step
        try:
            return super()._save(curr_step, last_step)
        finally:
            self._saving_step = None

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return filesystem.join(folder or self.folder, step_directory_name(step, self.branch))

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:
            raise ConfigurationError("a Hugging Face export is not a certified checkpoint (checkpoint.last_save_in_hf)")
        if self._saving_step is None:
            raise ConfigurationError(f"{checkpoint_id}: save through CheckpointManager.save(step), not dcp_save")
        evidence = None
        if self.audit is not None:
            state_dict = _materialized(state_dict)
            evidence = self.audit.checkpoint_evidence(state_dict)  # collective, before any rank writes
        writer = CertifiedWriter(
            checkpoint_id,
            run=self.run,
            step=self._saving_step,
            ledger=self.store,
            branch=self.branch,
            parent=self.parent,
            evidence=evidence,
        )
        ret: Any = None
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                checkpoint_id=checkpoint_id,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        self._last_writer = writer
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    @property
    def last_ckpt_id(self) -> str | None:
        # the writer sets it in finish(), which an async save runs before its future completes; in
        # the pinned-memory mode DCP writes from another process and this stays None
        return None if self._last_writer is None else self._last_writer.ckpt_id

    # --- loading --------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        if step != -1 or not snapshot_or_empty(Ledger(self.store)).records:
            return super()._load(step)  # an explicit step, an initial load, or a fresh start
        # The fault-tolerance branch: TorchTitan takes the highest step-N with a .metadata; certckpt
        # takes the latest-good (the newest checkpoint at the accepted level whose bytes verify now).
        point = plan_resume(self.store, accept=self.accept)
        directory = _directory_of(Ledger(self.store).url_of({"url": point.url}))
        logger.info("certckpt: resuming from %s (%s, %s)", point.parent, point.level, directory)
        states = self._states_to_load(point.step == 0)  # TorchTitan's step-0 seed holds the model only
        self.dcp_load(states, checkpoint_id=directory, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _find_load_step(self, folder: str = "") -> int:
        # Reached only when the run store has committed nothing: a step-N directory plain TorchTitan
        # wrote is refused rather than silently skipped (the run would start over from scratch).
        for _, path in step_directories(folder or self.folder):
            refuse_plain(path)
        return -1

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            # an initial import of Hugging Face safetensors weights (no pickle): TorchTitan's own path
            super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
            return
        refuse_plain(checkpoint_id)
        reader = CertifiedReader(checkpoint_id, check_fingerprints=self.check_fingerprints)
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id)
        if MODEL in self.states:
            # as TorchTitan does: the flattened model entries go back into the modules
            self.states[MODEL].load_state_dict(state_dict)
        self._enter_branch(checkpoint_id)

    def _enter_branch(self, directory: str) -> None:
        """After a load: new checkpoints go on a new branch whose parent is the one loaded, so that
        step numbers the abandoned branch already used never collide (``certckpt.trust.resume``)."""
        record = inspect(join(directory, MANIFEST_NAME)).record
        ledger = Ledger(self.store)
        snap = snapshot_or_empty(ledger)
        choice = branch_after_loading(ledger, record, step=record.step, snap=snap)
        self.branch = choice.branch
        self.parent = choice.parent
        self.resumed_step = choice.step
        self.resumed_consensus_fp = record.consensus_fp if choice.parent is not None else None
        if choice.parent is None:
            logger.warning(
                "certckpt: %s is not committed in %s; branch %s has no parent", directory, self.store, self.branch
            )

    # --- rotation -------------------------------------------------------------------------------

    def _purge_stale_checkpoints(self) -> None:
        if not self._should_purge():
            return
        candidates = step_directories(self.folder)[: -self.keep_latest_k]
        if not candidates:
            return
        status = certify_store(self.store, write_certificates=False)
        good = self._good(status)
        ids = {_key(_directory_of(e.url)): e.ckpt_id for e in status.snapshot.checkpoints}
        for _, path in candidates:
            cid = ids.get(_key(path))
            why = (
                "kept: no commit record vouches for it (an unfinished or foreign save is never deleted)"
                if cid is None
                else rotation_keeps(cid, snap=status.snapshot, verdicts=status.certification.verdicts, latest_good=good)
            )
            if why is not None:
                logger.info("certckpt: keep_latest_k would delete %s; %s", path, why)
                continue
            assert cid is not None  # an uncommitted directory is kept above
            self._retiring[path] = cid
            self.purge_queue.put(path)

    def _good(self, status: StoreStatus) -> str | None:
        """The checkpoint no rotation deletes: the newest at the accepted level that this store holds."""
        level = accept_level(self.accept)
        return next(
            (c for c in status.certification.candidates(level) if status.snapshot.available(c)),
            None,
        )

    def _remove(self, path: str) -> None:
        filesystem.rmtree(path)
        cid = self._retiring.pop(path, None)
        if cid is not None:
            why = Ledger(self.store).retire_gone(
                cid, reason="TorchTitan removed it (checkpoint.keep_latest_k)", policy="torchtitan"
            )
            if why is not None:
                logger.warning("certckpt: %s", why)
