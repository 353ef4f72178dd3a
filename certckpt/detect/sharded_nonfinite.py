"""Check 1 of an FSDP2 / HSDP audit session: non-finite reduced gradients, agreed by every rank.

Each rank sees only its own gradient shards, so the ranks exchange one flag pair per step (this
rank's reduced shards non-finite; its local gradient non-finite before the reduce-scatter, known
when the replay's reduce-scatter is installed), immediately or, with ``nonfinite_read="deferred"``,
by an asynchronous all-gather read a step later; a failing step is attributed from where each rank
found the values. ``ShardedNonFiniteCheck`` is a mixin of ``sharded.ShardedAuditSession`` and works
on the session's attributes.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .agreement import all_gather_bytes
from .setup_checks import late_detection_note

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
    """The non-finite check of ``ShardedAuditSession`` (a mixin: the session holds the state it reads).

    It reads the session's parameters, group and recorder (``_recorder``'s pre-reduce sums), and
    uses its ``_event`` and ``_fail``.
    """

    def _nonfinite_check(self, s: int, *, now: bool = True) -> bool:
        """Check the reduced gradients of the coming update (collective); returns whether to apply it.

        Every rank sums its local gradient shards (one reduction each), the ranks all-gather one flag
        each, and on a failure the names: a non-finite shard on some replicas of a region only names
        those ranks (the reduction delivered them bad values, or their memory went bad); on every
        holder of the region it came through the reduction from some rank's local gradient, which
        FSDP's reduce-scatter has consumed, and names nobody. A refused update's gradients are dropped.
        """
        self._settle_nonfinite(at=s)  # a deferred read of the previous step raises here
        named = [(n, p.grad) for n, p in self.params if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for _, g in named]
        pre_sums = self._recorder.take_pre_sums() if self._recorder is not None else None
        if self.nonfinite_read == "deferred" and not now:
            self._pending_flags = self._queue_nonfinite(s, named, grads, pre_sums)
            return True
        flags, pre_bad = _nonfinite_flags(grads, pre_sums)
        mine = torch.tensor([int(flags.any()), int(pre_bad)], dtype=torch.int64, device=self.wire_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        rows = [[int(x) for x in f.tolist()] for f in everyone]
        bad = [[n, shard_offsets(g)] for (n, g), b in zip(named, flags.tolist()) if b]
        return self._nonfinite_outcome(s, rows, bad)

    def _queue_nonfinite(self, s: int, named: list, grads: list[torch.Tensor], pre_sums: Any) -> dict[str, Any]:
        """Start the exchange of step s's flags without waiting for the device or the other ranks: the
        sums stay on the device, an asynchronous all-gather carries them, and on a GPU the result
        is copied to pinned host memory behind an event (read at the next step)."""
        sums = [g.sum(dtype=torch.float32) for g in grads]
        device = sums[0].device if sums else self.device
        sums.append(pre_sums.to(device).sum() if pre_sums is not None else torch.zeros((), device=device))
        bad = ~torch.isfinite(torch.stack(sums))
        mine = torch.stack([bad[:-1].any(), bad[-1]]).to(torch.int64)
        if mine.device != self.wire_device:  # CUDA gradients on a gloo group (tests): a synchronisation
            mine = mine.to(self.wire_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        work = dist.all_gather(everyone, mine, group=self.group, async_op=True)
        host, event = None, None
        if mine.device.type == "cuda":
            work.wait()  # the current stream waits for the collective; the host does not
            host = torch.empty(2 * self.world, dtype=torch.int64, pin_memory=True)
            host.copy_(torch.cat(everyone), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return {"s": s, "work": work, "everyone": everyone, "host": host, "event": event, "bad": bad, "named": named}

    def _settle_nonfinite(self, *, at: int | None = None) -> None:
        """Read the pending (deferred) step's exchanged flags; a failure is detected (and raised) now,
        at step ``at`` (default: the current step count)."""
        pending, self._pending_flags = self._pending_flags, None
        if pending is None:
            return
        if pending["event"] is not None:
            pending["event"].synchronize()  # the exchange of a step ago: done by now
            flat = pending["host"].tolist()
        else:
            pending["work"].wait()
            flat = [int(x) for f in pending["everyone"] for x in f.tolist()]
        rows = [flat[2 * r : 2 * r + 2] for r in range(self.world)]
        if not any(any(row) for row in rows):
            self._nonfinite_outcome(pending["s"], rows, [])
            return
        flags = pending["bad"][:-1].tolist()
        params = dict(self.params)
        bad = [[n, shard_offsets(params[n])] for (n, _), b in zip(pending["named"], flags) if b]
        self._nonfinite_outcome(pending["s"], rows, bad, late=self.step if at is None else at)

    def _nonfinite_outcome(self, s: int, rows: list[list[int]], mine_bad: list, *, late: int | None = None) -> bool:
        """Step s's exchanged flags (per rank: reduced shard non-finite, local gradient non-finite)
        and this rank's non-finite gradient regions: count a clean step, or detect (collective).
        ``late``: the step at which a deferred read found them (step s's update was applied)."""
        bad_ranks = [r for r, f in enumerate(rows) if f[0]]
        pre_ranks = [r for r, f in enumerate(rows) if f[1]]
        if not bad_ranks and not pre_ranks:
            self._checked += 1
            self._first_checked = s if self._first_checked is None else self._first_checked
            return True
        # the failing step: which tensors, and which regions, on every rank
        held = [[n, shard_offsets(p)] for n, p in self.params]
        texts = all_gather_bytes(
            json.dumps({"bad": mine_bad, "held": held}).encode(), group=self.group, wire_device=self.wire_device
        )
        reports = [json.loads(t) for t in texts]
        holders: dict[str, list[int]] = {}
        for r, rep in enumerate(reports):
            for n, off in rep["held"]:
                holders.setdefault(json.dumps([n, off]), []).append(r)
        suspects, where = set(), {}
        for r, rep in enumerate(reports):
            for n, off in rep["bad"]:
                where.setdefault(str(r), []).append(n if off is None else f"{n}@{','.join(map(str, off))}")
                region = json.dumps([n, off])
                flagged = [h for h in holders.get(region, [r]) if any(b == [n, off] for b in reports[h]["bad"])]
                if len(flagged) < len(holders.get(region, [r])):
                    suspects.add(r)  # its replicas of the same region hold finite values
        self._drop_grads()  # this step's update is dropped: it never reaches the weights
        if pre_ranks:
            # With the replay's reduce-scatter installed every rank knows whether its own local
            # gradient was finite before the reduction, as under DDP: those ranks produced the values.
            kind, suspects = "nonfinite-pre", set(pre_ranks)
            message = f"non-finite local gradients on rank(s) {pre_ranks} before the reduce-scatter"
        else:
            kind = "nonfinite-post"
            message = f"non-finite reduced gradients on rank(s) {bad_ranks} ({where})"
        extra = {"read": "deferred", "detected_at": late} if late is not None else {}
        ev = self._event(
            kind,
            "fail",
            step=s,
            suspects=suspects,
            contained=late is None,  # a deferred read's step was applied: its fault reached the weights
            post_ranks=bad_ranks,
            pre_ranks=pre_ranks,
            tensors=where,
            where="reduced gradient shards (after FSDP's reduce-scatter and the replicas' all-reduce)",
            policy=self.on_nonfinite,
            **extra,
        )
        if late is not None:
            message += late_detection_note(s)
        else:
            message += "; the update was dropped"
        self._fail(ev, message, policy="raise" if self.on_nonfinite == "raise" else "skip")
        return False

    def _drop_grads(self) -> None:
        for _, p in self.params:
            p.grad = None

    def _summarise_nonfinite(self, s: int) -> int:
        """Emit the per-step checks since the last summary, as the DDP auditor reports them at audit
        steps (here at checkpoints and at close: there are no audit steps without a replay); returns
        how many steps they were."""
        checked = self._checked
        if checked:
            self._event("nonfinite", "pass", step=s, steps_checked=self._checked, first=self._first_checked)
            self._checked, self._first_checked = 0, None
        return checked
