"""The vault: write-once, off-node copies of trusted checkpoints — promote, list, prune, restore.

A vault is a store at any fsspec URL holding one run's known-good checkpoints. Its ledger mirrors the
run's evidence (commit records, branches, audit events, revocations, incidents, certificates), so the
certifier re-derives every verdict there without the training nodes, and adds a *holding* record per
checkpoint it keeps. A checkpoint exists in the vault once its holding exists, and that is written
only after the copy was read back and verified.

Write-once everywhere: local and mounted file systems get a temp file verified *before* it is
published with ``os.link`` (which fails when the name exists) and a read-only mode; S3 gets
create-only PUTs (``If-None-Match: *``) and, when the bucket has Object Lock, retention on every
object. Deleting is left to ``prune``, which only does what a retention plan says. No torch import.
"""

from __future__ import annotations

import datetime
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UntrustedCheckpointError,
)
from certckpt.trust.ledger import VAULT_MARK, Ledger
from .retention import PrunePlan, RetentionEntry, RetentionPolicy, plan_prune, protected_checkpoints
from certckpt.trust.runstore import StoreStatus, certify_store, check_file, find_latest_good
from certckpt.format.storage import commit_local, commit_remote, filesystem, is_s3, join, open_read, remote_error_text, resolve, temp_name
from certckpt.format.verify import inspect

__all__ = ["VaultSite", "Promotion", "PruneResult", "Restore", "open_vault", "promote", "holdings", "prune", "restore", "LOCK_MODES"]

LOCK_MODES = ("auto", "none", "GOVERNANCE", "COMPLIANCE")
_MIRRORED = ("checkpoints", "branches", "events", "revocations", "incidents")
_CHUNK = 8 << 20
Progress = Callable[[int, int], None]


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


@dataclass(kw_only=True, slots=True)
class Promotion:
    """One checkpoint promoted (or found already promoted)."""

    ckpt_id: str
    url: str
    written: bool
    nbytes: int
    seconds: float
    lock: dict[str, Any] | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"ckpt_id": self.ckpt_id, "url": self.url, "written": self.written, "bytes": self.nbytes,
                "seconds": round(self.seconds, 4), "bytes_per_s": round(self.bytes_per_s), "lock": self.lock}


@dataclass(kw_only=True, slots=True)
class PruneResult:
    policy: str
    plan: PrunePlan
    applied: bool
    deleted: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # the store would not delete it (Object Lock)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "applied": self.applied, **self.plan.to_dict(), "deleted": self.deleted, "refused": self.refused}


@dataclass(kw_only=True, slots=True)
class Restore:
    ckpt_id: str
    source: str
    dest: str
    nbytes: int
    seconds: float
    written: bool = True

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"ckpt_id": self.ckpt_id, "source": self.source, "dest": self.dest, "bytes": self.nbytes,
                "seconds": round(self.seconds, 4), "bytes_per_s": round(self.bytes_per_s), "written": self.written}


# --- the site ------------------------------------------------------------------------------------


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


def _lock_options(site: VaultSite, mode: str, retain_days: float) -> dict[str, Any]:
    if mode not in LOCK_MODES:
        raise ValueError(f"lock mode {mode!r}: choose one of {', '.join(LOCK_MODES)}")
    if mode == "none":
        return {}
    if not site.object_lock:
        if mode == "auto":
            return {}
        raise StorageError(
            f"{site.url}: Object Lock {mode} asked for, but "
            + ("this bucket has no Object Lock; create the bucket with Object Lock enabled" if site.s3 else "it applies to S3 vaults only")
            + ", or pass lock mode 'none'"
        )
    if not retain_days > 0:
        raise ValueError("retain days must be > 0 for Object Lock retention")
    until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=retain_days)
    return {"ObjectLockMode": "GOVERNANCE" if mode == "auto" else mode, "ObjectLockRetainUntilDate": until}


def _lock_of(site: VaultSite, url: str) -> dict[str, Any] | None:
    """What protects a vaulted object now (read from the store, so racing promoters agree)."""
    if not site.s3:
        return {"mode": "read-only file"} if resolve(url).local is not None else None
    fs, path = filesystem(url)
    bucket, key = path.split("/", 1)
    head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    if not head.get("ObjectLockMode"):
        return None
    until = head.get("ObjectLockRetainUntilDate")
    return {"mode": head["ObjectLockMode"], "retain_until": until.astimezone(datetime.timezone.utc).isoformat() if until else None,
            "version_id": head.get("VersionId")}


