"""The auditor: drives the three detection checks from inside a DDP training loop.

Per step, in this order:

1. non-finite check of the local gradients before the all-reduce and of the reduced ones after it,
   inside a DDP communication hook that performs the all-reduce itself (the averaging is folded into
   the loss); the flags stay on the device until one small read before ``optimizer.step()``. On CPU,
   where a flag can be read for free, the local gradients are checked only when their reduced bucket
   comes back non-finite (``hook.lazy_pre_possible``): a clean step pays one pass over the gradients.
   With DDP's gradient copies (any device) the callback then hands ``.grad`` its view of the reduced
   bucket, which saves DDP's copy back into ``.grad`` (``hook.hand_over_possible``);
2. every ``audit_every`` steps, the ring replay audit: rank r recomputes rank r-1's micro-batch with
   its own weights and compares gradient signatures with those r-1 computed before the all-reduce;
3. weight consensus after ``optimizer.step()`` at audit steps, checkpoint steps and every
   ``consensus_every`` steps: every rank's weight fingerprints, all-gathered and compared.

The loop shapes users write are audited like plain DDP trains them: gradient accumulation
(``train_step(micro_batches=[...])``), clipping (``clip_grad_norm=``, ``before_optimizer_step=``),
fp16 with a gradient scaler (``grad_scaler=``), ``torch.compile`` in either order around DDP, and
floating-point buffers in the consensus (``consensus_buffers``). Set-up refusals are collective
(``agreement.refuse_together``): every rank raises the same error.

The checks themselves live in ``session.AuditSession`` (which loops run by a framework call at
their hook points); the ``Auditor`` is that session running certckpt's own loop, ``train_step``.

Usage (every rank)::

    auditor = Auditor(ddp_model, optimizer, loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
                      run="exp1", audit_every=10, sink=JsonlSink("events.jsonl"))
    for batch in loader:
        loss = auditor.train_step(batch)        # zero_grad, forward, backward, checks, step
        if auditor.step % 100 == 0:
            auditor.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                         f"ckpt/{auditor.step}.safetensors")
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from certckpt.errors import AuditSetupError, ConfigurationError, FaultDetectedError

from .digest import digests
from .events import log_audit_pass
from .exchange import RingShift
from .hook import nonfinite_flag
from .session import AuditSession, StepOutcome, consensus_buffers, restore_rng, unwrap_compiled
from .signature import signature

__all__ = [
    "Auditor",
    "FaultDetectedError",
    "AuditSetupError",
    "StepOutcome",
    "restore_rng",
    "unwrap_compiled",
    "consensus_buffers",
    "nonfinite_flag",
]


def _accumulator(acc: list, i: int):
    """A tensor hook adding parameter i's gradient of each backward into ``acc[i]`` (as autograd
    accumulates ``.grad``), leaving the gradient itself alone."""

    def hook(grad: torch.Tensor) -> None:
        if acc[i] is None:
            acc[i] = grad.detach().clone()
        else:
            acc[i].add_(grad.detach())

    return hook


class Auditor(AuditSession):
    """Wraps a DDP model and its optimizer; call ``train_step(batch)`` once per optimizer step.

    Takes the arguments of ``AuditSession`` (documented there): ``model``, ``optimizer``,
    ``loss_fn`` and the keyword-only options (``audit_every``, ``ledger``, ``clip_grad_norm``,
    ``grad_scaler``, ``replay_micro_batches``...). ``train_step`` runs the loop itself: zero_grad,
    forward and backward of each micro-batch, the checks, clipping, the optimizer step and the
    consensus; ``save`` writes a checkpoint with its evidence.
    """

    def train_step(self, batch: Any = None, *, micro_batches: Sequence[Any] | None = None) -> torch.Tensor:  # noqa: C901
        """One optimizer step with the checks; returns the (local) loss.

        Pass one batch (``train_step(batch)``), or the micro-batches of one accumulated step
        (``train_step(micro_batches=[mb1, mb2, ...])``). With micro-batches the step trains exactly
        as plain DDP accumulation does: each micro-batch's ``loss / len(micro_batches)`` is
        back-propagated in turn, all but the last under ``ddp.no_sync()`` (one graph alive at a
        time), and the accumulated gradients are averaged over the ranks in the all-reduce as DDP
        averages them; the returned loss is the mean of the micro-batches' losses.

        Example::

            for chunk in batched(loader, 4):
                auditor.train_step(micro_batches=list(chunk))

        Raises:
            FaultDetectedError: a check failed and the policy is ``raise`` (the update was not applied).
            ConfigurationError: neither or both of ``batch`` and ``micro_batches``, or no micro-batch.
        """
        units, micro = self._units(batch, micro_batches)
        if self._first:
            self._first_step_checks(units, micro)
            self._first = False
        s = self.step + 1
        audit = self.is_audit_step(s)
        self.last = StepOutcome(step=s, audited=audit)
        # An audit of a sample of the micro-batches signs them in training (``_forward_backward``);
        # otherwise the hook signs the local gradients, on audit steps and for the replay check.
        block = self._sample_block(s, len(units)) if audit and micro else None
        sign = (audit and block is None) or self._path_check_pending
        # With a scaler, a non-finite step may be an overflow, told apart by a neighbour's replay
        # of the step: the RNG state is kept at every step then (a small host copy).
        rng = self._rng_state() if audit or sign or self.grad_scaler is not None else None
        self._sample_sig = None
        # What this rank ships for its audit (kept for an arbitration): its step, or a sample of
        # it; it travels to the neighbour while this rank computes its own step.
        self._audit_payload = {"units": units, "micro": micro, "n": len(units), "rng": rng}
        shift = (
            RingShift(
                self._audit_payload,
                group=self.group,
                wire_device=self.wire_device,
                out_device=self.device,
            )
            if audit and block is None
            else None
        )
        self._zero_grad()
        self._hook.reset(audit=sign, average=1.0 / self.world if micro and self.world > 1 else None)
        if self.injector is not None:
            self.injector.begin(s, "train")
        if self._seal_source:
            self._check_seal()  # before the forward, where DDP broadcasts rank 0's buffers
        loss, shift = self._forward_backward(units, micro, shift, block)
        if self._seal_source:
            self._seal = digests(self.buffers)
        if self._hook.hand_over and not self._hook.handed_over_intact():
            raise AuditSetupError(
                f"rank {self.rank}: after backward, .grad no longer views DDP's reduced bucket "
                f"(torch {torch.__version__}"
                " changed how DDP finalizes gradients); construct the Auditor with hand_over_grads=False"
            )
        failed = self._nonfinite_due(s, now=self._must_read_now(s, audit) or self.grad_scaler is not None)
        self.step = s  # the step is attempted from here on, applied or not
        if failed is not None:  # the same on every rank: all drain the shift, so no message is left behind
            if shift is not None:
                shift.finish()
            if self.grad_scaler is not None:  # never deferred: the failing step is this one
                self._scaler_nonfinite(s, failed[1], units, micro, rng)
            else:
                self._nonfinite_detected(*failed)
            return loss
        self._checked_since_audit += 1
        if self._path_check_pending:
            self._check_replay_path(s, units, micro, rng)
        t0 = time.perf_counter()
        if audit and not self._replay_audit(s, units, micro, rng, shift.finish()):
            return loss
        replay_seconds = time.perf_counter() - t0
        self._before_optimizer()
        if self.grad_scaler is not None:
            # The scaler unscales (unless _before_optimizer did), finds the gradients finite, as the
            # hook did, and steps; then it grows its scale on schedule, as in any AMP loop.
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.injector is not None:
            self.injector.after_optimizer(list(zip(self.param_names, self.params)))
            self.injector.after_optimizer_buffers(list(zip(self.buffer_names, self.buffers)))
        due = audit or (self.consensus_every is not None and s % self.consensus_every == 0)
        t1 = time.perf_counter()
        consensus_ok = self.weight_consensus(s) if due else True
        if audit:
            extra = {"overflows": self._overflows} if self.grad_scaler is not None else {}
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked_since_audit, **extra)
            if consensus_ok:
                self.last_clean_audit = s
                if self.rank == 0:
                    seconds = replay_seconds + time.perf_counter() - t1
                    log_audit_pass(
                        step=s, branch=self.branch, ranks=self.world, checked=self._checked_since_audit, seconds=seconds
                    )
            self._checked_since_audit = 0
            self._overflows = 0
        return loss

    @staticmethod
    def _units(batch: Any, micro_batches: Sequence[Any] | None) -> tuple[list[Any], bool]:
        """The step's micro-batches as a list, and whether they were passed as micro-batches."""
        if micro_batches is None:
            if batch is None:
                raise ConfigurationError(
                    "train_step needs a batch: train_step(batch) or train_step(micro_batches=[...])"
                )
            return [batch], False
        if batch is not None:
            raise ConfigurationError("train_step takes a batch or micro_batches=[...], not both")
        units = list(micro_batches)
        if not units:
            raise ConfigurationError("train_step(micro_batches=...) needs at least one micro-batch")
        return units, True

    def _forward_backward(
        self, units: list[Any], micro: bool, shift: RingShift | None, block: tuple[int, int] | None
    ) -> tuple[torch.Tensor, RingShift | None]:
        """Forward and backward of every micro-batch, as plain DDP accumulation runs them.

        All but the last backward run under ``no_sync`` (gradients accumulate in ``.grad``); the
        last one triggers the all-reduce of the accumulated gradients. Each graph is freed before
        the next forward. ``block`` (an audit that samples micro-batches ``[a, b)``): the ring shift
        starts at micro-batch a with the RNG state of that moment, and tensor hooks add up those
        micro-batches' own gradients (before autograd accumulates them), signed at b. Returns the
        detached (mean) loss and the ring shift.
        """
        n = len(units)
        total: torch.Tensor | None = None
        acc: list[torch.Tensor | None] = []
        handles: list = []
        advanced = False
        for k, unit in enumerate(units):
            if block is not None and k == block[0]:
                self._audit_payload = {
                    "units": units[block[0] : block[1]],
                    "micro": True,
                    "n": n,
                    "rng": self._rng_state(),
                }
                shift = RingShift(
                    self._audit_payload,
                    group=self.group,
                    wire_device=self.wire_device,
                    out_device=self.device,
                )
                acc = [None] * len(self.params)
                handles = [p.register_hook(_accumulator(acc, i)) for i, p in enumerate(self.params)]
            sync = k == n - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                loss = self.loss_fn(self.train_model, unit)
                if shift is not None and not advanced:
                    shift.advance()
                    advanced = True
                self._scaled(loss, n=n, micro=micro).backward()
            part = loss.detach() / n if micro and n > 1 else loss.detach()
            total = part if total is None else total + part
            del loss
            if block is not None and k == block[1] - 1:
                for h in handles:
                    h.remove()
                self._sample_sig = self._sign_accumulated(acc, phase="train")
                acc = []
        return total, shift

    def _sample_block(self, s: int, n: int) -> tuple[int, int] | None:
        """The micro-batches ``[a, b)`` an audit at step s replays, or None for all of them.

        A contiguous block (the RNG state at its start is all a replay needs). Successive audits
        tile the step, ``[0, k)``, ``[k, 2k)``, ... with the last block ending at n, so that every
        micro-batch position is replayed once every ``ceil(n / k)`` audits; the same on every rank.
        """
        k = self.replay_micro_batches
        if k is None or k >= n:
            return None
        tiles = -(-n // k)
        start = min((s // self.audit_every) % tiles * k, n - k)
        return start, start + k

    def _sign_accumulated(self, acc: list[torch.Tensor | None], *, phase: str) -> torch.Tensor:
        """Signatures of accumulated gradients (zeros for a parameter that got none), after a
        drill's backward faults, which hit an accumulated gradient as they hit DDP's bucket."""
        if self.injector is not None:
            step = self.injector.step
            self.injector.begin(step, phase)
            present = [i for i, a in enumerate(acc) if a is not None]
            self.injector.on_local_grads([self.param_names[i] for i in present], [acc[i] for i in present])
            self.injector.begin(step, "train")
        rows = []
        for i, (a, p) in enumerate(zip(acc, self.params)):
            probes = self._probes.subset([i]) if self._probes is not None else None
            rows.append(signature([a if a is not None else torch.zeros_like(p)], mode=self.mode, probes=probes)[0])
            acc[i] = None
        return torch.stack(rows)

    def _before_optimizer(self) -> None:
        """Clipping and the user's gradient transform, on the reduced gradients, on every rank."""
        if self.grad_scaler is not None and (self.clip_grad_norm is not None or self.before_optimizer_step):
            self.grad_scaler.unscale_(self.optimizer)  # clip true gradients, as AMP code must
        if self.clip_grad_norm is not None:
            # The same call, on the same averaged gradients in the same order, as a plain DDP loop
            # makes after backward: every rank computes the same norm and the same scaling.
            self.last.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        if self.before_optimizer_step is not None:
            self.before_optimizer_step(self.model.module, self.optimizer)
