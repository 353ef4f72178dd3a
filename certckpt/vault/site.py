"""The vault's site: where a vault lives, whether it is usable, and what its store enforces (S3 Object Lock).

Also the Object Lock options a write-once PUT carries and the protection read back from a stored object.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from certckpt.errors import CheckpointNotFoundError, ConfigurationError, StorageError
from certckpt.format.storage import filesystem, is_s3, remote_error_text, resolve

__all__ = ["LOCK_MODES", "VaultSite", "lock_of", "lock_options", "open_vault"]

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
    target = resolve(url)
    if target.local is not None:
        if create:
            try:
                os.makedirs(target.local, exist_ok=True)
            except OSError as e:
                raise StorageError(f"{url}: cannot create the vault directory ({e.strerror or e})") from e
        elif not os.path.isdir(target.local):
            raise CheckpointNotFoundError(f"{url}: no such vault (directory not found)")
        return VaultSite(url=url, local=True)
    fs, path = filesystem(url)
    if not is_s3(fs):
        if not create and not fs.exists(path):
            raise CheckpointNotFoundError(f"{url}: no such vault")
        return VaultSite(url=url)
    bucket = path.split("/", 1)[0]
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"{url}: bucket {bucket!r} does not exist; create it with Object Lock enabled "
            f"(aws s3api create-bucket --bucket {bucket} --object-lock-enabled-for-bucket)"
        ) from e
    except PermissionError as e:
        raise StorageError(f"{url}: access to bucket {bucket!r} denied; check credentials and bucket policy") from e
    except Exception as e:  # botocore: no credentials, unreachable endpoint
        raise StorageError(f"{url}: {remote_error_text(e)}") from e
    try:
        conf = fs.call_s3("get_object_lock_configuration", Bucket=bucket)
        lock = conf.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
    except Exception:  # ObjectLockConfigurationNotFoundError: a bucket without Object Lock
        lock = False
    try:
        versioned = fs.call_s3("get_bucket_versioning", Bucket=bucket).get("Status") == "Enabled"
    except Exception:
        versioned = lock
    return VaultSite(url=url, s3=True, bucket=bucket, object_lock=lock, versioned=versioned)


def lock_options(site: VaultSite, *, mode: str, retain_days: float) -> dict[str, Any]:
    """The Object Lock arguments every PUT into the vault carries.

    Args:
        mode: one of ``LOCK_MODES``; ``auto`` is GOVERNANCE where the bucket has Object Lock, else nothing.
        retain_days: retention from now.

    Returns:
        ``put_object`` keyword arguments (empty when no lock applies).

    Raises:
        ValueError: an unknown mode, or a retention that is not > 0.
        StorageError: GOVERNANCE or COMPLIANCE asked for where the store has no Object Lock.
    """
    if mode not in LOCK_MODES:
        raise ConfigurationError(f"lock mode {mode!r}: choose one of {', '.join(LOCK_MODES)}")
    if mode == "none":
        return {}
    if not site.object_lock:
        if mode == "auto":
            return {}
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
    until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=retain_days)
    return {"ObjectLockMode": "GOVERNANCE" if mode == "auto" else mode, "ObjectLockRetainUntilDate": until}


def lock_of(site: VaultSite, url: str) -> dict[str, Any] | None:
    """What protects a vaulted object now (read from the store, so racing promoters agree)."""
    if not site.s3:
        return {"mode": "read-only file"} if resolve(url).local is not None else None
    fs, path = filesystem(url)
    bucket, key = path.split("/", 1)
    head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    if not head.get("ObjectLockMode"):
        return None
    until = head.get("ObjectLockRetainUntilDate")
    return {
        "mode": head["ObjectLockMode"],
        "retain_until": until.astimezone(datetime.timezone.utc).isoformat() if until else None,
        "version_id": head.get("VersionId"),
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
    fs, path = filesystem(url)
    bucket, key = path.split("/", 1)
    versions = markers = 0
    deleted = False
    kwargs: dict[str, str] = {}
    while True:
        out = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=key, **kwargs)
        versions += sum(1 for v in out.get("Versions", []) if v.get("Key") == key)
        for m in out.get("DeleteMarkers", []):
            if m.get("Key") == key:
                markers += 1
                deleted = deleted or bool(m.get("IsLatest"))
        if not out.get("IsTruncated"):
            return {"versions": versions, "delete_markers": markers, "deleted": deleted}
        kwargs = {"KeyMarker": out.get("NextKeyMarker", ""), "VersionIdMarker": out.get("NextVersionIdMarker", "")}
