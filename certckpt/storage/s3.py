"""An S3 bucket as a ``Storage`` (through s3fs): conditional create-only PUTs, Object Lock
retention carried by each PUT, and versions.

Imported only for an ``s3://`` URL (``storage_for`` imports it lazily, with fsspec).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import cast

from fsspec import AbstractFileSystem

from certckpt.errors import CheckpointNotFoundError, ConfigurationError, StorageError

from .base import Lock, LockRequest, Protection, Versions, remote_error_text
from .fsspec_store import FsspecStorage, Info

__all__ = ["S3Storage"]


def precondition_failed(e: BaseException) -> bool:
    """Whether the server answered 412 Precondition Failed (botocore's error, as the cause s3fs chains).

    A create-only PUT carries one precondition, ``If-None-Match: *``, so a 412 to it means the key
    exists. AWS and moto name the condition in the error (``<Condition>If-None-Match``), which s3fs
    turns into ``FileExistsError``; SeaweedFS 4.48 answers a bare ``PreconditionFailed``, which s3fs
    raises as ``OSError(EINVAL)``: without this a retried or racing write read as a failed upload.
    """
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if error.get("Code") == "PreconditionFailed" or status == 412:
                return True
        cause = cause.__cause__ or cause.__context__
    return False


class S3Storage(FsspecStorage):
    """An S3 bucket through s3fs: conditional create-only PUTs (``If-None-Match: *``), Object Lock
    retention carried by each PUT, and versions (a locked bucket is always versioned)."""

    def __init__(self, url: str, fs: AbstractFileSystem, root: str):
        super().__init__(url, fs, root)
        self.bucket = self.root.split("/", 1)[0]
        self._versioned: bool | None = None

    def _key(self, name: str) -> str:
        return self._path(name).split("/", 1)[1]

    def _s3(self, method: str, **kwargs: object) -> Info:
        return cast(Info, self.fs.call_s3(method, Bucket=self.bucket, **kwargs))

    def _put(self, src: str, path: str, *, create_only: bool, lock: LockRequest | None, extra: Info) -> None:
        retention = {"ObjectLockMode": lock.mode, "ObjectLockRetainUntilDate": lock.retain_until} if lock else {}
        if create_only:
            # If-None-Match: * — the server refuses an existing key; s3fs aborts a failed multipart upload
            try:
                self.fs.put_file(src, path, mode="create", **retention, **extra)
            except OSError as e:
                if isinstance(e, FileExistsError) or not precondition_failed(e):
                    raise
                raise FileExistsError(path) from e
        else:
            # A versioned, locked bucket keeps the replaced version; the new one gets its own lock.
            self.fs.put_file(src, path, **retention, **extra)

    def _find(self, path: str, *, depth: int) -> dict[str, Info]:
        # s3fs's find with a maxdepth lists every "directory" on its own (a ledger's chains: one LIST
        # per writer, 1,025 requests at 1,024 writers); without one it lists the prefix flat, one
        # request per 1,000 keys, and the depth is applied here.
        found = cast(dict[str, Info], self.fs.find(path, detail=True))
        base = path.rstrip("/") + "/"
        return {
            p: i for p, i in found.items() if p == path or (p.startswith(base) and p[len(base) :].count("/") < depth)
        }

    def names_after(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """One ListObjectsV2 request (``StartAfter``), however many objects the prefix holds; hidden
        names are kept, so that a short page always means the end (see ``Storage.names_after``)."""
        if not 1 <= limit <= 1000:
            raise ConfigurationError(f"names_after: limit {limit} is not 1-1000 (one S3 page)")
        key = self._key(prefix).rstrip("/") + "/"
        start = {"StartAfter": self._key(after)} if after else {}
        try:
            page = self._s3("list_objects_v2", Prefix=key, MaxKeys=limit, **start)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._failed(e, prefix, "list") from e
        root = self._key("").rstrip("/")
        return [str(o["Key"])[len(root) + 1 :] if root else str(o["Key"]) for o in page.get("Contents", [])]

    def open(self, *, create: bool = False, what: str = "store") -> Protection:
        return self.protection()  # a bucket is never created here: it needs Object Lock from its start

    def protection(self) -> Protection:
        bucket = self.bucket
        try:
            self._s3("head_bucket")
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{self.url}: bucket {bucket!r} does not exist; create it with Object Lock enabled "
                f"(aws s3api create-bucket --bucket {bucket} --object-lock-enabled-for-bucket)"
            ) from e
        except PermissionError as e:
            raise StorageError(
                f"{self.url}: access to bucket {bucket!r} denied; check credentials and bucket policy"
            ) from e
        except Exception as e:  # botocore: no credentials, unreachable endpoint
            raise StorageError(f"{self.url}: {remote_error_text(e)}") from e
        try:
            conf = self._s3("get_object_lock_configuration")
            lock = conf.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
        except Exception:  # ObjectLockConfigurationNotFoundError: a bucket without Object Lock
            lock = False
        try:
            versioned = self._s3("get_bucket_versioning").get("Status") == "Enabled"
        except Exception:
            versioned = lock
        self._versioned = versioned
        return Protection(object_lock=lock, versioned=versioned, bucket=bucket)

    def lock_of(self, name: str, *, version_id: str | None = None) -> Lock | None:
        """Raises ``StorageError`` when the object cannot be read (a missing one: None)."""
        extra = {"VersionId": version_id} if version_id else {}
        try:
            head = self._s3("head_object", Key=self._key(name), **extra)
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._failed(e, name, "read its lock") from e
        hold = head.get("ObjectLockLegalHoldStatus") == "ON"
        if not head.get("ObjectLockMode") and not hold:
            return None
        until = head.get("ObjectLockRetainUntilDate")
        return Lock(
            mode=str(head.get("ObjectLockMode") or ""),
            retain_until=until.astimezone(datetime.timezone.utc) if until else None,
            legal_hold=hold,
            version_id=head.get("VersionId"),
        )

    def versions(self, name: str) -> Versions | None:
        if not self._is_versioned():
            return None
        key = self._key(name)
        versions = markers = 0
        deleted = False
        for page in self._version_pages(key):
            versions += sum(1 for v in page.get("Versions", []) if v.get("Key") == key)
            for m in page.get("DeleteMarkers", []):
                if m.get("Key") == key:
                    markers += 1
                    deleted = deleted or bool(m.get("IsLatest"))
        return Versions(versions=versions, delete_markers=markers, deleted=deleted)

    def _is_versioned(self) -> bool:
        if self._versioned is None:
            self.protection()
        return bool(self._versioned)

    def _version_pages(self, key: str) -> Iterable[Info]:
        kwargs: dict[str, str] = {}
        while True:
            try:
                page = self._s3("list_object_versions", Prefix=key, **kwargs)
            except Exception as e:
                raise StorageError(f"{self.url}/{key}: cannot list its versions ({remote_error_text(e)})") from e
            yield page
            if not page.get("IsTruncated"):
                return
            kwargs = {
                "KeyMarker": page.get("NextKeyMarker", ""),
                "VersionIdMarker": page.get("NextVersionIdMarker", ""),
            }

    def delete(self, name: str) -> str | None:
        if not self._is_versioned():
            return super().delete(name)
        # A versioned (Object Lock) bucket: deleting the key only hides it behind a delete marker and
        # frees nothing; delete each version, which the server refuses while its retention holds.
        key = self._key(name)
        try:
            for page in self._version_pages(key):
                for v in page.get("Versions", []) + page.get("DeleteMarkers", []):
                    if v["Key"] != key:
                        continue
                    try:
                        self._s3("delete_object", Key=key, VersionId=v["VersionId"])
                    except PermissionError:
                        held = self.lock_of(name, version_id=v["VersionId"])
                        until = held.retain_until.isoformat() if held and held.retain_until else "?"
                        mode = f" {held.mode}" if held and held.mode else ""
                        return f"Object Lock{mode} retention until {until}"
        except StorageError as e:
            return str(e)
        except Exception as e:
            return remote_error_text(e)
        self.fs.invalidate_cache(self._path(name))
        return None
