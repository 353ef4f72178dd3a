"""Check 3 of a DDP audit session: the weight consensus, with the buffers it covers.

At audit, consensus and checkpoint steps every replica's parameters and floating-point buffers
(``consensus_buffers``) are digested, all-gathered and compared: a minority is named, no majority
is reported as such. A checkpoint step compares the 64-bit fingerprints instead, which the writer
reuses. Under DDP's ``broadcast_buffers`` the broadcast source (rank 0) seals its buffers after
each forward and checks the seal before the next one, and the consensus broadcasts rank 0's buffers
first, as DDP's next forward would. ``WeightConsensus`` is a mixin of ``session.AuditSession`` and
works on the session's attributes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from certckpt.format.fingerprinting import as_words, finalize, raw_sum
from certckpt.format.record import state_fingerprint

from .attribution import consensus_verdict
from .digest import digests

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
    """The weight consensus of ``AuditSession`` (a mixin: the session holds the state it reads).

    It compares the session's parameters and ``consensus_buffers``, keeps the agreed fingerprints
    in ``_consensus`` for the checkpoint evidence, and uses its ``_gather_rows``, ``_event`` and
    ``_fail``.
    """

    def weight_consensus(self, s: int, *, found_by: str | None = None, fingerprints: bool = False) -> bool:
        """Compare every replica's weights; returns whether they agree.

        Audits compare 32-bit audit digests (``digest.py``). A checkpoint step (``fingerprints=True``)
        compares the 64-bit fingerprints instead, which the checkpoint writer then reuses, and its
        pass event carries the state fingerprint the certifier matches against the file.
        """
        self._settle_deferred()  # no consensus vouches for weights a pending non-finite step updated
        state = [p.detach() for p in self.params]
        names = list(self.param_names)
        if self.buffers:
            if self._seal_source:
                self._check_seal()
            if self._bcast_buffers:
                self._broadcast_buffers()
            state += [b.detach() for b in self.buffers]
            names += self.buffer_names
        if not state:
            raw = torch.zeros(0, dtype=torch.int64)
        elif fingerprints:
            raw = torch.stack([raw_sum(as_words(t)) for t in state])
        else:
            raw = digests(state)
        columns = list(names)
        if self._bcast_buffers and self.buffers:
            # The broadcast source's seal flags vote too: only rank 0 can set them, so a broken seal
            # makes rank 0 the minority, naming the buffer that changed outside a forward.
            bad = self._seal_bad if self._seal_bad is not None else torch.zeros(len(self.buffers), dtype=torch.bool)
            raw = torch.cat([raw, bad.to(device=raw.device, dtype=torch.int64)])
            columns += [f"{n} (changed on the broadcast source outside a forward)" for n in self.buffer_names]
            self._seal_bad = None  # reported once; the seal restarts from the values held now
            if self._seal_source:
                self._seal = digests(self.buffers)
        rows = [r.tolist() for r in self._gather_rows(raw)]
        verdict = consensus_verdict(rows)
        if verdict.agreed:
            details: dict[str, Any] = {"params": len(self.params)}
            if self.buffers:
                details["buffers"] = len(self.buffers)
            if fingerprints:
                fps = {n: f"{finalize(r, t):016x}" for n, r, t in zip(names, rows[0], state)}
                details["fp"] = state_fingerprint(fps)
                self._consensus = (s, fps, details["fp"])
            if found_by is None:
                self._event("consensus", "pass", step=s, **details)
            return True
        names = [columns[j] for j in verdict.mismatched][:20]
        if self.last is not None and found_by is None:
            self.last.applied = False
        ev = self._event(
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
        self._consensus = None
        minority = list(verdict.minority_ranks) if verdict.majority is not None else "no majority"
        self._fail(
            ev,
            f"weights differ across replicas after step {s} (minority: {minority}; tensors {names[:3]})",
            policy=self.on_fault,
        )
        return False

    def _check_seal(self) -> None:
        """On the broadcast source: flag every buffer that changed since the last forward sealed it
        (device-side, no host synchronisation; the flags are read at the next consensus)."""
        if self._seal is None:
            return
        bad = digests(self.buffers) != self._seal
        self._seal_bad = bad if self._seal_bad is None else self._seal_bad | bad

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, as DDP's next synced forward would broadcast them.

        Done early at a consensus step, so that every replica holds the buffers the next step will
        use and their agreement (and the fingerprints a checkpoint reuses) can be checked.
        """
        src = dist.get_global_rank(self.group, 0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for same in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1) for b in same]).to(self.wire_device)
            dist.broadcast(flat, src, group=self.group)
            if self.rank != 0:
                with torch.no_grad():
                    offset = 0
                    for b in same:
                        b.copy_(flat[offset : offset + b.numel()].view_as(b))
                        offset += b.numel()

    def consensus_fingerprints(self) -> dict[str, str] | None:
        """Per-parameter fingerprints every replica agreed on at the current step, if checked."""
        if self._consensus and self._consensus[0] == self.step:
            return dict(self._consensus[1])
        return None
