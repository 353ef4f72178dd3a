"""Incidents: what a model-risk reviewer needs after a detection, and every decision taken since.

Every uncontained detection opens an incident in the run's ledger. Records are write-once: the
opening record holds the evidence (fault signature, affected and suspect ranks, where those ranks
ran, the steps, the checkpoint ids), and each decision is a new record, never an edit::

    _ledger/incidents/<incident_id>--00000000000000000000-opened.json
    _ledger/incidents/<incident_id>--<time_ns>-<action>.json

Life cycle (``incident_state`` derives it from the records; ``check_decision`` is the rule book):

* ``open``: quarantine the suspect node, roll back to a named trusted checkpoint, propose to replace
  hardware or return it to service. Replacement and return to service take effect only with an
  approval record by someone other than the proposer.
* ``resolved``: allowed only once a rollback decision names the checkpoint training restarted from
  and every replace / return-to-service proposal is approved.
* ``closed``: allowed only with a passing restore drill, recorded after the incident opened, that
  compared the recovered run with a clean reference. Retention deletes nothing before that.

The decision logic is pure; ``open_incident``, ``list_incidents`` and ``decide`` are the thin I/O
layer over the ledger. No torch import.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, CheckpointExistsError, CheckpointNotFoundError

__all__ = [
    "ACTIONS",
    "EXIT_FAULT_DETECTED",
    "Incident",
    "IncidentError",
    "incident_id_for",
    "build_opening",
    "incident_state",
    "check_decision",
    "open_incident",
    "open_missing_incidents",
    "list_incidents",
    "get_incident",
    "decide",
]

# Exit status of a training job stopped by an uncontained detection. It tells a scheduler "this
# failure is not transient: do not requeue on the suspect node" (Kubernetes podFailurePolicy
# onExitCodes, a Slurm epilog, a torchrun wrapper can all match it).
EXIT_FAULT_DETECTED = 86

ACTIONS = ("quarantine", "rollback", "replace", "return-to-service", "approve", "resolve", "close")
_NEEDS_APPROVAL = ("replace", "return-to-service")
_OPENED = "00000000000000000000-opened"
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class IncidentError(CertckptError, ValueError):
    """A decision the rules do not allow (the message says what is missing)."""


def incident_id_for(event: Mapping[str, Any]) -> str:
    """Deterministic id of the incident a failed check opens: every rank, and a later
    ``certckpt status``, name the same incident without talking to each other."""
    raw = f"inc-{event['branch']}-{event['step']}-{event['kind']}"
    return _NAME_SAFE.sub("_", raw)


def _ev(event: Any) -> dict[str, Any]:
    return event if isinstance(event, dict) else event.to_dict()


def _signature(ev: dict[str, Any]) -> dict[str, Any]:
    """The fault signature: which check, what it compared, which tensors and fingerprints disagreed."""
    details = ev.get("details") or {}
    tensors: list[str] = []
    for names in (details.get("mismatched") or {}).values():
        tensors.extend(n for n in names if n not in tensors)
    for n in details.get("tensors", []) or []:
        if n not in tensors:
            tensors.append(n)
    return {"check": ev["kind"], "tensors": tensors, "details": details}


def build_opening(event: Any, *, latest_good: str | None, made_suspect: Sequence[str], interval: Sequence[int] | None, now: float) -> dict[str, Any]:
    """The opening record of an incident (pure)."""
    ev = _ev(event)
    inventory = ev.get("inventory") or {}
    suspects = list(ev.get("suspect_ranks") or [])
    return {
        "incident_id": incident_id_for(ev),
        "record": "opened",
        "run": ev.get("run"),
        "branch": ev["branch"],
        "detected_step": ev["step"],
        "suspect_interval": list(interval) if interval else None,
        "signature": _signature(ev),
        "ranks": list(ev.get("ranks") or []),
        "suspect_ranks": suspects,
        "inventory": inventory,
        "suspect_nodes": sorted({_node_of(inventory.get(str(r), {})) for r in suspects} - {""}),
        "checkpoints": {"latest_good": latest_good, "made_suspect": list(made_suspect)},
        "opened_at": now,
    }


def _node_of(inv: Mapping[str, Any]) -> str:
    for k in ("node", "NODE_NAME", "KUBERNETES_NODE_NAME", "SLURMD_NODENAME", "instance", "INSTANCE_ID", "host"):
        if inv.get(k):
            return str(inv[k])
    return ""


@dataclass(kw_only=True, slots=True)
class Incident:
    """An incident as its records describe it now."""

    incident_id: str
    opened: dict[str, Any]
    decisions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        actions = {d["action"] for d in self.decisions}
        return "closed" if "close" in actions else "resolved" if "resolve" in actions else "open"

    @property
    def is_open(self) -> bool:
        return self.status != "closed"

    @property
    def rollback_to(self) -> str | None:
        named = [d["ckpt"] for d in self.decisions if d["action"] == "rollback" and d.get("ckpt")]
        return named[-1] if named else None

    def pending_approvals(self) -> list[dict[str, Any]]:
        approved = {d.get("approves") for d in self.decisions if d["action"] == "approve"}
        return [d for d in self.decisions if d["action"] in _NEEDS_APPROVAL and d["decision_id"] not in approved]

    def to_dict(self) -> dict[str, Any]:
        return {"incident_id": self.incident_id, "status": self.status, "rollback_to": self.rollback_to,
                "pending_approvals": [d["decision_id"] for d in self.pending_approvals()],
                "opened": self.opened, "decisions": self.decisions}


def incident_state(records: Iterable[Mapping[str, Any]]) -> dict[str, Incident]:
    """Incidents from their records (decisions in time order); decisions without an opening are ignored."""
    opened: dict[str, dict[str, Any]] = {}
    decisions: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("record") == "opened":
            opened.setdefault(r["incident_id"], dict(r))
        else:
            decisions.setdefault(r["incident_id"], []).append(dict(r))
    return {
        iid: Incident(incident_id=iid, opened=o, decisions=sorted(decisions.get(iid, []), key=lambda d: d["at"]))
        for iid, o in sorted(opened.items(), key=lambda kv: kv[1].get("opened_at", 0))
    }


def check_decision(
    incident: Incident,
    decision: Mapping[str, Any],
    *,
    trusted: Iterable[str] = (),
    drills: Sequence[Mapping[str, Any]] = (),
) -> None:
    """The rule book: raise ``IncidentError`` (saying what is missing) when a decision is not allowed.

    Args:
        trusted: checkpoint ids trusted now (a rollback must name one).
        drills: restore-drill records available (a close must cite a passing one).
    """
    action = decision["action"]
    if action not in ACTIONS:
        raise IncidentError(f"action {action!r}: choose one of {', '.join(ACTIONS)}")
    if not str(decision.get("by", "")).strip() or not str(decision.get("reason", "")).strip():
        raise IncidentError("every decision needs --by NAME and --reason TEXT")
    if incident.status == "closed":
        raise IncidentError(f"{incident.incident_id} is closed; open records cannot be reopened (decisions are final)")
    if action == "rollback":
        ckpt = decision.get("ckpt")
        if not ckpt:
            raise IncidentError("a rollback decision must name the checkpoint to restart from (--ckpt ID)")
        if ckpt not in set(trusted):
            raise IncidentError(f"{ckpt} is not a trusted checkpoint of this run; roll back to one (see `certckpt latest-good`)")
    if action == "approve":
        target = next((d for d in incident.decisions if d["decision_id"] == decision.get("approves")), None)
        if target is None or target["action"] not in _NEEDS_APPROVAL:
            pending = ", ".join(d["decision_id"] for d in incident.pending_approvals()) or "none"
            raise IncidentError(f"--approves must name a pending replace or return-to-service decision (pending: {pending})")
        if target["by"].strip().lower() == str(decision["by"]).strip().lower():
            raise IncidentError(f"{target['decision_id']} was proposed by {target['by']}; someone else must approve it")
    if action == "resolve":
        if incident.rollback_to is None:
            raise IncidentError(
                f"{incident.incident_id} cannot be resolved: no rollback decision names the checkpoint to restart from "
                "(record one with --action rollback --ckpt ID)"
            )
        pending = incident.pending_approvals()
        if pending:
            raise IncidentError(f"{incident.incident_id} cannot be resolved: {', '.join(d['decision_id'] for d in pending)} await approval")
    if action == "close":
        if incident.status != "resolved":
            raise IncidentError(f"{incident.incident_id} is {incident.status}; resolve it before closing")
        drill = next((d for d in drills if d.get("drill_id") == decision.get("drill")), None)
        if drill is None:
            raise IncidentError("closing needs a restore drill of the recovered run: run `certckpt drill restore VAULT ...` and pass --drill ID --vault VAULT")
        if drill.get("at", 0) < incident.opened.get("opened_at", 0):
            raise IncidentError(f"drill {decision.get('drill')} ran before the incident opened; run a new one on the recovered run")
        if drill.get("outcome") != "pass" or not (drill.get("stages", {}).get("metrics") or {}).get("ok"):
            raise IncidentError(f"drill {decision.get('drill')} did not pass against a clean reference (outcome {drill.get('outcome')})")


# --- the ledger layer ----------------------------------------------------------------------------


def _records(snap: Any) -> list[dict[str, Any]]:
    return list(getattr(snap, "incident_records", []))


def open_incident(ledger: Any, event: Any, *, status: Any = None) -> str:
    """Write the opening record for an uncontained failed check (idempotent); returns its id."""
    from .runstore import certify_store

    ev = _ev(event)
    iid = incident_id_for(ev)
    st = status if status is not None else certify_store(ledger.store, write_certificates=False)
    cert = st.certification
    det = next((d for d in cert.detections if d.branch == ev["branch"] and d.step == ev["step"] and d.interval), None)
    made = [c.ckpt_id for c in st.snapshot.checkpoints if c.branch == ev["branch"] and det and c.step > det.interval[0]]
    doc = build_opening(ev, latest_good=st.latest_good, made_suspect=sorted(made, key=lambda x: int(x.rpartition("@")[2])),
                        interval=det.interval if det else None, now=time.time())
    try:
        ledger.put_raw("incidents", f"{iid}--{_OPENED}.json", _dumps(doc))
    except CheckpointExistsError:
        pass  # opened already (by the training job or an earlier `status`): the first record stands
    return iid


def open_missing_incidents(ledger: Any, status: Any) -> list[str]:
    """Open an incident for every uncontained detection that has none yet (called by ``status``)."""
    have = {r["incident_id"] for r in _records(status.snapshot)}
    out = []
    for ev in status.snapshot.events:
        if ev.get("outcome") == "fail" and not ev.get("contained") and not (ev.get("details") or {}).get("found_by"):
            iid = incident_id_for(ev)
            if iid not in have:
                have.add(iid)
                out.append(open_incident(ledger, ev, status=status))
    return out


def _dumps(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def list_incidents(store: str) -> list[Incident]:
    from .ledger import Ledger

    return list(incident_state(_records(Ledger(store).snapshot())).values())


def get_incident(store: str, incident_id: str) -> Incident:
    for inc in list_incidents(store):
        if inc.incident_id == incident_id:
            return inc
    raise CheckpointNotFoundError(f"{store}: no incident {incident_id!r} (see `certckpt incident ls {store}`)")


def decide(
    store: str,
    incident_id: str,
    *,
    action: str,
    by: str,
    reason: str,
    ckpt: str | None = None,
    node: str | None = None,
    approves: str | None = None,
    drill: str | None = None,
    vault: str | None = None,
) -> dict[str, Any]:
    """Record a decision on an incident after checking it against the rules; returns the record.

    Args:
        ckpt: rollback: the checkpoint training restarts from.
        node: quarantine / replace / return-to-service: which node (default the suspect nodes).
        approves: approve: the decision id approved.
        drill: close: the restore drill's id (``latest``: the newest); ``vault`` is where it was
            recorded (default this store).
    """
    from .ledger import Ledger
    from .runstore import certify_store

    inc = get_incident(store, incident_id)
    status = certify_store(store, write_certificates=False)
    drills = []
    if action == "close":
        source = Ledger(vault) if vault else Ledger(store)
        names = source.list_raw("drills")
        drills = [dict(json.loads(v), drill_id=k.removesuffix(".json")) for k, v in source.read_raw("drills", names).items()]
    now = time.time()
    decision_id = f"{incident_id}--{time.time_ns():020d}-{action}"
    doc = {"incident_id": incident_id, "record": "decision", "decision_id": decision_id, "action": action, "by": by,
           "reason": reason, "at": now}
    if ckpt:
        doc["ckpt"] = ckpt
    if action in ("quarantine", "replace", "return-to-service"):
        doc["nodes"] = [node] if node else inc.opened.get("suspect_nodes", [])
    if approves:
        doc["approves"] = approves
    if drill:
        doc["drill"] = drill
        doc["drill_vault"] = vault or store
    if drill == "latest" and drills:
        doc["drill"] = max(drills, key=lambda d: d.get("at", 0))["drill_id"]
    check_decision(inc, doc, trusted=[c for c in status.certification.order if status.snapshot.available(c)], drills=drills)
    Ledger(store).put_raw("incidents", f"{decision_id}.json", _dumps(doc))
    return doc
