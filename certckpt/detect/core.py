"""What every audit session does the same way, DDP's (``session.AuditSession``) and FSDP2 / HSDP's
(``sharded.ShardedAuditSession``): both are an ``AuditSessionCore``.

Starting a session is one sequence on every rank, the same collectives in the same order:

1. ``__init__``: the process group and the wire device; the options, validated on every rank and
   refused together (``agreement.refuse_together``) with the variant's own refusals; the run's
   identity, the signing key, the ledger, the sink and the fleet registry; the state
   (``context.SessionState``) and the ``context.EventLog`` every check reports through;
2. the variant builds its context and its checks (no collective);
3. ``join``: the ranks agree on the model and the settings (``agree``, the variant's), exchange their
   node inventories, prove a resumed state (``prove_resumed``, the variant's) and look their devices
   up in the fleet registry.

After that the core keeps what both sessions keep alike: the step counters (``StateField``), the
lineage a checkpoint carries (``evidence``, ``end_lineage``), an audit pass (``audit_passed``),
``flush`` and ``close``.

Why a base class rather than a core object the sessions hold: what is shared is the sessions' own
surface (``session.step``, ``rank``, ``sink``, ``ledger``, ``inventory``, ``flush()``...), which
callbacks, the drill and users read, and ``Auditor`` already extends ``AuditSession``; a held core
would need every one of those forwarded, twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from certckpt.errors import AuditSetupError
from certckpt.format.signing import SigningKey, signing_key_for
from certckpt.trust.fleet import Fleet
from certckpt.trust.ledger import Ledger, LedgerSink

from . import context
from .agreement import all_gather_bytes, refuse_together, wire_device_for
from .context import EventLog, SessionState, StateField
from .events import EventSink, MemorySink, log_audit_pass, log_trusted, rank_inventory
from .evidence import CheckpointEvidence
from .fleet_check import check_fleet_at_start, fleet_for
from .options import AuditOptions, session_options

__all__ = ["AuditSessionCore", "lineage_evidence"]


def lineage_evidence(
    state: SessionState,
    s: int,
    *,
    run: str,
    branch: str,
    parent: str | None,
    head: dict[str, Any],
    consensus_fp: str | None,
    known_fingerprints: dict[tuple, tuple[str, str]] | None = None,
    tensor_fps: dict[str, str] | None = None,
) -> CheckpointEvidence:
    """What a checkpoint at step s carries, from a session's ``state``: its step range and the audit
    lineage since the previous checkpoint (``head``: the driver's description of its audits, first in
    the record). Every driver of the checks builds it so: the sessions (``AuditSessionCore.evidence``)
    and DeepSpeed's ``ZeroAudit``."""
    lineage = {
        **head,
        "audits": [{"step": st, "kind": k, "outcome": o} for st, k, o in state.lineage],
        "last_clean_audit": state.last_clean_audit,
        "consensus": {"step": s, "fp": consensus_fp} if consensus_fp else None,
    }
    return CheckpointEvidence(
        step=s,
        run=run,
        branch=branch,
        parent=parent,
        step_range=[(state.last_checkpoint_step or 0) + 1, s],
        lineage=lineage,
        consensus_fp=consensus_fp,
        known_fingerprints=known_fingerprints or {},
        tensor_fps=tensor_fps or {},
    )


