"""Triggered replays of a DDP audit session: sentinels every step, a replay of the step they doubt.

The communication hook sums the squares of each bucket's local gradient before its all-reduce
(``hook.sum_of_squares``; ``HookState.sentinels``). Before the optimizer step, ``SentinelCheck.row``
packs this rank's two non-finite flags, its global gradient norm's square, the squares summed over
at most ``Triggers.max_groups`` groups of buckets and, when the session knows it, the local loss
into one small float32 row, and the non-finite check exchanges those rows in its one collective of
the step (``NonFiniteCheck``: an all-gather in place of its flag exchange; one host read). Every
rank then holds the same table and runs the same pure decision (``sentinel.decide``), so every rank
replays the same steps. A replay triggered at step s is the ring replay of an audit step, run at s
before the update, and compares one of two trained signatures:

- with the hand-over, the local gradients the hook handed over to DDP (``HookState.kept``), signed
  only now, as an audit signs them;
- without it (``gradient_as_bucket_view=True``, ``hand_over_grads=False``, as the Accelerate,
  Lightning and Trainer integrations run, ``find_unused_parameters``, static graphs) no local
  gradient survives the all-reduce, and the signature is what the hook took of each bucket for the
  sentinels anyway: its sum of squares. The replaying neighbour lays its replayed gradients out as
  DDP's buckets (``HookState.layouts``) and sums their squares the same way; the sums are compared
  by their 32 bits (tolerance mode: the bucket norms within ``rtol``), and arbitrated the same way
  (``buckets.py``).

Where a triggered replay cannot run, the sentinels are off and say why (``SentinelCheck.off``):
a deferred non-finite read (the host learns of a step's scalars only after its update), a gradient
scaler (its scale moves every norm), or DDP's own mixed precision (its buckets hold gradients of a
low-precision forward the replay does not run).
"""

from __future__ import annotations

from typing import Any

import torch

from .buckets import TrainedSquares
from .context import CheckContext
from .exchange import RingShift
from .hook import any_nonfinite
from .options import NonfiniteRead
from .replay import RingReplay
from .sentinel import Decision, decide, scalars_of
from .signature import signature
from .timing import span

__all__ = ["SentinelCheck", "sentinels_off"]

FLAGS = 2  # a row starts with the pre- and post-reduce non-finite flags


def sentinels_off(ctx: CheckContext) -> str | None:
    """Why the sentinels cannot run in this session (None: they run); the same on every rank."""
    opts = ctx.options
    if not opts.triggers.enabled:
        return "turned off (Triggers(enabled=False))"
    if opts.nonfinite_read is NonfiniteRead.DEFERRED:
        return "nonfinite_read='deferred' reads a step's scalars after its update, too late to replay it"
    if ctx.grad_scaler is not None:
        return "a gradient scaler moves every gradient norm with its scale"
    if getattr(ctx.model, "mixed_precision", None) is not None:
        return (
            "DDP mixed precision: the buckets hold gradients of DDP's low-precision forward, which a replay through "
            "the bare module does not run, so the two would not compare"
        )
    return None


