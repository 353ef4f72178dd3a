"""What a DDP audit session reports: the outcome of each step and the evidence a checkpoint carries.

``StepOutcome`` is what happened at one optimizer step (``auditor.last``: applied or not, audited or
not, the events emitted, the gradient norm); ``CheckpointEvidence`` is what a checkpoint taken at a
step carries into its record (the consensus fingerprint, the audit lineage since the previous
checkpoint, the fingerprints the writer reuses): its ``RecordFields`` and the keyword arguments
``save_certified`` takes for it. Both are plain dataclasses: ``session.AuditSession`` fills them in.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from certckpt.format.record import RecordFields

from .events import AuditEvent

__all__ = ["CheckpointEvidence", "StepOutcome"]


@dataclass(slots=True)
class StepOutcome:
    """What happened at one step (``auditor.last``)."""

    step: int
    applied: bool = True
    audited: bool = False
    events: list[AuditEvent] = field(default_factory=list)
    grad_norm: torch.Tensor | None = None  # the total norm before clipping, with clip_grad_norm
    flagged: tuple[int, ...] = ()  # the ranks the sentinels flagged at this step
    triggered: bool = False  # the sentinels had this step replayed


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointEvidence:
    """What a checkpoint taken at ``step`` carries (``AuditSession.checkpoint_evidence``).

    Attributes:
        step: the optimizer step the weights follow.
        run, branch, parent: the run's identity and the checkpoint this branch resumed from.
        step_range: the steps since the previous checkpoint, ``[first, step]``.
        lineage: the audits since the previous checkpoint (the record's ``lineage``).
        consensus_fp: the state fingerprint every replica agreed on at ``step`` (None: no agreement).
        known_fingerprints: tensor identity -> (name, fingerprint hex) of the agreed tensors, so that
            the writer does not fingerprint them again.
        tensor_fps: ``{name: fingerprint hex}`` of the agreed tensors under the names the checkpoint
            stores them (a sharded run's DCP names), so that a writer can name what differs.
    """

    step: int
    run: str
    branch: str
    parent: str | None
    step_range: list[int]
    lineage: dict[str, Any]
    consensus_fp: str | None
    known_fingerprints: dict[tuple, tuple[str, str]]
    tensor_fps: dict[str, str] = field(default_factory=dict)

    def record_fields(self) -> RecordFields:
        """What this checkpoint's record carries (the writer's ``fields``, a commit's fields)."""
        return RecordFields(
            step=self.step,
            run=self.run,
            branch=self.branch,
            parent=self.parent,
            step_range=list(self.step_range),
            lineage=copy.deepcopy(self.lineage),  # the writer adds to it; each file gets its own
            consensus_fp=self.consensus_fp,
        )

    def save_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``certckpt.format.writer.save_certified`` for this checkpoint."""
        return {**self.record_fields().as_kwargs(), "known_fingerprints": self.known_fingerprints}
