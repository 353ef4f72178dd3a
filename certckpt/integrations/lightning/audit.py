"""``AuditCallback``: certckpt's three checks inside a Lightning DDP run.

A callback, not a strategy: Lightning calls a callback at exactly the points the checks need, on
every rank, whatever strategy options the user chose (``DDPStrategy(find_unused_parameters=...)``,
``static_graph``, timeouts), so the user keeps their strategy and adds one line. The checks run on
the model Lightning's ``ddp`` strategy built, through ``certckpt.detect.session.AuditSession``:

- ``on_train_start``: the session is set up on the ``DistributedDataParallel`` model (its
  communication hook, which checks every bucket for NaN/Inf before and after the all-reduce and
  averages it over the ranks as DDP's own hook does), after Lightning restored a checkpoint; a run
  resumed from the committed checkpoint proves first that every replica holds its weights (their
  consensus fingerprint is the one it recorded), else every rank refuses to start;
- ``on_train_batch_start``: each micro-batch (the batch and its ``batch_idx``) is noted, with the
  RNG state it starts from on steps that will be replayed;
- ``on_before_optimizer_step`` (after the step's last backward, before clipping and the update): the
  non-finite checks and, every ``audit_every`` steps, the ring replay audit, which calls the
  LightningModule's own ``training_step`` on the previous rank's micro-batches, on the bare module
  (outside DDP: no all-reduce) with the weights before the update, through ``torch.autograd.grad``
  (``.grad`` untouched); ``self.log`` calls during a replay are discarded;
- ``on_train_batch_end``: the weight consensus after the update, at audit steps;
- ``on_save_checkpoint`` (every rank, as Lightning builds a checkpoint): the consensus on the
  weights' 64-bit fingerprints, handed with the audit lineage to ``CertifiedCheckpointIO``, which
  writes and commits the file; it becomes ``trusted`` once the next audit passes.

A failed check raises ``FaultDetectedError`` on every rank (the update is not applied), after rank 0
wrote the incident to the ledger; ``certckpt.detect.stop_on_fault(callback)`` around
``trainer.fit`` turns it into exit status 86.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from certckpt.detect.agreement import all_gather_bytes, refuse_together, wire_device_for
from certckpt.detect.options import AuditOptions
from certckpt.detect.session import AuditSession
from certckpt.errors import AuditSetupError, ConfigurationError
from certckpt.log import enable as enable_log

from .checkpoint_io import CertifiedCheckpointIO
from .compat import CALLBACK_BASES, package_of

__all__ = ["AuditCallback"]


@contextlib.contextmanager
def _quiet(module: Any) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing meanwhile: a replay recomputes another rank's
    step, whose values must not reach this rank's logged metrics."""

    def discard(*args: Any, **kwargs: Any) -> None:
        return None

    module.log = discard
    module.log_dict = discard
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise AuditSetupError(
        "a replay of training_step returned no loss tensor (a Tensor or a dict with 'loss' is needed; returning"
        " None to skip a step is not supported under DDP)"
    )


