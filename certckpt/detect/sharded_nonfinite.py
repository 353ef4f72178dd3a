"""Check 1 of an FSDP2 / HSDP audit session: non-finite reduced gradients, agreed by every rank.

Each rank sees only its own gradient shards, so the ranks exchange one flag pair per step (this
rank's reduced shards non-finite; its local gradient non-finite before the reduce-scatter, known
when the replay's reduce-scatter is installed), immediately or, with ``nonfinite_read="deferred"``,
by an asynchronous all-gather read a step later; a failing step is attributed from where each rank
found the values. With the sentinels on (``sharded_trigger``), the same all-gather carries each
rank's sentinel row, the flags first. ``ShardedNonFiniteCheck`` is a check object of ``sharded.ShardedAuditSession``,
built on its ``sharded_context.ShardedContext``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .agreement import all_gather_bytes
from .letgo import released
from .options import NonfiniteRead
from .setup_checks import late_detection_note
from .sharded_context import ShardedContext
from .sharded_trigger import ShardedSentinels
from .timing import timed

__all__ = ["ShardedNonFiniteCheck", "shard_offsets"]


def shard_offsets(t: torch.Tensor) -> list[int] | None:
    """Where a DTensor's local shard starts in the global tensor (None: a plain tensor, or no shard here)."""
    if not isinstance(t, DTensor):
        return None
    chunks = t.__create_chunk_list__()
    return list(chunks[0].offsets) if chunks else None


