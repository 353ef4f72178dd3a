"""What the checks of an audit session share: one frozen context, one mutable state, one event log.

Both sessions (``session.AuditSession`` for DDP, ``sharded.ShardedAuditSession`` for FSDP2 / HSDP)
build their context once and hand it to each of their check objects. ``SessionContext`` is what
every check of either session reads: the process group, the devices, the ``AuditOptions`` object
itself (``ctx.options.on_fault``: one home per option, enums kept), ``EventLog`` (where events go,
how a failure raises on every rank together) and the mutable ``SessionState`` (``ctx.state``: the
step counter, the lineage since the last checkpoint, the step under way). ``CheckContext`` adds
what the DDP checks (``SetupChecks``, ``NonFiniteCheck``, ``RingReplay``, ``WeightConsensus``)
act on: the DDP model, the trained parameters and the buffers the consensus covers, the
communication hook's state and a drill's injector; its state is a ``DDPState`` (the agreed
fingerprints, the first step's checks). ``sharded_context.ShardedContext`` is the sharded one. A
check keeps only its own state besides (the non-finite check's pending read, the consensus's
buffer seal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from certckpt.errors import FaultDetectedError
from certckpt.trust.devices import device_of
from certckpt.trust.fleet import Fleet
from certckpt.trust.incident import incident_id_for
from certckpt.trust.ledger import Ledger

from .events import AuditEvent, EventSink, emit_event
from .evidence import StepOutcome
from .hook import HookState, average_over_ranks
from .inject import Injector
from .letgo import released
from .options import AuditOptions
from .sentinel import SentinelState
from .signature import Probes

__all__ = [
    "CheckContext",
    "SessionContext",
    "EventLog",
    "SessionState",
    "DDPState",
    "StateField",
    "MAX_LINEAGE",
]

T = TypeVar("T")


class StateField(Generic[T]):
    """A session attribute that lives in its ``state`` (the one place for mutable state), read and
    written through under its old name: ``step = StateField[int]()`` makes ``session.step`` be
    ``session.state.step``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> StateField[T]: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...
    def __get__(self, obj: object | None, objtype: type | None = None) -> T | StateField[T]:
        if obj is None:
            return self
        return cast(T, getattr(obj.state, self.name))  # type: ignore[attr-defined]  # a session has .state

    def __set__(self, obj: object, value: T) -> None:
        setattr(obj.state, self.name, value)  # type: ignore[attr-defined]  # a session has .state


MAX_LINEAGE = 100_000  # audit results kept for one checkpoint's lineage (a bound, not a design limit)


@dataclass(kw_only=True, slots=True)
class SessionState:
    """The mutable state every audit session keeps (``ctx.state``), DDP's and the sharded one's."""

    step: int
    """Optimizer steps attempted so far (``session.step``)."""
    last: StepOutcome | None = None
    """The outcome of the step under way or last run (``session.last``; DDP sessions)."""
    lineage: list[tuple[int, str, str]] = field(default_factory=list)
    """``(step, kind, outcome)`` of every event since the last checkpoint (at most ``MAX_LINEAGE``)."""
    last_clean_audit: int | None = None
    """The last step whose full audit passed."""
    last_checkpoint_step: int | None = None
    """The step of the last checkpoint taken (its lineage ends there)."""
    path_check_pending: bool = False
    """The replay-path check (a replay of the rank's own step) is still due."""
    open: dict[str, Any] | None = None
    """A step run by someone else's loop: its micro-batches and RNG states until ``before_update``."""
    audit_seconds: float = 0.0
    """The last replay audit's time (its log line)."""
    awaiting_trust: list[int] = field(default_factory=list)
    """Steps of the checkpoints taken since the last clean audit (rank 0's log line when one passes;
    a failed check empties it: those checkpoints are not made trusted by the next audit)."""
    sentinel: SentinelState = field(default_factory=SentinelState)
    """The sentinels' histories and rate limit (``sentinel.decide``; the same on every rank)."""
    triggered_replays: int = 0
    """Steps the sentinels had replayed so far."""
    triggers_suppressed: int = 0
    """Steps the sentinels flagged but the rate limit did not replay."""


