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

This module is the pure part (records in, decisions and records out); reading and writing them is
``certckpt.trust.runstore`` (``open_incident``, ``list_incidents``, ``decide``). No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import IncidentError

__all__ = [
    "ACTIONS",
    "EXIT_FAULT_DETECTED",
    "EXIT_DEVICE_REFUSED",
    "Incident",
    "incident_id_for",
    "build_opening",
    "incident_state",
    "check_decision",
    "node_of",
]

# Exit status of a training job stopped by an uncontained detection. It tells a scheduler "this
# failure is not transient: do not requeue on the suspect node" (Kubernetes podFailurePolicy
# onExitCodes, a Slurm epilog, a torchrun wrapper can all match it).
EXIT_FAULT_DETECTED = 86
# Exit status of a training job refused at its start because a rank's device is convicted in the
# fleet registry: "requeue, but not on that device" (nothing trained; no incident was opened).
EXIT_DEVICE_REFUSED = 87

ACTIONS = ("quarantine", "rollback", "replace", "return-to-service", "approve", "resolve", "close")
_NEEDS_APPROVAL = ("replace", "return-to-service")
OPENED_SUFFIX = "00000000000000000000-opened"  # sorts before every decision
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def incident_id_for(event: Mapping[str, object]) -> str:
    """Deterministic id of the incident a failed check opens: every rank, and a later
    ``certckpt status``, name the same incident without talking to each other."""
    raw = f"inc-{event['branch']}-{event['step']}-{event['kind']}"
    return _NAME_SAFE.sub("_", raw)


def _signature(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The fault signature: which check, what it compared, which tensors and fingerprints disagreed."""
    details = ev.get("details") or {}
    tensors: list[str] = []
    for names in (details.get("mismatched") or {}).values():
        tensors.extend(n for n in names if n not in tensors)
    for n in details.get("tensors", []) or []:
        if n not in tensors:
            tensors.append(n)
    return {"check": ev["kind"], "tensors": tensors, "details": details}


def build_opening(
    ev: Mapping[str, Any],
    *,
    latest_good: str | None,
    made_suspect: Sequence[str],
    interval: Sequence[int] | None,
    now: float,
) -> dict[str, Any]:
    """The opening record of an incident (pure), from the failed check's event record."""
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
        "suspect_nodes": sorted({node_of(inventory.get(str(r), {})) for r in suspects} - {""}),
        "checkpoints": {"latest_good": latest_good, "made_suspect": list(made_suspect)},
        "opened_at": now,
    }


def node_of(inv: Mapping[str, object]) -> str:
    """The node a rank ran on, from its inventory (scheduler variables first, the host name last)."""
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
        by_id = {d["decision_id"]: d for d in self.decisions}
        approved = {
            d.get("approves")
            for d in self.decisions
            if d["action"] == "approve" and not _same_signer(d, by_id.get(d.get("approves")))
        }
        return [d for d in self.decisions if d["action"] in _NEEDS_APPROVAL and d["decision_id"] not in approved]

    def to_dict(self) -> dict[str, object]:
        return {
            "incident_id": self.incident_id,
            "status": self.status,
            "rollback_to": self.rollback_to,
            "pending_approvals": [d["decision_id"] for d in self.pending_approvals()],
            "opened": self.opened,
            "decisions": self.decisions,
        }


def _signer_of(record: Mapping[str, object] | None) -> str | None:
    sig = record.get("sig") if record is not None else None
    key = sig.get("key") if isinstance(sig, Mapping) else None
    return key if isinstance(key, str) else None


