"""``AuditCallback``: the auditor's three checks inside the Hugging Face Trainer's DDP loop.

The checks are those of ``certckpt.detect.session.AuditSession``, built in ``on_train_begin`` (on
every rank, a collective) on the Trainer's ``DistributedDataParallel`` model; this module only
adapts the Trainer's loop to the session's hook points:

- ``on_train_begin``: the refusals the Trainer needs (no ``CertifiedTrainer``, no DDP, fp16 with a
  gradient scaler), then the session: its communication hook on the DDP model (each bucket's
  all-reduce, averaged as DDP does, with NaN/Inf checks of the local and reduced gradients); on a
  resume from the committed parent, the proof that every replica holds the parent's weights (their
  consensus fingerprint is the one the parent recorded), else every rank refuses to start;
- each micro-batch (``CertifiedTrainerMixin.training_step`` calls ``before_micro_batch``): the
  inputs, ``num_items_in_batch`` and the step's accumulation count are noted
  (``begin_micro_batch``), with the RNG state on steps that will be replayed;
- ``on_pre_optimizer_step`` (after the all-reduce and the Trainer's clipping, before
  ``optimizer.step()``): ``before_update``, the non-finite checks of every rank (flags exchanged
  every step) and, every ``audit_every`` steps, the ring replay audit: every rank recomputes its
  predecessor's micro-batches on the bare model with the Trainer's own loss
  (``CertifiedTrainerMixin.certckpt_loss``, the loss exactly as ``training_step`` back-propagates
  it) and a failure is arbitrated by a third rank, which names the rank. A detection raises
  ``FaultDetectedError`` on every rank before the update is applied;
- ``on_step_end`` (after the update): ``after_update``, the weight consensus at audit steps (and
  every ``consensus_every`` steps);
- at each checkpoint the certified Trainer asks for ``checkpoint_consensus``: the session's
  consensus on the 64-bit fingerprints (``checkpoint_evidence``), which the checkpoint carries with
  the audit lineage and the certifier matches.

Events go to the run store's ledger (rank 0), so checkpoints become ``trusted`` once the audit at
or after them passes. What this cannot do that the ``Auditor`` does: fp16 with a gradient scaler
(refused: telling an overflow from a fault needs the replay before the scaler's step) and sampling
micro-batches for the replay (an audit replays the whole step).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from certckpt.detect.agreement import refuse_together, wire_device_for
from certckpt.detect.inject import Fault
from certckpt.detect.options import AuditOptions
from certckpt.detect.session import AuditSession, CheckpointEvidence
from certckpt.errors import AuditSetupError, ConfigurationError

__all__ = ["AuditCallback"]


class AuditCallback(TrainerCallback):
    """Replay audits, non-finite checks and weight consensus for a ``CertifiedTrainer`` under DDP.

    Args:
        options: a ``certckpt.detect.AuditOptions`` (interval, mode, policies...); its fields may
            also be given as keywords (``AuditCallback(audit_every=10)``). The Trainer's loop
            needs two of them fixed: ``exchange_flags="every-step"`` (one small all-reduce per step,
            so that a reduction delivering non-finite values to some ranks only is seen by all)
            and ``hand_over_grads=False`` (the Trainer zeroes the gradients itself).
        check_replay: the same as ``check_determinism`` (this callback's earlier name for it).
        injector_faults: synthetic faults (``certckpt.detect.Fault``) for drills and tests.

    Example::

        audit = AuditCallback(audit_every=10)
        trainer = CertifiedTrainer(model=model, args=args, train_dataset=ds, callbacks=[audit])
        with stop_on_fault(audit):                      # exit 86 on a detection
            trainer.train()
    """

    def __init__(
        self,
        *,
        options: AuditOptions | None = None,
        check_replay: bool | None = None,
        injector_faults: list[Fault] | None = None,
        **shorthand: Any,
    ):
        if check_replay is not None:
            shorthand.setdefault("check_determinism", check_replay)
        try:
            self.options = AuditOptions.build(options, exchange_flags="every-step", hand_over_grads=False, **shorthand)
        except ConfigurationError as e:
            raise AuditSetupError(str(e)) from None
        self.faults = list(injector_faults or [])
        self.trainer: Any = None
        self.session: AuditSession | None = None
        self._evidence: CheckpointEvidence | None = None  # the checkpoint being committed
        self._hooked: set[int] = set()  # the DDP models already carrying the hook (a second train())

    def bind(self, trainer: Any) -> None:
        """Called by ``CertifiedTrainerMixin.train``: the callback needs the Trainer's model and loss."""
        self.trainer = trainer

    # --- set-up -------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise AuditSetupError(
                "AuditCallback needs CertifiedTrainer (or CertifiedTrainerMixin): a plain Trainer shows a callback "
                "neither its DDP model nor its micro-batches"
            )
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            raise AuditSetupError(
                "AuditCallback compares ranks: run the Trainer under DDP (torchrun --nproc-per-node N; N >= 3 names "
                "the faulty rank); without audits the certified Trainer's checkpoints reach `verified`"
            )
        trainer = self.trainer
        ddp = trainer.model_wrapped
        group = ddp.process_group if isinstance(ddp, DistributedDataParallel) else dist.group.WORLD
        wire = wire_device_for(group, next(trainer.model.parameters()).device)
        reason = None
        if not isinstance(ddp, DistributedDataParallel):
            reason = f"the Trainer's model is a {type(ddp).__name__}, not DistributedDataParallel"
        elif getattr(trainer.accelerator, "scaler", None) is not None:
            reason = (
                "fp16 with a gradient scaler: an overflow and a fault look alike until a replay before the scaler's "
                "step tells them apart, which the Trainer's loop does not allow; use bf16, or the Auditor's own loop"
            )
        refuse_together(reason, group=group, wire_device=wire, what="AuditCallback set-up")
        if id(ddp) in self._hooked:  # DDP takes one hook per model, and it holds the first state object
            raise AuditSetupError("AuditCallback: train() again on the same Trainer is not supported; build a new one")
        self._hooked.add(id(ddp))
        run = trainer.certckpt
        self.session = AuditSession(
            ddp,
            trainer.optimizer,
            loss_fn=self._replay_loss(trainer),
            run=run.run,
            branch=run.branch,
            # The certified Trainer recorded the branch and its parent already (``train``); the
            # session would record it again, and a branch record is written once.
            parent=None,
            options=self.options,
            injector_faults=self.faults or None,
            start_step=int(state.global_step),
            ledger=run.ledger,
            # a resume from the committed parent: every replica must hold its weights before the
            # first step, else every rank refuses (a wrong, partial or damaged load)
            expect_consensus_fp=run.resumed_fp,
        )
        self._evidence = None
        return control

    @staticmethod
    def _replay_loss(trainer: Any):
        """``loss_fn(module, unit)`` for the session: the loss ``training_step`` back-propagated
        for the noted micro-batch, recomputed on ``module`` (the bare model) by the Trainer's own
        ``certckpt_loss``, with that micro-batch's ``num_items_in_batch`` and accumulation count."""

        def loss_fn(module: torch.nn.Module, unit: dict[str, Any]) -> torch.Tensor:
            return trainer.certckpt_loss(module, unit["inputs"], unit["n"], int(unit["accumulation"]))

        return loss_fn

    # --- per step -----------------------------------------------------------------------------

    def before_micro_batch(self, inputs: Any, num_items_in_batch: Any) -> None:
        """Note a micro-batch for this step's checks (called before its forward pass)."""
        if self.session is None:
            return
        self.session.begin_micro_batch(
            {
                # A shallow copy: compute_loss may pop "labels" from the dict it is given.
                "inputs": dict(inputs),
                "n": num_items_in_batch,
                # The Trainer divides each loss by the step's count of micro-batches (fewer in an
                # epoch's last window): the replay, on whichever rank, divides by the same.
                "accumulation": int(self.trainer.current_gradient_accumulation_steps),
            }
        )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.session is not None:
            # ``certckpt_loss`` returns the loss as the Trainer back-propagated it, already divided
            # for the accumulation: the session divides it by nothing more.
            self.session.before_update(loss_divisor=1)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.after_update()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    # --- checkpoints --------------------------------------------------------------------------

    def checkpoint_consensus(self, s: int) -> tuple[str | None, dict[str, str]] | None:
        """The fingerprint consensus of checkpoint step ``s`` (collective): ``(state fp, per-tensor fps)``;
        the state fp None when there is no agreement (``CheckpointEvidence.consensus_fp``).

        Takes the session's checkpoint evidence: the lineage since the previous checkpoint is
        ``lineage()`` until ``checkpoint_done()``.

        Raises:
            FaultDetectedError: the replicas' weights differ (on every rank).
        """
        if self.session is None:
            return None
        if s != self.session.step:
            raise AuditSetupError(
                f"AuditCallback: a checkpoint at step {s}, but the audits are at step {self.session.step}; "
                "the Trainer's steps and the callback's have drifted apart (was on_step_end skipped?)"
            )
        self._evidence = self.session.checkpoint_evidence()
        fps = self.session.consensus_fingerprints() or {}
        return self._evidence.consensus_fp, fps

    def lineage(self) -> dict[str, Any] | None:
        """What the checkpoint being committed says about the audits since the previous one."""
        return copy.deepcopy(self._evidence.lineage) if self._evidence is not None else None

    def checkpoint_done(self) -> None:
        self._evidence = None

    def flush(self) -> None:
        """Write the events so far to the ledger (rank 0): before a checkpoint's commit."""
        if self.session is not None:
            self.session.flush()

    def close(self) -> None:
        """Flush the events to the ledger and remove the drills' hooks (``stop_on_fault`` calls it)."""
        if self.session is not None:
            self.session.close()
