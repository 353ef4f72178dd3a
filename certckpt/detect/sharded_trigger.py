"""Triggered replays of an FSDP2 / HSDP audit session: sentinels at each reduce-scatter, a replay of
the step they doubt.

Under FSDP a layer's local (unsharded, unreduced) gradient exists only as the input of its
reduce-scatter, which the replay's recorder already wraps (``sharded_replay.GradientRecorder``).
With the sentinels on, every training reduce-scatter also takes that input's sum of squares (one
dot product on the device, no synchronisation). Those per-layer sums are two things at once:

- the **sentinels' scalars**: before the optimizer step, ``ShardedSentinels.row`` packs this rank's
  two non-finite flags, its global local-gradient norm's square and the squares summed over at most
  ``Triggers.max_groups`` groups of consecutive layers into one float32 row, which the non-finite
  check exchanges in its one all-gather of the step (``ShardedNonFiniteCheck``; one host read);
  every rank runs the same pure decision (``sentinel.decide``) on the same table, so every rank
  replays the same steps;
- the step's **trained signature**: FSDP frees the local gradient after its reduce-scatter, so a
  triggered replay cannot digest it afterwards; but a replay recomputes that input bit for bit (the
  same weights, micro-batches, RNG states and kernels: what every audit checks with digests), so its
  sum of squares must equal the trained one *exactly*. A triggered replay is the ring replay of an
  audit step (``ShardedReplayAudit.audit``), run at the flagged step before its update, signing each
  layer with its sum of squares instead of its digest; the values are compared by their 32 bits.

A sum of squares is a weaker signature than a digest (a change that keeps a layer's sum of squares,
such as a sign flip, passes), but a trigger fires because some layer's sum of squares moved, so the
fault that fired it is one the comparison sees. The local loss is not a scalar here: the session
never sees the loop's loss (``loss_fn`` runs only in replays).

Where a triggered replay cannot run, the sentinels are off and say why (``ShardedSentinels.off``):
no ``loss_fn`` (nothing can replay a step), or a deferred non-finite read (the host learns of a
step's scalars only after its update).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .options import AuditOptions, NonfiniteRead
from .sentinel import Decision, decide, scalars_of
from .sharded_audit import ShardedReplayAudit
from .sharded_context import ShardedContext
from .sharded_replay import signed
from .timing import span

__all__ = ["ShardedSentinels", "sentinels_off", "layer_groups", "FLAGS"]

FLAGS = 2  # a row starts with the flags: reduced shards non-finite, local gradient non-finite


def sentinels_off(options: AuditOptions, *, replays: bool) -> str | None:
    """Why the sentinels cannot run in a sharded session (None: they run); the same on every rank
    (the options and whether there is a ``loss_fn`` are agreed at set-up)."""
    if not options.triggers.enabled:
        return "turned off (Triggers(enabled=False))"
    if not replays:
        return "no loss_fn: a triggered replay recomputes the step through loss_fn"
    if options.nonfinite_read is NonfiniteRead.DEFERRED:
        return "nonfinite_read='deferred' reads a step's scalars after its update, too late to replay it"
    return None


def layer_groups(layers: Sequence[str], max_groups: int) -> dict[str, int]:
    """Layer -> group: consecutive layers (in module order) in at most ``max_groups`` groups of
    nearly equal size (pure)."""
    n = len(layers)
    groups = min(n, max_groups)
    return {layer: i * groups // n for i, layer in enumerate(layers)}


class ShardedSentinels:
    """The sentinels and triggered replays of ``ShardedAuditSession`` (see the module docstring).

    ``replay``: the session's replay audit, which a trigger runs. ``off``: why the sentinels do not
    run (None: they do). ``names``: the scalars each row carries, after the flags.
    """

    def __init__(self, ctx: ShardedContext, *, replay: ShardedReplayAudit) -> None:
        self.ctx, self.replay = ctx, replay
        self.off = sentinels_off(ctx.options, replays=ctx.recorder is not None)
        layers = ctx.recorder.layers if ctx.recorder is not None else []
        self.groups = layer_groups(layers, ctx.options.triggers.max_groups)
        n_groups = len(set(self.groups.values()))
        self.names: tuple[str, ...] = ("grad_norm", *(f"group{g}_norm" for g in range(n_groups)))
        self._index: tuple[tuple[str, ...], torch.Tensor] | None = None  # (layers called, call -> group)
        self.squares: list[tuple[int, str, torch.Tensor]] = []  # the step's, until its decision
        if ctx.recorder is not None:
            ctx.recorder.sentinels = self.off is None

    @property
    def active(self) -> bool:
        return self.off is None

    def _group_index(self, layers: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """Reduce-scatter call -> group, cached while the step's calls keep their order (a new index
        would be a host-to-device copy every step)."""
        if self._index is None or self._index[0] != layers or self._index[1].device != device:
            index = torch.tensor([self.groups.get(layer, 0) for layer in layers], dtype=torch.long, device=device)
            self._index = (layers, index)
        return self._index[1]

    def row(self, pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
        """This rank's row: ``[post flag, pre flag, sum of squares, group sums...]`` (float32, on the
        wire device; no host synchronisation). Takes the step's squares from the recorder."""
        ctx = self.ctx
        assert ctx.recorder is not None, "the sentinels run with loss_fn only"
        self.squares = ctx.recorder.take_squares()
        with span("sentinels"):
            device = self.squares[0][2].device if self.squares else ctx.device
            n_groups = len(self.names) - 1
            if self.squares:
                squares = torch.stack([sq for _, _, sq in self.squares])
                index = self._group_index(tuple(layer for _, layer, _ in self.squares), device)
                total = squares.sum().reshape(1)
                grouped = torch.zeros(n_groups, dtype=torch.float32, device=device).index_add_(0, index, squares)
            else:  # nothing reduce-scattered (no gradient): zeros, the same on every such rank
                total = torch.zeros(1, dtype=torch.float32, device=device)
                grouped = torch.zeros(n_groups, dtype=torch.float32, device=device)
            parts = [
                post.to(device=device, dtype=torch.float32).reshape(1),
                pre.to(device=device, dtype=torch.float32).reshape(1),
                total,
                grouped,
            ]
            return torch.cat(parts).to(ctx.wire_device)

    def decide(self, s: int, table: list[list[float]] | None, *, replaying: bool) -> Decision | None:
        """The decision at step s from the exchanged table (None: no table this step); every rank
        computes the same one and keeps the same state (``ctx.state.sentinel``)."""
        if table is None or not self.active:
            return None
        state = self.ctx.state
        decision, state.sentinel = decide(
            scalars_of(table, self.names, skip=FLAGS),
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
        return decision

    def replay_now(self, s: int, step: dict[str, Any], n: int, decision: Decision) -> bool:
        """The ring replay of step s, before its update, because the sentinels flagged it (collective).

        Compares each rank's replay of its predecessor's micro-batches with the sums of squares the
        predecessor's training took at each reduce-scatter (exact, by their bits); attribution and
        arbitration as at an audit. Returns whether the update may be applied (a failed replay is a
        detection like any other, raised or dropped by ``on_fault``).
        """
        trained = signed(self.squares)  # one host read, on a triggered step only
        trigger = {
            "flagged": list(decision.flagged),
            "outliers": [o.to_dict() for o in decision.outliers[:8]],
            "suppressed_before": decision.suppressed_before,
        }
        return self.replay.audit(s, step, trained, n, trigger=trigger)