# --- copying -------------------------------------------------------------------------------------


def _upload_callback(progress: Progress, total: int):
    """An fsspec callback reporting ``(done, total)`` to a certckpt progress function."""
    from fsspec.callbacks import Callback

    class _Report(Callback):
        def call(self, *args: Any, **kwargs: Any) -> None:
            progress(min(self.value, total), total)

    return _Report()


def _stream(src_url: str, out, progress: Progress | None) -> int:
    with open_read(resolve(src_url)) as (fh, size):
        total, done = size or 0, 0
        while chunk := fh.read(_CHUNK):
            out.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
    return done


def copy_once(
    src_url: str,
    dst: str,
    *,
    header_digest: str | None,
    put_options: dict[str, Any] | None = None,
    read_only: bool = True,
    progress: Progress | None = None,
) -> tuple[bool, int]:
    """Copy a checkpoint under a name that must never be replaced, verifying the copy.

    Local destinations are verified before the name is published (a bad copy never appears);
    remote ones are read back after the upload. When the name already holds a verified copy of the
    same checkpoint this is a no-op.

    Returns:
        ``(written, bytes)``: written is False when an identical copy was already there.

    Raises:
        CheckpointExistsError: the name holds different content (nothing was changed).
        CorruptCheckpointError: the copy does not verify (local: nothing was published).
    """
    target = resolve(dst)
    if target.local is not None:
        final = os.path.abspath(target.local)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        try:
            with open(tmp, "xb") as out:
                n = _stream(src_url, out, progress)
                out.flush()
                os.fsync(out.fileno())
            if read_only:
                os.chmod(tmp, 0o444)
            problem = check_file(tmp, header_digest)
            if problem:
                raise CorruptCheckpointError(f"copy of {src_url} to {dst} does not verify ({problem}); nothing was published")
            commit_local(tmp, final, overwrite=False, display=dst)
            return True, n
        except CheckpointExistsError:
            return _already_there(dst, header_digest), os.path.getsize(final)
        except OSError as e:
            if isinstance(e, CertckptError):
                raise
            raise StorageError(f"{dst}: cannot write ({e.strerror or e}); nothing was published") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    src = resolve(src_url)
    spool = None
    try:
        if src.local is not None:
            local = src.local
        else:  # fsspec uploads from a local file: spool a remote source first
            fd, spool = tempfile.mkstemp(prefix=".certckpt-copy-")
            with os.fdopen(fd, "wb") as out:
                _stream(src_url, out, None)
            local = spool
        size = os.path.getsize(local)
        cb = _upload_callback(progress, size) if progress else None
        for attempt in range(8):
            try:
                commit_remote(local, dst, overwrite=False, display=dst, put_options=put_options, callback=cb)
                break
            except CheckpointExistsError:
                # A racing promoter's PUT may be refused (412/409) before its object is readable:
                # wait for it; if it never appears (that promoter failed), upload again.
                filesystem(dst)[0].invalidate_cache()
                try:
                    return _already_there(dst, header_digest), size
                except CheckpointNotFoundError:
                    time.sleep(0.1 * (attempt + 1))
        else:
            raise StorageError(f"{dst}: concurrent uploads under this name did not settle; retry")
        problem = check_file(dst, header_digest)
        if problem:
            raise CorruptCheckpointError(f"{dst}: the uploaded copy does not verify when read back ({problem}); it is not recorded as held")
        return True, size
    finally:
        if spool and os.path.exists(spool):
            os.unlink(spool)


def _already_there(dst: str, header_digest: str | None) -> bool:
    """True when ``dst`` holds a verified copy of this checkpoint; raises when it holds something else
    (``CheckpointNotFoundError`` when nothing is readable there yet)."""
    if not _exists(dst):
        raise CheckpointNotFoundError(f"{dst}: not readable yet")
    problem = check_file(dst, header_digest)
    if problem:
        raise CheckpointExistsError(f"{dst}: already holds different content ({problem}); write-once: nothing was changed")
    return False


def _exists(url: str) -> bool:
    target = resolve(url)
    if target.local is not None:
        return os.path.exists(target.local)
    fs, path = filesystem(url)
    return fs.exists(path)


