"""``CertifiedTrainerMixin``: a Hugging Face ``Trainer`` whose checkpoints are certified and committed.

What changes against the plain ``Trainer`` (private methods of transformers 5.x, each pinned by a test
in ``tests/integrations/test_integration_transformers.py``):

- ``_save``: weights through ``save_pretrained`` with certified shards; ``training_args.json``
  (``TrainingArguments.to_json_string()``) instead of the pickled ``training_args.bin``;
- ``_save_optimizer_and_scheduler``, ``_save_scaler``: write nothing; their states go into the
  checkpoint's manifest (``trainer.safetensors``), written last;
- ``_save_rng_state``: a certified RNG file per process instead of ``rng_state*.pth``;
- ``_finalize_training``: the plain one without its end-of-training cleanup (``save_total_limit=1``
  with a best model), which runs afterwards with latest-good kept;
- ``_save_checkpoint``: the plain one, then the manifest over every file of ``checkpoint-N/``, then
  its commit to the ledger beside the output (``OUTPUT_DIR/_ledger``), then ``save_total_limit``'s
  rotation (moved after the commit, and never deleting the run's latest-good), then a retirement
  record for each checkpoint it deleted;
- ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``: from those files;
- ``_load_best_model``: the checkpoint is verified first;
- ``_get_output_dir``: a resumed run trains on a new branch (``main-r1``...) and writes its
  checkpoints under ``OUTPUT_DIR/<branch>/``: the interrupted branch's stay as they were;
- ``train``: ``resume_from_checkpoint`` is verified (every file against the manifest) before
  anything is loaded; ``True`` means the store's latest good checkpoint (trusted, else verified)
  whose files all verify, not the newest directory; a fresh run refuses a store whose branch
  holds checkpoints already;
- ``training_step``: hands each micro-batch to the ``AuditCallback``, when there is one.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
import transformers
from transformers.trainer_pt_utils import set_rng_state_for_device
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.training_args import ParallelMode
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from certckpt.detect.agreement import refuse_together, wire_device_for
from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    ConfigurationError,
    CorruptCheckpointError,
)
from certckpt.format.asyncsave import SaveFuture
from certckpt.format.pipeline import CheckpointPipeline, host_copy
from certckpt.format.reader import load
from certckpt.format.record import RecordFields
from certckpt.format.verify import inspect
from certckpt.format.writer import save_certified
from certckpt.log import enable as enable_log
from certckpt.storage import write_atomic
from certckpt.trust.commit import commit_saved
from certckpt.trust.gate import rotation_keeps, store_doubt
from certckpt.trust.ledger import Ledger, ckpt_id_for, is_ckpt_id
from certckpt.trust.resume import branch_after_loading
from certckpt.trust.runstore import (
    StoreStatus,
    certify_store,
    committed_directory,
    latest_intact_directory,
    taken_problem,
)
from certckpt.trust.runstore import snapshot_or_empty as _snapshot

from .audit import AuditCallback
from .checkpoint import (
    ARGS_NAME,
    MANIFEST_NAME,
    leftover_problem,
    manifest_of,
    require_intact,
    rng_file_name,
    verify_checkpoint,
    write_manifest,
)
from .saving import ShardWriter, save_pretrained

__all__ = ["CertifiedTrainerMixin", "CertifiedTrainer", "CertifiedRun"]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    # The mixin is written against the Trainer it precedes in the MRO: mypy checks it as a subclass
    # of transformers.Trainer (the attributes it reads, the methods it overrides, its super() calls).
    # At run time it derives from object, as it always did, and mixes into any Trainer subclass.
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


@dataclass(kw_only=True, slots=True)
class CertifiedRun:
    """Where a certified Trainer commits, and as what (``trainer.certckpt``).

    Attributes:
        ledger: the run store whose ledger records every checkpoint (default: the output directory).
        run: the run name in every record.
        branch: the line of training, decided at ``train()``: ``main`` (or the name asked for) for
            a fresh run; for a resume a new branch, ``<branch>-r<N>``.
        parent: the checkpoint id this branch resumed from: None for a fresh run, and for a resume
            from files that are not the ones the store committed (another store's, or replaced).
        resumed_fp: the consensus fingerprint the committed parent recorded (None without a parent,
            or without audit evidence): ``AuditCallback`` proves every replica holds exactly it
            before the first step.
        subdir: whether this branch's checkpoints go under ``OUTPUT_DIR/<branch>/`` (a resumed
            branch: its checkpoint directories must not collide with the interrupted branch's).
        requested: the branch name passed to the Trainer, if any.
        audit: the bound ``AuditCallback``, if any.
    """

    ledger: Ledger
    run: str
    requested: str | None = None
    branch: str | None = None
    parent: str | None = None
    resumed_fp: str | None = None
    subdir: bool = False
    audit: AuditCallback | None = None
    saving_step: int | None = None  # set while a checkpoint is written (its shards carry the step)
    last_step: int | None = None  # the previous checkpoint's step on this branch (the record's step range)
    resumed_state: dict[str, Any] | None = None  # the manifest's content, loaded once per resume
    pipeline: CheckpointPipeline | None = None  # async_save=True: the checkpoint in flight
    shards: dict[str, SaveFuture] = field(default_factory=dict)  # this checkpoint's shards in flight

    def decided_branch(self) -> str:
        """``branch``, which ``train()`` decides before any checkpoint is written or committed."""
        if self.branch is None:
            raise CertckptError("the certified Trainer has no branch yet: it decides one in train()")
        return self.branch


class CertifiedTrainerMixin(_TrainerBase):
    """Put it before the Trainer class: ``class MyTrainer(CertifiedTrainerMixin, Trainer)``.

    Args:
        run: the run name recorded in the ledger (default: the output directory's name).
        branch: the branch to train on (default: ``main`` for a fresh run, ``<branch>-r<N>`` for a
            resume).
        ledger: the run store (default: ``args.output_dir``; ``certckpt status`` reads it).
        async_save: save checkpoints in the background: training waits only for a snapshot of the
            weights and the optimizer state in host memory; the files, the manifest and the commit
            follow (docs/integrations.md, "Saving in the background"). One checkpoint is in flight
            at a time: the next waits for it, and a failure is raised at the next checkpoint or at
            the end of training, on every rank.
        *args, **kwargs: the Trainer's own.

    Example:
        >>> trainer = CertifiedTrainer(model=model, args=args, train_dataset=ds)
        >>> trainer.train()                                # checkpoint-N/ certified and committed
        >>> trainer.train(resume_from_checkpoint=True)     # from the latest good checkpoint
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
        if self.args.process_index == 0:
            enable_log()  # one line per audit and per resume, from the main process (docs/integrations.md)
        _refuse_unsupported(self)
        store = ledger or self._certckpt_output_dir()
        name = run or os.path.basename(os.path.abspath(self._certckpt_output_dir()).rstrip("/")) or "run"
        if branch is not None and not is_ckpt_id(ckpt_id_for(branch, 0)):
            raise ConfigurationError(f"branch {branch!r}: use 1-100 letters, digits, '.', '_' or '-'")
        self.certckpt = CertifiedRun(ledger=Ledger(os.fspath(store)), run=name, requested=branch)
        if async_save:
            self.certckpt.pipeline = CheckpointPipeline()

    def _certckpt_output_dir(self) -> str:
        """``args.output_dir``, which ``TrainingArguments`` always sets (``trainer_output`` by default)."""
        if self.args.output_dir is None:
            raise ConfigurationError("TrainingArguments.output_dir is None: the certified Trainer needs a directory")
        return self.args.output_dir

    # --- resuming -----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; ``resume_from_checkpoint`` takes a checkpoint directory, its manifest, a
        checkpoint id (``main@500``) or ``True`` (the store's latest good checkpoint, trusted or
        verified). The checkpoint is verified on every rank before anything is loaded.

        Raises:
            CorruptCheckpointError: a file of the checkpoint does not match its manifest.
            NotACheckpointError: the directory was not written by a certified Trainer.
            CheckpointNotFoundError: ``True`` and the store holds checkpoints, none of them good (a
                store with none yet starts from scratch).
            ConfigurationError: a fresh run into a store whose branch holds checkpoints already.
            CheckpointExistsError: a ``checkpoint-<N>/`` this run would save into later holds a
                committed checkpoint or files of unknown origin (refused before the first step).
        """
        run = self.certckpt
        run.audit = next((c for c in self.callback_handler.callbacks if isinstance(c, AuditCallback)), None)
        if run.audit is not None:
            run.audit.bind(self)
        chosen: dict[str, str | None] = {"dir": None}

        def prepare() -> None:
            if resume_from_checkpoint is None or resume_from_checkpoint is False:
                self._certckpt_prepare(None)
            elif resume_from_checkpoint is True:
                chosen["dir"] = self._certckpt_latest_good()
                self._certckpt_prepare(chosen["dir"], verified=chosen["dir"] is not None)
            else:
                chosen["dir"] = self._certckpt_resolve(resume_from_checkpoint)
                self._certckpt_prepare(chosen["dir"])

        self._certckpt_together(prepare, what="resume")
        # before the branch is recorded: a refused run leaves nothing behind
        self._certckpt_together(lambda: self._certckpt_check_ahead() if self.args.should_save else None, what="resume")
        if run.parent is not None:
            # Written once every rank has decided: a rank still reading the ledger would otherwise see
            # the new branch taken and name another.
            branch = run.decided_branch()
            self._certckpt_together(
                lambda: run.ledger.start_branch(branch, parent=run.parent) if self.args.should_save else None,
                what="resume",
            )
        run.resumed_state = None
        try:
            result = super().train(chosen["dir"], *args, **kwargs)
        except BaseException:
            self._certckpt_drain()  # the checkpoint in flight is finished; the training error is raised
            raise
        else:
            self._certckpt_wait()
            return result
        finally:
            run.resumed_state = None
            if self.args.should_save:
                self._certckpt_retire_deleted()

    def _certckpt_wait(self) -> None:
        """Wait for the checkpoint in flight (``async_save=True``); when it failed on the saving rank,
        every rank raises ``AsyncSaveError``."""
        pipeline = self.certckpt.pipeline
        if pipeline is not None:
            self._certckpt_together(pipeline.wait, what="asynchronous checkpoint")

    def _certckpt_drain(self) -> None:
        """After a training error: finish the checkpoint in flight, logging (not raising) its failure."""
        pipeline = self.certckpt.pipeline
        if pipeline is None:
            return
        try:
            pipeline.wait()
        except CertckptError as e:
            logger.error("certckpt: %s", e)

    def _certckpt_latest_good(self) -> str | None:
        """The newest good checkpoint (trusted first, then verified) whose every file verifies now;
        None when the store has committed nothing yet (a first run starts from scratch, so the same
        ``train(resume_from_checkpoint=True)`` line serves the first run and every restart).

        ``certckpt latest-good`` re-verifies the committed file, the manifest; the other files of the
        directory are checked here, and a checkpoint with a damaged one is skipped, with a warning.
        """
        return latest_intact_directory(
            self.certckpt.ledger,
            verify_checkpoint,
            write_certificates=self.args.should_save,
            log=logger,
            prefix="certckpt: ",
        )

    def _certckpt_resolve(self, value: Any) -> str:
        ledger = self.certckpt.ledger
        return committed_directory(value, lambda: ledger, MANIFEST_NAME)

    def _certckpt_prepare(self, directory: str | None, *, verified: bool = False) -> None:
        """Verify the checkpoint, then decide the branch (the same decision on every rank).

        A fresh run trains on ``main`` (or the branch asked for), which must hold nothing yet. A
        resume always opens a new branch forked from the checkpoint (``main`` -> ``main-r1`` ->
        ``main-r2``, as ``certckpt.plan_resume`` names them): the interrupted branch may hold steps
        after the checkpoint (checkpoints, audit events) that the new run does again; the branch
        record supersedes what they left awaiting evidence (docs/trust.md, "Resuming").
        """
        run = self.certckpt
        snap = _snapshot(run.ledger)
        if directory is None:
            run.branch = run.requested or "main"
            mine = sorted(r["step"] for r in snap.records.values() if r["branch"] == run.branch)
            if mine:
                raise ConfigurationError(
                    f"{run.ledger.store}: the ledger holds checkpoints of branch {run.branch!r} already (newest "
                    f"{ckpt_id_for(run.branch, mine[-1])}); resume with train(resume_from_checkpoint=True), train into "
                    "another output_dir, or pass another branch name: CertifiedTrainer(..., branch=...)"
                )
            run.parent, run.subdir, run.last_step, run.resumed_fp = None, False, None, None
            return
        if not verified:
            require_intact(directory)
        path, _, step = manifest_of(directory)
        record = inspect(path).record
        # The committed checkpoint is this very file when the header digests agree (wherever it lies now).
        choice = branch_after_loading(run.ledger, record, step=step, snap=snap, requested=run.requested)
        if choice.parent is None:
            logger.warning(
                "certckpt: %s is not a checkpoint committed to %s; branch %s starts without a parent",
                directory,
                run.ledger.store,
                choice.branch,
            )
        run.branch, run.parent, run.subdir, run.last_step = choice.branch, choice.parent, True, step
        # what the audit proves the replicas hold before the first step (the committed parent's weights)
        run.resumed_fp = record.consensus_fp if choice.parent is not None else None

    def _certckpt_together(self, fn, *, what: str) -> None:
        """Run ``fn`` on every rank; when it fails on any, every rank raises (none is left waiting in
        the next collective): the failing rank its own error, the others a ``CertckptError`` naming it."""
        if not _distributed():
            fn()
            return
        error: BaseException | None = None
        try:
            fn()
        except Exception as e:  # any failure, certckpt's or the file system's: the others must learn of it
            error = e
        wire = wire_device_for(dist.group.WORLD, self.args.device)
        try:
            refuse_together(None if error is None else str(error), group=dist.group.WORLD, wire_device=wire, what=what)
        except CertckptError as together:
            if error is not None:
                raise error from None
            raise CertckptError(str(together)) from None

    # --- saving -------------------------------------------------------------------------------

    def _get_output_dir(self, trial: Any) -> str:
        base = super()._get_output_dir(trial)
        run = self.certckpt
        return os.path.join(base, run.branch) if run.subdir and run.branch else base

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self._certckpt_output_dir()
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        run = self.certckpt
        in_training = run.saving_step is not None
        writer = ShardWriter(
            step=run.saving_step,
            run=run.run,
            overwrite=not in_training,
            pipeline=run.pipeline if in_training else None,
        )
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(model, transformers.PreTrainedModel):
            save_pretrained(model, output_dir, writer=writer, state_dict=state_dict, is_main_process=True)
        else:
            # The plain Trainer writes such a model's state dict as model.safetensors: so does this.
            writer(
                # the Trainer holds a model whenever it saves (model_init builds one before training)
                state_dict if state_dict is not None else self.model.state_dict(),  # type: ignore[union-attr]
                os.path.join(output_dir, "model.safetensors"),
            )
        if in_training:
            run.shards = writer.pending
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif (tokenizer := getattr(self.data_collator, "tokenizer", None)) is not None:
            tokenizer.save_pretrained(output_dir)
        write_atomic(os.path.join(output_dir, ARGS_NAME), self.args.to_json_string().encode("utf-8"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # held by the checkpoint's manifest, written at the end of _save_checkpoint

    def _save_scaler(self, output_dir: str) -> None:
        pass  # held by the manifest too

    def _save_rng_state(self, output_dir: str) -> None:
        states: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
        }
        if torch.cuda.is_available():
            distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
            states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
        os.makedirs(output_dir, exist_ok=True)
        name = rng_file_name(self.args.process_index, self.args.world_size)
        save_certified(states, os.path.join(output_dir, name), step=self.state.global_step, run=self.certckpt.run)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run = self.certckpt
        step = self.state.global_step
        output_dir = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
        self._certckpt_wait()  # one checkpoint in flight: the previous one is committed (or failed) first
        self._certckpt_together(
            lambda: self._certckpt_clear(output_dir, step) if self.args.should_save else None, what="checkpoint"
        )
        run.saving_step = step
        # The Trainer's own rotation runs inside its save, before this checkpoint is committed, and
        # knows nothing of latest-good: it is switched off there and done after the commit instead.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            run.saving_step = None
            self.args.save_total_limit = limit
        self._certckpt_commit(output_dir, step, run_dir=self._get_output_dir(trial=trial))

    def _certckpt_clear(self, output_dir: str, step: int) -> None:
        """Before a save into ``checkpoint-<step>/`` (the saving rank): a directory that a save of
        this run at this step left uncommitted (a crash; ``leftover_problem`` says what proves it)
        is removed, so none of its files is taken into the new checkpoint. Any other is refused, and
        nothing in it touched: a committed checkpoint is never written over, and a directory of
        unknown origin (a plain Trainer's, another run's, one whose manifest no record of this
        ledger commits) is never removed: doubt frees no space."""
        why = self._certckpt_collision(output_dir, step)
        if why is not None:
            raise CheckpointExistsError(why)
        if os.path.lexists(output_dir):
            logger.warning("certckpt: removing %s, left uncommitted by an earlier save of this run", output_dir)
            shutil.rmtree(output_dir)

    def _certckpt_collision(self, output_dir: str, step: int) -> str | None:
        """Why a save at ``step`` may not take ``output_dir`` (None: free, or this run's leftover)."""
        run = self.certckpt
        problem = taken_problem(run.ledger, output_dir, lambda d: leftover_problem(d, run=run.run, step=step))
        if problem is None:
            return None
        return (
            f"{output_dir}: not a leftover of this run's own save at step {step} ({problem}), so certckpt neither "
            "writes into it nor removes it: move it away, or train into another output_dir"
        )

    def _certckpt_check_ahead(self) -> None:
        """Before the first step (the saving rank): every ``checkpoint-<N>/`` this branch would save
        into later is free or this run's leftover, so a collision fails now, not after hours of
        training at its step."""
        run_dir = self._get_output_dir(trial=None)
        start = self.certckpt.last_step or 0
        if not os.path.isdir(run_dir):
            return
        for name in sorted(os.listdir(run_dir)):
            found = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name)
            if found and int(found.group(1)) > start:
                why = self._certckpt_collision(os.path.join(run_dir, name), int(found.group(1)))
                if why is not None:
                    raise CheckpointExistsError(why)

    def _certckpt_commit(self, output_dir: str, step: int, *, run_dir: str | None = None) -> None:
        """Write the manifest and commit the checkpoint (rank 0); every rank raises if that fails.
        With ``async_save`` the manifest and the commit run in the background once the shards are
        durable; what they need from this step is copied first."""
        run = self.certckpt
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's RNG file is on disk
        consensus = run.audit.checkpoint_consensus(step) if run.audit is not None else None
        state = {
            # the Trainer creates the optimizer before it saves a checkpoint
            "optimizer": None if self.args.save_only_model else self.optimizer.state_dict(),  # type: ignore[union-attr]
            "scheduler": None
            if self.args.save_only_model or self.lr_scheduler is None
            else self.lr_scheduler.state_dict(),
            "scaler": _scaler_state(self),
        }
        lineage = run.audit.lineage() if run.audit is not None else None
        if run.audit is not None and self.args.should_save:
            run.audit.flush()  # the events up to this checkpoint reach the ledger before its commit
        first = (run.last_step or 0) + 1
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint

        def commit() -> None:
            if consensus is not None:
                _check_weights_match(output_dir, consensus[1])
            fields = RecordFields(
                step=step,
                run=run.run,
                branch=run.decided_branch(),
                parent=run.parent,
                step_range=[first, step],
                lineage=lineage,
                consensus_fp=consensus[0] if consensus else None,
            )
            result = write_manifest(output_dir, state, fields)
            # the events were flushed above, before the background; the branch was started at the resume
            commit_saved(run.ledger, result, fields, branch_started=True)
            if run_dir is not None:
                self._certckpt_rotate(run_dir, limit=limit, best=best)
            self._certckpt_retire_deleted()

        shards, run.shards = run.shards, {}
        if run.pipeline is not None:
            if self.args.should_save:
                state = host_copy(state)  # training moves the optimizer on while the manifest is written
                run.pipeline.submit(f"{output_dir}", list(shards.values()), commit)
        else:
            self._certckpt_together(lambda: commit() if self.args.should_save else None, what="checkpoint commit")
        run.last_step = step
        if run.audit is not None:
            run.audit.checkpoint_done()

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: Any):
        # At the end of training the plain Trainer deletes every checkpoint but the best one when
        # save_total_limit=1 (with a best model): that cleanup runs here instead, latest-good kept.
        self._certckpt_wait()  # the best model may be the checkpoint in flight
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            result = super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save and self.state.best_model_checkpoint is not None and limit == 1:
            self._certckpt_rotate(self._get_output_dir(trial=trial), limit=1, keep_newest=False)
        return result

    def _certckpt_rotate(
        self, run_dir: str, *, limit: int | None = None, keep_newest: bool = True, best: str | None = None
    ) -> None:
        """``save_total_limit`` as the Trainer applies it (the newest and the best checkpoint kept, the
        oldest others deleted; at the end of training only the best), after the new checkpoint is
        committed, and never deleting the run's latest-good: it stays, with a warning, until a newer
        checkpoint is trusted."""
        limit = self.args.save_total_limit if limit is None else limit
        best = self.state.best_model_checkpoint if best is None else best
        if limit is None or limit <= 0:
            return
        checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=False)
        # A resumed branch writes under OUTPUT_DIR/<branch>/, away from the checkpoint it resumed from:
        # that one counts as this run's oldest, as it would in the plain Trainer's single directory,
        # so the limit releases it once the gate lets it go (a newer checkpoint is latest-good).
        origin = self._certckpt_resumed_from_dir()
        if origin is not None and origin not in checkpoints:
            checkpoints.insert(0, origin)
        if len(checkpoints) <= limit:
            return
        protected = {checkpoints[-1]} if keep_newest else set()
        if best is not None:
            protected.add(str(Path(best)))
        ledger = self.certckpt.ledger
        status = certify_store(ledger.store, write_certificates=False)
        good = status.entry(status.latest_good).url if status.latest_good else None
        good_dir = os.path.abspath(os.path.dirname(good)) if good and "://" not in good else None
        # each committed checkpoint by its directory, once (a checkpoint-N/ holds one certified file)
        committed = {os.path.dirname(os.path.abspath(ledger.url_of(r))): c for c, r in status.snapshot.records.items()}
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if checkpoint in protected:
                continue
            why = self._certckpt_keeps(status, committed.get(os.path.abspath(checkpoint)), checkpoint, good_dir)
            if why is not None:
                logger.warning(
                    "certckpt: kept %s: %s; save_total_limit=%d would delete it. It is deleted once a newer"
                    " checkpoint is trusted and nothing is in doubt (until then it costs one more checkpoint of"
                    " disk)",
                    checkpoint,
                    why,
                    limit,
                )
                protected.add(checkpoint)
                continue
            shutil.rmtree(checkpoint, ignore_errors=True)
            remaining -= 1

    def _certckpt_resumed_from_dir(self) -> str | None:
        """The ``checkpoint-N/`` directory this branch resumed from, when it lies outside this branch's
        own directory and still exists (None for a fresh run)."""
        run = self.certckpt
        if run.parent is None:
            return None
        snap = _snapshot(run.ledger)
        record = snap.records.get(run.parent)
        if record is None or run.parent in snap.retired:
            return None
        url = run.ledger.url_of(record)
        if "://" in url:
            return None
        directory = os.path.dirname(url)
        if not os.path.basename(directory).startswith(f"{PREFIX_CHECKPOINT_DIR}-") or not os.path.isdir(directory):
            return None
        return directory

    def _certckpt_keeps(
        self, status: StoreStatus, cid: str | None, checkpoint: str, good_dir: str | None
    ) -> str | None:
        """Why the deletion gate keeps this checkpoint directory (``cid``: the checkpoint committed
        there, if any); None: the rotation may delete it."""
        if os.path.abspath(checkpoint) == good_dir:
            return f"{status.latest_good} is the run's latest-good"
        if cid is None:
            doubt = store_doubt(status.snapshot)
            return None if doubt is None else f"kept: {doubt}; nothing is deleted on doubt"
        verdicts = status.certification.verdicts
        return rotation_keeps(cid, snap=status.snapshot, verdicts=verdicts, latest_good=status.latest_good)

    def _certckpt_retire_deleted(self) -> None:
        """Record each committed checkpoint of this store whose manifest the Trainer deleted
        (``save_total_limit``), so that status and latest-good know it is gone, not damaged."""
        ledger = self.certckpt.ledger
        snap = _snapshot(ledger)
        for cid, rec in snap.records.items():
            if cid in snap.retired:
                continue
            url = ledger.url_of(rec)
            if "://" not in url and not os.path.exists(url) and not os.path.exists(os.path.dirname(url)):
                why = ledger.retire_gone(
                    cid,
                    reason="checkpoint directory deleted (the Trainer's save_total_limit, or by hand)",
                    policy="trainer",
                )
                if why is not None:
                    logger.warning("certckpt: %s", why)

    # --- loading ------------------------------------------------------------------------------

    def _certckpt_state(self, checkpoint: str) -> dict[str, Any]:
        run = self.certckpt
        if run.resumed_state is None:
            device = self.args.device
            where = device if self.args.world_size > 1 and device.type != "cpu" else "cpu"
            run.resumed_state = load(os.path.join(checkpoint, MANIFEST_NAME), map_location=where)
        return run.resumed_state

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = self._certckpt_state(checkpoint)
        if state.get("optimizer") is not None:
            # the Trainer creates the optimizer before it loads one from a checkpoint
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[union-attr]
        if state.get("scheduler") is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = self._certckpt_state(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if state.get("scaler") is not None and scaler is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, rng_file_name(self.args.process_index, self.args.world_size))
        if not os.path.isfile(path):
            logger.info(
                "certckpt: no RNG file %s (saved with another world size?); reproducibility is not guaranteed", path
            )
            return
        states = load(path, map_location="cpu")
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:
            distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
            set_rng_state_for_device("CUDA", torch.cuda, states, distributed)

    def _load_best_model(self) -> None:
        # the Trainer calls this only when best_model_checkpoint is set
        require_intact(self.state.best_model_checkpoint)  # type: ignore[arg-type]
        super()._load_best_model()

    # --- the audit's hand-off -----------------------------------------------------------------

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        audit = self.certckpt.audit
        if audit is not None:
            audit.before_micro_batch(inputs, num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)

    def certckpt_loss(
        self, module: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any, accumulation: int
    ) -> torch.Tensor:
        """The loss ``training_step`` back-propagates for one micro-batch, computed on ``module``
        (the bare model: the audit's replay). Mirrors ``Trainer.training_step`` of transformers 5.x."""
        with self.compute_loss_context_manager():
            # without return_outputs, compute_loss returns the loss alone
            loss = cast(torch.Tensor, self.compute_loss(module, dict(inputs), num_items_in_batch=num_items_in_batch))
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled:
            loss = loss / accumulation
        return loss / self.accelerator.gradient_accumulation_steps  # as Accelerator.backward divides


