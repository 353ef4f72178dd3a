"""The ledger: append-only, write-once records beside the checkpoints, on any fsspec URL.

Layout under ``<store>/_ledger/``::

    checkpoints/<branch>@<step>.json     commit records: a checkpoint exists only once its record does
    branches/<branch>.json               the checkpoint a branch resumed from (after a rollback)
    events/<time_ns>-<rand>.jsonl        segments of audit events (batched: not one object per step)
    revocations/<ckpt_id>--<time_ns>.json
    certificates/<ckpt_id>--<time_ns>.json   one per verdict change, with the checkpoint's digests
    retired/<ckpt_id>.json               a checkpoint whose file a retention policy deleted
    kept/<ckpt_id>.json                  a checkpoint whose file a rotation moved aside to keep it
    drills/<time_ns>-<rand>.json         restore-drill results
    incidents/<incident_id>--<...>.json  incident openings and decisions (see incident.py)
    placements/<branch>--<time_ns>-<rand>.json  runs with a fleet: per rank, the device a start ran on
    holdings/<ckpt_id>.json              vaults only: the checkpoint's copy held here (see vault.py)

A vault's ledger mirrors its source run's records (commit records keep pointing at the source, as
evidence of lineage) and adds a holding per checkpoint it keeps; only held, unretired checkpoints are
candidates for latest-good there. Every object is written once (create-only: a hard link locally,
``If-None-Match`` on S3) and never edited. No torch import.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
)
from certckpt.format.sharded.layout import MANIFEST_NAME
from certckpt.format.signing import SigningKey, TrustedKeys, signing_key_from_env, trusted_keys_from_env
from certckpt.format.trustconfig import TrustConfig, mmap_from_env, state_dir_from_env
from certckpt.log import COMMIT, RESUME
from certckpt.storage import (
    LEDGER_DIR,
    VAULT_MARK,
    Storage,
    join,
    put_once,
    resolve,
    storage_for,
)

from .certify import Revocation
from .chain import (
    CHAINS_DIR,
    GENESIS,
    digest,
    entry_doc,
    entry_name,
    genesis_problem,
    is_writer_id,
    new_genesis,
    parse_entry_name,
    scope_of,
)
from .chaincache import ChainCache
from .factcache import FactsCache
from .records import KINDS, CommitRecord, HoldingRecord, KeptRecord, is_ckpt_id, is_plain_name
from .snapshot import MAX_SMALL_RECORD_BYTES, SOURCES_DIR, LedgerSnapshot, read_snapshot

__all__ = [
    "Ledger",
    "LedgerSink",
    "LedgerSnapshot",
    "record_mismatch",
    "ckpt_id_for",
    "is_ckpt_id",
    "LEDGER_DIR",
    "VAULT_MARK",
]

# LEDGER_DIR and VAULT_MARK (a vault's ledger: {"kind": "certckpt-vault", "run", "source"}) are defined
# by the file layer, which must respect them too (a plain save never replaces a vault copy).
_KINDS = KINDS
FROM_ENV = "from-env"  # the default of Ledger's key options: read the environment
HEADS_PAGE = 1000  # chain entry names a seal lists (one S3 LIST page) to learn the other writers' heads
_RECORD_FILE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._@-]{0,250}$")  # no separator, no leading dot


def ckpt_id_for(branch: str, step: int) -> str:
    return f"{branch}@{step}"


def _check_name(kind: str, name: str) -> str:
    if not is_plain_name(name):
        raise ConfigurationError(f"{kind} {name!r}: use 1-100 letters, digits, '.', '_' or '-'")
    return name


def _record_name(name: str) -> str:
    # Every record's file name passes here, whatever built it: ids read from a store are data an
    # attacker may have written, and a separator or a `..` in them must never reach a path.
    if not _RECORD_FILE.match(name) or ".." in name:
        raise ConfigurationError(f"ledger record name {name!r} is not a plain file name; refused")
    return name


@dataclass(slots=True)
class _Chain:
    """This process's chain for one scope: its writer id, the last entry's number and digest, and
    the heads of the other writers its entries have named."""

    writer: str
    scope: str
    seq: int
    prev: str
    named: dict[str, int] = field(default_factory=dict)


def _dumps(doc: Mapping[str, object]) -> bytes:
    return (json.dumps(doc, separators=(",", ":"), sort_keys=True) + "\n").encode("utf-8")


def record_mismatch(
    held: bytes,
    doc: Mapping[str, Any],
    *,
    time_field: str,
    dumps: Callable[[Mapping[str, Any]], bytes],
    free: Collection[str] = (),
) -> str | None:
    """Why the record ``held`` (bytes found under a record's name) is not the record ``doc`` written at
    another time, or None when it is: every field but ``time_field`` (and the ``free`` ones, which
    only describe the fact: a retirement's reason) the same, and the very bytes ``dumps`` (this
    writer, its key) makes of the held record's fields. A retry of a write whose record was written,
    and whose chain entry was not (a commit, a retirement, a keep), finds such a record."""
    try:
        got = json.loads(held)
    except (ValueError, RecursionError):
        return "it is not readable JSON"
    if not isinstance(got, dict):
        return "it is not a JSON object"
    when = got.get(time_field)
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        return f"its {time_field} is not a number"
    differ = [k for k in sorted((doc.keys() | got.keys()) - {time_field, "sig", *free}) if got.get(k) != doc.get(k)]
    if differ:
        return "; ".join(f"its {k} is {str(got.get(k))[:80]!r}, not {str(doc.get(k))[:80]!r}" for k in differ[:3])
    kept = {k: got[k] for k in free if k in got}
    if kept.keys() != {k for k in free if k in doc} or not all(isinstance(v, str) for v in kept.values()):
        return f"its {', '.join(sorted(free))} are not text"
    if dumps({**doc, **kept, time_field: when}) != held:
        return "it is signed by another key, or not signed as this writer signs"
    return None


_Key = TypeVar("_Key")


def key_option(value: _Key | None | str, from_env: Callable[[], _Key | None], option: str) -> _Key | None:
    """A key option of ``Ledger``: ``FROM_ENV`` reads the environment, anything else is the key (or
    None) itself; the only string it takes is ``FROM_ENV`` (a key file is loaded by its caller)."""
    if isinstance(value, str):
        if value != FROM_ENV:
            raise ConfigurationError(
                f"{option} {value!r}: pass a key object, None or {FROM_ENV!r} (load a key file with "
                "certckpt.format.signing first)"
            )
        return from_env()
    return value


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
        chain: bool = True,
        trust: TrustConfig | None = None,
    ):
        """Args:
        store: the run store's (or vault's) path or URL.
        signing_key: signs every record written (default: ``$CERTCKPT_SIGNING_KEY``, else none).
        trusted_keys: when set, records that could move a verdict toward trusted count only when
            one of these keys signed them (default: ``$CERTCKPT_TRUSTED_KEYS``, else none).
        chain: a new ledger starts a chained store (a genesis record and per-writer chains); False
            keeps it unchained (a vault of a run written before chains existed).
        trust: the reader's configuration (its keys stand where ``trusted_keys`` is left at its
            default; its memory directory is where this reader's memory of the store lives);
            default: ``TrustConfig.from_env()``.
        """
        self.store = store.rstrip("/") if "://" in store else store.rstrip("/") or "/"
        self.root = join(self.store, LEDGER_DIR)
        self.signing_key: SigningKey | None = key_option(signing_key, signing_key_from_env, "signing_key")
        if trust is None:
            keys = key_option(trusted_keys, trusted_keys_from_env, "trusted_keys")
            trust = TrustConfig(trusted_keys=keys, mmap=mmap_from_env(), state_dir=state_dir_from_env())
        elif trusted_keys != FROM_ENV:
            trust = replace(trust, trusted_keys=key_option(trusted_keys, trusted_keys_from_env, "trusted_keys"))
        self.trust: TrustConfig = trust
        self.trusted_keys: TrustedKeys | None = trust.trusted_keys
        self._backend: Storage | None = None
        self._chained: bool | None = None  # learnt at the first write (a genesis record, or none)
        self._new_chained = chain  # whether a new ledger gets a genesis record (a vault of an old run: no)
        self._store_id: str | None = None
        self._genesis_sha = ""
        self._chains: dict[str, _Chain] = {}  # scope -> this process's chain for it
        self._seen: dict[str, int] = {}  # writer -> the last of its entries this writer listed
        self._seen_after = ""  # where the next page of the chains directory starts (``_heads``)
        self._rounds = 0  # open ``one_listing`` blocks
        self._round_read = False  # whether a seal inside them has read its page
        self._lock = threading.RLock()

    def _dumps(self, doc: Mapping[str, object]) -> bytes:
        return _dumps(self.signing_key.sign(doc) if self.signing_key is not None else doc)

    # --- chains -------------------------------------------------------------------------------

    def _storage(self) -> Storage:
        """The ledger directory's storage, its cached listings dropped: other processes write here."""
        if self._backend is None:
            self._backend = storage_for(self.root)
        self._backend.refresh()
        return self._backend

    def _read_optional(self, name: str) -> bytes | None:
        # the storage refuses a link or a FIFO named like a record (it would block the writer)
        return self._storage().get(name, limit=MAX_SMALL_RECORD_BYTES)

    def _has_records(self) -> bool:
        storage = self._storage()
        return any(storage.exists(k) for k in _KINDS)

    def chained(self) -> bool:
        """Whether this store chains its records (creating its genesis record when the ledger is new;
        a ledger written before chains existed stays unchained, as its readers expect)."""
        if self._chained is not None:
            return self._chained
        with self._lock:
            if self._chained is not None:
                return self._chained
            path = join(self.root, GENESIS)
            data = self._read_optional(GENESIS)
            if data is None:
                if not self._new_chained or self._has_records():
                    self._chained = False
                    return False
                try:
                    put_once(path, self._dumps(new_genesis(store_id=secrets.token_hex(16), now=time.time())))
                except CheckpointExistsError:
                    pass  # another writer created the store first: its genesis stands
                data = self._read_optional(GENESIS)
            doc: Any  # JSON read from the store: anything until genesis_problem vouches for it
            try:
                doc = json.loads(data) if data is not None else None
            except (ValueError, RecursionError):
                doc = None
            why = genesis_problem(doc)
            if why is not None:
                raise CertckptError(
                    f"{self.store}: {LEDGER_DIR}/{GENESIS} is damaged ({why}); restore it from a good copy "
                    "before writing to this store"
                )
            assert data is not None  # no bytes parse as no genesis record, refused above
            self._store_id, self._genesis_sha = doc["store_id"], digest(data)
            self._chained = True
            return True

    def create(self) -> None:
        """Create this store's ledger (its genesis record) now, unless it exists: what ``certckpt
        fleet init`` does for a registry, which nothing else creates.

        Raises:
            CertckptError: records are there already but no genesis (an unchained or damaged store).
        """
        if not self.chained():
            raise CertckptError(
                f"{self.store}: records are here but no genesis record (written before chained ledgers, or its "
                "genesis was deleted); create the ledger in an empty directory or prefix"
            )

    @property
    def store_id(self) -> str | None:
        """The store's identity (its genesis record's id), None for an unchained store."""
        return self._store_id if self.chained() else None

    def genesis_bytes(self) -> bytes | None:
        return self._read_optional(GENESIS)

    def _heads(self) -> dict[str, int]:
        """Every other writer's last entry number this writer has seen, after reading one more page
        of the chains directory (at most ``HEADS_PAGE`` names: one request on S3).

        Listing the whole directory at every seal made each commit cost more as the run grew (a
        request per 1,000 entries, and s3fs's walk one per writer). A page a seal, going round,
        costs the same at any size and still says only what was there: a head is the last entry
        this writer listed of that chain, never more, so it can never claim a tail that was not
        written (no false break), and every writer's head is seen again within one round of the
        directory (every entry, below 1,000 entries in all, as before)."""
        if self._rounds and self._round_read:
            return dict(self._seen)
        self._round_read = bool(self._rounds)
        page = self._storage().names_after(CHAINS_DIR, after=self._seen_after, limit=HEADS_PAGE)
        for path in page:
            parts = path.split("/")
            seq = parse_entry_name(parts[-1]) if len(parts) == 3 else None
            if seq is not None and is_writer_id(parts[1]):
                self._seen[parts[1]] = max(self._seen.get(parts[1], 0), seq)
        # a short page reached the end: the next seal starts the round again from the first chain
        self._seen_after = page[-1] if len(page) == HEADS_PAGE else ""
        return dict(self._seen)

    @contextlib.contextmanager
    def one_listing(self) -> Iterator[None]:
        """Seals written inside share one page of the chains directory: a commit (its events, its
        branch, its record: ``commit_saved``) lists once, however many entries it writes. The lock is
        not held across the block (a sink flushing from another thread would wait on it)."""
        with self._lock:
            self._rounds += 1
        try:
            yield
        finally:
            with self._lock:
                self._rounds -= 1
                self._round_read = self._round_read and self._rounds > 0

    def _seal(self, scope: str, records: list[tuple[str, str, bytes]]) -> None:
        """Append one entry to this writer's chain for ``scope``, sealing these record files (written
        already: a crash in between leaves a record nothing seals, which counts for nothing)."""
        if not records or not self.chained():
            return
        with self._lock:
            ch = self._chains.get(scope)
            if ch is None:
                ch = self._chains[scope] = _Chain("w" + secrets.token_hex(8), scope, 0, self._genesis_sha)
            # Only the heads that moved since this chain's last entry: what its entries claim of a
            # writer is still the greatest head this writer saw, first named in the same entry as
            # with every head repeated (so a truncation is caught, and named, exactly as before), and
            # an entry costs what moved, not one name per writer of the store.
            seen = {w: n for w, n in self._heads().items() if w != ch.writer and n > ch.named.get(w, 0)}
            assert self._store_id is not None  # chained() read it from the genesis record
            doc = entry_doc(
                store=self._store_id,
                writer=ch.writer,
                seq=ch.seq + 1,
                prev=ch.prev,
                scope=scope,
                records=[(kind, name, digest(data)) for kind, name, data in records],
                seen=seen,
                now=time.time(),
            )
            raw = self._dumps(doc)
            put_once(join(self.root, CHAINS_DIR, ch.writer, entry_name(ch.seq + 1)), raw)
            ch.seq, ch.prev = ch.seq + 1, digest(raw)
            ch.named.update(seen)

    def _put(self, kind: str, name: str, data: bytes, *, branch: str | None = None) -> bool:
        """Write one record create-only and seal it in this writer's chain."""
        self.chained()  # a new ledger gets its genesis before its first record
        written = put_once(join(self.root, kind, _record_name(name)), data)
        self._seal(scope_of(kind, branch), [(kind, name, data)])
        return written

    def _put_completing(
        self,
        kind: str,
        name: str,
        doc: Mapping[str, Any],
        *,
        time_field: str,
        refusal: str,
        advice: str = "",
        free: Collection[str] = (),
        branch: str | None = None,
    ) -> bool | None:
        """``_put`` of a record that states one fact (a commit, a retirement, a keep): True when
        written; False when the very record was there and sealed; None when an earlier attempt's
        record was found (written, its chain entry not: the process was killed in between, or its
        answer lost), the same in every field but ``time_field`` and the ``free`` ones, and sealed
        now, completing it as it was first written. A record nothing seals counts for nothing, so
        without this the retry would be refused and the fact never recorded.

        Raises:
            CheckpointExistsError: another record holds the name (``STORE: refusal (why); a record is
                never replaced`` + ``advice``); nothing is written or sealed.
        """
        data = self._dumps(doc)
        self.chained()  # a new ledger gets its genesis before its first record
        try:
            written = put_once(join(self.root, kind, _record_name(name)), data)
        except CheckpointExistsError:
            held = self._read_optional(f"{kind}/{_record_name(name)}")
            why: str | None = "it cannot be read"
            if held is not None:
                why = record_mismatch(held, doc, time_field=time_field, dumps=self._dumps, free=free)
            if why is not None:
                raise CheckpointExistsError(
                    f"{self.store}: {refusal} ({why}); a record is never replaced{advice}"
                ) from None
            assert held is not None  # no bytes are no match
            self._seal(scope_of(kind, branch), [(kind, name, held)])
            return None
        self._seal(scope_of(kind, branch), [(kind, name, data)])
        return written

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
        """Write the commit record that makes a published checkpoint exist; returns its id. The
        first writer of the record says so in the log (``certckpt.log``): one line per commit,
        whatever wrote it (a session, an integration, ``certckpt.save``).

        A commit is its record sealed by a chain entry; a record nothing seals counts for nothing.
        Run again after a failure (the record written, its chain entry not), it finds the earlier
        attempt's record, the same in every field but its commit time, and seals it: the commit is
        completed, with the time it was first made. Run again after it succeeded, it seals the
        record once more and changes nothing else.

        Raises:
            CheckpointExistsError: a record of another checkpoint (another file, fingerprint, run,
                parent...) holds ``branch@step``; nothing is written.
        """
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
        written = self._put_completing(
            "checkpoints",
            f"{cid}.json",
            doc,
            time_field="committed_at",
            refusal=f"{cid} has a commit record already, of another checkpoint",
            advice=": commit this checkpoint under a new step or branch",
            branch=branch,
        )
        if written is None:
            COMMIT.info(
                "completed the commit of checkpoint %s (step %d of branch %s) in %s: its record was written by an "
                "earlier attempt",
                cid,
                step,
                branch,
                self.store,
            )
        elif written:
            COMMIT.info("committed checkpoint %s (step %d of branch %s) in %s", cid, step, branch, self.store)
        return cid

    def start_branch(self, branch: str, *, parent: str) -> None:
        """Record that ``branch`` resumes from checkpoint ``parent`` (a rollback); the first writer
        of the record says so in the log (``certckpt.log``): one line per resume."""
        _check_name("branch", branch)
        if self._put("branches", f"{branch}.json", self._dumps({"branch": branch, "parent": parent}), branch=branch):
            RESUME.info("resumed from %s: new checkpoints go on branch %s (%s)", parent, branch, self.store)

    def record_placement(self, *, branch: str, start_step: int, devices: dict[str, str], **fields: object) -> str:
        """Record where this start of ``branch`` runs (per rank, its device; ``fields``: hosts, run,
        fleet), sealed in the branch's chain; returns the record's name. A fleet's conviction of
        one of these devices makes this branch's checkpoints after ``start_step`` suspect."""
        _check_name("branch", branch)
        name = f"{branch}--{time.time_ns():020d}-{secrets.token_hex(4)}.json"
        doc = {"branch": branch, "start_step": start_step, "devices": devices, "at": time.time(), **fields}
        self._put("placements", name, self._dumps(doc), branch=branch)
        return name

    def append_events(self, events: Iterable[Any]) -> str | None:
        """Write the events, one segment per branch, each sealed in its branch's chain with one
        signature (an unchained store signs every line, as it always did); returns the last
        segment's name (None when there were none)."""
        docs = [e if isinstance(e, dict) else e.to_dict() for e in events]
        if not docs:
            return None
        chained = self.chained()
        if self.signing_key is not None and not chained:
            docs = [self.signing_key.sign(d) for d in docs]
        by_branch: dict[object, list[dict[str, Any]]] = {}
        for d in docs:
            by_branch.setdefault(d.get("branch"), []).append(d)
        if chained:  # every branch names a chain: refused before anything is written
            for branch in by_branch:
                _check_name("branch", str(branch))
        name = None
        for branch, group in by_branch.items():
            lines = [json.dumps(d, separators=(",", ":"), sort_keys=True) for d in group]
            name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.jsonl"
            data = ("\n".join(lines) + "\n").encode("utf-8")
            put_once(join(self.root, "events", name), data)
            if chained:
                self._seal(scope_of("events", str(branch)), [("events", name, data)])
        return name

    def revoke(self, ckpt_id: str, *, reason: str, by: str = "") -> Revocation:
        if not reason.strip():
            raise ConfigurationError("a revocation needs a reason")
        if not is_ckpt_id(ckpt_id) or not self._storage().exists(f"checkpoints/{ckpt_id}.json"):
            raise CheckpointNotFoundError(f"{self.store}: no committed checkpoint {ckpt_id!r} (see `certckpt status`)")
        rev = Revocation(ckpt_id=ckpt_id, reason=reason, by=by, at=time.time())
        self._put(
            "revocations",
            f"{ckpt_id}--{time.time_ns()}.json",
            self._dumps({"ckpt_id": ckpt_id, "reason": reason, "by": by, "at": rev.at}),
        )
        return rev

    def record_certificates(self, certs: list[tuple[str, str, list[str], CommitRecord]]) -> None:
        """Write one certificate per ``(ckpt_id, verdict, reasons, commit record)``, sealed in one entry."""
        self.chained()
        written = []
        for ckpt_id, verdict, reasons, record in certs:
            name = _record_name(f"{ckpt_id}--{time.time_ns()}.json")
            data = self._dumps(
                {
                    "ckpt_id": ckpt_id,
                    "verdict": verdict,
                    "reasons": reasons,
                    "state_fp": record.state_fp,
                    "header_digest": record.header_digest,
                    "consensus_fp": record.consensus_fp,
                    "at": time.time(),
                }
            )
            put_once(join(self.root, "certificates", name), data)
            written.append(("certificates", name, data))
        self._seal("cache", written)

    def retire(self, ckpt_id: str, *, reason: str, policy: str = "") -> None:
        """Record that a retention policy deleted this checkpoint's file (written after the delete).
        Run again after a crash between the record and its chain entry (by the same policy or
        another: the fact is the same, the file is gone), it completes the earlier record as written.

        Raises:
            CheckpointExistsError: the record there is not this writer's retirement of ``ckpt_id``.
        """
        doc = {"ckpt_id": ckpt_id, "reason": reason, "policy": policy, "at": time.time()}
        refusal = f"{ckpt_id} has a retirement record already, another one"
        free = ("reason", "policy")
        self._put_completing("retired", f"{ckpt_id}.json", doc, time_field="at", refusal=refusal, free=free)

    def retire_gone(self, ckpt_id: str, *, reason: str, policy: str = "") -> str | None:
        """``retire`` for a file that is gone already (a rotation deleted it): the deletion cannot be
        undone, so a refusal is returned (why, in one line) rather than raised, for the caller to warn
        and go on. The checkpoint then reads as missing rather than retired: its verdict is lowered,
        and nothing else follows from it."""
        try:
            self.retire(ckpt_id, reason=reason, policy=policy)
        except CheckpointExistsError as e:
            return f"{e}; {ckpt_id} reads as missing, not retired"
        return None

    def keep(self, ckpt_id: str, *, url: str, replaced: str, reason: str) -> None:
        """Record that this checkpoint's file now lives at ``url`` (a plain name in the store): a
        rotation was about to replace the name it was committed under (``replaced``), and the file was
        moved aside instead (written after the move). Run again after a crash between the record and
        its chain entry, it completes the earlier record when it names the same places.

        Raises:
            CheckpointExistsError: the record there names another place (``url``, ``replaced``).
        """
        doc = {"ckpt_id": ckpt_id, "url": url, "replaced": replaced, "reason": reason, "at": time.time()}
        refusal = f"{ckpt_id} has a keep record already, another one"
        self._put_completing("kept", f"{ckpt_id}.json", doc, time_field="at", refusal=refusal, free=("reason",))

    def record_drill(self, doc: Mapping[str, object]) -> str:
        name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.json"
        self._put("drills", name, self._dumps(doc))
        return name

    def record_holding(self, doc: Mapping[str, object]) -> bool:
        """Vaults: the record that makes a promoted copy exist here. Deterministic content, so a
        racing promoter of the same checkpoint finds it identical (returns False) instead of failing."""
        if not is_ckpt_id(doc["ckpt_id"]):
            raise ConfigurationError(f"checkpoint id {doc['ckpt_id']!r} is not branch@step")
        return self._put("holdings", f"{doc['ckpt_id']}.json", self._dumps(doc))

    def write_record(self, kind: str, name: str, doc: Mapping[str, object]) -> bool:
        """Write one record create-only, signed when this ledger has a signing key, sealed in this
        writer's chain; idempotent."""
        if kind not in _KINDS or kind in ("events", "checkpoints", "branches", "placements"):
            raise ConfigurationError(f"write_record: kind {kind!r} is written by its own method")
        return self._put(kind, name, self._dumps(doc))

    def put_raw(self, kind: str, name: str, data: bytes, *, seal: bool = False) -> bool:
        """Mirror a record byte for byte (vault promotion: the source's chains seal it); idempotent
        like every ledger write. ``kind=""`` addresses the ledger's top level, ``chains/WRITER`` and
        ``sources`` a vault's copies of its source's chain entries and genesis. ``seal=True`` also
        seals it in this writer's store chain (the vault's own mark)."""
        _record_name(name)
        top = kind.split("/", 1)[0]
        if kind and kind not in _KINDS and top not in (CHAINS_DIR, SOURCES_DIR):
            raise ConfigurationError(f"ledger record kind {kind!r}: one of {', '.join(_KINDS)}")
        if top == CHAINS_DIR and (kind.count("/") != 1 or not is_plain_name(kind.split("/")[1])):
            raise ConfigurationError(f"ledger chain {kind!r} is not chains/WRITER")
        self.chained()
        written = put_once(join(self.root, kind, name) if kind else join(self.root, name), data)
        if seal:
            self._seal("store", [(kind, name, data)])
        return written

    def list_raw(self, kind: str) -> list[str]:
        """Names of the records of one kind (empty when there are none)."""
        return sorted(e.name.rsplit("/", 1)[-1] for e in self._storage().walk(kind, detail=False))

    def chain_listing(self, *, detail: bool = True) -> dict[str, list[str]]:
        """Every writer's chain entry names (a vault copies them with the records they seal)."""
        out: dict[str, list[str]] = {}
        for e in self._storage().walk(CHAINS_DIR, depth=2, detail=detail):
            writer, name = e.name.rsplit("/", 2)[-2:]
            if e.kind == "file" and is_plain_name(writer) and parse_entry_name(name) is not None:
                out.setdefault(writer, []).append(name)
        return {w: sorted(v) for w, v in out.items()}

    def read_raw(self, kind: str, names: list[str]) -> dict[str, bytes]:
        if not names:
            return {}
        prefix = f"{kind}/" if kind else ""
        got = self._storage().get_many(prefix + n for n in names)
        return {n.rsplit("/", 1)[-1]: v for n, v in got.items()}

    # --- reading ------------------------------------------------------------------------------

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

    def url_of(
        self, record: CommitRecord | HoldingRecord | KeptRecord | Mapping[str, Any], *, base: str | None = None
    ) -> str:
        """Where a record's file is; relative names are relative to ``base`` (default this store;
        a vault's mirrored commit records are relative to the run store they came from)."""
        u: str = record.url if isinstance(record, (CommitRecord, HoldingRecord, KeptRecord)) else record["url"]
        return u if "://" in u or u.startswith("/") else join(base or self.store, u)

    def listing_stamp(self) -> str | None:
        """A digest of every ledger file's name and change detector (size, times and inode locally;
        an object store's ETag), taken with the same listing a snapshot starts from; None when a
        file has no stamp, there is no file, or the ledger cannot be listed. A reader compares it with the one it took
        before a verified read to reuse what that read proved (``Fleet.read``)."""
        try:
            storage = self._storage()
            entries = storage.walk(CHAINS_DIR, depth=2) + storage.walk(depth=3, skip=(CHAINS_DIR,))
        except (CertckptError, OSError):
            return None
        if not any(e.kind == "file" for e in entries):
            return None  # gone, emptied or never written: each is told apart by a full read only
        h = hashlib.sha256()
        for e in sorted(entries, key=lambda e: e.name):
            if e.kind == "file" and not e.stamp:
                return None
            h.update(f"{e.name}\0{e.kind}\0{e.stamp}\n".encode())
        return h.hexdigest()

    def snapshot(
        self,
        *,
        remembered: dict[str, tuple[int, str]] | None = None,
        remembered_genesis: str | None = None,
        cache: FactsCache | None = None,
        chains: ChainCache | None = None,
    ) -> LedgerSnapshot:
        """Read every record, check every chain (missing ledger: an empty snapshot).

        Args:
            remembered: per writer, the chain head a reader verified before (a chain that is shorter
                now was rolled back: a break).
            remembered_genesis: the SHA-256 of the genesis record a reader verified before (a store
                without it, or with another, was deleted or re-created: a break).
            cache: event segments a reader verified and folded before (only what was appended since
                is parsed; used only where the chains still seal them as they were).
            chains: chain entries and small records a reader verified before (only what the listing
                does not show unchanged is fetched; ``certckpt.trust.chaincache``).

        Raises:
            StorageError: the store cannot be read; CertckptError: an event names no branch or step.
        """
        snap = read_snapshot(
            store=self.store,
            storage=self._storage(),
            trusted_keys=self.trusted_keys,
            url_of=self.url_of,
            remembered=remembered,
            remembered_genesis=remembered_genesis,
            cache=cache,
            chains=chains,
        )
        snap.trust = self.trust
        return snap

    def uncommitted(self, snap: LedgerSnapshot | None = None) -> list[str]:
        """Checkpoints directly in the store that no commit record names (ignored by latest-good):
        certified files, and sharded checkpoint directories whose manifest was written."""
        snap = snap or self.snapshot()
        p = snap.parsed
        named = {r.url.rstrip("/") for r in (p.holdings if snap.is_vault else p.commits).values()}
        named |= {r.url for r in p.kept.values()}
        storage = storage_for(self.store)
        entries = storage.listdir()
        names = [e.name for e in entries]
        sharded = {e.name for e in entries if e.kind == "directory" and storage.exists(f"{e.name}/{MANIFEST_NAME}")}
        return sorted(
            join(self.store, n)
            for n in names
            if (n.endswith(".safetensors") or n in sharded) and n not in named and join(self.store, n) not in named
        )


class LedgerSink:
    """An ``EventSink`` that batches events into ledger segments (written at ``flush``).

    Thread-safe: a checkpoint committed from a background saver (Lightning's ``AsyncCheckpointIO``)
    flushes while the training thread emits; segments are written one at a time, in order."""

    def __init__(self, ledger: Ledger, *, max_buffer: int = 4096):
        self.ledger = ledger
        self.max_buffer = max_buffer
        self._buffer: list[Any] = []
        self._lock = threading.RLock()

    def emit(self, event: Any) -> None:
        with self._lock:
            self._buffer.append(event)
            if len(self._buffer) >= self.max_buffer:
                self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._buffer:
                batch, self._buffer = self._buffer, []
                self.ledger.append_events(batch)
