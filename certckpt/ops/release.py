"""Releases: a certified checkpoint's model as plain safetensors, signed twice.

``make_release`` writes, into a new directory:

- ``model.safetensors``: the checkpoint's model tensors (its ``model`` entry, or ``--part``), a plain
  safetensors file that ``safetensors``/``from_pretrained`` load without certckpt; extra files the
  user names (a ``config.json``) beside it;
- ``model.sig``: an OpenSSF ``model_signing`` signature (Sigstore bundle, key-based, made by the
  ``model_signing`` package itself) over every file of the directory but the two signatures;
- ``certckpt-certificate.dsse.json``: certckpt's certificate (``release_cert``) binding the same
  files' SHA-256 and that very ``model.sig`` to the verdict, lineage, coverage and ledger position.

``verify_release`` checks all of it against one trusted public key. See docs/release.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    MissingDependencyError,
    ReleaseVerificationError,
    UntrustedCheckpointError,
)
from certckpt.format.companions import companion_listing
from certckpt.storage import LEDGER_DIR, storage_for
from certckpt.trust.certify import Level, accept_level
from certckpt.trust.coverage import lineage_of, parents_of
from certckpt.trust.runstore import StoreStatus, certify_store, check_file, find_latest_good
from certckpt.version import __version__

from .release_cert import (
    CERTIFICATE_NAME,
    SIGNATURE_NAME,
    check_statement,
    key_hint,
    load_private_key,
    load_public_key,
    open_envelope,
    sign_envelope,
    statement,
)
from .release_shapes import PrivateCopy, private_copy, released_model

__all__ = ["Release", "ReleaseCheck", "make_release", "verify_release", "MODEL_NAME"]

MODEL_NAME = "model.safetensors"
MAX_CERTIFICATE_BYTES = 16 << 20  # a lineage of thousands of checkpoints is well under 1 MB
_RANK = {"trusted": 2, "verified": 1}
_MODEL_SIGNING = "https://model_signing/signature/v1.0"


@dataclass(frozen=True, kw_only=True, slots=True)
class Release:
    """What ``make_release`` wrote.

    Attributes:
        directory: the release directory.
        ckpt_id: the checkpoint released.
        level: its verdict (``trusted`` or, when accepted, ``verified``).
        files: the model files with their SHA-256 (what both signatures cover).
        key_id: SHA-256 of the public key's PEM (what ``model_signing`` records as its hint).
    """

    directory: str
    ckpt_id: str
    level: str
    files: dict[str, str]
    key_id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleaseCheck:
    """What ``verify_release`` proved: ``files`` are the signed ones, and the certificate says."""

    directory: str
    ckpt_id: str
    level: str
    reasons: list[str]
    files: dict[str, str]
    coverage: str = ""
    predicate: dict[str, Any] = field(default_factory=dict)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _model_signing() -> Any:
    try:
        import model_signing  # optional: the `release` extra
    except ImportError as e:
        raise MissingDependencyError(
            f"releases are signed with OpenSSF model_signing: pip install 'certckpt[release]' ({e})"
        ) from e
    return model_signing


def is_run_store(location: str) -> bool:
    """Whether the directory or prefix ``location`` (a path or URL) holds a ledger."""
    if "://" not in location:
        return os.path.isdir(os.path.join(location, LEDGER_DIR))
    return not location.endswith(".safetensors") and storage_for(location).exists(LEDGER_DIR)


def enclosing_store(path: str) -> str | None:
    """The run store holding a checkpoint file or directory (a path or URL): the nearest directory or
    prefix (up to 3 up) with a ledger."""
    remote = "://" in path
    here = path.rstrip("/") if remote else os.path.abspath(path)
    for _ in range(3):
        up = here.rsplit("/", 1)[0] if remote else os.path.dirname(here)
        if up == here or (remote and (up.endswith(":/") or "://" not in up)):
            return None  # above the root (a bucket's, or the filesystem's)
        here = up
        if is_run_store(here):
            return here
    return None


def _choose(ckpt: str, store: str | None, level: Level) -> tuple[StoreStatus, str, str | None]:
    """The store's certified status, the checkpoint to release (its bytes are checked on the copy
    that is released) and, when ``ckpt`` named one weight file of a checkpoint directory, that file."""
    if store is None and is_run_store(ckpt):
        status, cid = find_latest_good(ckpt, accept=level, write_certificates=False)
        if cid is None:
            verified = [c for c in status.certification.verified_order if status.snapshot.available(c)]
            why = (
                f"newest verified, without audit evidence: {verified[0]}; `--accept verified` releases it and"
                " its certificate says so"
                if verified and level is Level.TRUSTED
                else f"`certckpt status {ckpt}` says why"
            )
            raise UntrustedCheckpointError(f"{ckpt}: no checkpoint is {level.value} ({why})")
        return status, cid, None
    store = store or enclosing_store(ckpt)
    if store is None:
        raise ConfigurationError(f"{ckpt}: no run store around it; name the store that committed it with --store")
    status = certify_store(store, write_certificates=False)
    for c in status.snapshot.checkpoints:
        member = _names(ckpt, c.ckpt_id, c.url)
        if member is None:
            continue
        v = status.certification.verdicts[c.ckpt_id]
        if v.level.rank < level.rank:
            hint = " (`--accept verified` takes a run without audit evidence)" if v.label == "verified" else ""
            raise UntrustedCheckpointError(
                f"{c.ckpt_id}: {v.label} ({', '.join(v.reasons) or 'no reason'}); a release takes {level.value}{hint}"
            )
        return status, c.ckpt_id, (member if member.endswith(".safetensors") else None)
    raise CheckpointNotFoundError(f"{ckpt}: not a checkpoint committed to {store}")


def _names(ckpt: str, cid: str, url: str) -> str | None:
    """Whether ``ckpt`` (an id, a path or URL) names the checkpoint ``cid`` committed at ``url``:
    None if not; "" for the checkpoint itself (its id, its committed file, its directory); a file
    name for one file its record lists (a Trainer ``checkpoint-N/model.safetensors``)."""
    if ckpt in (cid, url):
        return ""
    if "://" in ckpt or "://" in url:
        return None
    want, have = os.path.abspath(ckpt), os.path.abspath(url)
    if want == have:
        return ""
    here = os.path.dirname(have)
    if os.path.isdir(want):
        # a checkpoint directory (checkpoint-N/): the one file of it whose record lists the others
        listing = companion_listing(want) if want == here else None
        return "" if listing is not None and os.path.abspath(listing[0]) == have else None
    if os.path.dirname(want) != here:
        return None
    listing = companion_listing(here)
    if listing is None or os.path.abspath(listing[0]) != have or os.path.basename(want) not in listing[1]:
        return None
    return os.path.basename(want)


def _checked_copy(status: StoreStatus, cid: str, directory: str) -> PrivateCopy:
    """The checkpoint's bytes (a file, with the files its record lists, or a DCP directory), read
    once into ``directory``, then verified there as the very checkpoint committed (``check_file``):
    what is released is what was checked, whatever happens to the store's files meanwhile (checking
    the store's files, then reading them again, left a window in which someone who can write the
    store could swap in other weights)."""
    copy = private_copy(status.entry(cid).url, directory)
    rec = status.snapshot.records[cid]
    problem = check_file(copy.path, rec.get("header_digest"), committed=rec, trusted_keys=status.snapshot.trusted_keys)
    if problem:
        raise CorruptCheckpointError(copy.shown(problem))
    return copy


def _ledger_position(status: StoreStatus, cid: str) -> dict[str, Any]:
    snap = status.snapshot
    cert = snap.certificates.get(cid)
    return {
        "store": status.store,
        "store_id": snap.store_id,
        "chained": snap.chained,
        "heads": {w: [seq, digest] for w, (seq, digest) in sorted(snap.heads.items())},
        "segments": snap.segments,
        "events": len(snap.events),
        "breaks": len(snap.breaks),
        "certificate": {k: cert.get(k) for k in ("verdict", "reasons", "at") if k in cert} if cert else None,
    }


def _predicate(status: StoreStatus, cid: str, *, accept: Level, signature: dict[str, Any]) -> dict[str, Any]:
    snap, cert = status.snapshot, status.certification
    rec, v = snap.records[cid], cert.verdicts[cid]
    cov = status.coverage()[cid]
    by_id = {c.ckpt_id: c for c in snap.checkpoints}
    chain = lineage_of(cid, parents_of(snap.checkpoints, snap.branch_parents))
    audited = v.trusted and cov.audited
    return {
        "verdict": {
            "level": v.label,
            "reasons": list(v.reasons),
            "accepted": accept.value,
            "audited": audited,
            **(
                {}
                if audited
                else {"note": "no audit evidence: bytes and records verified, the computation was never replayed"}
            ),
        },
        "checkpoint": {
            "ckpt_id": cid,
            "run": rec.get("run"),
            "branch": by_id[cid].branch,
            "step": by_id[cid].step,
            "step_range": rec.get("step_range"),
            "state_fp": rec.get("state_fp"),
            "consensus_fp": rec.get("consensus_fp"),
            "header_digest": rec.get("header_digest"),
        },
        "consensus_fp": rec.get("consensus_fp"),
        "lineage": {
            "run": rec.get("run"),
            "branch": by_id[cid].branch,
            "steps": [0, by_id[cid].step],
            "parents": [
                {"ckpt_id": x, "branch": by_id[x].branch, "step": by_id[x].step, "verdict": cert.verdicts[x].label}
                for x in chain[1:]
            ],
            "branch_parents": dict(sorted(snap.branch_parents.items())),
        },
        "coverage": cov.to_json(),
        "ledger": _ledger_position(status, cid),
        "model_signature": signature,
        "issued": {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": f"certckpt {__version__}"},
    }


def _signature_facts(sig_path: str, key: Any) -> dict[str, Any]:
    """What the certificate records of ``model.sig``: its SHA-256 and the root digest it signs."""
    with open(sig_path, "rb") as f:
        raw = f.read()
    root = None
    try:
        import base64

        bundle = json.loads(raw)
        signed = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
        root = signed["subject"][0]["digest"]["sha256"]
    except (ValueError, KeyError, IndexError, TypeError):
        pass  # another bundle layout: the file's digest still binds it
    return {
        "file": SIGNATURE_NAME,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "predicate_type": _MODEL_SIGNING,
        "root_digest": root,
        "key": key_hint(key.public_key()),
    }


def make_release(
    ckpt: str,
    *,
    key: str,
    out: str,
    store: str | None = None,
    accept: str = "trusted",
    part: str | None = None,
    extra_files: Sequence[str] = (),
) -> Release:
    """Release a checkpoint (or a store's latest-good) into the new directory ``out``.

    Every shape certckpt writes: a file (its ``model`` entry), a checkpoint directory (a Trainer
    ``checkpoint-N/`` or an Accelerate ``checkpoint_<i>/``: its ``model.safetensors``, or the shards
    of its index, with the plain files ``from_pretrained`` reads, ``config.json`` and the tokenizer's),
    a DCP directory (consolidated into one file). See ``ops.release_shapes``.

    Args:
        ckpt: a committed checkpoint (its file, its directory, one weight file of its directory, or
            its id with ``store``), or a run store (its latest-good).
        key: an elliptic-curve private key, PEM (``certckpt keygen --release``).
        out: the release directory (must not exist, or be empty).
        store: the run store that committed ``ckpt`` (default: the one around it).
        accept: the lowest verdict released: ``trusted`` (default) or ``verified``.
        part: where the model's tensors are: an entry of a file (default ``model``, else
            ``state_dict``), a weight file of a checkpoint directory (default ``model.safetensors``),
            a prefix of a DCP checkpoint's names (default ``model``).
        extra_files: files copied beside the model and signed with it (``config.json``...).

    Raises:
        UntrustedCheckpointError: the checkpoint's verdict is below ``accept``.
        CorruptCheckpointError: its bytes do not verify now.
        CheckpointExistsError: ``out`` holds files.

    Example::

        make_release("runs/r1", key="keys/release", out="release/r1")
    """
    level = accept_level(accept)
    private = load_private_key(key)
    ms = _model_signing()
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointExistsError(f"{out}: exists and is not empty; a release goes into a new directory")
    names = [os.path.basename(p) for p in extra_files]
    if len(set(names)) != len(names) or {MODEL_NAME, SIGNATURE_NAME, CERTIFICATE_NAME} & set(names):
        raise ConfigurationError(f"extra files {names}: names must be unique and not {MODEL_NAME} or a signature's")
    status, cid, member = _choose(ckpt, store, level)
    from safetensors.torch import save_file

    # the private copy goes beside the release (the checkpoint's size in free space is needed there
    # anyway), not to a system temp directory that may be far smaller
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".certckpt-release-", dir=parent) as tmp:
        model = released_model(_checked_copy(status, cid, tmp), part if part is not None else member)
        extra = _extra_files(extra_files, model.carried)
        os.makedirs(out, exist_ok=True)
        save_file(model.tensors, os.path.join(out, MODEL_NAME), metadata={"format": "pt"})
        for name, src in sorted({**model.carried, **extra}.items()):
            shutil.copyfile(src, os.path.join(out, name))
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o644)  # a release is for others to read
    files = {n: _sha256(os.path.join(out, n)) for n in sorted(os.listdir(out))}
    hashing = ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE_NAME, CERTIFICATE_NAME], ignore_git_paths=False)
    ms.signing.Config().use_elliptic_key_signer(private_key=key).set_hashing_config(hashing).sign(
        out, os.path.join(out, SIGNATURE_NAME)
    )
    sig = _signature_facts(os.path.join(out, SIGNATURE_NAME), private)
    predicate = _predicate(status, cid, accept=level, signature=sig)
    predicate["checkpoint"]["released_from"] = model.source
    doc = statement(files=files, predicate=predicate)
    with open(os.path.join(out, CERTIFICATE_NAME), "x", encoding="utf-8") as f:
        json.dump(sign_envelope(doc, private), f, indent=2)
        f.write("\n")
    return Release(
        directory=out,
        ckpt_id=cid,
        level=status.certification.verdicts[cid].label,
        files=files,
        key_id=sig["key"],
    )


def _extra_files(paths: Sequence[str], carried: dict[str, str]) -> dict[str, str]:
    """``--with`` files by release name; one the checkpoint carries already (its verified copy) is
    taken only when it holds the same bytes."""
    out = {}
    for path in paths:
        name = os.path.basename(path)
        if name in carried:
            if _sha256(path) != _sha256(carried[name]):
                raise ConfigurationError(
                    f"--with {path}: the checkpoint holds another {name}, verified with it, which the release"
                    f" carries; leave --with for files the checkpoint does not hold"
                )
            continue
        out[name] = path
    return out


def _release_files(directory: str) -> dict[str, str]:
    """The model files found in a release directory now (name -> SHA-256): every regular file but
    the two signatures; a link or a subdirectory is refused (nothing is followed out of it)."""
    if not os.path.isdir(directory):
        raise ReleaseVerificationError(f"{directory}: not a release directory")
    out: dict[str, str] = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name in (SIGNATURE_NAME, CERTIFICATE_NAME):
            if os.path.islink(path) or not os.path.isfile(path):
                raise ReleaseVerificationError(f"{path}: not a plain file")
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            raise ReleaseVerificationError(f"{path}: not a plain file (a release holds files only)")
        out[name] = _sha256(path)
    for name in (SIGNATURE_NAME, CERTIFICATE_NAME):
        if not os.path.isfile(os.path.join(directory, name)):
            raise ReleaseVerificationError(f"{directory}: no {name}; not a certckpt release")
    return out


def _said(e: Exception) -> str:
    """The model_signing verifier's complaint in one short line (it prints digests as bytes)."""
    import re

    # The verifier's message holds the repr of a list of strings that contain both quote kinds
    # whenever a digest's bytes repr has a quote in it: the names' quotes are then escaped (\\'),
    # depending on the digest's value, so both forms are read.
    text = str(e).strip()
    changed = re.findall(r"Hash mismatch for \\?'([^'\\]{1,200})\\?'", text)
    extra = re.search(r"Extra files found in model \\?'[^']*': ([^\"\]\\]{1,300})", text)
    missing = re.search(r"Missing files in model \\?'[^']*': ([^\"\]\\]{1,300})", text)
    parts = [f"{n} changed since it was signed" for n in changed]
    parts += [f"files not signed: {extra.group(1)}"] if extra else []
    parts += [f"signed files missing: {missing.group(1)}"] if missing else []
    if parts:
        return "; ".join(parts)
    return text.splitlines()[0][:300] if text else type(e).__name__


def verify_release(directory: str, *, public_key: str, accept: str = "trusted") -> ReleaseCheck:
    """Check a release directory against one trusted public key.

    1. ``model.sig`` verifies with ``model_signing`` (its own verifier, key-based, offline): every
       file is the one signed, none missing or added, signed by this key;
    2. the certificate's DSSE signature verifies with the same key;
    3. the certificate names exactly these files with these SHA-256 and this very ``model.sig``;
    4. its verdict is at least ``accept`` (``trusted`` by default: a ``verified`` release, a run
       without audit evidence, is refused unless accepted).

    Raises:
        ReleaseVerificationError: the first check that fails, in one line.
    """
    level = accept_level(accept)
    ms = _model_signing()
    pub = load_public_key(public_key)
    files = _release_files(directory)
    sig_path = os.path.join(directory, SIGNATURE_NAME)
    try:
        ms.verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(directory, sig_path)
    except Exception as e:  # whatever the third-party verifier raises, the check failed
        raise ReleaseVerificationError(f"{sig_path}: model_signing verification failed: {_said(e)}") from e
    try:
        with open(os.path.join(directory, CERTIFICATE_NAME), encoding="utf-8") as f:
            data = f.read(MAX_CERTIFICATE_BYTES + 1)
        if len(data) > MAX_CERTIFICATE_BYTES:
            raise ValueError(f"over {MAX_CERTIFICATE_BYTES >> 20} MiB")
        envelope = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep to be a certificate
        raise ReleaseVerificationError(
            f"{directory}/{CERTIFICATE_NAME}: not a certificate ({str(e)[:80] or 'too deeply nested'})"
        ) from e
    doc = open_envelope(envelope, pub)
    ranks = {k: r for k, r in _RANK.items() if r >= level.rank}
    predicate = check_statement(doc, files=files, signature_sha256=_sha256(sig_path), accept_rank=ranks)
    ck, verdict = predicate.get("checkpoint") or {}, predicate.get("verdict") or {}
    cov = predicate.get("coverage") or {}
    bound = cov.get("bound") or {}
    lineage = cov.get("lineage") or {}
    text = (
        f"one-time fault replayed {bound.get('one_time_replayed')} since {cov.get('parent')},"
        f" {lineage.get('one_time_replayed')} over the lineage's {lineage.get('steps')} steps;"
        f" persistent fault caught within {bound.get('persistent_within')} step(s)"
        if isinstance(cov, dict) and cov
        else ""
    )
    return ReleaseCheck(
        directory=directory,
        ckpt_id=str(ck.get("ckpt_id")),
        level=str(verdict.get("level")),
        reasons=[str(r) for r in verdict.get("reasons") or []],
        files=files,
        coverage=text,
        predicate=predicate,
    )
