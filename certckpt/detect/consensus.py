"""Check 3 of a DDP audit session: the weight consensus, with the buffers it covers.

At audit, consensus and checkpoint steps every replica's parameters and floating-point buffers
(``consensus_buffers``) are digested, all-gathered and compared: a minority is named, no majority
is reported as such. A checkpoint step compares the 64-bit fingerprints instead, which the writer
reuses. Under DDP's ``broadcast_buffers`` the broadcast source (rank 0) seals its buffers after
each forward and checks the seal before the next one, and the consensus broadcasts rank 0's buffers
first, as DDP's next forward would. ``WeightConsensus`` is a check object of ``session.AuditSession``,
built on its ``context.CheckContext``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from certckpt.format.fingerprinting import as_words, finalize, raw_sum
from certckpt.format.record import state_fingerprint

from .attribution import consensus_verdict
from .context import CheckContext
from .digest import digests
from .letgo import released
from .timing import timed

__all__ = ["WeightConsensus", "consensus_buffers"]


_PER_RANK_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.InstanceNorm1d,
    torch.nn.InstanceNorm2d,
    torch.nn.InstanceNorm3d,
)


def consensus_buffers(module: torch.nn.Module, *, broadcast: bool) -> tuple[list[str], list[torch.Tensor]]:
    """The floating-point buffers every replica must hold identically at a consensus step.

    With DDP's ``broadcast_buffers=True`` all of them (the auditor broadcasts rank 0's copy first,
    as DDP's next forward would). Without it, the running statistics of (non-synchronised) batch
    and instance norms are each rank's own by design, so they stay out; ``SyncBatchNorm``'s
    statistics are computed over all ranks and stay in, as do constant buffers.
    """
    per_rank: set[int] = set()
    if not broadcast:
        for m in module.modules():
            if isinstance(m, _PER_RANK_NORMS) and getattr(m, "track_running_stats", False):
                per_rank |= {id(m.running_mean), id(m.running_var)}
    named = [(n, b) for n, b in module.named_buffers() if b.is_floating_point() and id(b) not in per_rank]
    return [n for n, _ in named], [b for _, b in named]


class WeightConsensus:
    """The weight consensus of ``AuditSession``, on the context's parameters and buffers.

    A consensus on fingerprints that agrees is kept in ``ctx.state.agreed`` for the checkpoint
    evidence. On the broadcast source (rank 0 under ``broadcast_buffers``) it also keeps the seal of
    the buffers (``seal``, ``check_seal``), its own state.
    """

    def __init__(self, ctx: CheckContext) -> None:
        self.ctx = ctx
        # With DDP's broadcast_buffers every forward starts from rank 0's copy, so rank 0 seals its
        # buffers after each forward and checks the seal before the next one: a change in between
        # (stored state corrupted) would be broadcast to every replica and into the checkpoints, and
        # is reported at the next consensus instead.
        self.seal_source = ctx.broadcast_buffers and bool(ctx.buffers) and ctx.rank == 0
        self._seal: torch.Tensor | None = None
        self._seal_bad: torch.Tensor | None = None

    @timed("consensus")
    def check(self, s: int, *, found_by: str | None = None, fingerprints: bool = False) -> bool:
        """Compare every replica's weights; returns whether they agree.

        Audits compare 32-bit audit digests (``digest.py``). A checkpoint step (``fingerprints=True``)
        compares the 64-bit fingerprints instead, which the checkpoint writer then reuses, and its
        pass event carries the state fingerprint the certifier matches against the file. The caller
        reads a pending deferred non-finite check first (``AuditSession.weight_consensus``).
        """
        ctx = self.ctx
        state = [p.detach() for p in ctx.params]
        names = list(ctx.param_names)
        if ctx.buffers:
            if self.seal_source:
                self.check_seal()
            if ctx.broadcast_buffers:
                self._broadcast_buffers()
            state += [b.detach() for b in ctx.buffers]
            names += ctx.buffer_names
        if not state:
            raw = torch.zeros(0, dtype=torch.int64)
        elif fingerprints:
            raw = torch.stack([raw_sum(as_words(t)) for t in state])
        else:
            raw = digests(state)
        columns = list(names)
        if ctx.broadcast_buffers and ctx.buffers:
            # The broadcast source's seal flags vote too: only rank 0 can set them, so a broken seal
            # makes rank 0 the minority, naming the buffer that changed outside a forward.
            bad = self._seal_bad if self._seal_bad is not None else torch.zeros(len(ctx.buffers), dtype=torch.bool)
            raw = torch.cat([raw, bad.to(device=raw.device, dtype=torch.int64)])
            columns += [f"{n} (changed on the broadcast source outside a forward)" for n in ctx.buffer_names]
            self._seal_bad = None  # reported once; the seal restarts from the values held now
            if self.seal_source:
                self.seal()
        rows = [r.tolist() for r in ctx.gather_rows(raw)]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            details: dict[str, Any] = {"params": len(ctx.params)}
            if ctx.buffers:
                details["buffers"] = len(ctx.buffers)
            if fingerprints:
                fps = {n: f"{finalize(r, t):016x}" for n, r, t in zip(names, rows[0], state)}
                details["fp"] = state_fingerprint(fps)
                ctx.state.agreed = (s, fps, details["fp"])
            if found_by is None:
                ctx.report.event("consensus", "pass", step=s, **details)
            return True
        names = [columns[j] for j in verdict.mismatched][:20]
        last = ctx.state.last
        if last is not None and found_by is None:
            last.applied = False
        ev = ctx.report.event(
            "consensus",
            "fail",
            step=s,
            suspects=verdict.minority_ranks if verdict.majority is not None else (),
            contained=False,
            tensors=names,
            majority=verdict.majority is not None,
            **({"found_by": found_by} if found_by else {}),
            **({} if verdict.majority is not None else {"note": "no majority: every rank differs (or a tie)"}),
        )
        ctx.state.agreed = None
        minority = list(verdict.minority_ranks) if verdict.majority is not None else "no majority"
        ctx.report.fail(
            ev,
            f"weights differ across replicas after step {s} (minority: {minority}; tensors {names[:3]})",
            policy=ctx.options.on_fault.value,
        )
        return False

    def seal(self) -> None:
        """On the broadcast source, after a forward: the buffers' digests, checked before the next one."""
        self._seal = digests(self.ctx.buffers)

    def check_seal(self) -> None:
        """On the broadcast source: flag every buffer that changed since the last forward sealed it
        (device-side, no host synchronisation; the flags are read at the next consensus)."""
        if self._seal is None:
            return
        bad = digests(self.ctx.buffers) != self._seal
        self._seal_bad = bad if self._seal_bad is None else self._seal_bad | bad

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP's next synced forward would broadcast them.

        Done early at a consensus step, so that every replica holds the buffers the next step will
        use and their agreement (and the fingerprints a checkpoint reuses) can be checked.
        """
        ctx = self.ctx
        src = dist.get_global_rank(ctx.group, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in ctx.buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for same in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in same]).to(ctx.wire_device)
            with released(flat):
                dist.broadcast(flat, src, group=ctx.group)
            if ctx.rank != 0:
                with torch.no_grad():
                    offset = 0
                    for b in same:
                        b.copy_(flat[offset : offset + b.numel()].view_as(b))
                        offset += b.numel()
