"""Promotion: trusted checkpoints of a run enter the vault with the evidence that certifies them; and
``holdings``, what the vault holds with its verdicts now.

The vault's ledger mirrors the run's evidence, so the vault re-derives every verdict without the run
store; a checkpoint is held once its holding record exists, written only after its copy verified.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    NotACheckpointError,
    UntrustedCheckpointError,
)
from certckpt.format.sharded.layout import MANIFEST_NAME
from certckpt.format.signing import SigningKey, TrustedKeys, signing_key_from_env
from certckpt.format.trustconfig import TrustConfig, trust_config_for
from certckpt.format.verify import inspect
from certckpt.storage import LockRequest, join, resolve
from certckpt.trust.certify import Level, accept_level
from certckpt.trust.chain import CHAINS_DIR
from certckpt.trust.ledger import VAULT_MARK, Ledger
from certckpt.trust.runstore import StoreStatus, certify_store, check_file
from certckpt.trust.snapshot import SOURCES_DIR

from .bundles import Bundle, bundle_of, describe, held_name
from .site import lock_of, lock_options, open_vault, versions_of
from .transfer import Progress, copy_bundle, copy_once, repair_bundle, repair_copy

__all__ = ["Promotion", "holdings", "promote", "unsigned_vault_problem"]

_MIRRORED = ("checkpoints", "branches", "events", "revocations", "incidents", "placements")  # as MIRRORED_KINDS


@dataclass(kw_only=True, slots=True)
class Promotion:
    """One checkpoint promoted (or found already promoted)."""

    ckpt_id: str
    url: str
    written: bool
    nbytes: int
    seconds: float
    lock: dict[str, Any] | None = None
    repaired: str | None = None  # why the vault's copy was replaced (``repair=True``), else None

    @property
    def bytes_per_s(self) -> float:
        # a clock tick as the floor: an instant copy still has a finite rate that JSON can carry
        return self.nbytes / max(self.seconds, 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ckpt_id": self.ckpt_id,
            "url": self.url,
            "written": self.written,
            "repaired": self.repaired,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 4),
            "bytes_per_s": round(self.bytes_per_s),
            "lock": self.lock,
        }


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
    # The run's chain entries after the records they seal (a reader meanwhile finds records nothing
    # seals yet, which count for nothing): the vault re-proves the run's evidence, gaps included.
    for writer, names in src.chain_listing().items():
        have = set(dst.list_raw(f"{CHAINS_DIR}/{writer}"))
        want = [n for n in names if n not in have]
        for name, data in src.read_raw(f"{CHAINS_DIR}/{writer}", want).items():
            written += dst.put_raw(f"{CHAINS_DIR}/{writer}", name, data)
    return written


def _check_pinned_source(vault: Ledger, source: str, store_id: str | None) -> None:
    """The vault pinned its source run store's identity (its mark): a store re-created at the same URL
    is another store, whose records this vault must never mix with the ones it holds."""
    raw = vault.read_raw("", [VAULT_MARK]).get(VAULT_MARK) if VAULT_MARK in vault.list_raw("") else None
    try:
        existing = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        existing = None
    pinned = existing.get("source_store") if isinstance(existing, dict) else None
    if pinned is not None and pinned != store_id:
        assert isinstance(existing, dict)  # pinned came from it
        if existing.get("source") != source:
            raise CertckptError(
                f"{vault.store}: this vault holds run {existing.get('run')!r} (run store {str(pinned)[:32]}); "
                f"{source} is another run store: use one vault prefix per run"
            )
        raise CertckptError(
            f"{vault.store}: this vault holds run store {str(pinned)[:32]}, and {source} is now another store "
            f"({store_id or 'unchained'}): deleted and re-created? promote it into a new vault"
        )


def _claim(vault: Ledger, run: str | None, source: str, run_ledger: Ledger, *, sealed: bool) -> None:
    """Tie the vault to one run (checkpoint ids are only unique within a run).

    ``sealed``: the vault's snapshot found its mark sealed by its own chain in an entry that counts.
    Then nothing is written when the mark is already there: sealing it again would start one more
    writer chain per promoting process (kept for good under Object Lock), an hourly promote with
    nothing new 8,760 a year. A mark whose seal does not count (none, a broken chain, a writer the
    trusted keys do not authenticate) is sealed again by this promoter, as before."""
    local = resolve(source).local
    if local is not None:
        source = os.path.abspath(local)
    mark = {"kind": "certckpt-vault", "run": run, "source": source}
    _check_pinned_source(vault, source, run_ledger.store_id if run_ledger.chained() else None)
    genesis = run_ledger.genesis_bytes() if run_ledger.chained() else None
    if genesis is not None:
        # the run's identity: its chains' entries are accepted here, and no other store's
        mark["source_store"] = run_ledger.store_id
        vault.put_raw(SOURCES_DIR, f"{run_ledger.store_id}.json", genesis)
    try:
        vault.put_raw("", VAULT_MARK, (json.dumps(mark, sort_keys=True) + "\n").encode(), seal=not sealed)
    except CheckpointExistsError:
        existing = json.loads(vault.read_raw("", [VAULT_MARK])[VAULT_MARK])
        if existing.get("run") != run:
            raise CertckptError(
                f"{vault.store}: this vault holds run {existing.get('run')!r}, not {run!r}; "
                "use one vault prefix per run"
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


def unsigned_vault_problem(vault: str, trusted: TrustedKeys | None, signing: SigningKey | None) -> str | None:
    """Why a promotion under ``trusted`` keys would certify nothing (checked before anything is
    copied), or None. The vault's own records (its mark, its holdings, its chain) are written by the
    promoter: unsigned, or signed by a key the trusted keys do not list, they count for nothing under
    those keys, so the vault could never certify what it holds."""
    if trusted is None:
        return None
    if signing is None:
        return (
            f"{vault}: trusted keys are configured (CERTCKPT_TRUSTED_KEYS) but no signing key: the vault's own"
            " records would be unsigned, and under trusted keys an unsigned record certifies nothing, so no"
            " checkpoint could be promoted; set CERTCKPT_SIGNING_KEY (a key the trusted keys list) for the"
            " promoter. Nothing was copied"
        )
    if signing.key_id not in trusted.keys:
        return (
            f"{vault}: the signing key (CERTCKPT_SIGNING_KEY, key {signing.key_id}) is not among the trusted keys"
            " (CERTCKPT_TRUSTED_KEYS): the vault's own records would certify nothing under them; sign with a"
            " trusted key, or add its public half to the trusted keys. Nothing was copied"
        )
    return None


def promote(
    run: str,
    vault: str,
    *,
    ckpts: Sequence[str] | None = None,
    lock_mode: str = "auto",
    retain_days: float = 30.0,
    progress: Progress | None = None,
    accept: str | Level = Level.TRUSTED,
    repair: bool = False,
    trust: TrustConfig | None = None,
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
        accept: ``"trusted"`` (default) or ``"verified"``: also promote verified checkpoints (a
            run without the auditor); the vault records and shows which level each one reached.
        repair: also re-read every copy the vault holds and replace each damaged or missing one
            from the run's copy, when that one verifies (``prune`` names such copies).
        trust: the reader's keys and memory for both stores (default ``TrustConfig.from_env()``).

    Raises:
        ConfigurationError: trusted keys are configured and the promoter has no signing key among
            them (``$CERTCKPT_SIGNING_KEY``): the vault's records would certify nothing (nothing copied).
        UntrustedCheckpointError: a requested checkpoint is below ``accept`` (nothing copied for it).
        CheckpointExistsError: the vault holds different content under a promoted name.
    """
    level = accept_level(accept)
    trust = trust_config_for(trust)
    unsigned = unsigned_vault_problem(vault, trust.trusted_keys, signing_key_from_env())
    if unsigned is not None:
        raise ConfigurationError(unsigned)
    site = open_vault(vault, create=True)
    put_options = lock_options(site, mode=lock_mode, retain_days=retain_days)
    source = Ledger(run, trust=trust)
    status = certify_store(run, trust=trust)
    cert, snap = status.certification, status.snapshot
    dest = Ledger(vault, chain=source.chained(), trust=trust)  # a run's vault is chained exactly when the run is
    try:
        before = dest.snapshot()
        held, mark_sealed = before.holdings, before.mark_sealed
    except CheckpointNotFoundError:  # a new vault: an S3 prefix exists only once something is in it
        held, mark_sealed = {}, False
    if ckpts is None:
        chosen = [c for c in reversed(cert.candidates(level)) if snap.available(c) and c not in held]
    else:
        chosen = list(dict.fromkeys(ckpts))
        for cid in chosen:
            if cid not in snap.records:
                raise CheckpointNotFoundError(f"{run}: no committed checkpoint {cid!r} (see `certckpt status {run}`)")
            v = cert.verdicts[cid]
            if v.level.rank < level.rank:
                hint = "; `--accept verified` takes it" if v.verified else ""
                raise UntrustedCheckpointError(
                    f"{cid} is {v.label} ({', '.join(v.reasons)}); only {level.value} checkpoints"
                    f"{' or better' if level is Level.VERIFIED else ''} enter the vault{hint}"
                )
            if not snap.available(cid):
                raise CheckpointNotFoundError(f"{run}: {cid} is no longer held there (pruned)")
    repaired = _repair(source, status, vault, held, put_options) if repair else []
    if not chosen and not held:
        return repaired
    runs = {snap.records[c].get("run") for c in chosen or held if c in snap.records}
    _claim(dest, runs.pop() if len(runs) == 1 else None, run, source, sealed=mark_sealed)
    # Always bring the evidence up to date, even with nothing new to copy: a revocation or a
    # detection recorded since the last promotion must reach the vault's verdicts.
    _mirror(source, dest, chosen)
    if not chosen:
        certify_store(vault, trust=trust)
        return repaired
    # The vault must reach the same verdict from the evidence it now holds, without the run store.
    vcert = certify_store(vault, write_certificates=False, trust=trust).certification
    out = []
    for cid in chosen:
        entry = status.entry(cid)
        rec = snap.records[cid]
        if not vcert.verdicts.get(cid) or vcert.verdicts[cid].level.rank < level.rank:
            raise UntrustedCheckpointError(f"{cid}: the evidence copied to {vault} does not certify it; not promoted")
        bundle = _source_bundle(cid, entry.url, rec.get("header_digest"))
        name = held_name(cid, bundle)
        url = join(vault, name)
        if not site.local:
            # A remote name is write-once (and may be locked): check the source before it can land
            # there. Local copies are verified before they are published, so a second read is waste.
            problem = check_file(entry.url, rec.get("header_digest"), trusted_keys=source.trusted_keys)
            if problem:
                raise CorruptCheckpointError(f"{cid}: the run's copy does not verify now ({problem}); not promoted")
        t0 = time.perf_counter()
        if bundle.kind == "file":
            written, nbytes = copy_once(
                entry.url,
                url,
                header_digest=rec.get("header_digest"),
                put_options=put_options,
                progress=progress,
                trusted_keys=source.trusted_keys,
            )
        else:  # every member first, the manifest or listing file last, then the whole copy checked
            written, nbytes = copy_bundle(
                bundle,
                join(vault, cid),
                header_digest=rec.get("header_digest"),
                committed=rec,
                put_options=put_options,
                progress=progress,
                trusted_keys=source.trusted_keys,
            )
        seconds = time.perf_counter() - t0
        marker = join(vault, cid, MANIFEST_NAME) if bundle.kind == "sharded" else url
        lock = lock_of(site, marker)
        v = cert.verdicts[cid]
        dest.record_holding(
            {
                "ckpt_id": cid,
                "url": name,
                "run": rec.get("run"),
                "branch": rec["branch"],
                "step": rec["step"],
                "header_digest": rec.get("header_digest"),
                "state_fp": rec.get("state_fp"),
                "bytes": nbytes,
                "source": entry.url,
                "certificate": {"verdict": v.label, "reasons": list(v.reasons)},
                "lock": lock,
                "metrics": _metrics(inspect(marker).record.user),
                **({} if bundle.kind == "file" else {"layout": describe(bundle)}),
            }
        )
        out.append(Promotion(ckpt_id=cid, url=url, written=written, nbytes=nbytes, seconds=seconds, lock=lock))
    certify_store(vault, trust=trust)  # the vault's own certificates for what it now holds
    return repaired + out


