"""The ledger: append-only, write-once records beside the checkpoints, on any fsspec URL.

Layout under ``<store>/_ledger/``::

    checkpoints/<branch>@<step>.json     commit records: a checkpoint exists only once its record does
    branches/<branch>.json               the checkpoint a branch resumed from (after a rollback)
    events/<time_ns>-<rand>.jsonl        segments of audit events (batched: not one object per step)
    revocations/<ckpt_id>--<time_ns>.json
    certificates/<ckpt_id>--<time_ns>.json   one per verdict change, with the checkpoint's digests
    retired/<ckpt_id>.json               a checkpoint whose file a retention policy deleted
    drills/<time_ns>-<rand>.json         restore-drill results
    incidents/<incident_id>--<...>.json  incident openings and decisions (see incident.py)
    holdings/<ckpt_id>.json              vaults only: the checkpoint's copy held here (see vault.py)

A vault's ledger mirrors its source run's records (commit records keep pointing at the source, as
evidence of lineage) and adds a holding per checkpoint it keeps; only held, unretired checkpoints are
candidates for latest-good there. Every object is written once (create-only: a hard link locally,
``If-None-Match`` on S3) and never edited. No torch import.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, CheckpointNotFoundError, ConfigurationError, StorageError
from certckpt.format.sharded.layout import MANIFEST_NAME
from certckpt.format.signing import SigningKey, TrustedKeys, signing_key_from_env, trusted_keys_from_env
from certckpt.format.storage import (
    LEDGER_DIR,
    VAULT_MARK,
    filesystem,
    join,
    put_once,
    remote_error_text,
    resolve,
)

from .certify import CheckpointEntry, Revocation
from .incident import incident_state

__all__ = ["Ledger", "LedgerSink", "LedgerSnapshot", "ckpt_id_for", "is_ckpt_id", "LEDGER_DIR", "VAULT_MARK"]

# LEDGER_DIR and VAULT_MARK (a vault's ledger: {"kind": "certckpt-vault", "run", "source"}) are defined
# by the file layer, which must respect them too (a plain save never replaces a vault copy).
_KINDS = (
    "checkpoints",
    "branches",
    "events",
    "revocations",
    "certificates",
    "holdings",
    "retired",
    "drills",
    "incidents",
)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_HELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,240}\.safetensors$")  # a plain file name
_CKPT_ID = re.compile(r"^([A-Za-z0-9._-]{1,100})@([0-9]{1,18})$")
# Records that can move a verdict toward trusted (or make a copy count as held); with trusted keys they
# need a trusted signature. Revocations, retirements and incident records only count against trust
# or for caution, and are kept unsigned.
_SIGNED_KINDS = ("checkpoints", "holdings", "branches", "drills", "certificates")


def _needs_signature(kind: str, r: dict[str, Any]) -> bool:
    # An incident's opening only adds caution; its decisions (rollback targets, approvals,
    # returns to service, closing) steer what happens next, so with trusted keys they count signed only.
    return kind in _SIGNED_KINDS or (kind == "incidents" and r.get("record") != "opened")


FROM_ENV = "from-env"  # the default of Ledger's key options: read the environment
_RECORD_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._@-]{0,250}$")  # no separator, no leading dot


def ckpt_id_for(branch: str, step: int) -> str:
    return f"{branch}@{step}"


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ConfigurationError(f"{kind} {name!r}: use 1-100 letters, digits, '.', '_' or '-'")
    return name


def is_ckpt_id(value: Any) -> bool:
    """Whether ``value`` is a checkpoint id (``branch@step``) safe to use in a name or a path."""
    m = _CKPT_ID.match(value) if isinstance(value, str) else None
    return m is not None and m.group(1) not in (".", "..")


def _record_name(name: str) -> str:
    # Every record's file name passes here, whatever built it: ids read from a store are data an
    # attacker may have written, and a separator or a `..` in them must never reach a path.
    if not _RECORD_FILE.match(name) or ".." in name:
        raise ConfigurationError(f"ledger record name {name!r} is not a plain file name; refused")
    return name


def _events_of(store: str, name: str, data: bytes) -> list[dict[str, Any]]:
    """The audit events of one segment. An event that cannot be read could have been a failed check,
    so it is never skipped: the whole store then cannot be certified until the segment is repaired."""
    out = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError):
            ev = None
        ok = (
            isinstance(ev, dict)
            and isinstance(ev.get("branch"), str)
            and isinstance(ev.get("step"), int)
            and not isinstance(ev.get("step"), bool)
            and isinstance(ev.get("kind"), str)
            and isinstance(ev.get("outcome"), str)
        )
        if not ok:
            raise CertckptError(
                f"{store}: ledger event segment {name}, line {n}, is not a readable audit event; "
                "the store cannot be certified until it is restored from a good copy"
            )
        out.append(ev)
    return out


def _why_invalid(kind: str, file: str, r: Any) -> str | None:
    """Why a record read from the store cannot be used (None when it can). Checked like user input:
    a record that fails is evidence of nothing, and never reaches a path, a verdict or a traceback."""
    if not isinstance(r, dict):
        return f"not a JSON object ({type(r).__name__})"
    if kind in ("checkpoints", "holdings", "retired", "revocations", "certificates"):
        cid = r.get("ckpt_id")
        if not is_ckpt_id(cid):
            return f"checkpoint id {str(cid)[:80]!r} is not branch@step"
        if kind in ("checkpoints", "holdings", "retired") and file != f"{cid}.json":
            return f"names {cid} but is stored as {file}"
    if kind == "checkpoints":
        step = r.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or f"{r.get('branch')}@{step}" != r["ckpt_id"]:
            return f"branch and step ({r.get('branch')!r}, {step!r}) do not make its id {r['ckpt_id']}"
        if not isinstance(r.get("url"), str) or not r["url"] or "\0" in r["url"]:
            return "has no file location"
        if "://" not in r["url"] and not r["url"].startswith("/") and ".." in r["url"].split("/"):
            return f"names its file {r['url'][:80]!r}, a path that climbs out of the store"
    if kind == "holdings":
        # A vault holds each copy under its plain name, in the vault itself: a file `<id>.safetensors`,
        # a sharded checkpoint's directory `<id>`, or a file with companions as `<id>/NAME.safetensors`
        # (its companions beside it): never a path that leaves `<id>/`.
        url, cid = r.get("url"), r["ckpt_id"]
        if not (
            url in (f"{cid}.safetensors", cid)
            or (isinstance(url, str) and url.startswith(f"{cid}/") and _HELD_NAME.match(url[len(cid) + 1 :]))
        ):
            return f"holds its copy at {str(url)[:80]!r}, not {cid}.safetensors, {cid} or {cid}/NAME.safetensors"
        if not isinstance(r.get("step"), int) or not isinstance(r.get("branch"), str):
            return "has no branch and step"
    if kind == "branches" and (
        not isinstance(r.get("branch"), str) or not _NAME.match(r["branch"]) or not is_ckpt_id(r.get("parent"))
    ):
        return "branch or parent is not a valid name"
    if kind == "incidents" and (not isinstance(r.get("incident_id"), str) or not _NAME.match(r["incident_id"])):
        return f"incident id {str(r.get('incident_id'))[:80]!r} is not a plain name"
    if kind == "revocations" and not isinstance(r.get("reason"), str):
        return "has no reason"
    if kind == "certificates" and not isinstance(r.get("at"), (int, float)):
        return "has no time"
    return None


def _dumps(doc: dict) -> bytes:
    return (json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n").encode("utf-8")


@dataclass(kw_only=True, slots=True)
class LedgerSnapshot:
    """Everything the ledger holds, read at one moment."""

    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> commit record
    events: list[dict[str, Any]] = field(default_factory=list)
    revocations: list[Revocation] = field(default_factory=list)
    certificates: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> latest certificate
    branch_parents: dict[str, str] = field(default_factory=dict)
    segments: int = 0
    holdings: dict[str, dict[str, Any]] = field(default_factory=dict)  # vaults: ckpt_id -> holding
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> retirement record
    drills: list[dict[str, Any]] = field(default_factory=list)
    incident_records: list[dict[str, Any]] = field(default_factory=list)
    is_vault: bool = False
    invalid: list[tuple[str, str]] = field(default_factory=list)  # (kind/file, why): records ignored
    # The keys this snapshot was read with: checkpoint files must be signed by one of them too.
    trusted_keys: TrustedKeys | None = None

    def open_incidents(self) -> list[str]:
        """Ids of the incidents not closed yet."""
        return [i.incident_id for i in incident_state(self.incident_records).values() if i.is_open]

    def available(self, ckpt_id: str) -> bool:
        """Whether this store holds the checkpoint's file (not pruned; in a vault, promoted here)."""
        return ckpt_id not in self.retired and (not self.is_vault or ckpt_id in self.holdings)

    def header_digest(self, ckpt_id: str) -> str | None:
        return self.records[ckpt_id].get("header_digest")


