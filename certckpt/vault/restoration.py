"""Restore: copy a vaulted checkpoint (or latest-good) back out of the vault, verified, never over other content.

A checkpoint that is suspect now (revoked since it was vaulted) is refused unless asked for explicitly.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, UntrustedCheckpointError
from certckpt.storage import join, resolve, storage_for
from certckpt.trust.certify import Level, accept_level
from certckpt.trust.runstore import certify_store, find_latest_good

from .bundles import Bundle, bundle_of
from .site import open_vault
from .transfer import Progress, copy_bundle, copy_once, whole_of

__all__ = ["Restore", "restore"]


@dataclass(kw_only=True, slots=True)
class Restore:
    """One checkpoint restored from a vault.

    Attributes:
        dest: the restored file's path or URL (a sharded checkpoint: its directory; a file with
            companions: that file, its companions beside it).
        written: False when ``dest`` already held a verified copy of the same checkpoint.
    """

    ckpt_id: str
    source: str
    dest: str
    nbytes: int
    seconds: float
    written: bool = True

    @property
    def bytes_per_s(self) -> float:
        # a clock tick as the floor: an instant copy still has a finite rate that JSON can carry
        return self.nbytes / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ckpt_id": self.ckpt_id,
            "source": self.source,
            "dest": self.dest,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 4),
            "bytes_per_s": round(self.bytes_per_s),
            "written": self.written,
        }


def restore(
    vault: str,
    ckpt: str,
    dest: str,
    *,
    allow_suspect: bool = False,
    progress: Progress | None = None,
    accept: str | Level = Level.TRUSTED,
) -> Restore:
    """Copy a vaulted checkpoint to ``dest`` (a file, or a directory to put it in) and verify it.

    A sharded checkpoint or a file with companions is a directory: ``dest`` is that directory, or an
    existing directory (or one ending in ``/``) to put ``<ckpt_id>/`` in; every member is copied and
    verified, the manifest or listing file last, and the restored whole is checked as committed.

    Args:
        ckpt: a checkpoint id, or ``latest-good``.
        allow_suspect: restore a checkpoint that is suspect now (revoked since), for investigation.
        accept: ``"trusted"`` (default) or ``"verified"``: also restore a verified checkpoint (a
            vault promoted with ``accept="verified"``), and let ``latest-good`` answer one when no
            trusted checkpoint is held.

    Raises:
        CheckpointNotFoundError: the vault does not hold it (never promoted, or pruned).
        UntrustedCheckpointError: it is suspect now and ``allow_suspect`` was not given.
        CheckpointExistsError: ``dest`` already holds something else (nothing is overwritten).
    """
    level = accept_level(accept)
    open_vault(vault)
    if ckpt == "latest-good":
        status, chosen = find_latest_good(vault, write_certificates=False, accept=level)
        if chosen is None:
            hint = "" if level is Level.VERIFIED else "; `--accept verified` also takes a verified one"
            raise CheckpointNotFoundError(
                f"{vault}: holds no trusted checkpoint to restore (see `certckpt vault ls {vault}`){hint}"
            )
        ckpt = chosen
    else:
        status = certify_store(vault, write_certificates=False)
    snap, cert = status.snapshot, status.certification
    if ckpt not in snap.holdings:
        raise CheckpointNotFoundError(f"{vault}: holds no checkpoint {ckpt!r} (see `certckpt vault ls {vault}`)")
    if ckpt in snap.retired:
        raise CheckpointNotFoundError(f"{vault}: {ckpt} was pruned ({snap.retired[ckpt].get('policy', '')})")
    v = cert.verdicts.get(ckpt)
    if not (v and v.level.rank >= level.rank) and not allow_suspect:
        if v is not None and v.verified:
            raise UntrustedCheckpointError(
                f"{ckpt} is verified, not trusted (no audit evidence: {', '.join(v.reasons)}); pass "
                "accept='verified' (--accept verified) to restore it"
            )
        raise UntrustedCheckpointError(
            f"{ckpt} is suspect now ({', '.join(v.reasons) if v else 'uncommitted'}); pass allow_suspect=True "
            "(--allow-suspect) to restore it for investigation"
        )
    h = snap.holdings[ckpt]
    src = join(vault, h["url"])
    target = resolve(dest)
    into_dir = dest.endswith("/") or (target.local is not None and os.path.isdir(target.local))
    t0 = time.perf_counter()
    if h["url"] == f"{ckpt}.safetensors":
        final = join(dest, h["url"]) if into_dir else dest
        written, nbytes = copy_once(
            src,
            final,
            header_digest=h.get("header_digest"),
            read_only=False,
            progress=progress,
            trusted_keys=snap.trusted_keys,  # keys: the signed data digest (BLAKE3, older SHA-256), not xxh3 alone
        )
    else:
        # A held directory: DEST is the checkpoint's directory (or, an existing directory, where
        # to put ``<ckpt_id>/``). The held manifest or listing file says what to copy only once it
        # is the committed one; members first, it last, then the restored whole is checked.
        directory = join(dest.rstrip("/"), ckpt) if into_dir else dest.rstrip("/")
        bundle = bundle_of(src, header_digest=h.get("header_digest"))
        _refuse_other_files(directory, bundle)
        written, nbytes = copy_bundle(
            bundle,
            directory,
            header_digest=h.get("header_digest"),
            committed=snap.records.get(ckpt),
            read_only=False,
            progress=progress,
            trusted_keys=snap.trusted_keys,
        )
        final = whole_of(bundle, directory)
    return Restore(
        ckpt_id=ckpt, source=src, dest=final, nbytes=nbytes, seconds=time.perf_counter() - t0, written=written
    )


def _refuse_other_files(directory: str, bundle: Bundle) -> None:
    """A checkpoint directory is restored only where nothing else is (what is there must be its own
    files: a restore cut short is resumed; anything else would be taken for part of it, or refused)."""
    storage = storage_for(directory)
    here = storage.stat("")
    if here is None:
        return
    if here.kind != "directory":
        raise CheckpointExistsError(f"{directory}: {here.what or 'a file'} is there; nothing was overwritten")
    names = {e.name.rsplit("/", 1)[-1] for e in storage.listdir()} - {""}
    names = {n for n in names if not n.startswith(".")}  # a restore's own temp files
    other = sorted(names - {m.name for m in bundle.members} - {bundle.marker})
    if other:
        raise CheckpointExistsError(
            f"{directory}: holds other files ({', '.join(other[:3])}{' ...' if len(other) > 3 else ''}); restore "
            "a checkpoint directory into an empty place — nothing was overwritten"
        )
