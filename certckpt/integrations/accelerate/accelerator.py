"""``CertifiedAccelerator``: an ``accelerate.Accelerator`` whose ``save_state`` / ``load_state`` are certified.

What changes against the plain ``Accelerator`` (accelerate 1.15; the private attributes it reads are
pinned by ``tests/integrations/test_integration_accelerate.py``: ``_models``, ``_optimizers``, ``_schedulers``,
``_dataloaders``, ``_custom_objects``, ``_save_model_state_pre_hook``, ``_load_model_state_pre_hook``):

- ``save_state`` (every process, as Accelerate's): rank 0 writes the weights, optimizer, scheduler and
  custom-object states as certified safetensors files (``layout``), every process its RNG file; then
  rank 0 writes the manifest over the directory and commits it to the run store's ledger, one
  checkpoint id ``<branch>@<optimizer step>`` per save; with an ``AcceleratorAudit`` the checkpoint
  carries the replicas' agreed fingerprints and the audit lineage. ``total_limit`` (automatic naming)
  is applied after the commit and never deletes the run's latest-good (``certckpt.trust.gate``).
- ``load_state`` (every process): the whole directory is verified on every process before anything is
  loaded (a missing rank's file, a swapped or edited file: one error on every process); ``None`` means
  the store's latest good checkpoint (trusted, else verified) whose files all verify; the RNG states
  are restored and checked; the run continues on a new branch (``main-r1``...) forked from it.
- ``prepare``: counts the first optimizer's steps (the checkpoint's step).
- ``async_save=True``: ``save_state`` returns once every state the main process saves is snapshotted
  into host memory; the files, the manifest and the commit follow on background threads
  (``certckpt.format.pipeline``), one checkpoint in flight. The next ``save_state``, ``load_state``,
  ``end_training`` and ``certckpt_wait()`` wait for it and raise its failure on every process.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType

from certckpt.errors import (
    CheckpointExistsError,
    ConfigurationError,
    CorruptCheckpointError,
    UnsupportedObjectError,
)
from certckpt.format.asyncsave import SaveFuture
from certckpt.format.durable import durable_together
from certckpt.format.pipeline import CheckpointPipeline, host_copy
from certckpt.format.reader import load
from certckpt.format.record import RecordFields
from certckpt.format.verify import inspect
from certckpt.format.writer import save_certified
from certckpt.log import enable as enable_log
from certckpt.storage import EXISTS
from certckpt.trust.commit import commit_saved
from certckpt.trust.gate import rotation_keeps, store_doubt
from certckpt.trust.ledger import Ledger, ckpt_id_for, is_ckpt_id
from certckpt.trust.resume import branch_after_loading
from certckpt.trust.runstore import (
    StoreStatus,
    certify_store,
    committed_directory,
    committed_into,
    latest_intact_directory,
)
from certckpt.trust.runstore import snapshot_or_empty as _snapshot

from .layout import (
    MANIFEST_NAME,
    indexed_name,
    leftover_problem,
    manifest_of,
    require_intact,
    rng_file_name,
    verify_state_dir,
    write_manifest,
)
from .together import distributed, together

__all__ = ["CertifiedAccelerator", "CertifiedRun"]

logger = logging.getLogger(__name__)

_CHECKPOINT_DIR = re.compile(r"^checkpoint_([0-9]+)$")  # Accelerate's automatic naming


@dataclass(kw_only=True, slots=True)
class CertifiedRun:
    """Where a ``CertifiedAccelerator`` commits, and as what (``accelerator.certckpt``).

    Attributes:
        ledger: the run store (``certckpt status`` reads it); None until the first save decides it
            when neither ``ledger=`` nor ``ProjectConfiguration(project_dir=...)`` gave one.
        run: the run name in every record.
        requested: the branch name passed to the accelerator, if any.
        branch: the line of training, decided at the first save, load or audited step.
        parent: the checkpoint id this branch resumed from.
        steps: optimizer steps applied so far (the first prepared optimizer's, restored by a load).
        last_step: the step of this branch's last committed checkpoint (the next record's step range
            starts after it; a save that fails, in the background too, leaves it alone).
        resumed_fp: the consensus fingerprint of the checkpoint loaded (the audit proves the
            replicas hold exactly it when it starts).
        audit: the ``AcceleratorAudit`` bound to this accelerator, if any.
        pipeline: with ``async_save=True``, the checkpoint in flight and the savers' staging memory.
        in_flight: the audit evidence, the save iteration and the directory of the checkpoint in
            flight (every process): when its background commit fails, the audit's lineage is
            reopened over its steps and the next automatic save takes its number again, as after a
            synchronous failure.
        failed: the directory this run's last save created and then failed in, before its commit:
            the one leftover the next automatic save may remove (nothing else is ever removed).
    """

    ledger: Ledger | None
    run: str | None
    requested: str | None = None
    branch: str | None = None
    parent: str | None = None
    steps: int = 0
    last_step: int | None = None
    resumed_fp: str | None = None
    audit: Any = None
    pipeline: CheckpointPipeline | None = None
    in_flight: Any = None
    failed: str | None = None


class CertifiedAccelerator(Accelerator):
    """``accelerate.Accelerator`` with certified, committed ``save_state`` checkpoints.

    Args:
        run: the run name recorded in the ledger (default: the run store's directory name).
        branch: the branch to train on (default ``main`` for a fresh run, ``<branch>-r<N>`` after a
            ``load_state``).
        ledger: the run store (default: ``ProjectConfiguration.project_dir``, else the parent of the
            first ``save_state`` directory).
        async_save: ``save_state`` waits only for a snapshot, in host memory, of every state the
            main process saves (kept and reused: about the size of the checkpoint); the files, the
            manifest and the commit are finished in the background. The checkpoint is committed (and
            ``latest-good`` can name it) only once all of it is durable.
        *args, **kwargs: the Accelerator's own.

    Example:
        >>> accelerator = CertifiedAccelerator(project_config=ProjectConfiguration(
        ...     project_dir="proj", automatic_checkpoint_naming=True, total_limit=2))
        >>> model, opt = accelerator.prepare(model, opt)
        >>> accelerator.load_state()        # latest-good, on a new branch (nothing yet: a fresh start)
        >>> ...                             # train
        >>> accelerator.save_state()        # proj/checkpoints/checkpoint_N/, certified and committed
    """

    def __init__(
        self,
        *args: Any,
        run: str | None = None,
        branch: str | None = None,
        ledger: str | None = None,
        async_save: bool = False,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if self.is_main_process:
            enable_log()  # one line per audit and per resume, from the main process
        if branch is not None and not is_ckpt_id(ckpt_id_for(branch, 0)):
            raise ConfigurationError(f"branch {branch!r}: use 1-100 letters, digits, '.', '_' or '-'")
        self._certckpt_refuse_unsupported()
        store = ledger or self.project_configuration.project_dir
        self.certckpt = CertifiedRun(
            ledger=None, run=run, requested=branch, pipeline=CheckpointPipeline() if async_save else None
        )
        if store:
            self._certckpt_set_store(os.fspath(store))
        self._certckpt_counted: set[int] = set()

    def _certckpt_set_store(self, store: str) -> None:
        run = self.certckpt
        run.ledger = Ledger(store)
        if run.run is None:
            run.run = os.path.basename(os.path.abspath(store).rstrip("/")) or "run"

    def _certckpt_refuse_unsupported(self) -> None:
        kind = self.distributed_type
        if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA):
            raise ConfigurationError(
                f"CertifiedAccelerator cannot certify {kind.value}: it writes its own checkpoint files; use the plain "
                "Accelerator for it (DDP, one process and multi-CPU are supported)"
            )
        if self.project_configuration.save_on_each_node and self.num_processes > 1:
            raise ConfigurationError(
                "CertifiedAccelerator: save_on_each_node=True would commit each node's copy to one ledger; "
                "save on shared storage instead"
            )

    # --- prepare: the step count --------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        result = super().prepare(*args, device_placement=device_placement)
        if self._optimizers:
            first = self._optimizers[0]
            inner = getattr(first, "optimizer", first)  # AcceleratedOptimizer wraps the torch optimizer
            if id(inner) not in self._certckpt_counted:
                self._certckpt_counted.add(id(inner))
                inner.register_step_post_hook(self._certckpt_count)
        return result

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """``Accelerator.backward``; with an ``AcceleratorAudit``, after the backward that reduced the
        gradients (``sync_gradients``), the audit's flag exchange starts, to overlap the clipping."""
        super().backward(loss, **kwargs)
        audit = self.certckpt.audit
        if audit is not None and self.sync_gradients:
            audit.after_backward()

    def _certckpt_count(self, *_: Any) -> None:
        self.certckpt.steps += 1

    @property
    def certified_step(self) -> int:
        """The optimizer step a checkpoint taken now records: the audit's when one runs, else the
        first prepared optimizer's applied steps."""
        audit = self.certckpt.audit
        if audit is not None and audit.session is not None:
            return int(audit.session.step)
        return self.certckpt.steps

    # --- deciding the branch ------------------------------------------------------------------

    def certckpt_ledger(self, output_dir: str | None = None) -> Ledger:
        run = self.certckpt
        if run.ledger is None:
            if output_dir is None:
                raise ConfigurationError(
                    "CertifiedAccelerator has no run store: pass ledger=DIR, or "
                    "ProjectConfiguration(project_dir=DIR), or save_state(DIR) first"
                )
            self._certckpt_set_store(os.path.dirname(os.path.abspath(output_dir)) or ".")
        assert run.ledger is not None
        return run.ledger

    def certckpt_decide_fresh(self) -> str:
        """The branch of a run that did not load a checkpoint (collective the first time: every
        process reads the ledger and decides the same): ``main`` (or the one asked for), which must
        hold no checkpoint yet."""
        run = self.certckpt
        if run.branch is not None:
            return run.branch
        ledger = self.certckpt_ledger()

        def decide() -> None:
            branch = run.requested or "main"
            snap = _snapshot(ledger)
            mine = sorted(r["step"] for r in snap.records.values() if r["branch"] == branch)
            if mine:
                raise ConfigurationError(
                    f"{ledger.store}: the ledger holds checkpoints of branch {branch!r} already (newest "
                    f"{ckpt_id_for(branch, mine[-1])}); resume with accelerator.load_state() (latest-good), save into "
                    "another directory, or pass another branch: CertifiedAccelerator(..., branch=...)"
                )
            run.branch = branch

        together(decide, what="branch", device=self.device)
        assert run.branch is not None
        return run.branch

    # --- saving -------------------------------------------------------------------------------

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str:
        """``Accelerator.save_state``, certified: every file pickle-free and the directory committed
        as one checkpoint (call it on every process, as Accelerate's). Returns the directory.

        Raises:
            UnsupportedObjectError: a state that cannot be stored without pickle (refused before a
                byte of it is written), or a pickle in the directory (a pre-hook's file).
            FaultDetectedError: the replicas' weights disagree (with an ``AcceleratorAudit``).
            CertckptError: the save failed on another process (every process raises).
        """
        if not safe_serialization:
            logger.warning("safe_serialization=False ignored: certified checkpoints are never pickled")
        if save_model_func_kwargs:
            raise ConfigurationError(
                f"save_state: {sorted(save_model_func_kwargs)} are DeepSpeed's options, which CertifiedAccelerator "
                "does not run"
            )
        self.certckpt_wait()  # one checkpoint in flight: the previous one is committed (or failed) first
        directory = self._certckpt_target(output_dir)
        ledger = self.certckpt_ledger(directory)
        run = self.certckpt
        branch = self.certckpt_decide_fresh()
        ours = self.project_configuration.automatic_checkpoint_naming and directory == run.failed
        step = self.certified_step
        self._certckpt_together(
            lambda: self._certckpt_clear_leftover(directory, ledger, step=step, ours=ours), what="checkpoint"
        )
        if os.path.exists(os.path.join(directory, MANIFEST_NAME)):
            raise ConfigurationError(
                f"{directory} holds a certified checkpoint already; certified checkpoints are never overwritten: "
                "save into a new directory"
            )
        audit = run.audit
        evidence = audit.checkpoint_evidence() if audit is not None and audit.session is not None else None
        # A directory this save creates is this run's own to remove should the save fail; one that was
        # there already (a stranger's, or an explicit one) never becomes so by a failed save into it.
        owned = None if os.path.lexists(directory) else directory
        try:
            self._certckpt_save(directory, step, branch, evidence, owned=owned)
        except BaseException as e:
            run.failed = owned
            if evidence is not None:  # nothing was committed: the next checkpoint's lineage covers these steps
                audit.reopen_lineage(evidence)
            if isinstance(e, CheckpointExistsError) and str(e).endswith(EXISTS):
                # the writer's advice (overwrite=True) is not one save_state takes: say what is there
                raise CheckpointExistsError(
                    f"{str(e)[: -len(EXISTS)]}a file of that name is there already, which this save did not "
                    "write; certckpt never writes over it: save into a new directory"
                ) from None
            raise
        run.failed = None
        self.project_configuration.iteration += 1
        logger.debug("saved %s at step %d on %s (%s)", directory, step, branch, ledger.store)
        return directory

    def _certckpt_save(self, directory: str, step: int, branch: str, evidence: Any, *, owned: str | None) -> None:
        run = self.certckpt
        audit = run.audit
        known = evidence.known_fingerprints if evidence is not None else None
        in_flight: list[SaveFuture] = []
        self._certckpt_together(
            lambda: self._certckpt_write_files(directory, step, known, in_flight), what="checkpoint save"
        )
        if distributed():
            dist.barrier()  # every process's RNG file is on disk before the manifest lists them
        first = (run.last_step or 0) + 1
        state = self._certckpt_manifest_state()
        consensus: dict[str, Any] = {}

        def commit() -> None:
            if evidence is not None:
                _check_weights_match(directory, consensus["fingerprints"])
            self._certckpt_commit(directory, state, step=step, branch=branch, first=first, evidence=evidence)
            run.last_step = step  # (main process) the next record's range starts after a committed checkpoint
            self._certckpt_rotate()
            self._certckpt_retire_deleted()

        def finish() -> None:
            if not self.is_main_process:
                return
            if evidence is not None:  # taken now: the audit moves on while a background commit waits
                consensus["fingerprints"] = audit.consensus_fingerprints()
                audit.flush()  # the events up to this checkpoint reach the ledger before its commit
            if run.pipeline is None:
                commit()
            else:  # the manifest is written in the background while training moves the originals on
                state.update(host_copy(state))
                run.pipeline.submit(directory, in_flight, commit)

        self._certckpt_together(finish, what="checkpoint commit")
        if run.pipeline is not None:
            run.in_flight = (evidence, self.project_configuration.iteration, owned)

    def _certckpt_clear_leftover(self, directory: str, ledger: Ledger, *, step: int, ours: bool) -> None:
        """Before a save into ``directory`` (the main process): refused when a committed checkpoint is
        there (even one whose manifest is gone: committed files are never written over). Removed
        first, so that none of its files is taken into the next checkpoint: ``ours``, the
        ``checkpoint_<i>`` this run's own last save created and left when it failed before its
        commit (in the background too; the number is taken again), with a manifest too (this run
        knows its commit failed, and no record points there); or a directory that a save of this run
        at ``step`` provably left (``leftover_problem``: a crash's, no manifest). Never a symbolic
        link. A directory of unknown origin is never removed (doubt frees no space): the save writes
        into it, as Accelerate's does; a pickle found there is refused, and so is a file under a name
        the save writes."""
        if not self.is_main_process or not os.path.isdir(directory):
            return
        cid = committed_into(ledger, directory)
        if cid is not None:
            raise CheckpointExistsError(
                f"{directory}: {cid} is committed there; committed checkpoints are never written over: save "
                "into a new directory"
            )
        remove = ours or leftover_problem(directory, run=self.certckpt.run, step=step) is None
        if remove and not os.path.islink(directory):
            logger.warning("certckpt: removing %s, left uncommitted by an earlier save of this run", directory)
            shutil.rmtree(directory)

    def _certckpt_together(self, fn: Any, *, what: str) -> Any:
        return together(fn, what=what, device=self.device)

    def certckpt_wait(self) -> None:
        """Wait for the checkpoint in flight (``async_save=True``; call it on every process): when it
        failed, every process raises ``AsyncSaveError`` and latest-good still names the one before.
        ``save_state``, ``load_state`` and ``end_training`` call it first."""
        run = self.certckpt
        if run.pipeline is None:
            return
        in_flight, run.in_flight = run.in_flight, None
        try:
            self._certckpt_together(run.pipeline.wait, what="asynchronous checkpoint")
        except BaseException:
            if in_flight is not None:  # never committed: as a synchronous save that failed
                evidence, iteration, run.failed = in_flight
                if evidence is not None and run.audit is not None:  # its steps join the next lineage
                    run.audit.reopen_lineage(evidence)
                # the next automatic save takes its number again (its leftover directory removed first)
                self.project_configuration.iteration = min(self.project_configuration.iteration, iteration)
            raise

    def end_training(self) -> None:
        """``Accelerator.end_training``, after the checkpoint in flight is committed (``async_save``)."""
        self.certckpt_wait()
        super().end_training()

    def _certckpt_target(self, output_dir: str | None) -> str:
        """The directory ``save_state`` writes: Accelerate's automatic ``checkpoint_<iteration>``, or
        the one given."""
        config = self.project_configuration
        if config.automatic_checkpoint_naming:
            if config.project_dir is None:
                raise ConfigurationError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...)")
            directory = os.path.join(config.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
        elif output_dir is None:
            raise ConfigurationError(
                "save_state() without a directory needs ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        else:
            directory = os.fspath(output_dir)
        return directory

    def _certckpt_write_files(self, directory: str, step: int, known: Any, in_flight: list[SaveFuture]) -> None:
        """Every process its RNG file; the main process the weights and the other states. The files
        are made durable together, under their names when this returns (``durable_together``); with
        ``async_save`` the main process's states are snapshotted and their saves left running, their
        futures appended to ``in_flight`` (waited for here when anything else fails)."""
        try:
            self._certckpt_write_all(directory, step, known, in_flight)
        except BaseException:
            for future in in_flight:  # nothing of a failed save keeps running behind the error
                future.exception()
            raise

    def _certckpt_write_all(self, directory: str, step: int, known: Any, in_flight: list[SaveFuture]) -> None:
        os.makedirs(directory, exist_ok=True)
        weights = []
        if self.is_main_process:
            weights = [self.unwrap_model(m).state_dict() for m in self._models]
            for hook in self._save_model_state_pre_hook.values():
                hook(self._models, weights, directory)  # a hook may write files and remove weights
        # the hooks ran outside the block: a hook's own save is under its name when the hook returns
        with durable_together() as batch:
            if self.is_main_process:
                for path in _visible_files(directory):  # a hook's files: the manifest lists them, durable or not
                    batch.add_existing(path)
            self._certckpt_write_states(directory, step, known, weights, in_flight)

    def _certckpt_write_states(
        self, directory: str, step: int, known: Any, weights: list[Any], in_flight: list[SaveFuture]
    ) -> None:
        name = self.certckpt.run
        # With async_save the main process hands every file to a saver (snapshotted now, written and
        # fsync'd in the background, where its commit waits for them). Another process's RNG file is
        # written at once: the main process's commit cannot wait on another process's saver.
        pipeline = self.certckpt.pipeline if self.is_main_process else None

        def write(obj: Any, file_name: str, **kwargs: Any) -> None:
            path = os.path.join(directory, file_name)
            if pipeline is None:
                save_certified(obj, path, step=step, run=name, **kwargs)
            else:
                in_flight.append(pipeline.saver_for(file_name).save(obj, path, step=step, run=name, **kwargs))

        if self.is_main_process:
            for i, w in enumerate(weights):
                write(w, indexed_name("model", i), **_known(known))
            for i, opt in enumerate(self._optimizers):
                write(opt.state_dict(), indexed_name("optimizer", i))
            for i, sched in enumerate(self._schedulers):
                write(sched.state_dict(), indexed_name("scheduler", i))
            for i, obj in enumerate(self._custom_objects):
                try:
                    write(obj.state_dict(), f"custom_checkpoint_{i}.safetensors")
                except UnsupportedObjectError as e:
                    raise UnsupportedObjectError(
                        f"register_for_checkpointing object {i} ({type(obj).__name__}): its state_dict() cannot be "
                        f"stored without pickle: {e}"
                    ) from e
        write(_rng_states(), rng_file_name(self.process_index))

    def _certckpt_manifest_state(self) -> dict[str, Any]:
        """What the manifest holds beside the files table: Accelerate's counters, the samplers',
        dataloaders' and gradient scaler's states."""
        return {
            "accelerator_step": int(self.step),
            "optimizer_steps": int(self.certckpt.steps),
            "num_processes": int(self.num_processes),
            "gradient_accumulation_steps": int(self.gradient_accumulation_steps),
            "dataloaders": [_dataloader_state(dl) for dl in self._dataloaders],
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def _certckpt_commit(
        self, directory: str, state: dict[str, Any], *, step: int, branch: str, first: int, evidence: Any
    ) -> None:
        run = self.certckpt
        ledger = self.certckpt_ledger(directory)
        fields = RecordFields(
            step=step,
            run=run.run,
            branch=branch,
            parent=run.parent,
            step_range=[first, step],
            lineage=evidence.lineage if evidence is not None else None,
            consensus_fp=evidence.consensus_fp if evidence is not None else None,
        )
        result = write_manifest(directory, state, fields)
        cid = ckpt_id_for(branch, step)
        if cid in _snapshot(ledger).records:
            logger.warning(
                "%s: step %d is committed already (%s); this checkpoint is certified but not committed",
                directory,
                step,
                cid,
            )
            return
        # the events were flushed before the manifest (commit()); the branch was started at the resume
        commit_saved(ledger, result, fields, branch_started=True)

    # --- rotation: total_limit, never latest-good ---------------------------------------------

    def _certckpt_rotate(self) -> None:
        """``total_limit`` as Accelerate applies it (the oldest ``checkpoint_<i>`` deleted), after the
        new checkpoint is committed, and never deleting what the deletion gate keeps: the run's
        latest-good stays, with a warning, until a newer checkpoint is trusted."""
        config = self.project_configuration
        limit = config.total_limit
        if not config.automatic_checkpoint_naming or limit is None or config.project_dir is None:
            return
        limit = max(int(limit), 1)
        folders = _numbered(os.path.join(config.project_dir, "checkpoints"))
        if len(folders) <= limit:
            return
        ledger = self.certckpt_ledger()
        status = certify_store(ledger.store, write_certificates=False)
        good = status.entry(status.latest_good).url if status.latest_good else None
        good_dir = os.path.dirname(os.path.abspath(good)) if good and "://" not in good else None
        committed = {os.path.dirname(os.path.abspath(ledger.url_of(r))): c for c, r in status.snapshot.records.items()}
        remaining = len(folders)
        for folder in folders[:-1]:  # the newest stays
            if remaining <= limit:
                break
            why = _keeps(status, committed.get(os.path.abspath(folder)), folder, good_dir)
            if why is not None:
                logger.warning(
                    "kept %s: %s; total_limit=%d would delete it. It is deleted once a newer checkpoint is"
                    " trusted (until then it costs one more checkpoint of disk)",
                    folder,
                    why,
                    limit,
                )
                continue
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1

    def _certckpt_retire_deleted(self) -> None:
        """Record each committed checkpoint whose directory is gone (``total_limit``, or by hand), so
        that status and latest-good know it was deleted, not damaged."""
        ledger = self.certckpt_ledger()
        snap = _snapshot(ledger)
        for cid, rec in snap.records.items():
            if cid in snap.retired:
                continue
            url = ledger.url_of(rec)
            if "://" not in url and not os.path.exists(url) and not os.path.exists(os.path.dirname(url)):
                why = ledger.retire_gone(
                    cid, reason="checkpoint directory deleted (total_limit, or by hand)", policy="accelerate"
                )
                if why is not None:
                    logger.warning("certckpt: %s", why)

    # --- loading ------------------------------------------------------------------------------

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs: Any
    ) -> str | None:
        """``Accelerator.load_state``, verified: the directory as a whole on every process first, then
        every state, the RNG states restored and checked, and a new branch for what follows.

        Args:
            input_dir: a certified ``save_state`` directory, its manifest, or a checkpoint id
                (``main@40``); ``None``: the store's latest good checkpoint (trusted first, then
                verified) whose files all verify, or nothing when the store has committed nothing yet
                (a first run: the same line serves the first run and every restart).
            load_kwargs, load_model_func_kwargs: ``strict=`` for the models' ``load_state_dict`` only.

        Returns:
            The directory loaded, or None (nothing to resume from).

        Raises:
            CorruptCheckpointError: a file is missing, swapped or edited, or an RNG state did not
                restore (every process raises; nothing was loaded).
            NotACheckpointError: not a certified directory (plain Accelerate's pickles are named,
                with the way to convert them).
            CheckpointNotFoundError: ``None`` and the store holds checkpoints, none of them good.
        """
        self.certckpt_wait()  # a checkpoint in flight is committed before the store is read
        strict = bool(load_model_func_kwargs.pop("strict", True))
        load_model_func_kwargs.pop("map_location", None)  # states are read to the CPU and moved by their owners
        if load_model_func_kwargs or load_kwargs:
            raise ConfigurationError(
                f"load_state: {sorted(load_model_func_kwargs) + sorted(load_kwargs or {})} are not supported by "
                "CertifiedAccelerator (strict= is)"
            )
        chosen: dict[str, str | None] = {"dir": None}

        def find() -> None:
            chosen["dir"] = self._certckpt_latest_good() if input_dir is None else self._certckpt_resolve(input_dir)

        self._certckpt_together(find, what="checkpoint load")
        directory = chosen["dir"]
        if directory is None:
            self.certckpt_decide_fresh()
            return None
        self._certckpt_together(lambda: self._certckpt_load(directory, strict=strict), what="checkpoint load")
        run = self.certckpt
        if run.parent is not None:
            branch, parent = run.branch, run.parent
            assert branch is not None
            ledger = self.certckpt_ledger()
            # written once every process has decided (a process still reading would see the branch taken)
            self._certckpt_together(
                lambda: ledger.start_branch(branch, parent=parent) if self.is_main_process else None, what="resume"
            )
        return directory

    def _certckpt_latest_good(self) -> str | None:
        """The newest good checkpoint (trusted first, then verified) whose every file verifies now."""
        return latest_intact_directory(self.certckpt_ledger(), verify_state_dir, write_certificates=False, log=logger)

    def _certckpt_resolve(self, value: Any) -> str:
        return committed_directory(value, self.certckpt_ledger, MANIFEST_NAME)

    def _certckpt_load(self, directory: str, *, strict: bool) -> None:
        """Verify, decide the branch, then load every state (this process's part)."""
        report = require_intact(directory)
        path, files, step = manifest_of(directory)
        record = inspect(path).record
        state = load(path, map_location="cpu")
        saved = int(state.get("num_processes", 1))
        mine = rng_file_name(self.process_index)
        if saved != self.num_processes or mine not in files:
            raise CorruptCheckpointError(
                f"refusing to load {directory}: saved by {saved} process(es), loading with {self.num_processes}; "
                f"{mine} {'is not' if mine not in files else 'is'} in it, and the RNG states would not continue the "
                f"run: launch {saved} processes to resume it"
            )
        self._certckpt_branch_from(directory, record, step or 0)
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, directory)  # a hook may load some models itself and remove them from the list
        for i, model in enumerate(models):
            weights = load(os.path.join(directory, indexed_name("model", i)), map_location="cpu")
            self.unwrap_model(model).load_state_dict(weights, strict=strict)
        for i, opt in enumerate(self._optimizers):
            opt.load_state_dict(load(os.path.join(directory, indexed_name("optimizer", i)), map_location="cpu"))
        for i, sched in enumerate(self._schedulers):
            sched.load_state_dict(load(os.path.join(directory, indexed_name("scheduler", i)), map_location="cpu"))
        customs = sorted(n for n in report.files if n.startswith("custom_checkpoint_"))
        if len(customs) != len(self._custom_objects):
            raise ConfigurationError(
                f"{directory}: {len(customs)} custom checkpoint(s), {len(self._custom_objects)} object(s) registered "
                "with register_for_checkpointing: register the same objects as the run that saved it"
            )
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(load(os.path.join(directory, f"custom_checkpoint_{i}.safetensors"), map_location="cpu"))
        for dl, dl_state in zip(self._dataloaders, state.get("dataloaders") or []):
            _load_dataloader_state(dl, dl_state)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state.get("accelerator_step", 0))
        self.certckpt.steps = int(state.get("optimizer_steps", step or 0))
        _restore_rng(os.path.join(directory, mine), load(os.path.join(directory, mine), map_location="cpu"))
        config = self.project_configuration
        if config.automatic_checkpoint_naming and config.project_dir is not None:
            # new names follow every existing one: a resumed branch never reuses a directory
            taken = _numbered(os.path.join(config.project_dir, "checkpoints"))
            last = int(_CHECKPOINT_DIR.match(os.path.basename(taken[-1])).group(1)) if taken else -1  # type: ignore[union-attr]
            config.iteration = max(config.iteration, last + 1)

    def _certckpt_branch_from(self, directory: str, record: Any, step: int) -> None:
        """A load always opens a new branch forked from the checkpoint (``main`` -> ``main-r1``, or
        the name asked for), as ``certckpt.trust.resume.branch_after_load`` decides; its parent is
        the committed checkpoint when this very file is the one committed (else it starts without
        one, with a warning, and the audit proves nothing at the start)."""
        run = self.certckpt
        ledger = self.certckpt_ledger()
        snap = _snapshot(ledger)
        choice = branch_after_loading(ledger, record, step=step, snap=snap, requested=run.requested)
        if choice.parent is None:
            logger.warning(
                "%s is not a checkpoint committed to %s; branch %s starts without a parent",
                directory,
                ledger.store,
                choice.branch,
            )
        run.branch, run.parent, run.last_step = choice.branch, choice.parent, step
        run.resumed_fp = record.consensus_fp if choice.parent is not None else None