# --- promote -------------------------------------------------------------------------------------


def _mirror(src: Ledger, dst: Ledger, cert_ids: Sequence[str]) -> int:
    """Copy the run's evidence into the vault's ledger, byte for byte; returns records written."""
    written = 0
    for kind in _MIRRORED:
        have = set(dst.list_raw(kind))
        want = [n for n in src.list_raw(kind) if n not in have]
        for name, data in src.read_raw(kind, want).items():
            written += dst.put_raw(kind, name, data)
    prefixes = tuple(f"{c}--" for c in cert_ids)
    have = set(dst.list_raw("certificates"))
    want = [n for n in src.list_raw("certificates") if n.startswith(prefixes) and n not in have]
    for name, data in src.read_raw("certificates", want).items():
        written += dst.put_raw("certificates", name, data)
    return written


def _claim(vault: Ledger, run: str | None, source: str) -> None:
    """Tie the vault to one run (checkpoint ids are only unique within a run)."""
    import json

    if resolve(source).local is not None:
        source = os.path.abspath(resolve(source).local)
    mark = {"kind": "certckpt-vault", "run": run, "source": source}
    try:
        vault.put_raw("", VAULT_MARK, (json.dumps(mark, sort_keys=True) + "\n").encode())
    except CheckpointExistsError:
        existing = json.loads(vault.read_raw("", [VAULT_MARK])[VAULT_MARK])
        if existing.get("run") != run:
            raise CertckptError(
                f"{vault.store}: this vault holds run {existing.get('run')!r}, not {run!r}; use one vault prefix per run"
            ) from None


def _metrics(user: dict[str, str]) -> dict[str, float]:
    out = {}
    for k, v in user.items():
        try:
            f = float(v)
        except ValueError:
            continue
        if math.isfinite(f):
            out[k] = f
    return out


def promote(
    run: str,
    vault: str,
    *,
    ckpts: Sequence[str] | None = None,
    lock_mode: str = "auto",
    retain_days: float = 30.0,
    progress: Progress | None = None,
) -> list[Promotion]:
    """Copy trusted checkpoints of a run store into a vault, with the evidence that certifies them.

    Args:
        run: the run store's path or URL.
        vault: the vault's path or URL (one per run).
        ckpts: checkpoint ids to promote; default every trusted checkpoint the vault lacks.
        lock_mode: S3 Object Lock mode: ``auto`` (GOVERNANCE when the bucket has Object Lock),
            ``none``, ``GOVERNANCE`` or ``COMPLIANCE`` (the last two require Object Lock).
        retain_days: Object Lock retention from now.
        progress: ``progress(done, total)`` during each copy.

    Raises:
        UntrustedCheckpointError: a requested checkpoint is not trusted (nothing copied for it).
        CheckpointExistsError: the vault holds different content under a promoted name.
    """
    site = open_vault(vault, create=True)
    put_options = _lock_options(site, lock_mode, retain_days)
    source = Ledger(run)
    status = certify_store(run)
    cert, snap = status.certification, status.snapshot
    dest = Ledger(vault)
    try:
        held = dest.snapshot().holdings
    except CheckpointNotFoundError:  # a new vault: an S3 prefix exists only once something is in it
        held = {}
    if ckpts is None:
        chosen = [c for c in reversed(cert.order) if snap.available(c) and c not in held]
    else:
        chosen = list(dict.fromkeys(ckpts))
        for cid in chosen:
            if cid not in snap.records:
                raise CheckpointNotFoundError(f"{run}: no committed checkpoint {cid!r} (see `certckpt status {run}`)")
            v = cert.verdicts[cid]
            if not v.trusted:
                raise UntrustedCheckpointError(f"{cid} is suspect ({', '.join(v.reasons)}); only trusted checkpoints enter the vault")
            if not snap.available(cid):
                raise CheckpointNotFoundError(f"{run}: {cid} is no longer held there (pruned)")
    if not chosen and not held:
        return []
    runs = {snap.records[c].get("run") for c in chosen or held if c in snap.records}
    _claim(dest, runs.pop() if len(runs) == 1 else None, run)
    # Always bring the evidence up to date, even with nothing new to copy: a revocation or a
    # detection recorded since the last promotion must reach the vault's verdicts.
    _mirror(source, dest, chosen)
    if not chosen:
        certify_store(vault)
        return []
    # The vault must reach the same verdict from the evidence it now holds, without the run store.
    vcert = certify_store(vault, write_certificates=False).certification
    out = []
    for cid in chosen:
        entry = status.entry(cid)
        rec = snap.records[cid]
        if not vcert.verdicts.get(cid) or not vcert.verdicts[cid].trusted:
            raise UntrustedCheckpointError(f"{cid}: the evidence copied to {vault} does not certify it; not promoted")
        name = f"{cid}.safetensors"
        url = join(vault, name)
        if not site.local:
            # A remote name is write-once (and may be locked): check the source before it can land
            # there. Local copies are verified before they are published, so a second read is waste.
            problem = check_file(entry.url, rec.get("header_digest"))
            if problem:
                raise CorruptCheckpointError(f"{cid}: the run's copy does not verify now ({problem}); not promoted")
        t0 = time.perf_counter()
        written, nbytes = copy_once(entry.url, url, header_digest=rec.get("header_digest"), put_options=put_options, progress=progress)
        seconds = time.perf_counter() - t0
        lock = _lock_of(site, url)
        v = cert.verdicts[cid]
        dest.record_holding({
            "ckpt_id": cid, "url": name, "run": rec.get("run"), "branch": rec["branch"], "step": rec["step"],
            "header_digest": rec.get("header_digest"), "state_fp": rec.get("state_fp"), "bytes": nbytes,
            "source": entry.url, "certificate": {"verdict": v.label, "reasons": list(v.reasons)},
            "lock": lock, "metrics": _metrics(inspect(url).record.user),
        })
        out.append(Promotion(ckpt_id=cid, url=url, written=written, nbytes=nbytes, seconds=seconds, lock=lock))
    certify_store(vault)  # the vault's own certificates for what it now holds
    return out


