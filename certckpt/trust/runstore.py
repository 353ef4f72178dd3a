"""Run-store operations behind ``certckpt status`` and ``certckpt latest-good``: read the ledger,
check files, certify, record verdict changes as certificates. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .certify import Certification, certify
from certckpt.errors import CertckptError
from .ledger import Ledger, LedgerSnapshot
from certckpt.format.verify import verify

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
        unavailable: trusted checkpoints skipped by latest-good because this store no longer holds
            their file (pruned by retention; in a vault, known only as lineage).
    """

    store: str
    snapshot: LedgerSnapshot
    certification: Certification
    problems: dict[str, str] = field(default_factory=dict)
    uncommitted: list[str] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)

    @property
    def latest_good(self) -> str | None:
        """The newest trusted checkpoint this store still holds (bytes not re-verified)."""
        return next((c for c in self.certification.order if self.snapshot.available(c) and c not in self.problems), None)

    def entry(self, ckpt_id: str):
        return next(c for c in self.snapshot.checkpoints if c.ckpt_id == ckpt_id)

    def suspect_intervals(self) -> list[dict[str, Any]]:
        return [
            {"branch": d.branch, "from": d.interval[0], "to": d.interval[1], "detected_step": d.step, "kind": d.kind,
             "suspect_ranks": list(d.suspect_ranks), "rollback_window": d.rollback_window}
            for d in self.certification.detections if d.interval is not None
        ]


def check_file(url: str, header_digest: str | None, *, progress=None) -> str | None:
    """Verify a committed checkpoint's bytes, and that it is the very file that was committed.

    Returns:
        None when it verifies, else one line saying what is wrong.
    """
    try:
        report = verify(url, progress=progress)
    except CertckptError as e:
        return str(e)
    if not report.ok:
        return report.problems[0].message
    if header_digest and report.info.record.header_digest != header_digest:
        return f"{url}: not the file that was committed (header digest {report.info.record.header_digest}, committed {header_digest})"
    return None


def _check(status_or_snap, cid: str) -> str | None:
    snap = getattr(status_or_snap, "snapshot", status_or_snap)
    entry = next(c for c in snap.checkpoints if c.ckpt_id == cid)
    return check_file(entry.url, snap.header_digest(cid))


def _record_changes(ledger: Ledger, status: StoreStatus) -> None:
    for cid, v in status.certification.verdicts.items():
        if not status.snapshot.available(cid):
            continue  # a vault certifies what it holds; lineage-only and pruned ones keep their last word
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
        for cid in snap.records:
            if not snap.available(cid):
                continue
            p = _check(snap, cid)
            if p:
                problems[cid] = p
    cert = certify(snap.checkpoints, snap.events, snap.revocations, corrupt=problems, branch_parents=snap.branch_parents)
    status = StoreStatus(store=store, snapshot=snap, certification=cert, problems=problems, uncommitted=ledger.uncommitted(snap))
    if write_certificates:
        _record_changes(ledger, status)
        if not snap.is_vault:  # a vault mirrors its run's incidents; it never opens its own
            from .incident import open_missing_incidents

            if open_missing_incidents(ledger, status):
                status.snapshot = ledger.snapshot()
    return status


def find_latest_good(store: str, *, verify_bytes: bool = True, write_certificates: bool = True) -> tuple[StoreStatus, str | None]:
    """The newest trusted checkpoint whose bytes verify now, falling back along the trusted order."""
    ledger = Ledger(store)
    status = certify_store(store, write_certificates=False)
    chosen = None
    for cid in status.certification.order:
        if not status.snapshot.available(cid):
            status.unavailable.append(cid)
            continue
        problem = _check(status, cid) if verify_bytes else None
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
