"""Audit events: what each check found, where, on which hardware; and the sinks that keep them.

The event schema is what the ledger and the certifier consume:
``(run, branch, step, kind, outcome, ranks, suspect_ranks, details, inventory)``.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from certckpt.errors import CertckptError, ConfigurationError
from certckpt.log import AUDIT, TRUST, say
from certckpt.trust.fleet import Fleet
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import open_incident

__all__ = [
    "emit_event",
    "EventSource",
    "AuditEvent",
    "EventSink",
    "MemorySink",
    "JsonlSink",
    "KINDS",
    "rank_inventory",
    "log_trusted",
    "inventory_override",
    "INVENTORY_ENV",
    "make_event",
    "publish",
    "log_audit_pass",
]

# nonfinite: the per-step checks since the previous audit, summarised at each audit step (and a
# failure as soon as it happens); replay: ring replay of step s's local gradients; consensus:
# weight fingerprints of W_s compared across replicas; overflow: a gradient scaler's overflow,
# confirmed by a neighbour's replay (always outcome "pass": the scaler skipped the update by design,
# and the certifier counts only the three audit kinds and failures, so it changes no verdict).
# triggered-replay: a replay the sentinels asked for between audits that found nothing (always
# outcome "pass"; one that finds a fault is a failed "replay" event). It is no audit: it vouches for
# the computation of its own step only, so the certifier builds no full audit from it.
KINDS = ("nonfinite-pre", "nonfinite-post", "nonfinite", "replay", "consensus", "overflow", "triggered-replay")

# Environment variables that identify where a rank runs (Kubernetes, Slurm, clouds, torchrun).
_NODE_ENV = (
    "KUBERNETES_POD_NAME",
    "POD_NAME",
    "POD_NAMESPACE",
    "NODE_NAME",
    "KUBERNETES_NODE_NAME",
    "SLURM_JOB_ID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_PROCID",
    "INSTANCE_ID",
    "EC2_INSTANCE_ID",
    "GCE_INSTANCE_ID",
    "AZURE_VM_ID",
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "LOCAL_RANK",
)


@dataclass(kw_only=True, slots=True)
class AuditEvent:
    """One check's outcome.

    Attributes:
        run: training run name.
        branch: line of training within the run.
        step: the optimizer update the check concerns (``W_step`` for consensus).
        kind: one of ``KINDS``.
        outcome: ``"pass"`` or ``"fail"``.
        ranks: the ranks that took part.
        suspect_ranks: the ranks the check blames (empty when it cannot attribute).
        contained: for a failure, True when the faulty update never reached the weights.
        details: check-specific facts (comparisons, mismatching tensors, fingerprints, notes).
        inventory: per rank, where it ran (host, pod, node, device name and UUID).
    """

    run: str
    branch: str
    step: int
    kind: str
    outcome: str
    ranks: list[int]
    suspect_ranks: list[int] = field(default_factory=list)
    contained: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    inventory: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigurationError(f"unknown audit event kind {self.kind!r}; expected one of {KINDS}")
        if self.outcome not in ("pass", "fail"):
            raise ConfigurationError(f"outcome must be 'pass' or 'fail', got {self.outcome!r}")

    @property
    def failed(self) -> bool:
        return self.outcome == "fail"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditEvent:
        return cls(**d)


class EventSink(Protocol):
    """Where events go. The ledger implements this; so do the two sinks below."""

    def emit(self, event: AuditEvent) -> None: ...

    def flush(self) -> None: ...


class MemorySink:
    """Keeps the most recent events in memory (tests, notebooks, ranks other than 0)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self.events: collections.deque[AuditEvent] = collections.deque(maxlen=max_events)

    def emit(self, event: AuditEvent) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON line per event to a local file; ``flush`` fsyncs (called at audits and saves)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the sink

    def emit(self, event: AuditEvent) -> None:
        line = json.dumps(event.to_dict(), separators=(",", ":"), sort_keys=True)
        with self._lock:
            self._f.write(line + "\n")

    def flush(self) -> None:
        with self._lock:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._f.close()

    @staticmethod
    def read(path: str) -> list[AuditEvent]:
        with open(path, encoding="utf-8") as f:
            return [AuditEvent.from_dict(json.loads(line)) for line in f if line.strip()]


INVENTORY_ENV = "CERTCKPT_INVENTORY"


def inventory_override(rank: int | None) -> dict[str, Any]:
    """What ``$CERTCKPT_INVENTORY`` says about this rank: a JSON object whose ``"*"`` entry applies
    to every rank and whose ``"0"``, ``"1"``... entries to one rank each (the later wins), e.g.
    ``{"*": {"host": "node-7"}, "1": {"device_id": "GPU-bad"}}``. For a scheduler that knows device
    identities the process cannot read, and for tests; a fleet registry names devices by it."""
    raw = os.environ.get(INVENTORY_ENV, "").strip()
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ConfigurationError(f"${INVENTORY_ENV} is not JSON ({e}); see docs/detection.md") from e
    if not isinstance(doc, dict) or not all(
        (k == "*" or k.isdigit()) and isinstance(v, dict) and all(isinstance(x, (str, int)) for x in v.values())
        for k, v in doc.items()
    ):
        example = '{"1": {"device_id": "GPU-7"}}'
        raise ConfigurationError(f'${INVENTORY_ENV} must map "*" or rank numbers to objects of strings, e.g. {example}')
    out = dict(doc.get("*", {}))
    out.update(doc.get(str(rank), {}) if rank is not None else {})
    return out


