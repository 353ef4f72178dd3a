"""Pruning: carry out what a retention plan allows, deleting every stored version of each file it lets go.

The only code that deletes from a vault; the policies and the guards no policy overrides are in ``retention``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, CorruptCheckpointError, StorageError
from certckpt.format.sharded.layout import MANIFEST_NAME
from certckpt.format.trustconfig import TrustConfig, trust_config_for
from certckpt.storage import Storage, join, storage_for
from certckpt.trust.certify import Level
from certckpt.trust.gate import gate_deletions, store_doubt
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import StoreStatus, certify_snapshot, check_file, find_latest_good

from .retention import PrunePlan, RetentionEntry, RetentionPolicy, plan_prune, protected_checkpoints
from .site import VaultSite, open_vault

__all__ = ["PruneResult", "prune"]


@dataclass(kw_only=True, slots=True)
class PruneResult:
    """What ``prune`` planned and, when applied, did.

    Attributes:
        deleted: checkpoints deleted and recorded as pruned.
        refused: per checkpoint, why the store would not delete it (an Object Lock retention); still held.
        damaged: per checkpoint, why its copy failed verification (a dry run reports them; ``apply``
            refuses while there are any).
    """

    policy: str
    plan: PrunePlan
    applied: bool
    deleted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    damaged: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "applied": self.applied,
            **self.plan.to_dict(),
            "deleted": self.deleted,
            "refused": self.refused,
            "damaged": self.damaged,
        }


def prune(
    vault: str,
    policy: RetentionPolicy,
    *,
    apply: bool = False,
    now: float | None = None,
    trust: TrustConfig | None = None,
) -> PruneResult:
    """Plan (and with ``apply``, carry out) the deletions a retention policy allows.

    Latest-good, the rollback target before every open suspect interval, and everything while an
    incident is open are kept whatever the policy says. A deletion the store refuses (an Object
    Lock retention that has not expired) is reported, and the checkpoint stays held.

    Every copy the plan keeps is read back and verified first: a damaged copy is not good, so it
    neither counts as latest-good nor as what a policy keeps, and the plan is made again without it.
    With ``apply``, any damaged copy makes prune refuse and delete nothing.

    Every deletion then passes the deletion gate (``certckpt.trust.gate``): a copy goes only when the
    vault's own ledger is intact, an authenticated commit record vouches for it and its verdict rests
    on no doubt; the plan lists why each other one is kept.

    Raises:
        CorruptCheckpointError: ``apply`` and a copy the plan relies on is damaged (named, with how to
            repair it); nothing was deleted.
    """
    site = open_vault(vault)
    now = time.time() if now is None else now
    trust = trust_config_for(trust)
    status, _ = find_latest_good(vault, verify_bytes=False, write_certificates=False, trust=trust)
    snap = status.snapshot
    # Deletion acts only on evidence a trusted writer vouches for: an unsigned revocation or failure
    # still demotes a checkpoint everywhere else, but never makes its copy (or its lineage) deletable.
    status.certification = certify_snapshot(snap, corrupt=status.problems, authenticated_only=True)
    breaks = [b for b in snap.breaks if b.scope != "cache"]
    if apply and breaks:
        raise CertckptError(
            f"{vault}: nothing pruned: the vault's ledger is tampered ({breaks[0].describe()}); restore the "
            "missing or altered records from a good copy (`certckpt status` lists them), then prune again"
        )
    damaged: dict[str, str] = {}
    checked: set[str] = set()
    while True:
        plan = _plan(status, policy, now=now, damaged=damaged)
        unchecked = [cid for cid in plan.keep if cid not in checked]
        if not unchecked:
            break
        for cid in unchecked:  # each copy is read at most once, whatever the number of rounds
            checked.add(cid)
            problem = check_file(
                join(vault, snap.holdings[cid]["url"]), snap.header_digest(cid), trusted_keys=snap.trusted_keys
            )
            if problem is not None:
                damaged[cid] = problem
    plan = _gated(plan, status, damaged)
    result = PruneResult(policy=str(policy), plan=plan, applied=apply, damaged=damaged)
    if not apply:
        return result
    if damaged:
        which = "; ".join(f"{cid}: {why}" for cid, why in damaged.items())
        raise CorruptCheckpointError(
            f"{vault}: nothing pruned: {len(damaged)} cop{'y' if len(damaged) == 1 else 'ies'} retention relies on "
            f"{'is' if len(damaged) == 1 else 'are'} damaged ({which}); repair them from the run store with "
            f"`certckpt vault promote RUN_STORE {vault} --repair`, then prune again"
        )
    ledger = Ledger(vault, trust=trust)
    storage = storage_for(vault)
    for cid in plan.delete:
        h = snap.holdings[cid]
        if h["url"] == f"{cid}.safetensors":
            refused = storage.delete(h["url"])
        else:
            refused = _delete_held_directory(site, storage, h)
        if refused:
            result.refused[cid] = refused
            continue
        ledger.retire(cid, reason="no retention policy keeps it", policy=str(policy))
        result.deleted.append(cid)
    return result


def _gated(plan: PrunePlan, status: StoreStatus, damaged: dict[str, str]) -> PrunePlan:
    """The plan after the deletion gate: what retention releases stays deleted only where the vault's
    own authenticated records prove it (``certckpt.trust.gate``); everything else is kept, with why."""
    verdicts = {
        cid: v
        for cid, v in status.certification.verdicts.items()
        if cid not in damaged and status.snapshot.records.get(cid) is not None
    }
    decision = gate_deletions(
        plan.delete, verdicts=verdicts, doubt=store_doubt(status.snapshot), protected=dict(plan.guarded)
    )
    for cid, why in decision.keep.items():
        plan.keep[cid] = plan.guarded[cid] = why
    plan.delete = decision.delete
    return plan


def _plan(status: StoreStatus, policy: RetentionPolicy, *, now: float, damaged: dict[str, str]) -> PrunePlan:
    """The retention plan over what the vault holds, counting damaged copies as not good."""
    snap, cert = status.snapshot, status.certification
    live = [cid for cid in snap.holdings if snap.available(cid)]
    # with nothing trusted, the newest verified copy is the one to keep: never prune the last good one
    latest = next((c for c in cert.candidates("verified") if snap.available(c) and c not in damaged), None)
    # Policies count trusted copies; a vault of a run without the auditor (promoted with
    # accept="verified") holds no trusted copy, so there they count the verified ones.
    good = [c for c in live if c in cert.verdicts and c not in damaged]
    level = Level.TRUSTED if any(cert.verdicts[c].trusted for c in good) else Level.VERIFIED
    entries = [
        RetentionEntry(
            ckpt_id=cid,
            branch=snap.holdings[cid]["branch"],
            step=snap.holdings[cid]["step"],
            trusted=cid in good and cert.verdicts[cid].level.rank >= level.rank,
            committed_at=snap.records.get(cid, {}).get("committed_at", 0.0),
            metrics=snap.holdings[cid].get("metrics", {}),
        )
        for cid in live
    ]
    intervals = [(d.branch, d.interval[0], d.interval[1]) for d in cert.detections if d.interval is not None]
    protected = protected_checkpoints(
        entries, latest_good=latest, intervals=intervals, branch_parents=snap.branch_parents
    )
    return plan_prune(entries, policy, now=now, protected=protected, open_incidents=snap.open_incidents())


def _delete_held_directory(site: VaultSite, storage: Storage, holding: dict[str, Any]) -> str | None:
    """Delete a held directory: the file that commits it (manifest or listing file) FIRST, so that a
    deletion cut short never leaves something taken for a whole checkpoint, then every other file in
    it. Returns why the store refused (nothing is deleted when a lock still holds any file)."""
    cid = holding["ckpt_id"]
    marker = MANIFEST_NAME if holding["url"] == cid else holding["url"].rsplit("/", 1)[-1]
    try:
        # every file, hidden ones (a writer's temp files) included
        entries = storage.walk(cid, depth=1, hidden=True)
        names = sorted(e.name.rsplit("/", 1)[-1] for e in entries if e.kind != "directory")
    except CertckptError as e:
        return str(e)
    if site.versioned:
        for name in [marker, *names]:  # refuse before deleting anything while a retention holds
            locked = _lock_text(storage, f"{cid}/{name}")
            if locked:
                return f"{name}: {locked}"
    refused = storage.delete(f"{cid}/{marker}")
    if refused:
        return refused
    for name in names:
        if name != marker:
            refused = storage.delete(f"{cid}/{name}")
            if refused:
                return f"{name}: {refused} (its {marker} is deleted: the copy is no longer a checkpoint)"
    storage.remove_empty(cid)  # a file that appeared meanwhile keeps it; the copy is gone either way
    return None


def _lock_text(storage: Storage, name: str) -> str | None:
    """The Object Lock retention or legal hold that still protects the current version of ``name``,
    else None (a legal hold has no date: it protects until someone with the right lifts it)."""
    try:
        lock = storage.lock_of(name)
    except StorageError:
        return None  # gone or unreadable: the delete says what is wrong
    if lock is None or not lock.active():
        return None
    if lock.legal_hold:
        return "Object Lock legal hold (lift it with s3api put-object-legal-hold --legal-hold Status=OFF)"
    until = lock.retain_until.isoformat() if lock.retain_until else "?"
    return f"Object Lock {lock.mode} retention until {until}"
