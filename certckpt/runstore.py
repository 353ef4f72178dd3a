"""Run-store operations behind ``certckpt status`` and ``certckpt latest-good``: read the ledger,
check files, certify, record verdict changes as certificates. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .certify import Certification, certify
from .errors import CertckptError
from .ledger import Ledger, LedgerSnapshot
from .verify import verify

__all__ = ["StoreStatus", "certify_store", "find_latest_good", "check_file"]


@dataclass(kw_only=True, slots=True)
class StoreStatus:
    """A run store, certified.

    Attributes:
        store: its URL or path.
        snapshot: the ledger's records.
        certification: verdicts, detections, latest-good order.
        problems: per checkpoint id, why its bytes did not verify (those checked).
        uncommitted: checkpoint files without a commit record.
        fallbacks: trusted checkpoints skipped by latest-good because their bytes failed now.
    """

    store: str
    snapshot: LedgerSnapshot
    certification: Certification
    problems: dict[str, str] = field(default_factory=dict)
    uncommitted: list[str] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)

    def entry(self, ckpt_id: str):
        return next(c for c in self.snapshot.checkpoints if c.ckpt_id == ckpt_id)

    def suspect_intervals(self) -> list[dict[str, Any]]:
        return [
            {"branch": d.branch, "from": d.interval[0], "to": d.interval[1], "detected_step": d.step, "kind": d.kind,
             "suspect_ranks": list(d.suspect_ranks), "rollback_window": d.rollback_window}
            for d in self.certification.detections if d.interval is not None
        ]


def check_file(ledger: Ledger, record: dict[str, Any]) -> str | None:
    """Verify a committed checkpoint's bytes, and that it is the very file that was committed."""
    url = ledger.url_of(record)
    try:
        report = verify(url)
    except CertckptError as e:
        return str(e)
    if not report.ok:
        return report.problems[0].message
    if record.get("header_digest") and report.info.record.header_digest != record["header_digest"]:
        return f"{url}: not the file that was committed (header digest {report.info.record.header_digest}, committed {record['header_digest']})"
    return None


def _record_changes(ledger: Ledger, status: StoreStatus) -> None:
    for cid, v in status.certification.verdicts.items():
        prev = status.snapshot.certificates.get(cid)
        if prev is None or prev["verdict"] != v.label or list(prev["reasons"]) != list(v.reasons):
            ledger.record_certificate(cid, verdict=v.label, reasons=list(v.reasons), record=status.snapshot.records[cid])


def certify_store(store: str, *, verify_bytes: bool = False, write_certificates: bool = True) -> StoreStatus:
    """Certify every committed checkpoint of a run store.

    Args:
        store: the run store's path or URL.
        verify_bytes: verify every checkpoint's bytes (otherwise only latest-good's are checked).
        write_certificates: record each verdict change in the ledger.
    """
    ledger = Ledger(store)
    snap = ledger.snapshot()
    problems = {}
    if verify_bytes:
        for cid, rec in snap.records.items():
            p = check_file(ledger, rec)
            if p:
                problems[cid] = p
    cert = certify(snap.checkpoints, snap.events, snap.revocations, corrupt=problems, branch_parents=snap.branch_parents)
    status = StoreStatus(store=store, snapshot=snap, certification=cert, problems=problems, uncommitted=ledger.uncommitted(snap))
    if write_certificates:
        _record_changes(ledger, status)
    return status


def find_latest_good(store: str, *, verify_bytes: bool = True, write_certificates: bool = True) -> tuple[StoreStatus, str | None]:
    """The newest trusted checkpoint whose bytes verify now, falling back along the trusted order."""
    ledger = Ledger(store)
    status = certify_store(store, write_certificates=False)
    chosen = None
    for cid in status.certification.order:
        problem = check_file(ledger, status.snapshot.records[cid]) if verify_bytes else None
        if problem is None:
            chosen = cid
            break
        status.fallbacks.append((cid, problem))
        status.problems[cid] = problem
    if status.fallbacks:
        snap = status.snapshot
        status.certification = certify(
            snap.checkpoints, snap.events, snap.revocations, corrupt=status.problems, branch_parents=snap.branch_parents
        )
    if write_certificates:
        _record_changes(ledger, status)
    return status, chosen
