"""The vault's site: where a vault lives, whether it is usable, and what its store enforces (S3 Object Lock).

Also the Object Lock options a write-once PUT carries and the protection read back from a stored object.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from certckpt.errors import ConfigurationError, StorageError
from certckpt.storage import LockRequest, storage_for, storage_of

__all__ = ["LOCK_MODES", "VaultSite", "lock_of", "lock_options", "open_vault", "versions_of"]

LOCK_MODES = ("auto", "none", "GOVERNANCE", "COMPLIANCE")


@dataclass(frozen=True, kw_only=True, slots=True)
class VaultSite:
    """Where a vault lives and what its store can enforce.

    Attributes:
        object_lock: the S3 bucket has Object Lock enabled (retention can be set per object).
        versioned: the bucket keeps versions (deleting a key leaves the data until each version goes).
    """

    url: str
    local: bool = False
    s3: bool = False
    bucket: str | None = None
    object_lock: bool = False
    versioned: bool = False


def open_vault(url: str, *, create: bool = False) -> VaultSite:
    """Check that a vault location is usable and learn what it enforces.

    Raises:
        CheckpointNotFoundError: a local vault directory or an S3 bucket does not exist.
        StorageError: no credentials, endpoint unreachable, access refused (one line, with the fix).
    """
    found = storage_for(url).open(create=create, what="vault")
    return VaultSite(
        url=url,
        local=found.local,
        s3=found.bucket is not None,
        bucket=found.bucket,
        object_lock=found.object_lock,
        versioned=found.versioned,
    )


def lock_options(site: VaultSite, *, mode: str, retain_days: float) -> LockRequest | None:
    """The Object Lock arguments every PUT into the vault carries.

    Args:
        mode: one of ``LOCK_MODES``; ``auto`` is GOVERNANCE where the bucket has Object Lock, else nothing.
        retain_days: retention from now.

    Returns:
        The retention each new object carries (None when no lock applies).

    Raises:
        ValueError: an unknown mode, or a retention that is not > 0.
        StorageError: GOVERNANCE or COMPLIANCE asked for where the store has no Object Lock.
    """
    if mode not in LOCK_MODES:
        raise ConfigurationError(f"lock mode {mode!r}: choose one of {', '.join(LOCK_MODES)}")
    if mode == "none":
        return None
    if not site.object_lock:
        if mode == "auto":
            return None
        raise StorageError(
            f"{site.url}: Object Lock {mode} asked for, but "
            + (
                "this bucket has no Object Lock; create the bucket with Object Lock enabled"
                if site.s3
                else "it applies to S3 vaults only"
            )
            + ", or pass lock mode 'none'"
        )
    if not retain_days > 0:
        raise ConfigurationError("retain days must be > 0 for Object Lock retention")
    return LockRequest(
        mode="COMPLIANCE" if mode == "COMPLIANCE" else "GOVERNANCE", retain_for=datetime.timedelta(days=retain_days)
    )


def lock_of(site: VaultSite, url: str) -> dict[str, Any] | None:
    """What protects a vaulted object now (read from the store, so racing promoters agree)."""
    if not site.s3:
        return {"mode": "read-only file"} if site.local else None
    storage, name = storage_of(url)
    lock = storage.lock_of(name)
    if lock is None or not lock.mode:
        return None
    return {
        "mode": lock.mode,
        "retain_until": lock.retain_until.isoformat() if lock.retain_until else None,
        "version_id": lock.version_id,
    }


def versions_of(site: VaultSite, url: str) -> dict[str, Any] | None:
    """An S3 key's stored versions and delete markers, and whether a delete marker is current
    (``deleted``); None off S3 or on an unversioned bucket.

    A held copy normally has one version and no delete marker. More versions mean the name was
    written again (a repair does that; so does someone with write access: the current bytes are
    what ``--verify`` reads); a current delete marker means someone deleted it (no lock, or
    GOVERNANCE bypassed with ``BypassGovernanceRetention``): the old versions are still there.
    """
    if not site.s3 or not site.versioned:
        return None
    storage, name = storage_of(url)
    found = storage.versions(name)
    if found is None:
        return None
    return {"versions": found.versions, "delete_markers": found.delete_markers, "deleted": found.deleted}
