"""Check 1 of a DDP audit session: non-finite gradients, before and after the all-reduce.

The communication hook leaves per-bucket flags on the device; ``NonFiniteCheck`` reads them once
before the optimizer step (exchanging them between ranks only on a failing step, unless
``exchange_flags="every-step"``), tells a gradient scaler's overflow from a fault by having a
neighbour recompute the flagged ranks' micro-batches, and records (and, by policy, raises) a
detection naming the rank whose local gradients went bad, or the reduction. It is a mixin of
``session.AuditSession`` and works on the session's attributes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .exchange import recv_payload, send_payload
from .hook import any_nonfinite
from .setup_checks import late_detection_note

__all__ = ["NonFiniteCheck"]


class NonFiniteCheck:
    """The non-finite check of ``AuditSession`` (a mixin: the session holds the state it reads).

    It reads the hook's flags (``_hook``) and uses the session's ``_replay`` (a scaler's overflow
    check), ``_event``, ``_fail`` and ``_zero_grad``.
    """

    def _nonfinite_due(self, s: int, *, now: bool) -> tuple[int, tuple[list[int], list[int]]] | None:
        """The non-finite check of step s: ``(failing step, flags)``, or None when clean.

        Immediate (``nonfinite_read="immediate"``, and at every step that must know now: audits,
        consensus steps, the first steps): the flags are read here, before the update. Deferred
        (``nonfinite_read="deferred"``): the step's flags are copied to the host without waiting,
        and the *previous* step's, long since computed, are read instead; the failing step is then
        the previous one, whose update was applied. A deferred read never waits for the GPU to
        drain its queue, which the immediate one does once a step (issue 15: 9 % of a 4.7 ms step
        of the envelope's model on an H200).
        """
        failed = self._settle_deferred_flags()
        if failed is not None:
            return failed
        if self.nonfinite_read == "deferred" and not now:
            self._pending_flags = (s, self._queue_flags())
            return None
        flags = self._read_flags()
        return None if flags is None else (s, flags)

    def _queue_flags(self) -> tuple[int, torch.Tensor, Any]:
        """This step's per-bucket sums, local (pre-reduce) ones first, on their way to the host (no
        wait): ``(how many are local, the sums, the event that marks their arrival)``."""
        hook = self._hook
        sums = list(hook.pre) + list(hook.post)
        if not sums:
            return 0, torch.zeros(0), None
        both = torch.stack(sums)  # one launch; each sum is tested on the host, as an immediate read would
        if both.device.type != "cuda":
            return len(hook.pre), both, None
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return len(hook.pre), host, event

    def _settle_deferred_flags(self) -> tuple[int, tuple[list[int], list[int]]] | None:
        """Read the pending (deferred) step's flags: ``(that step, flags)`` when they fail, else None.

        Every rank holds the same pending step, and a non-finite reduced bucket reaches every rank
        alike, so the ranks enter the flag exchange together, as in an immediate read.
        """
        pending, self._pending_flags = self._pending_flags, None
        if pending is None:
            return None
        s, (n_pre, host, event) = pending
        if event is not None:
            event.synchronize()  # the copy of that step's sums, queued a step ago: done by now
        values = [float(x) for x in host.tolist()]
        if all(math.isfinite(v) for v in values[n_pre:]):
            return None
        flags = torch.zeros(2 * self.world, dtype=torch.int32, device=self.wire_device)
        flags[self.world + self.rank] = 1
        flags[self.rank] = int(not all(math.isfinite(v) for v in values[:n_pre]))
        dist.all_reduce(flags, group=self.group)
        values = flags.tolist()
        return s, (values[: self.world], values[self.world :])

    def _settle_deferred(self) -> None:
        """Before anything that vouches for the weights (a consensus, a checkpoint, the end of the
        run): the pending step's flags are read, and a failure is detected (and raised) now."""
        failed = self._settle_deferred_flags()
        if failed is not None:
            self._nonfinite_detected(*failed)

    def _read_flags(self) -> tuple[list[int], list[int]] | None:
        """None on a clean step; else per rank ``(pre-reduce flags, post-reduce flags)``.

        A non-finite value in any rank's local gradients survives the averaging (NaN and Inf
        propagate through a sum), so a post flag is set whenever any pre flag is; and it is equal on
        every rank whenever the reduction delivers the same values to all. So by default
        (``exchange_flags="on-failure"``) a clean step exchanges nothing: reading the post flags is
        the step's only host synchronisation, and only a failing step all-reduces the flags to learn
        which rank (if any) produced the bad values. A reduction that delivers non-finite values to
        some ranks only breaks that assumption: those ranks enter an exchange the others never join
        (gloo aborts on the mismatched collective, NCCL times out). ``exchange_flags="every-step"``
        pays one small all-reduce per step so that every rank always learns every rank's flags, and
        such a fault becomes a contained detection on all ranks.
        """
        hook = self._hook
        post_local = bool(any_nonfinite(hook.post)) if hook.post else False  # the step's one host read
        if not post_local and self.exchange_flags == "on-failure":
            return None
        flags = torch.zeros(2 * self.world, dtype=torch.int32, device=self.wire_device)
        if post_local:
            flags[self.world + self.rank] = 1
        if hook.pre:  # eager: every bucket's; lazy: those of the buckets that came back non-finite
            flags[self.rank] = any_nonfinite(hook.pre).to(self.wire_device)
        dist.all_reduce(flags, group=self.group)
        values = flags.tolist()
        if not any(values):
            return None
        return values[: self.world], values[self.world :]

    def _scaler_nonfinite(
        self, s: int, flags: tuple[list[int], list[int]], units: list[Any], micro: bool, rng: dict[str, torch.Tensor]
    ) -> None:
        """A non-finite step under a gradient scaler: an overflow (the scaler's business) or a fault.

        Each rank whose local gradients were non-finite ships its micro-batches and RNG state to
        the next rank, which recomputes them with its own copy of the weights and the same scale.
        Non-finite again on every flagged rank's neighbour: the scale overflowed, as it does by
        design; the scaler skips the update and backs its scale off, and an ``overflow`` event
        (outcome pass) records it. Finite on a neighbour: that rank's own computation went wrong,
        a ``nonfinite-pre`` detection naming it, the update dropped and the scale left alone.
        Non-finite reduced gradients from finite local ones are a detection as without a scaler.
        """
        pre = [r for r, f in enumerate(flags[0]) if f]
        if not pre:
            self._nonfinite_detected(s, flags)
            return
        verdict = torch.zeros(self.world, dtype=torch.int64, device=self.wire_device)  # 1: finite on replay
        for origin in pre:
            replayer = (origin + 1) % self.world
            payload = {"units": units, "micro": micro, "rng": rng}
            if self.world == 1:
                got = payload  # one rank: the same device recomputes (a transient fault only shows)
            elif self.rank == origin:
                send_payload(
                    payload, dist.get_global_rank(self.group, replayer), group=self.group, wire_device=self.wire_device
                )
                continue
            elif self.rank == replayer:
                got = recv_payload(
                    dist.get_global_rank(self.group, origin),
                    group=self.group,
                    wire_device=self.wire_device,
                    out_device=self.device,
                )
            else:
                continue
            bad = self._replay(self.model.module, got["units"], bool(got["micro"]), got["rng"], s, finite=True)
            verdict[origin] = 0 if bool(bad) else 1
        dist.all_reduce(verdict, group=self.group)
        faulty = [r for r in pre if int(verdict[r])]
        if faulty:
            self._nonfinite_detected(s, flags, faulty=faulty, overflow_replayed=[r for r in pre if r not in faulty])
            return
        scale = float(self.grad_scaler.get_scale())
        self.grad_scaler.step(self.optimizer)  # finds the Inf/NaN itself and skips the update
        self.grad_scaler.update()
        self.last.applied = False
        self._overflows += 1
        self._event(
            "overflow",
            "pass",
            step=s,
            contained=True,
            pre_ranks=pre,
            replayed_by=[(r + 1) % self.world for r in pre],
            scale=scale,
            new_scale=float(self.grad_scaler.get_scale()),
        )

    def _nonfinite_detected(
        self, s: int, flags: tuple[list[int], list[int]], *, faulty: list[int] | None = None, **extra: Any
    ) -> None:
        """Record (and, by policy, raise) a non-finite detection; ``faulty``: with a gradient scaler,
        the flagged ranks whose micro-batches a neighbour recomputed finite (the others overflowed)."""
        late = self.last is None or self.last.step != s  # a deferred read: step s's update was applied
        if self.last is not None:
            self.last.applied = False
        pre = [r for r, f in enumerate(flags[0]) if f]
        post = [r for r, f in enumerate(flags[1]) if f]
        bad = (
            []  # step s's gradients are gone; .grad holds a later step's
            if late
            else [
                n
                for n, p in zip(self.param_names, self.params)
                if p.grad is not None and not torch.isfinite(p.grad).all()
            ]
        )
        if late:
            extra = {**extra, "read": "deferred", "detected_at": self.last.step if self.last else s}
        if pre:
            kind, suspects = "nonfinite-pre", pre if faulty is None else faulty
            msg = f"non-finite local gradients on rank(s) {suspects} before the all-reduce"
            if faulty is not None:
                msg += " (a neighbour recomputed the same micro-batches with finite gradients: not an overflow)"
        else:
            kind, suspects = "nonfinite-post", []
            msg = (
                f"gradients became non-finite in the all-reduce (seen on rank(s) {post}) while every rank's local"
                " gradients were finite: suspect the reduction (interconnect, or a rank's reduction arithmetic)"
            )
        ev = self._event(
            kind,
            "fail",
            step=s,
            suspects=suspects,
            contained=not late,  # a deferred read's step was applied: its fault reached the weights
            pre_ranks=pre,
            post_ranks=post,
            tensors=bad[:20],
            policy=self.on_nonfinite,
            **extra,
        )
        self._zero_grad()
        if late:
            msg += late_detection_note(s)
        else:
            msg += "; the update was not applied"
        self._fail(ev, msg, policy="raise" if self.on_nonfinite == "raise" else "skip")