# --- helpers ------------------------------------------------------------------------------------


def _known(known: Any) -> dict[str, Any]:
    return {"known_fingerprints": known} if known else {}


def _visible_files(directory: str) -> list[str]:
    """The regular files of ``directory`` but hidden ones (writers' temp files)."""
    with os.scandir(directory) as entries:
        return sorted(e.path for e in entries if not e.name.startswith(".") and e.is_file(follow_symlinks=False))


def _numbered(parent: str) -> list[str]:
    """Accelerate's ``checkpoint_<i>`` directories under ``parent``, oldest first."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _CHECKPOINT_DIR.match(n))]
    return [os.path.join(parent, n) for _, n in sorted(found)]


def _keeps(status: StoreStatus, cid: str | None, folder: str, good_dir: str | None) -> str | None:
    """Why the deletion gate keeps this directory (``cid``: the checkpoint committed there); None: it may go."""
    if os.path.abspath(folder) == good_dir:
        return f"{status.latest_good} is the run's latest-good"
    if cid is None:
        doubt = store_doubt(status.snapshot)
        return None if doubt is None else f"{doubt}; nothing is deleted on doubt"
    return rotation_keeps(
        cid, snap=status.snapshot, verdicts=status.certification.verdicts, latest_good=status.latest_good
    )


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng(path: str, states: Any) -> None:
    """Set this process's RNG states from its file, then check that they are what the file holds.

    Raises:
        CorruptCheckpointError: a state is missing or does not restore.
    """
    try:
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:
            torch.cuda.set_rng_state_all(states["cuda"])
        numpy_now: Any = np.random.get_state()  # the legacy tuple (name, keys, pos, has_gauss, cached)
        ok = (
            random.getstate() == tuple(states["python"])
            and torch.equal(torch.random.get_rng_state(), states["cpu"])
            and np.array_equal(numpy_now[1], states["numpy"][1])
        )
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{path}: the RNG state did not restore ({type(e).__name__}: {e}); resuming would not continue the run: "
            "load another checkpoint"
        ) from e
    if not ok:
        raise CorruptCheckpointError(
            f"{path}: the RNG state read back differs from the file's after restoring it; load another checkpoint"
        )


def _dataloader_state(dl: Any) -> dict[str, Any]:
    """What a prepared dataloader needs to continue: its epoch count, its seedable sampler's epoch
    and seed, a stateful dataloader's own state."""
    out: dict[str, Any] = {"iteration": getattr(dl, "iteration", None)}
    sampler = dl.get_sampler() if hasattr(dl, "get_sampler") else None
    if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch"):
        out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(dl, "use_stateful_dataloader", False):
        out["stateful"] = dl.state_dict()
    return out


