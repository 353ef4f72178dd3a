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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from certckpt.errors import AuditSetupError, ConfigurationError, FaultDetectedError

from .exchange import RingShift
from .hook import nonfinite_flag
from .session import AuditSession, StepOutcome, consensus_buffers, restore_rng, unwrap_compiled
from .signature import signature
from .timing import span

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


def _accumulator(acc: list[torch.Tensor | None], i: int) -> Callable[[torch.Tensor], None]:
    """A tensor hook adding parameter i's gradient of each backward into ``acc[i]`` (as autograd
    accumulates ``.grad``), leaving the gradient itself alone."""

    def hook(grad: torch.Tensor) -> None:
        a = acc[i]
        if a is None:
            acc[i] = grad.detach().clone()
        else:
            a.add_(grad.detach())

    return hook


@dataclass(slots=True)
class _Shipment:
    """What this rank ships for the audit of the step under way, and the ring shift carrying it.

    ``payload``: its micro-batches (all of them, or an audit's sample) and their RNG state, kept for
    an arbitration; ``sampled``: the signature of a sample's gradients, taken in training.
    """

    payload: dict[str, Any]
    shift: RingShift | None = None
    sampled: torch.Tensor | None = None


class Auditor(AuditSession):
    """Wraps a DDP model and its optimizer; call ``train_step(batch)`` once per optimizer step.

    Takes the arguments of ``AuditSession`` (documented there): ``model``, ``optimizer``,
    ``loss_fn`` and the keyword-only options (``audit_every``, ``ledger``, ``clip_grad_norm``,
    ``grad_scaler``, ``replay_micro_batches``...). ``train_step`` runs the loop itself: zero_grad,
    forward and backward of each micro-batch, the checks, clipping, the optimizer step and the
    consensus; ``save`` writes a checkpoint with its evidence.
    """

    def train_step(self, batch: Any = None, *, micro_batches: Sequence[Any] | None = None) -> torch.Tensor:
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
        ctx, state = self.ctx, self.state
        units, micro = self._units(batch, micro_batches)
        if state.first_step:
            self.setup.first_step_checks(units, micro)
            state.first_step = False
        s = state.step + 1
        audit = self.is_audit_step(s)
        state.last = StepOutcome(step=s, audited=audit)
        # An audit of a sample of the micro-batches signs them in training (``_forward_backward``);
        # otherwise the hook signs the local gradients, on audit steps and for the replay check.
        block = self._sample_block(s, len(units)) if audit and micro else None
        sign = (audit and block is None) or state.path_check_pending
        # With a scaler, a non-finite step may be an overflow, told apart by a neighbour's replay
        # of the step: the RNG state is kept at every step then (a small host copy).
        # And with the sentinels on, at every step: any step may be replayed.
        rng = ctx.rng_state() if audit or sign or ctx.grad_scaler is not None or self.sentinels.active else None
        # What this rank ships for its audit (kept for an arbitration): its step, or a sample of
        # it; it travels to the neighbour while this rank computes its own step.
        shipment = _Shipment({"units": units, "micro": micro, "n": len(units), "rng": rng})
        if audit and block is None:
            shipment.shift = RingShift(
                shipment.payload,
                group=ctx.group,
                wire_device=ctx.wire_device,
                out_device=ctx.device,
            )
        ctx.drop_grads()
        ctx.hook.reset(audit=sign, average=1.0 / ctx.world if micro and ctx.world > 1 else None)
        if ctx.injector is not None:
            ctx.injector.begin(s, "train")
        if self.consensus.seal_source:
            self.consensus.check_seal()  # before the forward, where DDP broadcasts rank 0's buffers
        loss = self._forward_backward(units, micro, shipment, block)
        self.sentinels.loss = loss  # a forward fault shows in the loss first
        if self.consensus.seal_source:
            self.consensus.seal()
        if ctx.hook.hand_over and not ctx.hook.handed_over_intact():
            raise AuditSetupError(
                f"rank {ctx.rank}: after backward, .grad no longer views DDP's reduced bucket "
                f"(torch {torch.__version__}"
                " changed how DDP finalizes gradients); construct the Auditor with hand_over_grads=False"
            )
        replay_seconds = self._checks(s, audit, units, micro, rng, shipment)
        if replay_seconds is not None:
            self._update(s, audit, replay_seconds)
        return loss

    def _checks(
        self,
        s: int,
        audit: bool,
        units: list[Any],
        micro: bool,
        rng: dict[str, torch.Tensor] | None,
        shipment: _Shipment,
    ) -> float | None:
        """The checks of step s before its update: the non-finite flags, the replay-path check and,
        on an audit step, the replay. Returns the replay's time when the update may be applied,
        None when it was refused (its gradients dropped)."""
        ctx, state = self.ctx, self.state
        now = self.nonfinite.must_read_now(s, audit=audit) or ctx.grad_scaler is not None
        failed = self.nonfinite.due(s, now=now)
        state.step = s  # the step is attempted from here on, applied or not
        if failed is not None:  # the same on every rank: all drain the shift, so no message is left behind
            if shipment.shift is not None:
                shipment.shift.finish()
            if ctx.grad_scaler is not None:  # never deferred: the failing step is this one
                self.nonfinite.scaler_nonfinite(s, failed[1], units, micro, rng)
            else:
                self.nonfinite.detected(*failed)
            return None
        state.checked_since_audit += 1
        if state.path_check_pending:
            self.replay.check_path(s, units, micro, rng)
        decision = self.sentinels.decide(s, self.nonfinite.table, replaying=audit)
        t0 = time.perf_counter()
        if audit:
            assert shipment.shift is not None, "an audit step's micro-batches travel to the neighbour"
            prev = shipment.shift.finish()
            if not self.replay.audit(s, units, prev, payload=shipment.payload, sampled=shipment.sampled):
                return None
        # not an audit: no consensus follows, and the replay vouches for this step alone
        elif (
            decision is not None
            and decision.replay
            and not self.sentinels.replay_now(s, units, shipment.payload, decision)
        ):
            return None
        return time.perf_counter() - t0

    def _update(self, s: int, audit: bool, replay_seconds: float) -> None:
        """Step s's update, once its checks passed: clipping and the user's transform, the optimizer
        step, and the consensus (audit and consensus steps) with an audit step's summary."""
        ctx, state = self.ctx, self.state
        self._before_optimizer()
        if ctx.grad_scaler is not None:
            # The scaler unscales (unless _before_optimizer did), finds the gradients finite, as the
            # hook did, and steps; then it grows its scale on schedule, as in any AMP loop.
            ctx.grad_scaler.step(ctx.optimizer)
            ctx.grad_scaler.update()
        else:
            ctx.optimizer.step()
        if ctx.injector is not None:
            ctx.injector.after_optimizer(list(zip(ctx.param_names, ctx.params)))
            ctx.injector.after_optimizer_buffers(list(zip(ctx.buffer_names, ctx.buffers)))
        due = audit or (self.consensus_every is not None and s % self.consensus_every == 0)
        t1 = time.perf_counter()
        consensus_ok = self.weight_consensus(s) if due else True
        if audit:
            extra: dict[str, Any] = {"overflows": state.overflows} if ctx.grad_scaler is not None else {}
            ctx.report.event("nonfinite", "pass", step=s, steps_checked=state.checked_since_audit, **extra)
            if consensus_ok:
                seconds = replay_seconds + time.perf_counter() - t1
                self.audit_passed(s, checked=state.checked_since_audit, seconds=seconds)
            state.checked_since_audit = 0
            state.overflows = 0

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
        self, units: list[Any], micro: bool, shipment: _Shipment, block: tuple[int, int] | None
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch, as plain DDP accumulation runs them.

        All but the last backward run under ``no_sync`` (gradients accumulate in ``.grad``); the
        last one triggers the all-reduce of the accumulated gradients. Each graph is freed before
        the next forward. ``block`` (an audit that samples micro-batches ``[a, b)``): the ring shift
        starts at micro-batch a with the RNG state of that moment (``shipment``'s payload and
        shift), and tensor hooks add up those micro-batches' own gradients (before autograd
        accumulates them), signed at b (``shipment.sampled``). Returns the detached (mean) loss.
        """
        ctx = self.ctx
        n = len(units)
        total: torch.Tensor | None = None
        acc: list[torch.Tensor | None] = []
        handles: list[Any] = []
        advanced = False
        for k, unit in enumerate(units):
            if block is not None and k == block[0]:
                shipment.payload = {
                    "units": units[block[0] : block[1]],
                    "micro": True,
                    "n": n,
                    "rng": ctx.rng_state(),
                }
                shipment.shift = RingShift(
                    shipment.payload,
                    group=ctx.group,
                    wire_device=ctx.wire_device,
                    out_device=ctx.device,
                )
                acc = [None] * len(ctx.params)
                handles = [p.register_hook(_accumulator(acc, i)) for i, p in enumerate(ctx.params)]
            sync = k == n - 1
            with contextlib.nullcontext() if sync else ctx.model.no_sync():
                loss = ctx.loss_fn(self.train_model, unit)
                if shipment.shift is not None and not advanced:
                    shipment.shift.advance()
                    advanced = True
                ctx.scaled(loss, n=n, micro=micro).backward()
            part = loss.detach() / n if micro and n > 1 else loss.detach()
            total = part if total is None else total + part
            del loss
            if block is not None and k == block[1] - 1:
                for h in handles:
                    h.remove()
                shipment.sampled = self._sign_accumulated(acc, phase="train")
                acc = []
        assert total is not None  # units holds at least one micro-batch (``_units``)
        return total

    def _sample_block(self, s: int, n: int) -> tuple[int, int] | None:
        """The micro-batches ``[a, b)`` an audit at step s replays, or None for all of them.

        A contiguous block (the RNG state at its start is all a replay needs). Successive audits
        tile the step, ``[0, k)``, ``[k, 2k)``, ... with the last block ending at n, so that every
        micro-batch position is replayed once every ``ceil(n / k)`` audits; the same on every rank.
        """
        k = self.options.replay_micro_batches
        if k is None or k >= n:
            return None
        tiles = -(-n // k)
        start = min((s // self.options.audit_every) % tiles * k, n - k)
        return start, start + k

    def _sign_accumulated(self, acc: list[torch.Tensor | None], *, phase: str) -> torch.Tensor:
        """Signatures of accumulated gradients (zeros for a parameter that got none), after a
        drill's backward faults, which hit an accumulated gradient as they hit DDP's bucket."""
        ctx = self.ctx
        if ctx.injector is not None:
            step = ctx.injector.step
            ctx.injector.begin(step, phase)
            present = [(i, a) for i, a in enumerate(acc) if a is not None]
            ctx.injector.on_local_grads([ctx.param_names[i] for i, _ in present], [a for _, a in present])
            ctx.injector.begin(step, "train")
        rows = []
        with span("train_signature"):
            for i, (a, p) in enumerate(zip(acc, ctx.params)):
                probes = ctx.probes.subset([i]) if ctx.probes is not None else None
                grad = a if a is not None else torch.zeros_like(p)
                rows.append(signature([grad], mode=ctx.options.mode, probes=probes)[0])
                acc[i] = None
        return torch.stack(rows)

    def _before_optimizer(self) -> None:
        """Clipping and the user's gradient transform, on the reduced gradients, on every rank."""
        ctx = self.ctx
        clip, before = ctx.options.clip_grad_norm, ctx.options.before_optimizer_step
        if ctx.grad_scaler is not None and (clip is not None or before):
            ctx.grad_scaler.unscale_(ctx.optimizer)  # clip true gradients, as AMP code must
        if clip is not None:
            # The same call, on the same averaged gradients in the same order, as a plain DDP loop
            # makes after backward: every rank computes the same norm and the same scaling.
            norm = torch.nn.utils.clip_grad_norm_(ctx.params, clip)
            if self.state.last is not None:
                self.state.last.grad_norm = norm
        if before is not None:
            before(ctx.model.module, ctx.optimizer)
