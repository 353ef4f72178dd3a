"""``AcceleratorAudit``: the auditor's three checks inside a user's own Accelerate training loop.

The checks are those of ``certckpt.detect.session.AuditSession`` (the Lightning and Trainer
callbacks' too); this module only finds the session's hook points in an Accelerate loop::

    for batch in loader:
        with accelerator.accumulate(model):
            loss = audit.loss(batch)                  # was: loss = loss_fn(model, batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

- ``audit.loss(batch)`` (each micro-batch): ``begin_micro_batch`` (the batch noted, with the RNG
  state on steps that will be replayed), then ``loss_fn(model, batch)`` on the prepared DDP model,
  its gradient scaled by ``1 / world`` (``average_over_ranks``: the all-reduce's sum is then DDP's
  average). The first call starts the session (a collective, on every process): the DDP
  communication hook (each bucket's all-reduce, with NaN/Inf checks of the local and reduced
  gradients), the branch and the step the ``CertifiedAccelerator`` decided, and after a
  ``load_state`` the proof that every replica holds exactly the weights loaded;
- a step pre-hook on the prepared optimizer's torch optimizer, which Accelerate calls only when
  gradients are synchronised (the last micro-batch of an ``accumulate`` window), after the user's
  ``clip_grad_norm_``: ``before_update``, the non-finite checks and, every ``audit_every`` steps,
  the ring replay audit: every rank recomputes its predecessor's micro-batches with ``loss_fn`` on the
  bare module, each divided by ``gradient_accumulation_steps`` as ``accelerator.backward`` divides
  it; a third rank arbitrates and names the faulty rank. A detection raises ``FaultDetectedError``
  on every rank out of ``optimizer.step()``, before the update;
- a step post-hook: ``after_update``, the weight consensus at audit steps;
- ``CertifiedAccelerator.save_state`` asks for the checkpoint evidence (the consensus on the
  weights' 64-bit fingerprints and the audit lineage) and commits the checkpoint with it.

Not audited (refused when the audit is built): one process, a model that is not
``DistributedDataParallel`` (FSDP, DeepSpeed), fp16 with a gradient scaler (an overflow would read as
a fault), several prepared optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from certckpt.detect.agreement import refuse_together, wire_device_for
from certckpt.detect.hook import average_over_ranks
from certckpt.detect.inject import Fault
from certckpt.detect.options import AuditOptions
from certckpt.detect.session import AuditSession, CheckpointEvidence
from certckpt.errors import AuditSetupError, ConfigurationError

from .accelerator import CertifiedAccelerator
from .together import distributed

__all__ = ["AcceleratorAudit"]


class AcceleratorAudit:
    """Replay audits, non-finite checks and weight consensus for a ``CertifiedAccelerator`` DDP loop.

    Build it on every process after ``accelerator.prepare`` (and after ``load_state`` when resuming
    is not automatic: the session starts at the first ``loss`` call, with the step and branch the
    accelerator holds then).

    Args:
        accelerator: the ``CertifiedAccelerator`` (its ledger receives the events, its checkpoints
            carry the evidence).
        model: the prepared model (``DistributedDataParallel`` under ``accelerate launch``).
        optimizer: the prepared optimizer.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, the loss the loop back-propagates (before
            ``accelerator.backward`` divides it for accumulation); called with the DDP model for
            training and the bare module for replays, so it must be a pure function of the
            weights, the batch and the RNG state (dropout is fine: the RNG state travels).
        options: a ``certckpt.detect.AuditOptions``; its fields may also be given as keywords
            (``audit_every=10``). Two are fixed by the loop's shape: ``exchange_flags="every-step"``
            and ``hand_over_grads=False`` (the loop zeroes the gradients itself).
        injector_faults: synthetic faults (``certckpt.detect.Fault``) for drills and tests.

    Example::

        audit = AcceleratorAudit(accelerator, model, optimizer, loss_fn=loss_fn, audit_every=10)
        with stop_on_fault(audit):                      # exit 86 on a detection
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(audit.loss(batch))
                    optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        accelerator: CertifiedAccelerator,
        model: torch.nn.Module,
        optimizer: Any,
        *,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        options: AuditOptions | None = None,
        injector_faults: list[Fault] | None = None,
        **shorthand: Any,
    ):
        if not isinstance(accelerator, CertifiedAccelerator):
            raise AuditSetupError(
                "AcceleratorAudit needs a CertifiedAccelerator (certckpt.integrations.accelerate): its checkpoints "
                "carry the audits' evidence"
            )
        try:
            self.options = AuditOptions.build(options, exchange_flags="every-step", hand_over_grads=False, **shorthand)
        except ConfigurationError as e:
            raise AuditSetupError(str(e)) from None
        if not distributed():
            raise AuditSetupError(
                "AcceleratorAudit compares processes: launch with `accelerate launch --num_processes N` (N >= 3 "
                "names the faulty rank); without audits the certified checkpoints reach `verified`"
            )
        self.accelerator, self.model, self.loss_fn = accelerator, model, loss_fn
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer Accelerate wraps
        self.faults = list(injector_faults or [])
        self.session: AuditSession | None = None
        self._refuse_setup()
        self._handles = [
            self.optimizer.register_step_pre_hook(self._before_step),
            self.optimizer.register_step_post_hook(self._after_step),
        ]
        accelerator.certckpt.audit = self

    def _refuse_setup(self) -> None:
        """Refused on every process together (the same message), before any collective of the session."""
        acc = self.accelerator
        first = next(iter(self.model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        reason = None
        if not isinstance(self.model, DistributedDataParallel):
            reason = f"the prepared model is a {type(self.model).__name__}, not DistributedDataParallel"
        elif acc.scaler is not None:
            reason = (
                "fp16 with a gradient scaler: an overflow and a fault look alike until a replay before the scaler's "
                "step tells them apart; use bf16, or the Auditor's own loop"
            )
        elif len(acc._optimizers) > 1:
            reason = "several prepared optimizers: the audit follows one optimizer step per training step"
        group = self.model.process_group if isinstance(self.model, DistributedDataParallel) else None
        refuse_together(
            reason, group=group or dist.group.WORLD, wire_device=wire_device_for(group, device), what="AcceleratorAudit"
        )

    # --- per micro-batch ----------------------------------------------------------------------

    def note(self, batch: Any) -> None:
        """Note a micro-batch before its forward pass, for a loop that computes its loss itself
        (``loss`` does it for you, and is cheaper: see there)."""
        self._note(batch, averaged=False)

    def loss(self, batch: Any) -> torch.Tensor:
        """Note ``batch``, then return ``loss_fn(model, batch)`` for ``accelerator.backward``.

        The value is ``loss_fn``'s; its gradient carries DDP's averaging over the processes
        (``average_over_ranks``), so the communication hook need not multiply every reduced
        gradient by ``1 / world`` in one more pass over them (the replay scales its losses the
        same way and reproduces the gradients bit for bit). The weights then equal a run without
        the audit within rounding, not bit for bit.
        """
        session = self._note(batch, averaged=True)
        return average_over_ranks(self.loss_fn(self.model, batch), session.world)

    def _note(self, batch: Any, *, averaged: bool) -> AuditSession:
        if self.session is None:
            self._start()
        assert self.session is not None
        self.session.begin_micro_batch(batch, loss_averaged=averaged)
        return self.session

    def _start(self) -> None:
        acc = self.accelerator
        run = acc.certckpt
        branch = acc.certckpt_decide_fresh()
        ledger = acc.certckpt_ledger()
        self.session = AuditSession(
            self.model,  # type: ignore[arg-type]  # refused above unless DistributedDataParallel
            self.optimizer,
            loss_fn=self.loss_fn,
            run=run.run or "run",
            branch=branch,
            parent=None,  # the accelerator records the branch and its parent at load_state
            options=self.options,
            injector_faults=self.faults or None,
            start_step=run.steps,
            ledger=ledger,
            expect_consensus_fp=run.resumed_fp,
        )

    def after_backward(self) -> None:
        """After the backward of a synchronised micro-batch (``CertifiedAccelerator.backward`` calls
        it): the non-finite flags' exchange starts while the loop clips (``AuditSession.after_backward``)."""
        if self.session is not None and self._handles:  # not after close()
            self.session.after_backward()

    # --- the optimizer's step -----------------------------------------------------------------

    def _before_step(self, *_: Any) -> None:
        if self.session is None:
            raise ConfigurationError(
                "AcceleratorAudit: optimizer.step() before any audit.loss(batch): compute each micro-batch's loss "
                "through audit.loss (or call audit.note(batch) before its forward)"
            )
        # accelerator.backward divided each micro-batch's loss by gradient_accumulation_steps (also in
        # a shorter last window of the dataloader): the replay divides by the same.
        self.session.before_update(loss_divisor=int(self.accelerator.gradient_accumulation_steps))

    def _after_step(self, *_: Any) -> None:
        if self.session is not None:
            self.session.after_update()

    # --- checkpoints --------------------------------------------------------------------------

    def checkpoint_evidence(self) -> CheckpointEvidence:
        """The consensus on the weights' fingerprints at this step and the lineage since the previous
        checkpoint (collective: ``save_state`` calls it on every process)."""
        assert self.session is not None
        return self.session.checkpoint_evidence()

    def reopen_lineage(self, evidence: CheckpointEvidence) -> None:
        """The checkpoint ``evidence`` was taken for was not committed: the next one's lineage and step
        range reach back over its steps (``AuditSessionCore.reopen_lineage``)."""
        if self.session is not None:
            self.session.reopen_lineage(evidence)

    def consensus_fingerprints(self) -> dict[str, str] | None:
        return self.session.consensus_fingerprints() if self.session is not None else None

    def flush(self) -> None:
        """Write the events so far to the ledger (rank 0): before a checkpoint's commit."""
        if self.session is not None:
            self.session.flush()

    def close(self) -> None:
        """Flush the events, remove the drills' hooks and this audit's optimizer hooks (``stop_on_fault``
        calls it; never a collective)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.session is not None:
            self.session.close()