def marker_url(vault: str, holding: dict[str, Any]) -> str:
    """The held file that commits a holding: the file itself, or a held directory's manifest (its
    Object Lock and versions stand for the whole copy, which was written before it)."""
    if holding["url"] == holding["ckpt_id"]:
        return join(vault, holding["url"], MANIFEST_NAME)
    return join(vault, holding["url"])


def _source_bundle(cid: str, url: str, header_digest: str | None) -> Bundle:
    """The run's checkpoint as files to copy (one file, a sharded directory, or a file with companions)."""
    try:
        return bundle_of(url, header_digest=header_digest)
    except (CorruptCheckpointError, NotACheckpointError) as e:  # missing or unreadable: their own error
        raise CorruptCheckpointError(f"{cid}: the run's copy is not as committed ({e}); not promoted") from e


def _repair(
    source: Ledger, status: StoreStatus, vault: str, held: dict[str, dict[str, Any]], put_options: LockRequest | None
) -> list[Promotion]:
    """Replace each held copy that no longer verifies with the run's copy (checked first)."""
    snap = status.snapshot
    out = []
    for cid, h in sorted(held.items()):
        url = join(vault, h["url"])
        problem = check_file(url, h.get("header_digest"), trusted_keys=source.trusted_keys)
        if problem is None:
            continue
        if cid not in snap.records or not snap.available(cid):
            raise CorruptCheckpointError(
                f"{cid}: the vault's copy is damaged ({problem}) and {source.store} no longer holds it; "
                "restore it from another vault or a backup"
            )
        t0 = time.perf_counter()
        src = status.entry(cid).url
        if h["url"] == f"{cid}.safetensors":
            nbytes = repair_copy(
                src,
                url,
                header_digest=h.get("header_digest"),
                put_options=put_options,
                trusted_keys=source.trusted_keys,
            )
        else:  # a held directory: only its damaged or missing files, members first, the marker last
            nbytes = repair_bundle(
                _source_bundle(cid, src, h.get("header_digest")),
                join(vault, cid),
                header_digest=h.get("header_digest"),
                put_options=put_options,
                trusted_keys=source.trusted_keys,
            )
        out.append(
            Promotion(
                ckpt_id=cid,
                url=url,
                written=True,
                nbytes=nbytes,
                seconds=time.perf_counter() - t0,
                lock=lock_of(open_vault(vault), marker_url(vault, h)),
                repaired=problem,
            )
        )
    return out


