"""The deletion gate: the one pure rule that decides whether a checkpoint's bytes may be deleted.

Every path that frees space asks it: a vault prune (after its retention policy), and the framework
rotations that delete a run's files (Lightning's ``save_top_k``, the Trainer's ``save_total_limit``).
Its principle (docs/signing.md, "Deleting"): doubt may lower a verdict, it never frees space. A copy is
released only on positive, authenticated evidence that the policy lets it go: the store's own ledger
intact, the copy's commit record authenticated, and its verdict resting on no doubt. Whatever cannot
be proven (a break anywhere the decision reads, a record missing, a registry that cannot vouch, a
copy that does not verify) means keep, and says why. No I/O, no torch import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .certify import Reason, Verdict
from .snapshot import LedgerSnapshot

__all__ = ["DOUBT_REASONS", "GateDecision", "gate_deletions", "rotation_keeps", "store_doubt"]

# Reasons that say "cannot be proven", not "proven bad": a copy suspect for one of them is kept.
# `tampered`: a chain it depends on is broken (its own store's, or a fleet registry's that cannot
# vouch); `device-convicted`: evidence from another store (a fleet registry) that the vault's own
# ledger does not hold; `corrupt`: its bytes do not verify now (repair it; never delete the evidence).
DOUBT_REASONS = frozenset({Reason.TAMPERED, Reason.DEVICE_CONVICTED, Reason.CORRUPT})


@dataclass(frozen=True, kw_only=True, slots=True)
class GateDecision:
    """What may go, and why everything else stays.

    Attributes:
        delete: ids the gate releases, in the order the caller gave them.
        keep: ``{ckpt_id: why}`` for every candidate it keeps.
    """

    delete: list[str] = field(default_factory=list)
    keep: dict[str, str] = field(default_factory=dict)


def store_doubt(snap: LedgerSnapshot) -> str | None:
    """Why nothing of this store may be deleted (None when its own ledger proves its history): a break
    of any writer that seals evidence (certificates, re-derived on every read, do not count)."""
    breaks = [b for b in snap.breaks if b.scope != "cache"]
    if breaks:
        return f"the ledger is tampered ({breaks[0].describe()})"
    return None


def gate_deletions(
    candidates: Iterable[str],
    *,
    verdicts: Mapping[str, Verdict],
    doubt: str | None,
    protected: Mapping[str, str],
) -> GateDecision:
    """Release the candidates a policy lets go, unless anything about them is in doubt.

    Args:
        candidates: the ids a retention policy or a framework rotation would delete.
        verdicts: the certifier's verdicts over authenticated evidence only; an id missing here has
            no authenticated commit record and is kept.
        doubt: why the store as a whole cannot be trusted to decide (``store_doubt``); None when it can.
        protected: ``{ckpt_id: why}`` that no policy deletes (latest-good, rollback targets, an open incident).
    """
    out = GateDecision()
    for cid in candidates:
        why = _keep_reason(cid, verdicts=verdicts, doubt=doubt, protected=protected)
        if why is None:
            out.delete.append(cid)
        else:
            out.keep[cid] = why
    return out


def _keep_reason(
    cid: str, *, verdicts: Mapping[str, Verdict], doubt: str | None, protected: Mapping[str, str]
) -> str | None:
    if doubt is not None:
        return f"kept: {doubt}; nothing is deleted on doubt"
    if cid in protected:
        return protected[cid]
    verdict = verdicts.get(cid)
    if verdict is None:
        return "kept: no authenticated commit record vouches for it (unproven, never released)"
    doubtful = [str(r) for r in verdict.reasons if r in DOUBT_REASONS]
    if doubtful:
        return f"kept: its verdict rests on doubt ({', '.join(doubtful)}), which never frees space"
    return None


def rotation_keeps(
    ckpt_id: str, *, snap: LedgerSnapshot, verdicts: Mapping[str, Verdict], latest_good: str | None
) -> str | None:
    """Why a framework rotation (``save_top_k``, ``save_total_limit``) must not delete this run's
    checkpoint: it is latest-good, or the gate keeps it (None: it may go)."""
    protected = {latest_good: "it is the run's latest-good"} if latest_good else {}
    doubt = store_doubt(snap)
    if ckpt_id not in verdicts and doubt is None and ckpt_id not in protected:
        # The rotating writer committed this checkpoint itself, and a background save may not have
        # sealed the record yet (written, then sealed); a record deleted by someone else would be a
        # break of the chain that sealed it, which is doubt.
        return None
    decision = gate_deletions([ckpt_id], verdicts=verdicts, doubt=doubt, protected=protected)
    return decision.keep.get(ckpt_id)