def _nonfinite_flags(grads: list[torch.Tensor], pre_sums: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """``(per-gradient flags, any pre-reduce sum non-finite)`` on the host, in one synchronisation.

    One reduction per gradient, no copy: NaN and Inf survive a sum (an overflow to Inf is flagged too,
    and means the gradients are unusable anyway), as the DDP hook's check. ``pre_sums``: the sums of
    this rank's local gradients taken at each reduce-scatter (``GradientRecorder``), if any.
    """
    sums = [g.sum(dtype=torch.float32) for g in grads]
    if pre_sums is not None:
        sums.append(pre_sums.to(sums[0].device if sums else pre_sums.device).sum())
    if not sums:
        return torch.zeros(0, dtype=torch.bool), False
    bad = ~torch.isfinite(torch.stack(sums).cpu())
    if pre_sums is None:
        return bad, False
    return bad[:-1], bool(bad[-1])


class ShardedNonFiniteCheck:
    """The non-finite check of ``ShardedAuditSession``, on the context's parameters and recorder.

    Its own state: the deferred read still on its way, and the clean steps counted since the last
    summary (``summarise``).
    """

    def __init__(self, ctx: ShardedContext, *, sentinels: ShardedSentinels | None = None) -> None:
        self.ctx, self.sentinels = ctx, sentinels
        self._pending: dict[str, Any] | None = None  # a deferred read's step, still on its way
        self._checked = 0  # steps whose non-finite check passed since the last summary
        self._first_checked: int | None = None
        self.table: list[list[float]] | None = None  # every rank's sentinel row, when this step exchanged them

    @timed("nonfinite_check")
    def check(self, s: int, *, now: bool = True) -> bool:
        """Check the reduced gradients of the coming update (collective); returns whether to apply it.

        Every rank sums its local gradient shards (one reduction each), the ranks all-gather one flag
        each, and on a failure the names: a non-finite shard on some replicas of a region only names
        those ranks (the reduction delivered them bad values, or their memory went bad); on every
        holder of the region it came through the reduction from some rank's local gradient, which
        FSDP's reduce-scatter has consumed, and names nobody. A refused update's gradients are dropped.
        """
        ctx = self.ctx
        self.table = None
        self.settle(at=s)  # a deferred read of the previous step raises here
        named = [(n, p.grad) for n, p in ctx.params if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for _, g in named]
        pre_sums = ctx.recorder.take_pre_sums() if ctx.recorder is not None else None
        if ctx.options.nonfinite_read is NonfiniteRead.DEFERRED and not now:
            self._pending = self._queue(s, named, grads, pre_sums)
            return True
        if self.sentinels is not None and self.sentinels.active:
            return self._check_with_sentinels(s, named, grads, pre_sums)
        flags, pre_bad = _nonfinite_flags(grads, pre_sums)
        mine = torch.tensor([int(flags.any()), int(pre_bad)], dtype=torch.int64, device=ctx.wire_device)
        everyone = [torch.empty_like(mine) for _ in range(ctx.world)]
        with released(mine, *everyone):  # a step's exchange may be a run's last collective (letgo)
            dist.all_gather(everyone, mine, group=ctx.group)
        rows = [[int(x) for x in f.tolist()] for f in everyone]
        bad = [[n, shard_offsets(g)] for (n, g), b in zip(named, flags.tolist()) if b]
        return self._outcome(s, rows, bad)

    def _check_with_sentinels(
        self, s: int, named: list[Any], grads: list[torch.Tensor], pre_sums: torch.Tensor | None
    ) -> bool:
        """The flags and the sentinels' scalars of every rank, in the same one all-gather (float32
        rows in place of the two int flags) and one host read, where the plain check reads twice."""
        ctx = self.ctx
        assert self.sentinels is not None
        device = grads[0].device if grads else pre_sums.device if pre_sums is not None else ctx.device
        bad = ~torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in grads])) if grads else None
        post = bad.any() if bad is not None else torch.zeros((), dtype=torch.bool, device=device)
        # (a zero made on the host and copied to a GPU would be a synchronisation: made there instead)
        pre = (
            ~torch.isfinite(pre_sums.sum())
            if pre_sums is not None
            else torch.zeros((), dtype=torch.bool, device=device)
        )
        mine = self.sentinels.row(pre, post)
        everyone = [torch.empty_like(mine) for _ in range(ctx.world)]
        with released(mine, *everyone):  # a step's exchange may be a run's last collective (letgo)
            dist.all_gather(everyone, mine, group=ctx.group)
        table = torch.stack(everyone).tolist()  # the step's one host read
        self.table = table
        rows = [[int(r[0] != 0), int(r[1] != 0)] for r in table]
        if not any(any(r) for r in rows):
            return self._outcome(s, rows, [])
        flags = bad.tolist() if bad is not None else []
        return self._outcome(s, rows, [[n, shard_offsets(g)] for (n, g), b in zip(named, flags) if b])

    def discard_pending(self) -> None:
        """Forget a deferred read still pending (``close``: no checkpoint covers that step)."""
        self._pending = None

    def _queue(self, s: int, named: list[Any], grads: list[torch.Tensor], pre_sums: Any) -> dict[str, Any]:
        """Start the exchange of step s's flags without waiting for the device or the other ranks: the
        sums stay on the device, an asynchronous all-gather carries them, and on a GPU the result
        is copied to pinned host memory behind an event (read at the next step)."""
        ctx = self.ctx
        sums = [g.sum(dtype=torch.float32) for g in grads]
        device = sums[0].device if sums else ctx.device
        sums.append(pre_sums.to(device).sum() if pre_sums is not None else torch.zeros((), device=device))
        bad = ~torch.isfinite(torch.stack(sums))
        mine = torch.stack([bad[:-1].any(), bad[-1]]).to(torch.int64)
        if mine.device != ctx.wire_device:  # CUDA gradients on a gloo group (tests): a synchronisation
            mine = mine.to(ctx.wire_device)
        everyone = [torch.empty_like(mine) for _ in range(ctx.world)]
        work = dist.all_gather(everyone, mine, group=ctx.group, async_op=True)
        host, event = None, None
        if mine.device.type == "cuda":
            assert work is not None  # async_op=True returns the work
            work.wait()  # the current stream waits for the collective; the host does not
            host = torch.empty(2 * ctx.world, dtype=torch.int64, pin_memory=True)
            host.copy_(torch.cat(everyone), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return {"s": s, "work": work, "everyone": everyone, "host": host, "event": event, "bad": bad, "named": named}

    def settle(self, *, at: int | None = None) -> None:
        """Read the pending (deferred) step's exchanged flags; a failure is detected (and raised) now,
        at step ``at`` (default: the current step count)."""
        ctx = self.ctx
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending["event"] is not None:
            pending["event"].synchronize()  # the exchange of a step ago: done by now
            flat = pending["host"].tolist()
        else:
            pending["work"].wait()
            flat = [int(x) for f in pending["everyone"] for x in f.tolist()]
        rows = [flat[2 * r : 2 * r + 2] for r in range(ctx.world)]
        if not any(any(row) for row in rows):
            self._outcome(pending["s"], rows, [])
            return
        flags = pending["bad"][:-1].tolist()
        params = dict(ctx.params)
        bad = [[n, shard_offsets(params[n])] for (n, _), b in zip(pending["named"], flags) if b]
        self._outcome(pending["s"], rows, bad, late=ctx.state.step if at is None else at)

    def _outcome(self, s: int, rows: list[list[int]], mine_bad: list[Any], *, late: int | None = None) -> bool:
        """Step s's exchanged flags (per rank: reduced shard non-finite, local gradient non-finite)
        and this rank's non-finite gradient regions: count a clean step, or detect (collective).
        ``late``: the step at which a deferred read found them (step s's update was applied)."""
        ctx = self.ctx
        bad_ranks = [r for r, f in enumerate(rows) if f[0]]
        pre_ranks = [r for r, f in enumerate(rows) if f[1]]
        if not bad_ranks and not pre_ranks:
            self._checked += 1
            self._first_checked = s if self._first_checked is None else self._first_checked
            return True
        suspects, where = self._where(mine_bad)
        ctx.drop_grads()  # this step's update is dropped: it never reaches the weights
        if pre_ranks:
            # With the replay's reduce-scatter installed every rank knows whether its own local
            # gradient was finite before the reduction, as under DDP: those ranks produced the values.
            kind, suspects = "nonfinite-pre", set(pre_ranks)
            message = f"non-finite local gradients on rank(s) {pre_ranks} before the reduce-scatter"
        else:
            kind = "nonfinite-post"
            message = f"non-finite reduced gradients on rank(s) {bad_ranks} ({where})"
        extra = {"read": "deferred", "detected_at": late} if late is not None else {}
        ev = ctx.report.event(
            kind,
            "fail",
            step=s,
            suspects=suspects,
            contained=late is None,  # a deferred read's step was applied: its fault reached the weights
            post_ranks=bad_ranks,
            pre_ranks=pre_ranks,
            tensors=where,
            where="reduced gradient shards (after FSDP's reduce-scatter and the replicas' all-reduce)",
            policy=ctx.options.on_nonfinite.value,
            **extra,
        )
        if late is not None:
            message += late_detection_note(s)
        else:
            message += "; the update was dropped"
        ctx.report.fail(ev, message, policy=ctx.options.on_nonfinite.value)
        return False

    def _where(self, mine_bad: list[Any]) -> tuple[set[int], dict[str, list[str]]]:
        """A failing step: which tensors, and which regions, on every rank (collective); the ranks
        whose replicas of a region hold finite values are the suspects."""
        ctx = self.ctx
        held = [[n, shard_offsets(p)] for n, p in ctx.params]
        texts = all_gather_bytes(
            json.dumps({"bad": mine_bad, "held": held}).encode(), group=ctx.group, wire_device=ctx.wire_device
        )
        reports = [json.loads(t) for t in texts]
        holders: dict[str, list[int]] = {}
        for r, rep in enumerate(reports):
            for n, off in rep["held"]:
                holders.setdefault(json.dumps([n, off]), []).append(r)
        suspects: set[int] = set()
        where: dict[str, list[str]] = {}
        for r, rep in enumerate(reports):
            for n, off in rep["bad"]:
                where.setdefault(str(r), []).append(n if off is None else f"{n}@{','.join(map(str, off))}")
                region = json.dumps([n, off])
                flagged = [h for h in holders.get(region, [r]) if any(b == [n, off] for b in reports[h]["bad"])]
                if len(flagged) < len(holders.get(region, [r])):
                    suspects.add(r)  # its replicas of the same region hold finite values
        return suspects, where

    def summarise(self, s: int) -> int:
        """Emit the per-step checks since the last summary, as the DDP auditor reports them at audit
        steps (here at checkpoints and at close: there are no audit steps without a replay); returns
        how many steps they were."""
        checked = self._checked
        if checked:
            self.ctx.report.event("nonfinite", "pass", step=s, steps_checked=self._checked, first=self._first_checked)
            self._checked, self._first_checked = 0, None
        return checked