# --- list ----------------------------------------------------------------------------------------


def holdings(vault: str) -> tuple[StoreStatus, list[dict[str, Any]]]:
    """Every checkpoint the vault holds or held, with its verdict now."""
    open_vault(vault)
    status = certify_store(vault, write_certificates=False)
    snap, cert = status.snapshot, status.certification
    rows = []
    for cid, h in sorted(snap.holdings.items(), key=lambda kv: (kv[1]["branch"] != "main", kv[1]["branch"], kv[1]["step"])):
        v = cert.verdicts.get(cid)
        rows.append({
            "ckpt_id": cid, "branch": h["branch"], "step": h["step"], "url": join(vault, h["url"]), "bytes": h.get("bytes"),
            "verdict": v.label if v else "suspect", "reasons": list(v.reasons) if v else ["uncommitted"],
            "latest_good": cid == cert.latest_good, "pruned": cid in snap.retired, "lock": h.get("lock"), "metrics": h.get("metrics", {}),
        })
    return status, rows


# --- prune ---------------------------------------------------------------------------------------


def prune(vault: str, policy: RetentionPolicy, *, apply: bool = False, now: float | None = None) -> PruneResult:
    """Plan (and with ``apply``, carry out) the deletions a retention policy allows.

    Latest-good, the rollback target before every open suspect interval, and everything while an
    incident is open are kept whatever the policy says. A deletion the store refuses (an Object
    Lock retention that has not expired) is reported, and the checkpoint stays held.
    """
    site = open_vault(vault)
    now = time.time() if now is None else now
    status, _ = find_latest_good(vault, verify_bytes=False, write_certificates=False)
    snap, cert = status.snapshot, status.certification
    live = [cid for cid in snap.holdings if snap.available(cid)]
    latest = next((c for c in cert.order if snap.available(c)), None)
    entries = [
        RetentionEntry(
            ckpt_id=cid, branch=snap.holdings[cid]["branch"], step=snap.holdings[cid]["step"],
            trusted=cert.verdicts[cid].trusted if cid in cert.verdicts else False,
            committed_at=snap.records.get(cid, {}).get("committed_at", 0.0), metrics=snap.holdings[cid].get("metrics", {}),
        )
        for cid in live
    ]
    intervals = [(d.branch, d.interval[0], d.interval[1]) for d in cert.detections if d.interval is not None]
    protected = protected_checkpoints(entries, latest_good=latest, intervals=intervals, branch_parents=snap.branch_parents)
    plan = plan_prune(entries, policy, now=now, protected=protected, open_incidents=snap.open_incidents())
    result = PruneResult(policy=str(policy), plan=plan, applied=apply)
    if not apply:
        return result
    ledger = Ledger(vault)
    for cid in plan.delete:
        url = join(vault, snap.holdings[cid]["url"])
        refused = _delete(site, url)
        if refused:
            result.refused[cid] = refused
            continue
        ledger.retire(cid, reason="no retention policy keeps it", policy=str(policy))
        result.deleted.append(cid)
    return result