def rank_inventory(device: Any = None, *, rank: int | None = None) -> dict[str, Any]:
    """Where this process runs: host, scheduler identifiers, and the CUDA device's name and UUID,
    with ``$CERTCKPT_INVENTORY``'s entries for this rank on top (``inventory_override``)."""
    inv: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    env = {k: os.environ[k] for k in _NODE_ENV if os.environ.get(k)}
    if env:
        inv["env"] = env
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        inv["device"] = props.name
        uuid = getattr(props, "uuid", None)
        if uuid:
            inv["device_uuid"] = f"GPU-{uuid}"
    else:
        inv["device"] = "cpu"
    inv.update(inventory_override(rank))
    return inv


def make_event(
    *,
    run: str,
    branch: str,
    world: int,
    inventory: dict[str, Any],
    step: int,
    kind: str,
    outcome: str,
    suspects: Any = (),
    contained: bool = False,
    details: dict[str, Any],
) -> AuditEvent:
    """One check's event as every driver of the checks builds it (every rank builds the same one;
    the ranks' inventory travels with failures only)."""
    return AuditEvent(
        run=run,
        branch=branch,
        step=step,
        kind=kind,
        outcome=outcome,
        ranks=list(range(world)),
        suspect_ranks=sorted(int(s) for s in suspects),
        contained=contained,
        details=details,
        inventory=inventory if outcome == "fail" else {},
    )


class EventSource(Protocol):
    """Who emits a session's events (``context.EventLog``): the run's identity, which every rank
    builds alike, and where rank 0 publishes them."""

    run: str
    branch: str
    rank: int
    world: int
    inventory: dict[str, dict[str, Any]]
    """Per rank, where it runs (``rank_inventory``); failures carry it."""
    sink: EventSink
    ledger: Ledger | None
    """Where a failure that reached the weights opens its incident."""
    fleet: Fleet | None
    """Where the devices a failure blames are convicted."""


def emit_event(
    source: EventSource,
    kind: str,
    outcome: str,
    *,
    step: int,
    suspects: Any = (),
    contained: bool = False,
    details: dict[str, Any],
) -> AuditEvent:
    """``make_event`` from ``source``'s identity, published by its rank 0: every session's events are
    built so (``context.EventLog.event``)."""
    ev = make_event(
        run=source.run,
        branch=source.branch,
        world=source.world,
        inventory=source.inventory,
        step=step,
        kind=kind,
        outcome=outcome,
        suspects=suspects,
        contained=contained,
        details=details,
    )
    if source.rank == 0:
        publish(ev, sink=source.sink, ledger=source.ledger, fleet=source.fleet)
    return ev


def publish(ev: AuditEvent, *, sink: EventSink, ledger: Ledger | None = None, fleet: Fleet | None = None) -> None:
    """Rank 0's part of an event: into the sink; a failure is flushed at once and, when it reached the
    weights (uncontained, not a replay's precondition check), opens an incident in ``ledger`` and
    convicts the blamed ranks' devices in ``fleet``. A ledger or a fleet that cannot be written must
    not hide the detection itself: ``certckpt status`` opens the incident later."""
    sink.emit(ev)
    if not ev.failed:
        return
    sink.flush()
    if ev.contained or ev.details.get("found_by"):
        return
    if ledger is not None:
        try:
            open_incident(ledger, ev.to_dict())
        except (CertckptError, OSError) as e:
            where = getattr(ledger, "store", ledger)
            say(f"certckpt: could not record the incident in {where}: {e}")
    if fleet is not None:
        try:
            fleet.report_detection(ev.to_dict(), store=getattr(ledger, "store", None))
        except (CertckptError, OSError) as e:
            say(f"certckpt: could not record the conviction in fleet {fleet.url}: {e}")


def log_audit_pass(*, step: int, branch: str | None, ranks: int, checked: int, seconds: float) -> None:
    """The one INFO line of a passed audit (rank 0 calls it; ``certckpt.log`` says who sees it)."""
    AUDIT.info(
        "audit at step %d on %s passed: replay and weight consensus across %d ranks, %d step(s) free of"
        " non-finite gradients checked (%.0f ms)",
        step,
        branch or "main",
        ranks,
        checked,
        1000 * seconds,
    )


def log_trusted(*, branch: str | None, steps: list[int], audit_step: int, store: str | None) -> None:
    """Rank 0's line when checkpoints become trusted: a clean audit at ``audit_step`` covered the
    unaudited steps of the checkpoints at ``steps`` (the newest is the run's latest-good, as far as
    this session knows; ``certckpt latest-good`` also re-verifies its bytes)."""
    b = branch or "main"
    names = ", ".join(f"{b}@{s}" for s in steps)
    TRUST.info(
        "checkpoint(s) %s trusted: the audit at step %d passed over their unaudited steps; "
        "latest-good is now %s@%d (%s)",
        names,
        audit_step,
        b,
        max(steps),
        store or "no ledger",
    )