class AuditSessionCore:
    """The start-up, identity and bookkeeping of an audit session (see the module docstring).

    A variant sets the class attributes below, builds its checks after ``__init__`` and calls
    ``join`` last; it implements ``agree`` and ``prove_resumed``.
    """

    STATE: ClassVar[type[SessionState]] = SessionState
    """The state class the variant's checks share."""
    UNUSED: ClassVar[tuple[str, ...]] = ()
    """The options this variant does not read: set away from their defaults, they are refused."""
    NAME: ClassVar[str] = "the audit session"
    """How refusals name the variant (``"... does not take clip_grad_norm"``)."""
    SETUP: ClassVar[str] = "audit set-up"
    """How a refusal at set-up names the check (``"... refused on every rank"``)."""

    # --- the mutable state, kept in ``self.state`` ----------------------------------------------

    # optimizer steps done so far (applied or not)
    step = StateField[int]()
    # the last step whose full audit passed (a clean audit point)
    last_clean_audit = StateField[int | None]()
    # the step of the last checkpoint taken through the session
    last_checkpoint_step = StateField[int | None]()

    def __init__(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        *,
        group: Any,
        options: AuditOptions | None,
        shorthand: dict[str, Any],
        problem: Callable[[AuditOptions], str | None],
        run: str,
        branch: str,
        parent: str | None,
        sink: EventSink | None,
        ledger: Ledger | str | None,
        signing_key: SigningKey | str | None,
        start_step: int,
    ) -> None:
        """The local part of starting, and the one collective that agrees on the options.

        Args:
            model: the model (its first parameter's device decides where collectives travel).
            optimizer: its optimizer.
            group: the process group of every rank (None: the default group).
            options, shorthand: the ``AuditOptions`` and keywords on top of them.
            problem: ``problem(options) -> str | None``, the variant's objection on this rank (the
                model, the options together); every rank refuses together when any objects.
            run, branch, parent, sink, ledger, signing_key, start_step: as the sessions document them.

        Raises:
            AuditSetupError: no process group, or some rank refused the set-up (on every rank).
        """
        if not (dist.is_available() and dist.is_initialized()):
            # No process group: nothing to agree with, and no rank can be waiting in a collective.
            raise AuditSetupError("torch.distributed is not initialized; call dist.init_process_group first")
        self.model, self.optimizer = model, optimizer
        self.group: Any = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        first = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        self.device = first.device if first is not None else torch.device("cpu")
        self.wire_device = wire_device_for(self.group, self.device)
        opts, bad = session_options(options, shorthand, unused=self.UNUSED, where=self.NAME)
        # validated on every rank, then decided together: a refusal on some ranks only would leave
        # the others waiting in the next collective
        refuse_together(bad or problem(opts), group=self.group, wire_device=self.wire_device, what=self.SETUP)
        self.options = opts
        self.run, self.branch, self.parent = run, branch, parent
        self.signing_key = signing_key_for(signing_key)  # a bad key file is refused before any step
        self.ledger: Ledger | None = Ledger(ledger, signing_key=self.signing_key) if isinstance(ledger, str) else ledger
        if sink is None and self.ledger is not None:
            sink = LedgerSink(self.ledger)
        self.sink: EventSink = sink if sink is not None else MemorySink()
        self.fleet: Fleet | None = fleet_for(opts.fleet, signing_key=self.signing_key)
        self.inventory: dict[str, dict[str, Any]] = {}
        self.state = self.STATE(
            step=start_step,
            last_clean_audit=start_step or None,
            last_checkpoint_step=start_step or None,
        )
        self.report = EventLog(
            run=run,
            branch=branch,
            rank=self.rank,
            world=self.world,
            group=self.group,
            wire_device=self.wire_device,
            sink=self.sink,
            ledger=self.ledger,
            state=self.state,
        )

    def context_fields(self) -> dict[str, Any]:
        """The fields of ``context.SessionContext``, which the variant's check context adds to."""
        return {
            "optimizer": self.optimizer,
            "group": self.group,
            "rank": self.rank,
            "world": self.world,
            "device": self.device,
            "wire_device": self.wire_device,
            "options": self.options,
            "report": self.report,
            "state": self.state,
        }

    @property
    def audit_every(self) -> int:
        """The replay-audit interval (``options.audit_every``)."""
        return self.options.audit_every

    @property
    def consensus_every(self) -> int | None:
        """The extra weight-consensus interval (``options.consensus_every``)."""
        return self.options.consensus_every

    # --- the collective part of starting --------------------------------------------------------

    def agree(self) -> None:
        """Every rank must hold the same model and settings (collective; the variant's check)."""
        raise NotImplementedError

    def prove_resumed(self, expected: str) -> None:
        """The replicas hold the state of the checkpoint resumed from, whose consensus fingerprint
        is ``expected`` (collective; every rank refuses together otherwise)."""
        raise NotImplementedError

    def join(self, *, expect_consensus_fp: str | None) -> None:
        """The collective part of starting (the same calls, in the same order, on every rank): the
        ranks agree, the inventories are exchanged, a resumed state is proven, the fleet looked up."""
        self.agree()
        mine = json.dumps(rank_inventory(self.device, rank=self.rank)).encode()
        payloads = all_gather_bytes(mine, group=self.group, wire_device=self.wire_device)
        self.inventory = self.report.inventory = {str(r): json.loads(b) for r, b in enumerate(payloads)}
        if expect_consensus_fp is not None:
            self.prove_resumed(expect_consensus_fp)
        if self.fleet is not None:
            self.report.fleet = self.fleet
            check_fleet_at_start(
                self.fleet,
                policy=self.options.fleet_policy.value,
                inventory=self.inventory,
                rank=self.rank,
                group=self.group,
                wire_device=self.wire_device,
                ledger=self.ledger,
                run=self.run,
                branch=self.branch,
                start_step=self.state.step,
            )

    # --- audits and checkpoints ---------------------------------------------------------------

    def audit_passed(self, s: int, *, checked: int, seconds: float) -> None:
        """Step s's full audit passed (replay, non-finite checks, consensus): a clean audit point."""
        self.state.last_clean_audit = s
        if self.rank == 0:
            log_audit_pass(step=s, branch=self.branch, ranks=self.world, checked=checked, seconds=seconds)
            due = [p for p in self.state.awaiting_trust if p <= s]
            self.state.awaiting_trust = [p for p in self.state.awaiting_trust if p > s]
            if due:
                store = self.ledger.store if self.ledger is not None else None
                log_trusted(branch=self.branch, steps=due, audit_step=s, store=store)

    def evidence(
        self,
        s: int,
        *,
        head: dict[str, Any],
        consensus_fp: str | None,
        known_fingerprints: dict[tuple, tuple[str, str]] | None = None,
        tensor_fps: dict[str, str] | None = None,
    ) -> CheckpointEvidence:
        """What a checkpoint at step s carries: its step range and the lineage since the previous
        checkpoint (``head``: the variant's description of its audits, first in the record)."""
        return lineage_evidence(
            self.state,
            s,
            run=self.run,
            branch=self.branch,
            parent=self.parent,
            head=head,
            consensus_fp=consensus_fp,
            known_fingerprints=known_fingerprints,
            tensor_fps=tensor_fps,
        )

    def end_lineage(self, s: int) -> None:
        """A checkpoint at step s was taken: the next one's lineage starts after it."""
        self.state.last_checkpoint_step = s
        self.state.lineage = []
        if self.rank == 0 and self.ledger is not None:  # the certifier judges committed checkpoints only
            if self.state.last_clean_audit == s:  # taken right after a clean audit: nothing unaudited
                log_trusted(branch=self.branch, steps=[s], audit_step=s, store=self.ledger.store)
            else:
                self.state.awaiting_trust.append(s)

    def reopen_lineage(self, evidence: CheckpointEvidence) -> None:
        """The checkpoint ``evidence`` was taken for was never committed (its save failed, perhaps in
        the background): the next checkpoint's step range and lineage reach back over its steps.

        Without this, the next record would start after a checkpoint that does not exist, and the
        audits of the failed one's steps would be in no checkpoint's lineage.
        """
        earlier = [(a["step"], a["kind"], a["outcome"]) for a in evidence.lineage.get("audits", [])]
        self.state.lineage = (earlier + self.state.lineage)[: context.MAX_LINEAGE]
        first = evidence.step_range[0]
        self.state.last_checkpoint_step = first - 1 if first > 1 else None
        # nothing of the failed step is committed, so there is nothing to log trusted for it
        self.state.awaiting_trust = [p for p in self.state.awaiting_trust if p != evidence.step]

    def flush(self) -> None:
        """Write the events emitted so far to the sink (rank 0; the ledger's events before a commit)."""
        if self.rank == 0:
            self.sink.flush()

    def release(self) -> None:
        """What the variant lets go of at ``close`` (never a collective, never raising for a check)."""

    def close(self) -> None:
        """End the session on this rank: the variant's ``release``, then the events flushed. Not a
        collective and never raises for a check: it also runs in exception handlers (Lightning's
        ``on_exception``, ``stop_on_fault``), where another rank may never join one. A deferred
        non-finite read still pending is left unread: no checkpoint covers that step (checkpoints
        read it first)."""
        self.release()
        self.sink.flush()
