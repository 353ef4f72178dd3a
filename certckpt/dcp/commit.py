"""Committing a sharded checkpoint to a run store's ledger, through the trust layer's public API.

The commit record names the checkpoint *directory*, with the manifest's header digest (which covers
every shard file's header digest, and through them every byte) and the manifest record's run,
branch, step and state fingerprint, so that the certifier's cross-check of a commit record against
the checkpoint's own record has something to compare. ``certckpt status`` lists such a checkpoint
with its verdict; ``latest-good`` verifies the directory as ``certckpt verify DIR`` does. The vault
holds it as a directory (``docs/operations.md``).
"""

from __future__ import annotations

from certckpt.errors import ConfigurationError
from certckpt.format.writer import SaveResult
from certckpt.trust.commit import commit_saved
from certckpt.trust.ledger import Ledger, ckpt_id_for, is_ckpt_id

__all__ = ["check_commit_options", "commit_checkpoint"]


def check_commit_options(*, ledger: str | None, step: int | None, branch: str) -> None:
    """Refuse, before anything is written, what a commit would refuse after the save."""
    if ledger is None:
        return
    if type(step) is not int or step < 0:
        raise ConfigurationError(f"a ledger commit needs step=N (a non-negative int), got {step!r}")
    if not isinstance(branch, str) or not is_ckpt_id(ckpt_id_for(branch, step)):
        raise ConfigurationError(f"branch {branch!r}: use 1-100 letters, digits, '.', '_' or '-'")


def commit_checkpoint(
    store: str,
    location: str,
    *,
    manifest: SaveResult,
    nbytes: int,
    tensors: int,
    run: str | None,
    branch: str,
    step: int,
    parent: str | None = None,
    consensus_fp: str | None = None,
    step_range: list[int] | None = None,
) -> str:
    """Write the commit record of the sharded checkpoint at ``location``; returns its id (``branch@step``).

    Args:
        store: the run store whose ledger records the commit.
        location: the checkpoint directory.
        manifest: what writing its manifest returned (header digest, state fingerprint).
        nbytes: the checkpoint's bytes (manifest and shard files).
        tensors: the number of global tensors.
        consensus_fp, step_range: the state fingerprint every replica agreed on at ``step`` and the
            updates since the previous checkpoint (from an audited run's evidence), or None.

    Raises:
        CheckpointExistsError: ``branch@step`` is committed already; the directory stays uncommitted.
    """
    result = SaveResult(
        location=location,
        nbytes=nbytes,
        state_fp=manifest.state_fp,
        tensors=tensors,
        seconds=manifest.seconds,
        header_digest=manifest.header_digest,
    )
    return commit_saved(
        Ledger(store),
        result,
        run=run,
        branch=branch,
        step=step,
        parent=parent,
        consensus_fp=consensus_fp,
        step_range=step_range,
    )