class CertifiedTrainer(CertifiedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with certified, committed checkpoints (see ``CertifiedTrainerMixin``)."""


def _refuse_unsupported(trainer: Any) -> None:
    major = int(transformers.__version__.split(".")[0])
    problems = []
    if major < 5:
        problems.append(f"transformers {transformers.__version__}: the certified Trainer overrides 5.x internals")
    for flag, what in (
        ("is_deepspeed_enabled", "DeepSpeed"),
        ("is_fsdp_enabled", "FSDP"),
        ("is_fsdp_xla_enabled", "FSDP on XLA"),
        ("is_distributed_loading_by_transformers", "a model sharded at load time (tensor parallelism)"),
    ):
        if getattr(trainer, flag, False):
            problems.append(f"{what} writes its own checkpoint files")
    if is_torch_xla_available() or is_sagemaker_mp_enabled():
        problems.append("XLA and SageMaker model parallelism write their own checkpoint files")
    if trainer.args.save_on_each_node and trainer.args.world_size > 1:
        problems.append("save_on_each_node=True: every node would commit its own copy to one ledger")
    if type(trainer.model).__module__.startswith("peft."):
        problems.append("a PEFT model saves its adapters through peft, not through save_pretrained's shard writer")
    if problems:
        raise ConfigurationError(
            "CertifiedTrainer cannot certify this set-up: " + "; ".join(problems) + "; use the plain Trainer for it"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _scaler_state(trainer: Any) -> dict[str, Any] | None:
    scaler = getattr(trainer.accelerator, "scaler", None)
    return scaler.state_dict() if scaler is not None else None


def _check_weights_match(directory: str, fingerprints: dict[str, str]) -> None:
    """The weights written are the ones every replica agreed on: each model tensor's fingerprint in
    its file's record equals the consensus fingerprint of the parameter of that name."""
    compared = 0
    for name in sorted(os.listdir(directory)):
        if not (name.endswith(".safetensors") and name.startswith("model")):
            continue
        for tensor, entry in inspect(os.path.join(directory, name)).record.tensors.items():
            want = fingerprints.get(tensor)
            if want is None:
                continue
            compared += 1
            if entry.get("fp") != want:
                raise CorruptCheckpointError(
                    f"{directory}/{name}: tensor `{tensor}` has fingerprint {entry.get('fp')}, every replica agreed on "
                    f"{want}; the weights changed between the consensus and the write: not committed"
                )
    if not compared and fingerprints:
        logger.warning(
            "certckpt: %s: no model tensor name matches a trained parameter's; weights not cross-checked", directory
        )