def _delete(site: VaultSite, url: str) -> str | None:
    """Delete a vaulted file; returns why the store refused, or None when it is gone."""
    target = resolve(url)
    if target.local is not None:
        try:
            os.unlink(target.local)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot delete ({e.strerror or e})"
        return None
    fs, path = filesystem(url)
    if not site.versioned:
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as e:
            return remote_error_text(e)
        return None
    # A versioned (Object Lock) bucket: deleting the key only hides it behind a delete marker and
    # frees nothing; delete each version, which the server refuses while its retention holds.
    bucket, key = path.split("/", 1)
    try:
        listing = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=key)
        versions = [v for v in listing.get("Versions", []) + listing.get("DeleteMarkers", []) if v["Key"] == key]
        for v in versions:
            try:
                fs.call_s3("delete_object", Bucket=bucket, Key=key, VersionId=v["VersionId"])
            except PermissionError:
                head = fs.call_s3("head_object", Bucket=bucket, Key=key, VersionId=v["VersionId"])
                until = head.get("ObjectLockRetainUntilDate")
                return f"Object Lock {head.get('ObjectLockMode', '')} retention until {until.isoformat() if until else '?'}".replace("  ", " ")
    except Exception as e:
        return remote_error_text(e)
    fs.invalidate_cache(path)
    return None


# --- restore -------------------------------------------------------------------------------------


def restore(
    vault: str,
    ckpt: str,
    dest: str,
    *,
    allow_suspect: bool = False,
    progress: Progress | None = None,
) -> Restore:
    """Copy a vaulted checkpoint to ``dest`` (a file, or a directory to put it in) and verify it.

    Args:
        ckpt: a checkpoint id, or ``latest-good``.
        allow_suspect: restore a checkpoint that is suspect now (revoked since), for investigation.

    Raises:
        CheckpointNotFoundError: the vault does not hold it (never promoted, or pruned).
        UntrustedCheckpointError: it is suspect now and ``allow_suspect`` was not given.
        CheckpointExistsError: ``dest`` already holds something else (nothing is overwritten).
    """
    open_vault(vault)
    if ckpt == "latest-good":
        status, chosen = find_latest_good(vault, write_certificates=False)
        if chosen is None:
            raise CheckpointNotFoundError(f"{vault}: holds no trusted checkpoint to restore (see `certckpt vault ls {vault}`)")
        ckpt = chosen
    else:
        status = certify_store(vault, write_certificates=False)
    snap, cert = status.snapshot, status.certification
    if ckpt not in snap.holdings:
        raise CheckpointNotFoundError(f"{vault}: holds no checkpoint {ckpt!r} (see `certckpt vault ls {vault}`)")
    if ckpt in snap.retired:
        raise CheckpointNotFoundError(f"{vault}: {ckpt} was pruned ({snap.retired[ckpt].get('policy', '')})")
    v = cert.verdicts.get(ckpt)
    if not (v and v.trusted) and not allow_suspect:
        raise UntrustedCheckpointError(
            f"{ckpt} is suspect now ({', '.join(v.reasons) if v else 'uncommitted'}); pass allow_suspect=True "
            "(--allow-suspect) to restore it for investigation"
        )
    h = snap.holdings[ckpt]
    src = join(vault, h["url"])
    target = resolve(dest)
    into_dir = dest.endswith("/") or (target.local is not None and os.path.isdir(target.local))
    final = join(dest, h["url"]) if into_dir else dest
    t0 = time.perf_counter()
    written, nbytes = copy_once(src, final, header_digest=h.get("header_digest"), read_only=False, progress=progress)
    return Restore(ckpt_id=ckpt, source=src, dest=final, nbytes=nbytes, seconds=time.perf_counter() - t0, written=written)