def _same_signer(approval: Mapping[str, object], proposal: Mapping[str, object] | None) -> bool:
    """An approval signed with the proposal's own key approves nothing (two people, two keys)."""
    key = _signer_of(approval)
    return key is not None and key == _signer_of(proposal)


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
    decision: Mapping[str, object],
    *,
    trusted: Iterable[str] = (),
    drills: Sequence[Mapping[str, Any]] = (),
    signer: str | None = None,
) -> None:
    """The rule book: raise ``IncidentError`` (saying what is missing) when a decision is not allowed.

    Args:
        trusted: checkpoint ids trusted now (a rollback must name one).
        drills: restore-drill records available (a close must cite a passing one).
        signer: the id of the key that will sign this decision, if any: an approval signed by the
            key that signed the proposal is the same person, whatever ``by`` says.
    """
    action = decision["action"]
    if action not in ACTIONS:
        raise IncidentError(f"action {action!r}: choose one of {', '.join(ACTIONS)}")
    if not str(decision.get("by", "")).strip() or not str(decision.get("reason", "")).strip():
        raise IncidentError("every decision needs --by NAME and --reason TEXT")
    if incident.status == "closed":
        raise IncidentError(f"{incident.incident_id} is closed; open records cannot be reopened (decisions are final)")
    if action == "rollback":
        _check_rollback(decision, trusted)
    if action == "approve":
        _check_approval(incident, decision, signer)
    if action == "resolve":
        _check_resolve(incident)
    if action == "close":
        _check_close(incident, decision, drills)


def _check_rollback(decision: Mapping[str, object], trusted: Iterable[str]) -> None:
    """A rollback names the checkpoint training restarts from, and it is trusted now."""
    ckpt = decision.get("ckpt")
    if not ckpt:
        raise IncidentError("a rollback decision must name the checkpoint to restart from (--ckpt ID)")
    if ckpt not in set(trusted):
        raise IncidentError(
            f"{ckpt} is not a trusted checkpoint of this run; roll back to one (see `certckpt latest-good`)"
        )


def _check_approval(incident: Incident, decision: Mapping[str, object], signer: str | None) -> None:
    """An approval names a replace or return-to-service proposal, by another person with another key."""
    target = next((d for d in incident.decisions if d["decision_id"] == decision.get("approves")), None)
    if target is None or target["action"] not in _NEEDS_APPROVAL:
        pending = ", ".join(d["decision_id"] for d in incident.pending_approvals()) or "none"
        raise IncidentError(
            f"--approves must name a pending replace or return-to-service decision (pending: {pending})"
        )
    if target["by"].strip().lower() == str(decision["by"]).strip().lower():
        raise IncidentError(f"{target['decision_id']} was proposed by {target['by']}; someone else must approve it")
    if signer is not None and signer == _signer_of(target):
        raise IncidentError(
            f"{target['decision_id']} was signed by key {signer}, the key signing this approval; "
            "someone else, with their own key, must approve it"
        )


def _check_resolve(incident: Incident) -> None:
    """Resolving needs a rollback decision that names a checkpoint, and no proposal awaiting approval."""
    if incident.rollback_to is None:
        raise IncidentError(
            f"{incident.incident_id} cannot be resolved: no rollback decision names the checkpoint to restart from "
            "(record one with --action rollback --ckpt ID)"
        )
    pending = incident.pending_approvals()
    if pending:
        raise IncidentError(
            f"{incident.incident_id} cannot be resolved: {', '.join(d['decision_id'] for d in pending)} await approval"
        )


def _check_close(incident: Incident, decision: Mapping[str, object], drills: Sequence[Mapping[str, Any]]) -> None:
    """Closing needs the incident resolved and a restore drill, run since it opened, that passed
    against a clean reference."""
    if incident.status != "resolved":
        raise IncidentError(f"{incident.incident_id} is {incident.status}; resolve it before closing")
    drill = next((d for d in drills if d.get("drill_id") == decision.get("drill")), None)
    if drill is None:
        raise IncidentError(
            "closing needs a restore drill of the recovered run: "
            "run `certckpt drill restore VAULT ...` and pass --drill ID --vault VAULT"
        )
    if drill.get("at", 0) < incident.opened.get("opened_at", 0):
        raise IncidentError(
            f"drill {decision.get('drill')} ran before the incident opened; run a new one on the recovered run"
        )
    if drill.get("outcome") != "pass" or not (drill.get("stages", {}).get("metrics") or {}).get("ok"):
        raise IncidentError(
            f"drill {decision.get('drill')} did not pass against a clean reference (outcome {drill.get('outcome')})"
        )
