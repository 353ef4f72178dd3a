"""What the checks of an FSDP2 / HSDP audit session share: one frozen context and one mutable state.

``sharded.ShardedAuditSession`` builds a ``ShardedContext`` once and hands it to its check objects
(``ShardedNonFiniteCheck``, ``ShardedReplayAudit``): the sharded model and its optimizer, the process
group of the mesh, the trained parameters, the policies, the gradient recorder of the replay (if
any) and ``ShardedEventLog`` (where events go and how a failure raises). What changes from step to
step and is shared lives in one place, ``ShardedState`` (``ctx.state``): the step counter, the step
under way, the lineage since the last checkpoint, the audit outcomes. A check keeps only its own
state besides (the non-finite check's pending read and its count of clean steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from certckpt.errors import FaultDetectedError
from certckpt.trust.incident import incident_id_for

from .events import AuditEvent, EventSink, emit_event
from .sharded_replay import GradientRecorder

__all__ = ["ShardedContext", "ShardedEventLog", "ShardedState"]


@dataclass(kw_only=True, slots=True)
class ShardedState:
    """The mutable state of a sharded audit session, shared by its checks (``ctx.state``)."""

    step: int
    """Optimizer steps done so far (``session.step``)."""
    lineage: list[tuple[int, str, str]] = field(default_factory=list)
    """``(step, kind, outcome)`` of every event since the last checkpoint."""
    last_clean_audit: int | None = None
    last_checkpoint_step: int | None = None
    audit_seconds: float = 0.0
    """The last replay audit's time (its log line)."""
    open: dict[str, Any] | None = None
    """The step under way, from its first ``begin_micro_batch`` to ``before_update`` (replay audits)."""
    path_check_pending: bool = False
    """The replay-path check (a replay of the rank's own step) is still due."""
    first_batch: bool = True
    """The first step's micro-batches have not been checked for shipping yet."""
    audited: tuple[int, bool] | None = None
    """``(audit step, replay passed)`` from ``before_update`` until ``after_update``."""
    update: tuple[dict[str, Any], list[torch.Tensor]] | None = None
    """The inputs of the audited optimizer step (``sharded_replay.update_inputs``) until it is replayed."""


class ShardedEventLog:
    """The session's events: built alike on every rank, published by rank 0, kept in the lineage.

    ``emit_event`` reads the identity from here (``run``, ``branch``, ``world``, ``inventory``,
    ``rank``, ``sink``, ``ledger``).
    """

    def __init__(
        self,
        *,
        run: str,
        branch: str,
        rank: int,
        world: int,
        group: Any,
        sink: EventSink,
        ledger: Any,
        inventory: dict[str, dict[str, Any]],
        state: ShardedState,
    ) -> None:
        self.run, self.branch, self.rank, self.world, self.group = run, branch, rank, world, group
        self.sink, self.ledger, self.inventory, self.state = sink, ledger, inventory, state
        self.fleet: Any = None  # a fleet registry convicts the devices rank 0's failures blame

    def event(
        self, kind: str, outcome: str, *, step: int, suspects: Any = (), contained: bool = False, **details: Any
    ) -> AuditEvent:
        """Emit one check's event; it joins the lineage."""
        ev = emit_event(self, kind, outcome, step=step, suspects=suspects, contained=contained, details=details)
        self.state.lineage.append((step, kind, outcome))
        return ev

    def fail(self, ev: AuditEvent, message: str, *, policy: str) -> None:
        """Raise ``FaultDetectedError`` on every rank together when ``policy`` is ``"raise"``."""
        if policy != "raise":
            return
        # every rank raises here together, after rank 0 has written the event (see context.EventLog.fail)
        dist.barrier(group=self.group)
        raise FaultDetectedError(
            f"step {ev.step}: {message}", ev, incident_id=None if ev.contained else incident_id_for(ev.to_dict())
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedContext:
    """What the checks of one sharded audit session share, fixed at construction."""

    model: torch.nn.Module
    """The ``fully_shard``-ed module."""
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None
    """What the loop back-propagates per micro-batch; None: no replay audit."""
    group: Any
    rank: int
    world: int
    device: torch.device
    wire_device: torch.device
    on_nonfinite: str
    on_fault: str
    nonfinite_read: str
    params: list[tuple[str, torch.Tensor]]
    """The trained parameters by name (DTensors, and any plain tensor ``fully_shard`` left alone)."""
    names_by_id: dict[int, str]
    not_replayed: list[str]
    """Trained parameters that are not DTensors: FSDP never reduces them, so no replay signs them."""
    recorder: GradientRecorder | None
    """Signs the local gradients at each reduce-scatter (the replay audit), None without ``loss_fn``."""
    report: ShardedEventLog
    state: ShardedState

    def drop_grads(self) -> None:
        """A refused update: every trained parameter's gradient dropped."""
        for _, p in self.params:
            p.grad = None
