"""Check 1 of a DDP audit session: non-finite gradients, before and after the all-reduce.

The communication hook leaves per-bucket flags on the device; ``NonFiniteCheck`` reads them once
before the optimizer step (exchanging them between ranks only on a failing step, unless
``exchange_flags="every-step"``), tells a gradient scaler's overflow from a fault by having a
neighbour recompute the flagged ranks' micro-batches, and records (and, by policy, raises) a
detection naming the rank whose local gradients went bad, or the reduction. ``NonFiniteCheck`` is a
check object of ``session.AuditSession``, built on its ``context.CheckContext``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist

from .context import CheckContext
from .exchange import recv_payload, send_payload
from .hook import any_nonfinite
from .letgo import released
from .options import ExchangeFlags, NonfiniteRead
from .replay import RingReplay
from .setup_checks import late_detection_note
from .timing import timed
from .trigger import SentinelCheck

__all__ = ["NonFiniteCheck"]

Flags = tuple[list[int], list[int]]  # per rank: (pre-reduce flags, post-reduce flags)


class NonFiniteCheck:
    """The non-finite check of ``AuditSession``: reads the hook's flags (``ctx.hook``).

    ``replay``: the ring replay that tells a gradient scaler's overflow from a fault. ``sentinels``:
    the sentinels whose scalars travel with the flags (``trigger.SentinelCheck``). Its own state is
    the deferred read still on its way (``nonfinite_read="deferred"``) and the table of every rank's
    sentinel row the last immediate read exchanged (``table``; None when none was).
    """

    def __init__(self, ctx: CheckContext, *, replay: RingReplay, sentinels: SentinelCheck | None = None) -> None:
        self.ctx, self.replay, self.sentinels = ctx, replay, sentinels
        self._pending: tuple[int, tuple[int, torch.Tensor, Any]] | None = None  # a deferred read's step and sums
        # an exchange started early: step, out, work, and the wait for gloo's worker to let go of its
        # tensors once it is complete (letgo: the last step's exchange may be a run's last collective)
        self._early: tuple[int, list[torch.Tensor], Any, contextlib.ExitStack] | None = None
        self.table: list[list[float]] | None = None

    def exchange_early(self, s: int) -> None:
        """Start step s's exchange now, right after its last backward, and read it before the
        update: the sentinels' rows (with the flags) when the sentinels are on, else the flags with
        ``exchange_flags="every-step"``; otherwise nothing to do.

        The exchange is a point where every rank waits for the slowest. Started as the step's
        gradients come out of their all-reduce, where the ranks have just met, it runs while the
        loop clips the gradients, and ``due`` finds it done instead of making every rank wait once
        more (measured in ``benchmarks/bench_accelerate.py``). The flags and the buckets' sums of
        squares are final by then: the hook computed them as each bucket came back. Every rank must
        call it at the same point of the same step (a collective), and call nothing else that
        changes the flags before ``due``.
        """
        self._settle_early()
        ctx = self.ctx
        letgo = contextlib.ExitStack()
        if self.sentinels is not None and self.sentinels.active:
            rows, work = self._start_rows(letgo=letgo)
            self._early = (s, rows, work, letgo)
            return
        if ctx.options.exchange_flags is not ExchangeFlags.EVERY_STEP:
            return
        flags = self._local_flags()
        letgo.enter_context(released(flags))
        work = dist.all_reduce(flags, group=ctx.group, async_op=True)
        self._early = (s, [flags], work, letgo)

    def _settle_early(self) -> tuple[int, list[torch.Tensor]] | None:
        """The early exchange started, once complete: ``(its step, what it exchanged)`` (the summed
        flags, or every rank's sentinel row); None when none was."""
        early, self._early = self._early, None
        if early is None:
            return None
        s, out, work, letgo = early
        del early
        work.wait()
        del work  # the work holds its tensors: the wait for the worker's release comes after
        letgo.close()
        return s, out

    def must_read_now(self, s: int, *, audit: bool) -> bool:
        """Steps whose non-finite flags are read before their update even when reads are deferred:
        audits and consensus steps (their evidence covers the step) and the replay-path check."""
        every = self.ctx.options.consensus_every
        due = every is not None and s % every == 0
        return audit or due or self.ctx.state.path_check_pending

    @timed("nonfinite_check")
    def due(self, s: int, *, now: bool) -> tuple[int, Flags] | None:
        """The non-finite check of step s: ``(failing step, flags)``, or None when clean.

        Immediate (``nonfinite_read="immediate"``, and at every step that must know now: audits,
        consensus steps, the first steps): the flags are read here, before the update. Deferred
        (``nonfinite_read="deferred"``): the step's flags are copied to the host without waiting,
        and the *previous* step's, long since computed, are read instead; the failing step is then
        the previous one, whose update was applied. A deferred read never waits for the GPU to
        drain its queue, which the immediate one does once a step (issue 15: 9 % of a 4.7 ms step
        of the envelope's model on an H200).
        """
        self.table = None
        failed = self._settle_deferred_flags()
        if failed is not None:
            return failed
        if self.ctx.options.nonfinite_read is NonfiniteRead.DEFERRED and not now:
            self._pending = (s, self._queue_flags())
            return None
        flags = self._read_flags(s)
        return None if flags is None else (s, flags)

    def discard_pending(self) -> None:
        """Forget a deferred read still pending (``close``: no checkpoint covers that step); an early
        exchange every rank started is let finish first."""
        self._pending = None
        self._settle_early()

    def _queue_flags(self) -> tuple[int, torch.Tensor, Any]:
        """This step's per-bucket sums, local (pre-reduce) ones first, on their way to the host (no
        wait): ``(how many are local, the sums, the event that marks their arrival)``."""
        hook = self.ctx.hook
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

    def _settle_deferred_flags(self) -> tuple[int, Flags] | None:
        """Read the pending (deferred) step's flags: ``(that step, flags)`` when they fail, else None.

        Every rank holds the same pending step, and a non-finite reduced bucket reaches every rank
        alike, so the ranks enter the flag exchange together, as in an immediate read.
        """
        ctx = self.ctx
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        s, (n_pre, host, event) = pending
        if event is not None:
            event.synchronize()  # the copy of that step's sums, queued a step ago: done by now
        values = [float(x) for x in host.tolist()]
        if all(math.isfinite(v) for v in values[n_pre:]):
            return None
        flags = torch.zeros(2 * ctx.world, dtype=torch.int32, device=ctx.wire_device)
        flags[ctx.world + ctx.rank] = 1
        flags[ctx.rank] = int(not all(math.isfinite(v) for v in values[:n_pre]))
        with released(flags):  # a step's exchange may be a run's last collective (letgo)
            dist.all_reduce(flags, group=ctx.group)
        exchanged = flags.tolist()
        return s, (exchanged[: ctx.world], exchanged[ctx.world :])

    def settle_deferred(self) -> None:
        """Before anything that vouches for the weights (a consensus, a checkpoint, the end of the
        run): the pending step's flags are read, and a failure is detected (and raised) now."""
        failed = self._settle_deferred_flags()
        if failed is not None:
            self.detected(*failed)

    def _local_flags(self) -> torch.Tensor:
        """This rank's flags as the exchange sums them: ``[pre-reduce by rank..., post-reduce by
        rank...]``, this rank's two entries set (no host read)."""
        ctx, hook = self.ctx, self.ctx.hook
        flags = torch.zeros(2 * ctx.world, dtype=torch.int32, device=ctx.wire_device)
        if hook.post:
            flags[ctx.world + ctx.rank] = any_nonfinite(hook.post).to(ctx.wire_device)
        if hook.pre:  # eager: every bucket's; lazy: those of the buckets that came back non-finite
            flags[ctx.rank] = any_nonfinite(hook.pre).to(ctx.wire_device)
        return flags

    def _read_flags(self, s: int) -> Flags | None:
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
        ctx, hook = self.ctx, self.ctx.hook
        early = self._settle_early()
        sentinels = self.sentinels is not None and self.sentinels.active
        if early is not None and early[0] == s:  # exchanged already (exchange_early)
            if sentinels:
                return self._flags_from_rows(early[1])
            values = early[1][0].tolist()
        else:
            if sentinels:
                with contextlib.ExitStack() as letgo:
                    rows = self._start_rows(wait=True, letgo=letgo)[0]
                return self._flags_from_rows(rows)
            post_local = bool(any_nonfinite(hook.post)) if hook.post else False  # the step's one host read
            if not post_local and ctx.options.exchange_flags is ExchangeFlags.ON_FAILURE:
                return None
            flags = self._local_flags()
            with released(flags):
                dist.all_reduce(flags, group=ctx.group)
            values = flags.tolist()
        if not any(values):
            return None
        return values[: ctx.world], values[ctx.world :]

    def _start_rows(self, *, letgo: contextlib.ExitStack, wait: bool = False) -> tuple[list[torch.Tensor], Any]:
        """All-gather this rank's sentinel row (its flags ride along): ``(every rank's row, the
        work)``, in flight unless ``wait``.

        The sentinels need every rank's scalars at every step, so the flags ride along: every rank
        learns every rank's flags, as with ``exchange_flags="every-step"`` (a reduction that
        delivers non-finite values to some ranks only is a contained detection too), and a clean
        step still pays one small collective and one host read.
        """
        ctx, hook = self.ctx, self.ctx.hook
        assert self.sentinels is not None
        pre, post = self.sentinels.flags_of(hook.pre, hook.post)
        mine = self.sentinels.row(pre, post)
        rows = [torch.empty_like(mine) for _ in range(ctx.world)]
        letgo.enter_context(released(mine, *rows))  # closed by the caller once the gather is complete
        work = dist.all_gather(rows, mine, group=ctx.group, async_op=not wait)
        return rows, work

    def _flags_from_rows(self, rows: list[torch.Tensor]) -> Flags | None:
        """The exchanged rows, kept as ``table`` (the step's one host read): every rank's flags,
        or None on a clean step."""
        table = torch.stack(rows).tolist()
        self.table = table
        pre_flags = [int(r[0] != 0) for r in table]
        post_flags = [int(r[1] != 0) for r in table]
        if not any(pre_flags) and not any(post_flags):
            return None
        return pre_flags, post_flags

    def scaler_nonfinite(
        self, s: int, flags: Flags, units: list[Any], micro: bool, rng: dict[str, torch.Tensor] | None
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
        ctx = self.ctx
        pre = [r for r, f in enumerate(flags[0]) if f]
        if not pre:
            self.detected(s, flags)
            return
        verdict = torch.zeros(ctx.world, dtype=torch.int64, device=ctx.wire_device)  # 1: finite on replay
        for origin in pre:
            replayer = (origin + 1) % ctx.world
            payload: dict[str, Any] = {"units": units, "micro": micro, "rng": rng}
            if ctx.world == 1:
                got = payload  # one rank: the same device recomputes (a transient fault only shows)
            elif ctx.rank == origin:
                send_payload(
                    payload, dist.get_global_rank(ctx.group, replayer), group=ctx.group, wire_device=ctx.wire_device
                )
                continue
            elif ctx.rank == replayer:
                got = recv_payload(
                    dist.get_global_rank(ctx.group, origin),
                    group=ctx.group,
                    wire_device=ctx.wire_device,
                    out_device=ctx.device,
                )
            else:
                continue
            bad = self.replay.recompute(ctx.model.module, got["units"], bool(got["micro"]), got["rng"], s, finite=True)
            verdict[origin] = 0 if bool(bad) else 1
        with released(verdict):
            dist.all_reduce(verdict, group=ctx.group)
        faulty = [r for r in pre if int(verdict[r])]
        if faulty:
            self.detected(s, flags, faulty=faulty, overflow_replayed=[r for r in pre if r not in faulty])
            return
        scaler = ctx.grad_scaler
        scale = float(scaler.get_scale())
        scaler.step(ctx.optimizer)  # finds the Inf/NaN itself and skips the update
        scaler.update()
        if ctx.state.last is not None:
            ctx.state.last.applied = False
        ctx.state.overflows += 1
        ctx.report.event(
            "overflow",
            "pass",
            step=s,
            contained=True,
            pre_ranks=pre,
            replayed_by=[(r + 1) % ctx.world for r in pre],
            scale=scale,
            new_scale=float(scaler.get_scale()),
        )

    def detected(self, s: int, flags: Flags, *, faulty: list[int] | None = None, **extra: Any) -> None:
        """Record (and, by policy, raise) a non-finite detection; ``faulty``: with a gradient scaler,
        the flagged ranks whose micro-batches a neighbour recomputed finite (the others overflowed)."""
        ctx = self.ctx
        last = ctx.state.last
        late = last is None or last.step != s  # a deferred read: step s's update was applied
        if last is not None:
            last.applied = False
        pre = [r for r, f in enumerate(flags[0]) if f]
        post = [r for r, f in enumerate(flags[1]) if f]
        bad = (
            []  # step s's gradients are gone; .grad holds a later step's
            if late
            else [
                n
                for n, p in zip(ctx.param_names, ctx.params)
                if p.grad is not None and not torch.isfinite(p.grad).all()
            ]
        )
        if late:
            extra = {**extra, "read": "deferred", "detected_at": last.step if last else s}
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
        ev = ctx.report.event(
            kind,
            "fail",
            step=s,
            suspects=suspects,
            contained=not late,  # a deferred read's step was applied: its fault reached the weights
            pre_ranks=pre,
            post_ranks=post,
            tensors=bad[:20],
            policy=ctx.options.on_nonfinite.value,
            **extra,
        )
        ctx.drop_grads()
        if late:
            msg += late_detection_note(s)
        else:
            msg += "; the update was not applied"
        ctx.report.fail(ev, msg, policy=ctx.options.on_nonfinite.value)
