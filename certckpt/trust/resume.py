"""Where a run restarts: the checkpoint to load and the new branch to train on.

Restarting on the same branch collides with what the interrupted run left after the restart point
(checkpoints awaiting an audit that will never come, file names already taken). A resume therefore
always opens a new branch forked from the chosen checkpoint; the ledger's branch record is what
supersedes the abandoned checkpoints (``certify``'s ``superseded`` reason), and ids, hence file
names ``<branch>@<step>.safetensors``, never collide.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from certckpt.errors import CheckpointNotFoundError
from certckpt.format.trustconfig import TrustConfig

from .certify import Level, accept_level
from .ledger import Ledger
from .runstore import find_latest_good

__all__ = ["ResumePoint", "plan_resume", "next_branch"]

_SUFFIX = re.compile(r"-r[0-9]+$")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """What a restarted job needs: load ``url``, then audit from ``step`` on ``branch``.

    Attributes:
        parent: the checkpoint id resumed from (``Auditor(parent=...)``; recorded once per branch).
        url: the checkpoint's file (verified when the point was planned).
        step: its optimizer step (``Auditor(start_step=...)``).
        branch: the new branch to train on (``Auditor(branch=...)``), ``<base>-r<N>``.
        consensus_fp: the weights every replica agreed on at ``step`` (None without the auditor):
            the restarted replicas' first consensus must equal it.
        level: ``trusted`` or ``verified``.
    """

    parent: str
    url: str
    step: int
    branch: str
    consensus_fp: str | None
    level: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def next_branch(parent_branch: str, taken: set[str]) -> str:
    """``main`` -> ``main-r1``, ``main-r1`` -> ``main-r2``: the first free resume branch name."""
    base = _SUFFIX.sub("", parent_branch)
    n = 1
    while f"{base}-r{n}" in taken:
        n += 1
    return f"{base}-r{n}"


def plan_resume(
    store: str, *, accept: str | Level = Level.TRUSTED, verify_bytes: bool = True, trust: TrustConfig | None = None
) -> ResumePoint:
    """The checkpoint a run restarts from (latest-good) and the branch it continues on.

    Nothing is written: the restarted auditor records the branch (``Auditor(branch=..., parent=...)``,
    or ``Ledger.start_branch``) when it starts.

    Raises:
        CheckpointNotFoundError: no checkpoint qualifies (nothing trusted, or verified with ``accept``).
    """
    level = accept_level(accept)
    status, chosen = find_latest_good(
        store, verify_bytes=verify_bytes, write_certificates=False, accept=level, trust=trust
    )
    if chosen is None:
        raise CheckpointNotFoundError(
            f"{store}: no {'trusted' if level is Level.TRUSTED else 'trusted or verified'} checkpoint to resume "
            f"from (see `certckpt status {store}`)"
        )
    snap = status.snapshot
    entry = status.entry(chosen)
    # every branch name ever recorded, valid or not: a new branch must not reuse any
    recorded = {n.removesuffix(".json") for n in Ledger(store, trust=trust).list_raw("branches")}
    taken = {c.branch for c in snap.checkpoints} | set(snap.branch_parents) | recorded
    return ResumePoint(
        parent=chosen,
        url=entry.url,
        step=entry.step,
        branch=next_branch(entry.branch, taken),
        consensus_fp=entry.consensus_fp,
        level=status.certification.verdicts[chosen].label,
    )
