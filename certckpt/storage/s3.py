"""An S3 bucket as a ``Storage`` (through s3fs): conditional create-only PUTs, Object Lock
retention carried by each PUT, and versions.

Imported only for an ``s3://`` URL (``storage_for`` imports it lazily, with fsspec).
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import weakref
from collections.abc import Container, Iterable, Sequence
from typing import cast

from botocore.utils import parse_timestamp, tzutc
from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from certckpt.errors import CheckpointNotFoundError, ConfigurationError, StorageError

from .base import Lock, LockRequest, Protection, Versions, remote_error_text
from .fsspec_store import FsspecStorage, Info

__all__ = ["S3Storage"]

_PAGE = 1000  # keys in one ListObjectsV2 answer
_LAST = "\U0010ffff"  # after every key that starts with what it follows (the greatest code point)


def _timestamp(value: object) -> datetime.datetime:
    """A timestamp of a response, as botocore's own parser gives it (UTC, dateutil's ``tzutc``).

    S3 lists every object's time as ISO 8601 in UTC (``2026-06-01T12:00:00.000Z``), which botocore
    parses with dateutil: 40 µs a key, three quarters of what a listing of thousands of keys costs
    the client. Those are read directly; anything else goes to botocore's parser."""
    if isinstance(value, str) and value.endswith("Z") and "T" in value:
        try:
            return datetime.datetime.fromisoformat(value[:-1]).replace(tzinfo=tzutc())
        except ValueError:
            pass
    return cast(datetime.datetime, parse_timestamp(value))


_FAST_TIMESTAMPS: weakref.WeakSet[object] = weakref.WeakSet()


def _fast_timestamps(fs: AbstractFileSystem) -> None:
    """Parse the timestamps of this s3fs session's responses with ``_timestamp`` (once a session;
    botocore's public hook: the session's response parser factory, shared by its clients)."""
    session = getattr(fs, "session", None)
    if session is None:
        return
    try:
        factory = session.get_component("response_parser_factory")
        if factory not in _FAST_TIMESTAMPS:
            factory.set_parser_defaults(timestamp_parser=_timestamp)
            _FAST_TIMESTAMPS.add(factory)
    except Exception:  # another botocore: its own parser stays, only slower
        return


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
        # the date is fixed here, at the write, so every object gets the whole retention asked for
        retention = {"ObjectLockMode": lock.mode, "ObjectLockRetainUntilDate": lock.until()} if lock else {}
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

    def _find(self, path: str, *, depth: int, skip: Container[str] = (), hint: Sequence[str] = ()) -> dict[str, Info]:
        # s3fs's find with a maxdepth lists every "directory" on its own (a ledger's chains: one LIST
        # per writer, 1,025 requests at 1,024 writers); without one it lists the prefix flat, one
        # request per 1,000 keys, and the depth is applied here.
        if skip or hint:
            found = self._listed_in_parts(path, skip=skip, hint=hint)
        else:
            found = cast(dict[str, Info], self.fs.find(path, detail=True))
        base = path.rstrip("/") + "/"
        return {
            p: i for p, i in found.items() if p == path or (p.startswith(base) and p[len(base) :].count("/") < depth)
        }

    def _listed_in_parts(self, path: str, *, skip: Container[str], hint: Sequence[str]) -> dict[str, Info]:
        """Every object under the directory ``path``, listed in parts at once: the keys under each
        skipped name are not listed at all (a ledger's records are listed without its chains), and
        the rest is cut at every page's worth of ``hint``.

        A part starts after one cut (``StartAfter``) and ends where it sees the next cut, or at the
        end of the listing: so the parts cover every key whatever the server's order (SeaweedFS lists
        a directory's entries before the names that sort between them) and whichever cuts are gone,
        at worst listing some keys twice. A skipped name's keys are contiguous in both orders: a part
        ends at the first of them, and the next starts after the last any key could be."""
        _fast_timestamps(self.fs)
        bucket, _, key = path.partition("/")
        prefix = key.rstrip("/") + "/" if key else ""
        names = list(skip) if isinstance(skip, Iterable) else []  # one that cannot be named is listed (and dropped)
        gaps = sorted(f"{prefix}{name}/" for name in names if isinstance(name, str) and name)
        cuts = sorted({h.partition("/")[2] for h in hint[_PAGE - 1 :: _PAGE]} - {""})
        cuts = [c for c in cuts if not any(c.startswith(g) for g in gaps)]
        bounds = sorted([(c, c, False) for c in cuts] + [(g, g + _LAST, True) for g in gaps])
        parts: list[tuple[str | None, str | None, bool]] = []  # (start after, end, end is a gap)
        after: str | None = None
        for at, then, gap in bounds:
            parts.append((after, at, gap))
            after = then
        parts.append((after, None, False))

        async def part(after: str | None, end: str | None, gap: bool) -> list[Info]:
            out: list[Info] = []
            while True:
                start = {"StartAfter": after} if after else {}
                page = await self.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=_PAGE, **start)
                contents = page.get("Contents", [])
                for o in contents:
                    k = str(o["Key"])
                    if end is not None and (k.startswith(end) if gap else k == end):
                        if not gap:
                            out.append(o)  # a cut belongs to the part it ends
                        return out
                    out.append(o)
                if not page.get("IsTruncated") or not contents:
                    return out
                after = str(contents[-1]["Key"])

        async def every() -> list[list[Info]]:
            return list(await asyncio.gather(*(part(a, e, g) for a, e, g in parts)))

        found: dict[str, Info] = {}
        for listed in sync(self.fs.loop, every):
            for o in listed:
                k = str(o["Key"])
                if k.endswith("/"):
                    continue  # a "directory" marker, not an object
                found[f"{bucket}/{k}"] = {
                    "name": f"{bucket}/{k}",
                    "type": "file",
                    "size": o.get("Size"),
                    "ETag": o.get("ETag"),
                    "LastModified": o.get("LastModified"),
                }
        return found

    def get_many(self, names: Iterable[str]) -> dict[str, bytes]:
        names = list(names)
        if not names:
            return {}
        paths = {self._path(n): n for n in names}
        # s3fs asks each object's size first (a HEAD per GET) to fetch a large one in ranges at once;
        # these are ledger records, read whole: one GET each.
        cat_file = getattr(self.fs, "_cat_file", None)
        takes = cat_file is not None and "max_concurrency" in inspect.signature(cat_file).parameters
        whole = {"max_concurrency": 1} if takes else {}
        try:
            got: dict[str, object] = self.fs.cat(list(paths), on_error="omit", **whole)
        except Exception as e:
            raise self._failed(e, "", "read") from e
        return {paths[p]: v for p, v in got.items() if isinstance(v, bytes)}

    def names_after(self, prefix: str, *, after: str = "", limit: int = 1000) -> list[str]:
        """One ListObjectsV2 request (``StartAfter``), however many objects the prefix holds; hidden
        names are kept, so that a short page always means the end (see ``Storage.names_after``)."""
        if not 1 <= limit <= 1000:
            raise ConfigurationError(f"names_after: limit {limit} is not 1-1000 (one S3 page)")
        _fast_timestamps(self.fs)  # a writer reads a page at every seal: 1,000 timestamps
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