@dataclass(kw_only=True, slots=True)
class DDPState(SessionState):
    """The mutable state of a DDP audit session, shared by its checks (``ctx.state``)."""

    checked_since_audit: int = 0
    """Steps whose non-finite checks passed since the last audit."""
    overflows: int = 0
    """A gradient scaler's overflow steps since the last audit."""
    agreed: tuple[int, dict[str, str], str] | None = None
    """The last fingerprint consensus that agreed: ``(step, {tensor: fp}, state fp)``."""
    first_step: bool = True
    """The first step's set-up checks are still due."""
    loss_averaged: bool = False
    """The step under way back-propagates losses that carry DDP's averaging over the ranks
    (``hook.average_over_ranks``): the hook leaves the reduced sum as it is, and replays scale
    their losses the same way (``CheckContext.scaled``)."""

    def agreed_at(self, step: int) -> tuple[dict[str, str], str] | None:
        """``({tensor: fp}, state fp)`` when the replicas agreed on their fingerprints at ``step``."""
        if self.agreed is not None and self.agreed[0] == step:
            return self.agreed[1], self.agreed[2]
        return None


class EventLog:
    """A session's events: built alike on every rank, published by rank 0, kept in the lineage.

    Both sessions' checks report through it (``ctx.report``); it is the ``events.EventSource`` that
    ``emit_event`` reads the run's identity from. ``inventory`` is filled in once every rank's is
    gathered, ``fleet`` once the fleet registry is known.
    """

    def __init__(
        self,
        *,
        run: str,
        branch: str,
        rank: int,
        world: int,
        group: Any,
        wire_device: torch.device,
        sink: EventSink,
        ledger: Ledger | None,
        state: SessionState,
    ) -> None:
        self.run, self.branch, self.rank, self.world = run, branch, rank, world
        self.group, self.wire_device = group, wire_device
        self.sink, self.ledger, self.state = sink, ledger, state
        self.inventory: dict[str, dict[str, Any]] = {}
        self.fleet: Fleet | None = None  # a fleet registry convicts the devices rank 0's failures blame

    def event(
        self, kind: str, outcome: str, *, step: int, suspects: Any = (), contained: bool = False, **details: Any
    ) -> AuditEvent:
        """Emit one check's event; it joins the lineage (up to ``MAX_LINEAGE``) and the step's outcome."""
        ev = emit_event(self, kind, outcome, step=step, suspects=suspects, contained=contained, details=details)
        if ev.failed:
            self.state.awaiting_trust.clear()
        if len(self.state.lineage) < MAX_LINEAGE:
            self.state.lineage.append((ev.step, ev.kind, ev.outcome))
        if self.state.last is not None:
            self.state.last.events.append(ev)
        return ev

    def fail(self, ev: AuditEvent, message: str, *, policy: str) -> None:
        """Raise ``FaultDetectedError`` on every rank together when ``policy`` is ``"raise"``.

        Every rank fails here together, and rank 0 has just written the event and the incident
        (``event``). No rank leaves before that is done: a launcher (torchrun, Lightning's) stops the
        other ranks as soon as one exits, and a rank 0 stopped in the middle of its write would leave
        a detection without its incident record. So the ranks all-reduce a flag on the wire device
        (the group's own device, which every other collective of the session uses) and read it on
        the host: under NCCL a collective only queues work on a stream, and only the read holds the
        host until every rank, rank 0 included, has reached this point. (``dist.barrier`` would
        block too, but under NCCL it runs on a device it guesses unless the group was bound to one.)
        """
        if policy != "raise":
            return
        incident = None if ev.contained else incident_id_for(ev.to_dict())
        # the devices rank 0 convicts for it (``events.publish``): every rank can name them
        blames = self.fleet is not None and not ev.contained and not ev.details.get("found_by")
        convicted = [d for r in ev.suspect_ranks if (d := device_of(ev.inventory.get(str(r)) or {}))] if blames else []
        if self.world > 1:
            arrived = torch.ones(1, dtype=torch.int64, device=self.wire_device)
            with released(arrived):  # the process may end right after this raise (letgo)
                dist.all_reduce(arrived, group=self.group)
            int(arrived.item())  # the host waits here for every rank (see above)
        raise FaultDetectedError(
            f"step {ev.step}: {message}",
            ev,
            incident_id=incident,
            convicted=convicted,
            fleet=self.fleet.url if self.fleet is not None and convicted else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionContext:
    """What the checks of any audit session share, fixed at construction (see the module docstring)."""

    optimizer: torch.optim.Optimizer
    group: Any
    rank: int
    world: int
    device: torch.device
    """Where the parameters live."""
    wire_device: torch.device
    """Where the group's collectives take their tensors."""
    options: AuditOptions
    """How the checks run, as the session agreed on them (enums stay enums: ``ctx.options.mode``)."""
    report: EventLog
    state: SessionState

    def drop_grads(self) -> None:
        """Drop the trained parameters' gradients (each session's context knows which they are)."""
        raise NotImplementedError

    def fail_replay(self, ev: AuditEvent, suspects: tuple[int, ...]) -> bool:
        """A failed replay audit (``ev``): the update is refused (its gradients dropped), the audit
        fails as ``options.on_fault`` says, naming ``suspects``; False (the step's outcome)."""
        self.drop_grads()
        who = f"rank(s) {list(suspects)}" if suspects else "no rank could be named"
        message = f"replay audit failed ({who}); the update was not applied"
        self.report.fail(ev, message, policy=self.options.on_fault.value)
        return False


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckContext(SessionContext):
    """What the checks of one DDP audit session share, fixed at construction (see the module docstring)."""

    # --- the model
    model: DistributedDataParallel
    """The DDP model (``model.module``: the bare module replays run on)."""
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    state: DDPState
    grad_scaler: Any
    """``options.grad_scaler`` when it is enabled, else None: a disabled ``GradScaler`` scales nothing and
    never overflows. The checks read this one, never ``options.grad_scaler``."""
    # --- what is trained and compared
    param_names: list[str]
    params: list[torch.Tensor]
    """The trained parameters, in the order every signature and digest list follows."""
    not_in_optimizer: list[torch.Tensor]
    """Trained parameters the optimizer does not own (their gradients are dropped by hand)."""
    buffer_names: list[str]
    buffers: list[torch.Tensor]
    """The floating-point buffers the consensus covers (``consensus.consensus_buffers``)."""
    broadcast_buffers: bool
    """DDP broadcasts rank 0's buffers at each synced forward."""
    probes: Probes | None
    """Tolerance mode's random projections."""
    # --- the objects the checks act through
    hook: HookState
    injector: Injector | None

    def drop_grads(self) -> None:
        """Drop every trained parameter's gradient, the optimizer's and any it does not own.

        A step's local gradients must be that step's alone: the replay recomputes one step's
        gradient, so a parameter whose ``.grad`` accumulated across steps (trained by DDP but
        outside this optimizer) would be a false alarm at every audit.
        """
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.not_in_optimizer:
            p.grad = None

    def scaled(self, loss: torch.Tensor, *, n: int = 1, micro: bool = False) -> torch.Tensor:
        """The loss to back-propagate, so that the reduced gradients are DDP's averaged ones.

        One batch: the loss divided by the world size, and the hook's all-reduce sums. Dividing
        the scalar loss costs nothing, where dividing the gradients in the hook costs a pass over
        them. Micro-batches: ``loss / n``, as plain DDP users accumulate, and the hook multiplies
        the accumulated bucket by ``1 / world`` before the all-reduce, as DDP does: one pass per
        optimizer step (amortised over n backward passes) buys weights bit-equal to plain DDP's. When
        the step's losses carry the averaging (``state.loss_averaged``): ``average_over_ranks(loss) / n``,
        in the order the loop applied them (``AcceleratorAudit.loss``, then ``accelerator.backward``'s
        division), and the hook multiplies nothing. Replays scale the same way, so that a replayed
        gradient is bit-for-bit the local one.
        """
        if micro:
            out = average_over_ranks(loss, self.world) if self.state.loss_averaged else loss
            out = out / n if n > 1 else out
        else:
            out = loss / self.world if self.world > 1 else loss
        # As plain AMP code writes it: ``scaler.scale(loss / n).backward()``.
        return self.grad_scaler.scale(out) if self.grad_scaler is not None else out

    def rng_state(self) -> dict[str, torch.Tensor]:
        """The RNG states a micro-batch starts with (``replay.restore_rng`` sets them back)."""
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def gather_rows(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``mine``, in rank order, on the CPU (one all-gather)."""
        wire = mine.to(self.wire_device)
        out = [torch.empty_like(wire) for _ in range(self.world)]
        with released(wire, *out):  # a save's consensus: maybe the script's last collectives but one (letgo)
            dist.all_gather(out, wire, group=self.group)
        return [o.cpu() for o in out]
