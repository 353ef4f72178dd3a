"""Where a run restarts: the checkpoint to load and the new branch to train on.

Restarting on the same branch collides with what the interrupted run left after the restart point
(checkpoints awaiting an audit that will never come, file names already taken). A resume therefore
always opens a new branch forked from the chosen checkpoint; the ledger's branch record is what
supersedes the abandoned checkpoints (``certify``'s ``superseded`` reason), and ids, hence file
names ``<branch>@<step>.safetensors``, never collide.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from certckpt.errors import CheckpointNotFoundError, ConfigurationError
from certckpt.format.trustconfig import TrustConfig

from .certify import Level, accept_level
from .ledger import Ledger, ckpt_id_for, is_ckpt_id
from .runstore import find_latest_good

__all__ = [
    "ResumePoint",
    "plan_resume",
    "next_branch",
    "BranchAfterLoad",
    "branch_after_load",
    "branch_after_loading",
    "recorded_branches",
]

_SUFFIX = re.compile(r"-r[0-9]+$")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """What a restarted job needs: load ``url``, then audit from ``step`` on ``branch``.

    Attributes:
        parent: the checkpoint id resumed from (``Auditor(parent=...)``; recorded once per branch).
            ``plan_resume`` always names one; a framework's load (Lightning's ``resume_point``)
            leaves it None when the file loaded is not the one its store committed (another
            store's, or replaced after its commit): the branch then starts without a parent.
        url: the checkpoint's file (verified when the point was planned).
        step: its optimizer step (``Auditor(start_step=...)``).
        branch: the new branch to train on (``Auditor(branch=...)``), ``<base>-r<N>``.
        consensus_fp: the weights every replica agreed on at ``step``, as the committed parent
            recorded them (None without the auditor, or without a parent): the restarted replicas'
            first consensus must equal it (``Auditor(expect_consensus_fp=...)``).
        level: ``trusted`` or ``verified`` (a framework's load: also ``suspect``, or ``not committed
            in this store``).
    """

    parent: str | None
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


@dataclass(frozen=True, slots=True)
class BranchAfterLoad:
    """Where new checkpoints go once a framework has loaded a checkpoint's files.

    Attributes:
        source: the id the files name (``<their branch>@<their step>``).
        parent: ``source`` when the store committed these very files (the same header digest),
            else None: the new branch then starts without a parent.
        branch: the new branch, ``next_branch`` of the files' branch among every name taken.
        step: the files' step.
    """

    source: str
    parent: str | None
    branch: str
    step: int


def branch_after_load(
    *,
    branch: str | None,
    step: int | None,
    header_digest: str,
    records: Mapping[str, Mapping[str, Any]],
    branch_parents: Iterable[str],
    recorded: Iterable[str],
    requested: str | None = None,
    store: str | None = None,
) -> BranchAfterLoad:
    """The branch a run continues on after loading a checkpoint (a pure decision).

    Args:
        branch, step, header_digest: the loaded files' record (its branch, None for ``main``).
        records: the ledger's commit records by checkpoint id (``LedgerSnapshot.records``).
        branch_parents: the branches the ledger records a parent for.
        recorded: every other branch name taken, valid or not (``recorded_branches``; the branches
            audit events name, where a framework counts them): a new branch reuses none of them,
            nor any branch a commit names.
        requested: the branch name the user asked for, instead of the next free one.
        store: the run store, named in the error.

    The files count as the committed checkpoint only when the commit record's header digest is
    theirs (a directory replaced after its commit, or another store's, is not): doubt never gives
    a branch a parent.

    Raises:
        ConfigurationError: ``requested`` is not a branch name, or is taken already.
    """
    source_branch = branch or "main"
    source = ckpt_id_for(source_branch, step or 0)
    committed = records.get(source)
    known = committed is not None and committed.get("header_digest") == header_digest
    taken = {r["branch"] for r in records.values()} | set(branch_parents) | set(recorded)
    free = next_branch(source_branch, taken)
    if requested is not None:
        if not isinstance(requested, str) or not is_ckpt_id(ckpt_id_for(requested, 0)):
            raise ConfigurationError(
                f"branch {requested!r} is not a branch name: use 1-100 letters, digits, '.', '_' or '-', or pass"
                f" none for the next free one ({free!r})"
            )
        if requested in taken:
            raise ConfigurationError(
                f"branch {requested!r} exists in {store or 'the run store'} already and a resume opens a new"
                f" branch: pass a new branch name, or none (then it is {free!r}, after the branch resumed from)"
            )
    return BranchAfterLoad(source=source, parent=source if known else None, branch=requested or free, step=step or 0)


def branch_after_loading(
    ledger: Ledger, record: Any, *, step: int | None, snap: Any, requested: str | None = None
) -> BranchAfterLoad:
    """:func:`branch_after_load` for a loaded file's record against ``ledger``: the records and branch
    parents of ``snap`` (the ledger's snapshot, read once by the caller), every branch the ledger
    names taken (:func:`recorded_branches`), errors naming the store.

    Args:
        record: the loaded file's ``CertRecord`` (its ``branch`` and ``header_digest``).
        step: the step the loaded file holds.
        snap: ``ledger``'s ``LedgerSnapshot`` (empty when the store has committed nothing).
        requested: the branch name the user asked for.
    """
    return branch_after_load(
        branch=record.branch,
        step=step,
        header_digest=record.header_digest,
        records=snap.records,
        branch_parents=snap.branch_parents,
        recorded=recorded_branches(ledger) if snap.records else (),
        requested=requested,
        store=ledger.store,
    )


def recorded_branches(ledger: Ledger) -> set[str]:
    """Every branch name the ledger has a branch record for, valid or not."""
    return {n.removesuffix(".json") for n in ledger.list_raw("branches")}


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
    recorded = recorded_branches(Ledger(store, trust=trust))
    taken = {c.branch for c in snap.checkpoints} | set(snap.branch_parents) | recorded
    return ResumePoint(
        parent=chosen,
        url=entry.url,
        step=entry.step,
        branch=next_branch(entry.branch, taken),
        consensus_fp=entry.consensus_fp,
        level=status.certification.verdicts[chosen].label,
    )