# The bases are every installed Lightning's Callback, found at import time (compat.py); mypy cannot
# follow a starred base list and takes the class as deriving from Any.
class AuditCallback(*CALLBACK_BASES):  # type: ignore[misc]
    """The replay audit, non-finite checks and weight consensus of ``certckpt.detect`` in a
    ``Trainer(strategy="ddp")`` run; use it with ``plugins=[CertifiedCheckpointIO()]``.

    Args:
        options: a ``certckpt.detect.AuditOptions`` (interval, mode, policies...); its fields may
            also be given as keywords (``AuditCallback(audit_every=10)``). With
            ``on_nonfinite="skip"`` every gradient of a refused step is set to None, so the optimizer
            leaves the weights alone; Lightning still counts the step.
        ledger: the run store for events, incidents and commits (default: ``CertifiedCheckpointIO``'s
            ``ledger``, else the first ``ModelCheckpoint``'s ``dirpath``).
        run: the run's name in records (default: ``CertifiedCheckpointIO``'s choice).
        replay_fn: ``fn(module, batch, batch_idx) -> loss`` to replay instead of ``training_step``,
            for a ``training_step`` with side effects a replay must not repeat (metric objects
            updated in place, counters).
        injector_faults: ``certckpt.detect.Fault`` objects, for drills and tests.

    Example:
        >>> audit = AuditCallback(audit_every=10)
        >>> trainer = L.Trainer(strategy="ddp", plugins=[CertifiedCheckpointIO()],
        ...                     callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=10), audit])
        >>> with stop_on_fault(audit):
        ...     trainer.fit(model)
    """

    def __init__(
        self,
        *,
        options: AuditOptions | None = None,
        ledger: str | None = None,
        run: str | None = None,
        replay_fn: Callable[[Any, Any, int], Any] | None = None,
        injector_faults: list | None = None,
        **shorthand: Any,
    ):
        super().__init__()
        if replay_fn is not None and not callable(replay_fn):
            raise ConfigurationError("replay_fn must be callable as fn(module, batch, batch_idx) -> loss")
        self.options = AuditOptions.build(options, **shorthand)
        self.ledger, self.run, self.replay_fn = ledger, run, replay_fn
        self.injector_faults = list(injector_faults or [])
        self.session: AuditSession | None = None
        self._stepped = False

    # --- set-up ---------------------------------------------------------------------------------

    def _store(self, trainer: Any, io: Any) -> str | None:
        if self.ledger is not None:
            return self.ledger
        if isinstance(io, CertifiedCheckpointIO) and io.ledger_store is not None:
            return io.ledger_store
        for cb in trainer.checkpoint_callbacks:
            if getattr(cb, "dirpath", None):
                return str(cb.dirpath)
        return None

    def _problem(self, trainer: Any, pl_module: Any) -> str | None:
        """What keeps this run from being audited (None: nothing), decided on every rank."""
        if not isinstance(trainer.strategy.model, DistributedDataParallel):
            return (
                f"AuditCallback needs Trainer(strategy='ddp') (a DistributedDataParallel model), got"
                f" {type(trainer.strategy).__name__}"
            )
        if not pl_module.automatic_optimization:
            return "AuditCallback audits automatic optimization only (manual_backward is the module's own loop)"
        if len(trainer.optimizers) != 1:
            return f"AuditCallback needs exactly one optimizer, got {len(trainer.optimizers)}"
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return (
                "fp16 with a gradient scaler (precision='16-mixed') is not audited under Lightning yet (an overflow"
                " would read as a fault); use precision='bf16-mixed' or 32"
            )
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            return "the DDP strategy has a communication hook already; certckpt's checks need their own"
        return None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            enable_log()  # one line per audit and per resume, from rank 0 (docs/integrations.md)
        if not (dist.is_available() and dist.is_initialized()):
            raise AuditSetupError(
                "AuditCallback needs torch.distributed: Trainer(strategy='ddp', devices=N) (N >= 3 names a faulty rank)"
            )
        group = dist.group.WORLD
        wire = wire_device_for(group, pl_module.device)
        refuse_together(self._problem(trainer, pl_module), group=group, wire_device=wire, what="AuditCallback set-up")
        io = certified_io(trainer)
        store = self._store(trainer, io)
        if not isinstance(io, CertifiedCheckpointIO):
            warnings.warn(
                f"certckpt: checkpoints go through {type(io).__name__}, not certified: add"
                " Trainer(plugins=[CertifiedCheckpointIO()]) so that they are committed and can become trusted",
                UserWarning,
                stacklevel=2,
            )
        refuse_together(
            None if store is not None else "no run store for the audit events",
            group=group,
            wire_device=wire,
            what="AuditCallback set-up",
            advice="give AuditCallback(ledger=DIR), CertifiedCheckpointIO(ledger=DIR) or ModelCheckpoint(dirpath=DIR)",
        )
        certified = isinstance(io, CertifiedCheckpointIO)
        run = self.run or (io.run_name(store) if certified else "run")
        branch, parent = (io.branch, io.parent) if certified else ("main", None)
        # a resume from the committed parent: every replica must hold its weights before the first
        # step, else every rank refuses (a file that is not the committed one has no parent: no proof)
        point = io.resume_point if certified and parent is not None else None
        expect = point.consensus_fp if point is not None else None
        start = int(trainer.global_step)
        # Every rank decided the branch from the ledger on its own; they must agree before anything
        # is recorded under it.
        mine = json.dumps([run, branch, parent, start, expect]).encode()
        seen = all_gather_bytes(mine, group=group, wire_device=wire)
        refuse_together(
            None if all(s == seen[0] for s in seen) else f"ranks disagree on run/branch/step: {mine.decode()}",
            group=group,
            wire_device=wire,
            what="AuditCallback set-up",
        )
        session = AuditSession(
            trainer.strategy.model,
            trainer.optimizers[0],
            loss_fn=self._replay_loss(trainer, pl_module),
            run=run,
            branch=branch,
            parent=parent,
            start_step=start,
            ledger=store,
            hand_over_grads=False,  # Lightning zeroes the gradients itself (the hand-over needs set_to_none)
            injector_faults=self.injector_faults or None,
            options=self.options,
            expect_consensus_fp=expect,
        )
        if certified:
            io.bind_audits(store=store, run=run, flush=session.flush)
        self.session = session
        self._stepped = False

    def _replay_loss(self, trainer: Any, pl_module: Any) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn(module, unit)`` for the session: the module's own ``training_step`` (or
        ``replay_fn``) on a noted micro-batch, in the precision plugin's context, logging off."""
        replay_fn = self.replay_fn
        signature_utils = package_of(pl_module).sub("utilities.signature_utils")
        takes_idx = signature_utils.is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        precision = trainer.precision_plugin

        def loss_fn(module: Any, unit: Any) -> torch.Tensor:
            batch, idx = unit["batch"], int(unit["batch_idx"])
            with precision.train_step_context(), _quiet(module):
                if replay_fn is not None:
                    out = replay_fn(module, batch, idx)
                elif takes_idx:
                    out = module.training_step(batch, idx)
                else:
                    out = module.training_step(batch)
            return _loss_of(out)

        return loss_fn

    # --- per step ---------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.session is not None:
            self.session.begin_micro_batch({"batch": batch, "batch_idx": int(batch_idx)})

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session is None:
            return
        self._stepped = True
        # Lightning divides each micro-batch's loss by accumulate_grad_batches (a short last window
        # of an epoch too); a replay divides by the same number. Replays need autograd, whatever
        # grad mode the optimizer calls its closure in.
        with torch.enable_grad():
            self.session.before_update(loss_divisor=int(trainer.accumulate_grad_batches))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.session is not None and self._stepped:
            self._stepped = False
            self.session.after_update()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.session is None:
            return
        evidence = self.session.checkpoint_evidence()
        io = certified_io(trainer)
        if isinstance(io, CertifiedCheckpointIO):
            io.offer_evidence(evidence)

    # --- the end ----------------------------------------------------------------------------------

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Flush the events to the ledger (``stop_on_fault`` calls it too); safe to call twice."""
        if self.session is not None:
            self.session.close()


def certified_io(trainer: Any) -> Any:
    """The trainer's checkpoint plugin, seen through wrappers that hold one (Lightning's
    ``AsyncCheckpointIO(CertifiedCheckpointIO())`` saves on its own thread through the inner one)."""
    io = trainer.strategy.checkpoint_io
    for _ in range(4):  # a wrapper of a wrapper at most, in practice
        if isinstance(io, CertifiedCheckpointIO):
            return io
        inner = getattr(io, "checkpoint_io", None)
        if inner is None or inner is io:
            break
        io = inner
    return trainer.strategy.checkpoint_io