def holdings(
    vault: str, *, verify: bool = False, trust: TrustConfig | None = None
) -> tuple[StoreStatus, list[dict[str, Any]]]:
    """Every checkpoint the vault holds or held, with its verdict now.

    Args:
        verify: also re-read every held copy (``"copy"``: ``"ok"`` or what is wrong) and, on a
            versioned S3 bucket, count each copy's versions and delete markers (``"versions"``).
    """
    site = open_vault(vault)
    status = certify_store(vault, write_certificates=False, trust=trust)
    snap, cert = status.snapshot, status.certification
    rows = []
    order = sorted(snap.holdings.items(), key=lambda kv: (kv[1]["branch"] != "main", kv[1]["branch"], kv[1]["step"]))
    for cid, h in order:
        v = cert.verdicts.get(cid)
        rows.append(
            {
                "ckpt_id": cid,
                "branch": h["branch"],
                "step": h["step"],
                "url": join(vault, h["url"]),
                "bytes": h.get("bytes"),
                "verdict": v.label if v else "suspect",
                "reasons": list(v.reasons) if v else ["uncommitted"],
                "latest_good": cid == cert.latest_good,
                "pruned": cid in snap.retired,
                "lock": h.get("lock"),
                "metrics": h.get("metrics", {}),
            }
        )
        if verify and cid not in snap.retired:
            url = rows[-1]["url"]
            problem = check_file(url, h.get("header_digest"), trusted_keys=snap.trusted_keys)
            if problem and h["url"] != f"{cid}.safetensors" and "/" in h["url"] and h["url"] not in problem:
                problem = f"{url}: {problem}"  # a held directory: say which of its files is wrong
            rows[-1]["copy"] = problem or "ok"
            rows[-1]["versions"] = versions_of(site, marker_url(vault, h))
    return status, rows