class Ledger:
    """Records of one run store (the directory or prefix holding the checkpoints).

    Example:
        >>> ledger = Ledger("s3://bucket/run1")
        >>> snap = ledger.snapshot()
    """

    def __init__(
        self,
        store: str,
        *,
        signing_key: SigningKey | None | str = FROM_ENV,
        trusted_keys: TrustedKeys | None | str = FROM_ENV,
    ):
        """Args:
        store: the run store's (or vault's) path or URL.
        signing_key: signs every record written (default: ``$CERTCKPT_SIGNING_KEY``, else none).
        trusted_keys: when set, records that could move a verdict toward trusted count only when
            one of these keys signed them (default: ``$CERTCKPT_TRUSTED_KEYS``, else none).
        """
        self.store = store.rstrip("/") if "://" in store else store.rstrip("/") or "/"
        self.root = join(self.store, LEDGER_DIR)
        self.signing_key = signing_key_from_env() if signing_key == FROM_ENV else signing_key
        self.trusted_keys = trusted_keys_from_env() if trusted_keys == FROM_ENV else trusted_keys

    def _dumps(self, doc: dict[str, Any]) -> bytes:
        return _dumps(self.signing_key.sign(doc) if self.signing_key is not None else doc)

    # --- writing ------------------------------------------------------------------------------

    def commit_checkpoint(
        self,
        *,
        branch: str,
        step: int,
        location: str,
        run: str | None = None,
        parent: str | None = None,
        consensus_fp: str | None = None,
        state_fp: str | None = None,
        header_digest: str | None = None,
        step_range: list[int] | None = None,
        nbytes: int | None = None,
    ) -> str:
        """Write the commit record that makes a published checkpoint exist; returns its id."""
        _check_name("branch", branch)
        cid = ckpt_id_for(branch, step)
        doc = {
            "ckpt_id": cid,
            "run": run,
            "branch": branch,
            "step": step,
            "url": self._relative(location),
            "parent": parent,
            "consensus_fp": consensus_fp,
            "state_fp": state_fp,
            "header_digest": header_digest,
            "step_range": step_range,
            "bytes": nbytes,
            "committed_at": time.time(),
        }
        put_once(join(self.root, "checkpoints", _record_name(f"{cid}.json")), self._dumps(doc))
        return cid

    def start_branch(self, branch: str, *, parent: str) -> None:
        """Record that ``branch`` resumes from checkpoint ``parent`` (a rollback)."""
        _check_name("branch", branch)
        put_once(join(self.root, "branches", f"{branch}.json"), self._dumps({"branch": branch, "parent": parent}))

    def append_events(self, events: Iterable[Any]) -> str | None:
        """Write one segment holding these events; returns its name (None when there were none)."""
        docs = [e if isinstance(e, dict) else e.to_dict() for e in events]
        if self.signing_key is not None:
            docs = [self.signing_key.sign(d) for d in docs]
        lines = [json.dumps(d, separators=(",", ":"), sort_keys=True) for d in docs]
        if not lines:
            return None
        name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.jsonl"
        put_once(join(self.root, "events", name), ("\n".join(lines) + "\n").encode("utf-8"))
        return name

    def revoke(self, ckpt_id: str, *, reason: str, by: str = "") -> Revocation:
        if not reason.strip():
            raise ConfigurationError("a revocation needs a reason")
        if not self._exists(join(self.root, "checkpoints", f"{ckpt_id}.json")):
            raise CheckpointNotFoundError(f"{self.store}: no committed checkpoint {ckpt_id!r} (see `certckpt status`)")
        rev = Revocation(ckpt_id=ckpt_id, reason=reason, by=by, at=time.time())
        put_once(
            join(self.root, "revocations", f"{ckpt_id}--{time.time_ns()}.json"),
            self._dumps({"ckpt_id": ckpt_id, "reason": reason, "by": by, "at": rev.at}),
        )
        return rev

    def record_certificate(self, ckpt_id: str, *, verdict: str, reasons: list[str], record: dict[str, Any]) -> None:
        put_once(
            join(self.root, "certificates", _record_name(f"{ckpt_id}--{time.time_ns()}.json")),
            self._dumps(
                {
                    "ckpt_id": ckpt_id,
                    "verdict": verdict,
                    "reasons": reasons,
                    "state_fp": record.get("state_fp"),
                    "header_digest": record.get("header_digest"),
                    "consensus_fp": record.get("consensus_fp"),
                    "at": time.time(),
                }
            ),
        )

    def retire(self, ckpt_id: str, *, reason: str, policy: str = "") -> None:
        """Record that a retention policy deleted this checkpoint's file (written after the delete)."""
        put_once(
            join(self.root, "retired", _record_name(f"{ckpt_id}.json")),
            self._dumps({"ckpt_id": ckpt_id, "reason": reason, "policy": policy, "at": time.time()}),
        )

    def record_drill(self, doc: dict[str, Any]) -> str:
        name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.json"
        put_once(join(self.root, "drills", name), self._dumps(doc))
        return name

    def record_holding(self, doc: dict[str, Any]) -> bool:
        """Vaults: the record that makes a promoted copy exist here. Deterministic content, so a
        racing promoter of the same checkpoint finds it identical (returns False) instead of failing."""
        if not is_ckpt_id(doc["ckpt_id"]):
            raise ConfigurationError(f"checkpoint id {doc['ckpt_id']!r} is not branch@step")
        return put_once(join(self.root, "holdings", _record_name(f"{doc['ckpt_id']}.json")), self._dumps(doc))

    def write_record(self, kind: str, name: str, doc: dict[str, Any]) -> bool:
        """Write one record create-only, signed when this ledger has a signing key; idempotent."""
        return self.put_raw(kind, name, self._dumps(doc))

    def put_raw(self, kind: str, name: str, data: bytes) -> bool:
        """Mirror a record byte for byte (vault promotion); idempotent like every ledger write.
        ``kind=""`` addresses the ledger's top level."""
        _record_name(name)
        if kind and kind not in _KINDS:
            raise ConfigurationError(f"ledger record kind {kind!r}: one of {', '.join(_KINDS)}")
        return put_once(join(self.root, kind, name) if kind else join(self.root, name), data)

    def list_raw(self, kind: str) -> list[str]:
        """Names of the records of one kind (empty when there are none)."""
        fs, root = self._fs()
        try:
            return sorted(n for n in (p.rsplit("/", 1)[-1] for p in fs.find(f"{root}/{kind}")) if not n.startswith("."))
        except FileNotFoundError:
            return []
        except Exception as e:  # OSError, and botocore's own types (no credentials, unreachable endpoint)
            raise StorageError(f"{self.store}: cannot list the ledger ({remote_error_text(e)})") from e

    def read_raw(self, kind: str, names: list[str]) -> dict[str, bytes]:
        if not names:
            return {}
        fs, root = self._fs()
        base = f"{root}/{kind}" if kind else root
        try:
            got = fs.cat([f"{base}/{n}" for n in names])
        except Exception as e:  # OSError, and botocore's own types (no credentials, unreachable endpoint)
            raise StorageError(f"{self.store}: cannot read the ledger ({remote_error_text(e)})") from e
        return {p.rsplit("/", 1)[-1]: v for p, v in got.items()}

    # --- reading ------------------------------------------------------------------------------

    def _exists(self, location: str) -> bool:
        target = resolve(location)
        if target.local is not None:
            return os.path.exists(target.local)
        fs, path = filesystem(target.url)
        return fs.exists(path)

    def _fs(self):
        target = resolve(self.root)
        if target.local is not None:
            import fsspec

            return fsspec.filesystem("file"), target.local
        fs, path = filesystem(target.url)
        # Other processes write this ledger: a listing cached by this process would hide their records.
        fs.invalidate_cache()
        return fs, path

    def _relative(self, location: str) -> str:
        """The file's path relative to the store when it lies inside it (``main@5.safetensors``,
        ``checkpoint-5/trainer.safetensors``), else its full location: a store that is moved or
        copied whole keeps finding its files."""
        store, loc = resolve(self.store), resolve(location)
        if store.local is not None and loc.local is not None:
            root, path = os.path.abspath(store.local), os.path.abspath(loc.local)
            inside = os.path.commonpath([root, path]) == root and path != root
            return os.path.relpath(path, root).replace(os.sep, "/") if inside else path
        prefix = self.store + "/"
        rest = location[len(prefix) :] if location.startswith(prefix) else None
        return rest if rest and ".." not in rest.split("/") else location

    def url_of(self, record: dict[str, Any], *, base: str | None = None) -> str:
        """Where a record's file is; relative names are relative to ``base`` (default this store;
        a vault's mirrored commit records are relative to the run store they came from)."""
        u = record["url"]
        return u if "://" in u or u.startswith("/") else join(base or self.store, u)

    def snapshot(self) -> LedgerSnapshot:
        """Read every record (missing ledger: an empty snapshot).

        Raises:
            StorageError: the store cannot be read; CertckptError: a record is not valid JSON.
        """
        try:
            fs, root = self._fs()
            if not fs.exists(root):
                if not fs.exists(root.rsplit("/", 1)[0] or "/"):
                    raise CheckpointNotFoundError(f"{self.store}: no such run store")
                return LedgerSnapshot()
            # Hidden names are other writers' temp files, about to be linked and removed: not records.
            files = {
                k: sorted(p for p in fs.find(f"{root}/{k}") if not p.rsplit("/", 1)[-1].startswith("."))
                if fs.exists(f"{root}/{k}")
                else []
                for k in _KINDS
            }
            contents = fs.cat([p for v in files.values() for p in v]) if any(files.values()) else {}
        except (CertckptError, FileNotFoundError) as e:
            if isinstance(e, CertckptError):
                raise
            if "NoSuchBucket" in str(e) or "bucket does not exist" in str(e).lower():
                raise StorageError(f"{self.store}: cannot read the ledger ({remote_error_text(e)})") from e
            raise CheckpointNotFoundError(f"{self.store}: no such run store") from e
        except Exception as e:  # OSError, and botocore's own types (no credentials, unreachable endpoint)
            raise StorageError(f"{self.store}: cannot read the ledger ({remote_error_text(e)})") from e

        def load(path: str) -> Any:
            try:
                return json.loads(contents[path])
            except (KeyError, ValueError, RecursionError) as e:
                raise CertckptError(
                    f"{self.store}: ledger record {path.rsplit('/', 1)[-1]} is unreadable ({e.__class__.__name__})"
                ) from e

        def valid(kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
            for p in files[kind]:
                name = p.rsplit("/", 1)[-1]
                r = load(p)
                why = _why_invalid(kind, name, r)
                if why is None and self.trusted_keys is not None and _needs_signature(kind, r):
                    why = self.trusted_keys.problem(r)
                if why is None:
                    yield name, r
                else:
                    snap.invalid.append((f"{kind}/{name}", why))

        mark = None
        if files["holdings"] or fs.exists(f"{root}/{VAULT_MARK}"):
            try:
                mark = json.loads(fs.cat_file(f"{root}/{VAULT_MARK}"))
            except (OSError, ValueError):
                mark = {}
        snap = LedgerSnapshot(segments=len(files["events"]), is_vault=mark is not None, trusted_keys=self.trusted_keys)
        for _, r in valid("checkpoints"):
            snap.records[r["ckpt_id"]] = r
        for _, h in valid("holdings"):
            snap.holdings[h["ckpt_id"]] = h
        for _, r in valid("retired"):
            snap.retired[r["ckpt_id"]] = r
        snap.drills = [dict(d, drill_id=name.removesuffix(".json")) for name, d in valid("drills")]
        snap.incident_records = [r for _, r in valid("incidents")]
        for _, b in valid("branches"):
            snap.branch_parents[b["branch"]] = b["parent"]
        for r in snap.records.values():
            snap.checkpoints.append(
                CheckpointEntry(
                    ckpt_id=r["ckpt_id"],
                    branch=r["branch"],
                    step=r["step"],
                    parent=r.get("parent") or snap.branch_parents.get(r["branch"]),
                    consensus_fp=r.get("consensus_fp"),
                    committed_at=r.get("committed_at", 0.0),
                    url=self.url_of(snap.holdings[r["ckpt_id"]])
                    if r["ckpt_id"] in snap.holdings
                    else self.url_of(r, base=(mark or {}).get("source")),
                )
            )
        for p in files["events"]:
            name = p.rsplit("/", 1)[-1]
            for n, ev in enumerate(_events_of(self.store, name, contents[p]), 1):
                # A failed check counts signed or not (it can only count against trust); a passing
                # one is evidence for trust and needs a trusted signature when keys are configured.
                why = None if self.trusted_keys is None or ev["outcome"] == "fail" else self.trusted_keys.problem(ev)
                if why is None:
                    snap.events.append(ev)
                else:
                    snap.invalid.append((f"events/{name}#{n}", why))
        for _, d in valid("revocations"):
            snap.revocations.append(
                Revocation(ckpt_id=d["ckpt_id"], reason=d["reason"], by=d.get("by", ""), at=d.get("at", 0.0))
            )
        for _, d in valid("certificates"):
            prev = snap.certificates.get(d["ckpt_id"])
            if prev is None or d["at"] >= prev["at"]:
                snap.certificates[d["ckpt_id"]] = d
        return snap

    def uncommitted(self, snap: LedgerSnapshot | None = None) -> list[str]:
        """Checkpoints directly in the store that no commit record names (ignored by latest-good):
        certified files, and sharded checkpoint directories whose manifest was written."""
        snap = snap or self.snapshot()
        named = {r["url"].rstrip("/") for r in (snap.holdings if snap.is_vault else snap.records).values()}
        target = resolve(self.store)
        try:
            if target.local is not None:
                names = os.listdir(target.local)
                sharded = {n for n in names if os.path.isfile(os.path.join(target.local, n, MANIFEST_NAME))}
            else:
                fs, path = filesystem(target.url)
                listing = fs.ls(path, detail=True)
                names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listing]
                dirs = [n for n, e in zip(names, listing) if e.get("type") == "directory"]
                sharded = {n for n in dirs if fs.exists(f"{path}/{n}/{MANIFEST_NAME}")}
        except FileNotFoundError:
            return []
        return sorted(
            join(self.store, n)
            for n in names
            if (n.endswith(".safetensors") or n in sharded) and n not in named and join(self.store, n) not in named
        )


class LedgerSink:
    """An ``EventSink`` that batches events into ledger segments (written at ``flush``)."""

    def __init__(self, ledger: Ledger, *, max_buffer: int = 4096):
        self.ledger = ledger
        self.max_buffer = max_buffer
        self._buffer: list[Any] = []

    def emit(self, event: Any) -> None:
        self._buffer.append(event)
        if len(self._buffer) >= self.max_buffer:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            batch, self._buffer = self._buffer, []
            self.ledger.append_events(batch)