class SentinelCheck:
    """The sentinels and triggered replays of ``AuditSession`` (see the module docstring).

    ``replay``: the ring replay a trigger runs. ``off``: why the sentinels do not run (None: they do).
    """

    def __init__(self, ctx: CheckContext, *, replay: RingReplay) -> None:
        self.ctx, self.replay = ctx, replay
        self.off = sentinels_off(ctx)
        ctx.hook.sentinels = self.off is None
        self._groups: tuple[int, int, torch.Tensor] | None = None  # (buckets, groups, bucket -> group)
        self.names: tuple[str, ...] = ()
        self.loss: torch.Tensor | None = None  # the step's local loss, when the session knows it

    @property
    def active(self) -> bool:
        return self.off is None

    def _group_index(self, buckets: int, device: torch.device) -> tuple[int, torch.Tensor]:
        """Bucket -> group (consecutive buckets, at most ``max_groups`` groups), cached."""
        groups = min(buckets, self.ctx.options.triggers.max_groups)
        if self._groups is None or self._groups[:2] != (buckets, groups) or self._groups[2].device != device:
            index = torch.tensor([b * groups // buckets for b in range(buckets)], dtype=torch.long, device=device)
            self._groups = (buckets, groups, index)
        return groups, self._groups[2]

    def row(self, pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
        """This rank's row: ``[pre flag, post flag, sum of squares, group sums..., loss?]`` (float32,
        on the wire device; no host synchronisation)."""
        ctx, hook = self.ctx, self.ctx.hook
        with span("sentinels"):
            sums = [t for _, t in sorted(hook.sumsq, key=lambda it: it[0])]
            device = sums[0].device if sums else ctx.device
            squares = torch.stack(sums) if sums else torch.zeros(1, device=device)
            groups, index = self._group_index(len(squares), device)
            grouped = torch.zeros(groups, dtype=torch.float32, device=device).index_add_(0, index, squares)
            parts = [
                pre.to(device=device, dtype=torch.float32).reshape(1),
                post.to(device=device, dtype=torch.float32).reshape(1),
                squares.sum().reshape(1),
                grouped,
            ]
            names = ["grad_norm", *(f"group{g}_norm" for g in range(groups))]
            if self.loss is not None:
                parts.append(self.loss.detach().to(device=device, dtype=torch.float32).reshape(1))
                names.append("loss")
            self.names = tuple(names)
            return torch.cat(parts).to(ctx.wire_device)

    @staticmethod
    def flags_of(pre: list[torch.Tensor], post: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The hook's pre- and post-reduce flags as two 0-dim tensors (no host read)."""
        zero = torch.zeros((), dtype=torch.bool)
        return (any_nonfinite(pre) if pre else zero), (any_nonfinite(post) if post else zero)

    def scalars(self, table: list[list[float]]) -> list[list[float]]:
        """The exchanged rows without their flags, squares turned into norms (loss as it is)."""
        return scalars_of(table, self.names, skip=FLAGS)

    def decide(self, s: int, table: list[list[float]] | None, *, replaying: bool) -> Decision | None:
        """The decision at step s from the exchanged table (None: no table this step); every rank
        computes the same one and keeps the same state (``ctx.state.sentinel``)."""
        if table is None or not self.active:
            return None
        state = self.ctx.state
        decision, state.sentinel = decide(
            self.scalars(table),
            self.names,
            state.sentinel,
            step=s,
            triggers=self.ctx.options.triggers,
            replaying=replaying,
        )
        if decision.replay:
            state.triggered_replays += 1
        if decision.suppressed:
            state.triggers_suppressed += 1
        if state.last is not None:
            state.last.flagged = decision.flagged
            state.last.triggered = decision.replay
        return decision

    def sign_local(self) -> None:
        """Sign the step's local gradients now, as the hook signs them on an audit step: the ones it
        handed over to DDP and kept alive (``HookState.kept``); a parameter without one signs zeros,
        as DDP's bucket holds them."""
        ctx, hook = self.ctx, self.ctx.hook
        local = {hook.index[id(p)]: g for p, g in hook.kept}
        grads = [local[i] if i in local else torch.zeros_like(p) for i, p in enumerate(ctx.params)]
        with span("train_signature"):
            rows = signature(grads, mode=ctx.options.mode, probes=ctx.probes)
        hook.local_sig = dict(enumerate(rows))

    def trained_squares(self) -> TrainedSquares:
        """The step's buckets' sums of squares as the hook took them, with their layouts (no host
        read). A bucket reduced twice in a step (a loop that syncs on every micro-batch) counts with
        its last sum, the one its reduced gradient came from."""
        hook = self.ctx.hook
        last = dict(hook.sumsq)
        sums = [last[i] for i in sorted(last)]
        device = sums[0].device if sums else self.ctx.device
        stacked = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float32, device=device)
        return TrainedSquares(layouts=tuple(hook.step_layouts()), sums=stacked)

    def replay_now(self, s: int, units: list[Any], payload: dict[str, Any], decision: Decision) -> bool:
        """The ring replay of step s, before its update, because the sentinels flagged it (collective).

        Compares the kept local gradients' signatures (with the hand-over) or the buckets' sums of
        squares (without it) with the neighbour's replay. Returns whether the update may be applied
        (a failed replay is a detection like any other, raised or dropped by ``on_fault``).
        ``payload``: this rank's micro-batches and the RNG state they started with, as an audit
        ships them.
        """
        ctx = self.ctx
        squares = None
        if ctx.hook.hand_over:
            self.sign_local()
        else:
            squares = self.trained_squares()
        prev = RingShift(payload, group=ctx.group, wire_device=ctx.wire_device, out_device=ctx.device).finish()
        trigger = {
            "flagged": list(decision.flagged),
            "outliers": [o.to_dict() for o in decision.outliers[:8]],
            "suppressed_before": decision.suppressed_before,
        }
        return self.replay.audit(s, units, prev, payload=payload, trigger=trigger, squares=squares)
