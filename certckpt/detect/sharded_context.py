"""What the checks of an FSDP2 / HSDP audit session share: one frozen context and one mutable state.

``sharded.ShardedAuditSession`` builds a ``ShardedContext`` once and hands it to its check objects
(``ShardedNonFiniteCheck``, ``ShardedReplayAudit``). It is ``context.SessionContext`` (the process
group of the mesh, the options, the ``EventLog`` both sessions report through, the state) with the
sharded model, its trained parameters and the gradient recorder of the replay (if any). What changes
from step to step and is shared lives in one place, ``ShardedState`` (``ctx.state``): the fields of
``context.SessionState`` and the audit outcomes between ``before_update`` and ``after_update``. A
check keeps only its own state besides (the non-finite check's pending read and its count of clean
steps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .context import SessionContext, SessionState
from .sharded_replay import GradientRecorder

__all__ = ["ShardedContext", "ShardedState"]


@dataclass(kw_only=True, slots=True)
class ShardedState(SessionState):
    """The mutable state of a sharded audit session, shared by its checks (``ctx.state``)."""

    first_batch: bool = True
    """The first step's micro-batches have not been checked for shipping yet."""
    audited: tuple[int, bool] | None = None
    """``(audit step, replay passed)`` from ``before_update`` until ``after_update``."""
    update: tuple[dict[str, Any], list[torch.Tensor]] | None = None
    """The inputs of the audited optimizer step (``sharded_replay.update_inputs``) until it is replayed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedContext(SessionContext):
    """What the checks of one sharded audit session share, fixed at construction."""

    model: torch.nn.Module
    """The ``fully_shard``-ed module."""
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None
    """What the loop back-propagates per micro-batch; None: no replay audit."""
    state: ShardedState
    params: list[tuple[str, torch.Tensor]]
    """The trained parameters by name (DTensors, and any plain tensor ``fully_shard`` left alone)."""
    names_by_id: dict[int, str]
    not_replayed: list[str]
    """Trained parameters that are not DTensors: FSDP never reduces them, so no replay signs them."""
    recorder: GradientRecorder | None
    """Signs the local gradients at each reduce-scatter (the replay audit), None without ``loss_fn``."""

    def drop_grads(self) -> None:
        """A refused update: every trained parameter's gradient dropped."""
        for _, p in self.params:
            p.grad = None