def _load_dataloader_state(dl: Any, state: Any) -> None:
    if not isinstance(state, dict):
        raise CorruptCheckpointError("the manifest's dataloader state is not a mapping")
    if state.get("iteration") is not None and hasattr(dl, "iteration"):
        dl.iteration = int(state["iteration"])
    sampler = dl.get_sampler() if hasattr(dl, "get_sampler") else None
    if sampler is not None and state.get("sampler") is not None and hasattr(sampler, "initial_seed"):
        sampler.epoch = int(state["sampler"]["epoch"])
        sampler.initial_seed = int(state["sampler"]["initial_seed"])
    if state.get("stateful") is not None and hasattr(dl, "load_state_dict"):
        dl.load_state_dict(state["stateful"])


def _check_weights_match(directory: str, fingerprints: dict[str, str] | None) -> None:
    """The weights written are the ones every replica agreed on: each model tensor's fingerprint in
    its file's record equals the agreed fingerprint of the parameter of that name."""
    if not fingerprints:
        return
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("model") and name.endswith(".safetensors")):
            continue
        for tensor, entry in inspect(os.path.join(directory, name)).record.tensors.items():
            want = fingerprints.get(tensor)
            if want is not None and entry.get("fp") != want:
                raise CorruptCheckpointError(
                    f"{directory}/{name}: tensor `{tensor}` has fingerprint {entry.get('fp')}, every replica agreed "
                    f"on {want}; the weights changed between the consensus and the write: not committed"
                )
