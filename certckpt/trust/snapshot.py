"""Reading a ledger: every record checked like user input, chains checked for gaps, and only what an
intact, authenticated chain seals counted in favour of trust.

``read_snapshot`` is the ledger's read path (``Ledger.snapshot`` calls it). Rules (docs/signing.md):

- a record that could move a verdict toward trusted (a commit, a passing audit event, a branch's
  fork point, a vault holding, a drill, a certificate, an incident decision) counts only when an
  intact entry of its writer's chain seals its bytes, in the scope it belongs to (a branch's chain
  for its events and commits), and, with trusted keys, that chain is signed by one of them;
- evidence against trust (a failed check, a revocation, a retirement, an incident's opening) counts
  signed or not, read pessimistically: an unauthenticated failure is never contained;
- a broken chain (an entry or a record missing, altered, reordered, replayed from another store, or
  a tail sealed by another writer gone) marks its branch ``tampered`` after the last step it proves
  (a store-wide writer's break marks every branch).

Stores written before chains existed (no ``genesis.json``) are read as before, each record on its
own signature, and say so (``LedgerSnapshot.notes``). No torch import.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from certckpt.errors import CertckptError, CheckpointNotFoundError, StorageError
from certckpt.format.signing import TrustedKeys
from certckpt.format.trustconfig import TrustConfig
from certckpt.storage import VAULT_MARK, Storage, is_missing_bucket, remote_error_text, storage_for

from .certify import CheckpointEntry, Revocation
from .chain import (
    CHAINS_DIR,
    GENESIS,
    Break,
    ChainCheck,
    Proven,
    check_chains,
    digest,
    genesis_problem,
    parse_entry_name,
)
from .chaincache import ChainCache
from .factcache import FactsCache
from .facts import AuditFacts, EventProblem, read_event
from .incident import incident_state
from .listing import MAX_RECORD_BYTES, MAX_SMALL_RECORD_BYTES, Taken, keep, take, take_again
from .records import (
    KINDS,
    AppealRecord,
    BranchRecord,
    CertificateRecord,
    ClearanceRecord,
    CommitRecord,
    ConvictionRecord,
    DrillRecord,
    FleetRecord,
    HoldingRecord,
    IncidentRecord,
    KeptRecord,
    Outcome,
    PlacementRecord,
    Record,
    RetiredRecord,
    RevocationRecord,
    StoreRecord,
    parse_record,
)

__all__ = [
    "FleetRecords",
    "LedgerSnapshot",
    "ParsedRecords",
    "MAX_RECORD_BYTES",
    "MAX_SMALL_RECORD_BYTES",
    "SOURCES_DIR",
    "read_snapshot",
]

SOURCES_DIR = "sources"  # a vault's copy of its source run's genesis record
# What a vault copies from its run (the rest of a run's records may be absent there).
MIRRORED_KINDS = frozenset({"checkpoints", "branches", "events", "revocations", "incidents", "placements"})
# Records that can move a verdict toward trusted (or make a copy count as held), or free space.
# Appeals and clearances set a device's convictions aside: they count only authenticated. A retirement
# says a checkpoint's file is gone by policy and a keep says where it lives now: what a rotation
# reads to decide that a name holds no committed file, so an unsealed one would let a rotation write
# over a checkpoint's file (a crash's unsealed record is completed when the retirement is retried).
# Convictions, placements and a fleet's store registrations only add doubt: they count signed or not.
_FOR_TRUST = (
    "checkpoints",
    "holdings",
    "branches",
    "drills",
    "certificates",
    "appeals",
    "clearances",
    "retired",
    "kept",
)
BRANCH_KINDS = ("checkpoints", "branches", "placements")  # records sealed by their branch's chain
_BATCH = 256  # event segments read per request: bounded memory, few round trips
# Listings again of the chains that look truncated (see read_snapshot). Each can race the writers
# again: with two writers appending without pause, three were lapped in the suite under load (a false
# break); a true truncation stays through every one, and each lists only the chains still behind.
_RELISTS = 8
_BATCH_BYTES = 256 << 20  # event segments held at once while they are hashed
# Segments hashed by this read are kept for folding up to this many bytes, so that a warm read (a
# few new segments) fetches each once; beyond it (a cold read of a big ledger) they are read again.
_KEEP_BYTES = 64 << 20
_R = TypeVar("_R", bound=Record)
_F = TypeVar("_F", bound=FleetRecord)


def _for_trust(kind: str, r: Record) -> bool:
    # An incident's opening only adds caution; its decisions (rollback targets, approvals,
    # returns to service, closing) steer what happens next, so they count only when authenticated.
    return kind in _FOR_TRUST or (isinstance(r, IncidentRecord) and not r.is_opening)


@dataclass(kw_only=True, slots=True)
class FleetRecords:
    """A fleet registry's records that stand (each says whether it is ``authenticated``)."""

    convictions: list[ConvictionRecord] = field(default_factory=list)
    appeals: list[AppealRecord] = field(default_factory=list)
    clearances: list[ClearanceRecord] = field(default_factory=list)
    stores: list[StoreRecord] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class ParsedRecords:
    """The records that stand, typed (``records.parse_record``): what the trust layer reads."""

    commits: dict[str, CommitRecord] = field(default_factory=dict)  # ckpt_id -> commit record
    holdings: dict[str, HoldingRecord] = field(default_factory=dict)  # vaults: ckpt_id -> holding
    retired: dict[str, RetiredRecord] = field(default_factory=dict)  # ckpt_id -> retirement record
    kept: dict[str, KeptRecord] = field(default_factory=dict)  # ckpt_id -> where a rotation moved its file
    certificates: dict[str, CertificateRecord] = field(default_factory=dict)  # ckpt_id -> latest certificate
    drills: list[DrillRecord] = field(default_factory=list)
    incidents: list[IncidentRecord] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class LedgerSnapshot:
    """Everything the ledger holds, read at one moment.

    Attributes:
        facts: the audit events that count, folded for the certifier.
        failures: every failed-check event read (signed or not), as stored.
        chained: the store has a genesis record and its writers chain their records.
        breaks: per writer, the first broken link of its chain.
        tampered: per branch (``"*"``: every branch), the last step its chains prove intact.
        notes: what a reader should know about how this ledger was read (one line each).
        invalid: records used for nothing (or, for failures, read pessimistically), with the reason.
        parsed: the records that stand, typed. ``records``, ``holdings``, ``retired``, ``kept``,
            ``certificates``, ``drills`` and ``incident_records`` are the same records as stored
            (their JSON objects), for the callers outside ``certckpt.trust`` that still index them.
    """

    checkpoints: list[CheckpointEntry] = field(default_factory=list)
    parsed: ParsedRecords = field(default_factory=ParsedRecords)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> commit record
    facts: AuditFacts = field(default_factory=AuditFacts)
    failures: list[dict[str, Any]] = field(default_factory=list)
    revocations: list[Revocation] = field(default_factory=list)
    certificates: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> latest certificate
    branch_parents: dict[str, str] = field(default_factory=dict)
    segments: int = 0
    holdings: dict[str, dict[str, Any]] = field(default_factory=dict)  # vaults: ckpt_id -> holding
    retired: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> retirement record
    kept: dict[str, dict[str, Any]] = field(default_factory=dict)  # ckpt_id -> where a rotation moved its file
    drills: list[dict[str, Any]] = field(default_factory=list)
    incident_records: list[dict[str, Any]] = field(default_factory=list)
    is_vault: bool = False
    # a vault: its mark is sealed by the vault's own chain, in an entry that counts for this reader
    # (intact, and authenticated under its trusted keys); a promoter seals it again only when not
    mark_sealed: bool = False
    invalid: list[tuple[str, str]] = field(default_factory=list)  # (kind/file, why): records ignored
    # The keys this snapshot was read with: checkpoint files must be signed by one of them too.
    trusted_keys: TrustedKeys | None = None
    trust: TrustConfig | None = None  # the reader's whole configuration (set by Ledger.snapshot)
    chained: bool = False
    store_id: str | None = None
    breaks: list[Break] = field(default_factory=list)
    tampered: dict[str, int] = field(default_factory=dict)
    # per branch, the step after which a fleet registry named by its placements cannot vouch for the
    # devices (set when the registries are read, ``runstore.convicted_ranges_for``)
    unproven_after: dict[str, int] = field(default_factory=dict)
    # the convictions that reach this run: per placement of a convicted device, the steps it computed
    # and the conviction's evidence (set when the registries are read, ``runstore.convicted_ranges_for``;
    # what the timeline draws)
    device_convictions: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # (record, counts): where a run's ranks ran at each start (runs configured with a fleet)
    placements: list[tuple[PlacementRecord, bool]] = field(default_factory=list)
    # a fleet registry's records, each with whether a trusted writer vouches for it
    fleet: FleetRecords = field(default_factory=FleetRecords)
    heads: dict[str, tuple[int, str]] = field(default_factory=dict)
    # what a reader may remember of this store: its genesis's SHA-256, and the heads of the writers
    # that count (with trusted keys, an unauthenticated writer's head is never remembered)
    genesis: str | None = None
    memorable_heads: dict[str, tuple[int, str]] = field(default_factory=dict)
    event_loader: Callable[[], list[dict[str, Any]]] | None = None
    facts_cache: FactsCache | None = None  # what a reader keeps to read only new segments next time
    chain_cache: ChainCache | None = None  # what a reader keeps to read only new chain entries next time
    loaded_events: list[dict[str, Any]] | None = None

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every audit event that counts, as stored (read again on first use: a big ledger's events
        are folded into ``facts`` while reading, not kept)."""
        if self.loaded_events is None:
            self.loaded_events = self.event_loader() if self.event_loader is not None else []
        return self.loaded_events

    def event_branches(self) -> set[str]:
        """Branches the audit events name (without reading the events again, as ``events`` would)."""
        failed: set[str] = {
            f["branch"] for f in self.failures if isinstance(f, dict) and isinstance(f.get("branch"), str)
        }
        return set(self.facts.branches) | {e.branch for e in self.facts.doubtful} | failed

    def open_incidents(self) -> list[str]:
        """Ids of the incidents not closed yet."""
        return [i.incident_id for i in incident_state(r.raw for r in self.parsed.incidents).values() if i.is_open]

    def available(self, ckpt_id: str) -> bool:
        """Whether this store holds the checkpoint's file (not pruned; in a vault, promoted here)."""
        p = self.parsed
        return ckpt_id not in p.retired and (not self.is_vault or ckpt_id in p.holdings)

    def header_digest(self, ckpt_id: str) -> str | None:
        return self.parsed.commits[ckpt_id].header_digest

    def publish_raw(self) -> None:
        """Fill the as-stored views (``records``, ``holdings``...) from ``parsed``."""
        p = self.parsed
        self.records = {k: v.raw for k, v in p.commits.items()}
        self.holdings = {k: v.raw for k, v in p.holdings.items()}
        self.retired = {k: v.raw for k, v in p.retired.items()}
        self.kept = {k: v.raw for k, v in p.kept.items()}
        self.certificates = {k: v.raw for k, v in p.certificates.items()}
        self.drills = [dict(d.raw, drill_id=d.drill_id) for d in p.drills]
        self.incident_records = [i.raw for i in p.incidents]


def _segment_lines(data: bytes) -> list[object]:
    """The JSON values of a segment's lines (None for a line that is not JSON); one parse per segment."""
    lines = [ln for ln in data.split(b"\n") if ln.strip()]
    try:
        values: list[object] = json.loads(b"[" + b",".join(lines) + b"]")  # a JSON array: its lines' values
        if len(values) == len(lines):
            return values
    except (ValueError, RecursionError):
        pass
    out: list[object] = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except (ValueError, RecursionError):
            out.append(None)
    return out


def read_snapshot(
    *,
    store: str,
    storage: Storage,
    trusted_keys: TrustedKeys | None,
    url_of: Callable[..., str],
    remembered: dict[str, tuple[int, str]] | None = None,
    remembered_genesis: str | None = None,
    cache: FactsCache | None = None,
    chains: ChainCache | None = None,
) -> LedgerSnapshot:
    """Read and check every record of one ledger (missing ledger: an empty snapshot).

    Args:
        remembered: per writer, the chain head this reader verified before (rollback check).
        remembered_genesis: the SHA-256 of the genesis record this reader verified before: a store
            without it, or with another one, was deleted or re-created (a break).
        cache: event segments this reader verified and folded before: used only where the chains
            still seal them as they were (``LedgerSnapshot.facts_cache`` is the cache to keep next).
        chains: chain entries and small records this reader verified before: used only for what the
            listing shows unchanged (``LedgerSnapshot.chain_cache`` is the cache to keep next); a
            read it cannot finish exactly (a proven start that no longer holds, a chain behind a
            claim) is done again without it.

    Raises:
        CheckpointNotFoundError: no such store; StorageError: it cannot be read; CertckptError: an
        event names no branch or step (the store cannot be certified until it is repaired).
    """
    try:
        if not storage.exists():
            if remembered_genesis is not None:
                return _gone(trusted_keys, "the ledger is gone (deleted)")
            if not storage_for(store).exists():
                raise CheckpointNotFoundError(f"{store}: no such run store")
            return LedgerSnapshot(trusted_keys=trusted_keys)
        keys = sorted(trusted_keys.keys) if trusted_keys is not None else []

        def reader_of(taken: Taken) -> _Reader:
            reader = _Reader(store, trusted_keys, url_of, taken, remembered, storage, cache)
            reader.remembered_genesis = remembered_genesis
            reader.hash_segments()
            reader.check_chains()
            return reader

        def settled(reader: _Reader) -> _Reader:
            # A chain that looks behind another writer's claim is listed again (only that chain),
            # a few times: each listing can race the writers again (with two writers appending
            # without pause, three were lapped in the suite under load), a true truncation stays.
            for _ in range(_RELISTS):
                if reader.check is None or not reader.check.behind:
                    break
                reader = reader_of(take_again(storage, reader.taken, reader.check.behind))
            return reader

        segments = cache.segments if cache is not None else ()
        reader = settled(reader_of(take(storage, chains=chains, keys=keys, segments=segments)))
        if reader.check is not None and reader.check.incomplete:
            reader = settled(reader_of(take(storage, chains=None, keys=keys)))
        snap = reader.read()
        if snap.chained and snap.store_id is not None:
            snap.chain_cache = keep(reader.taken, reader.check, store_id=snap.store_id, keys=keys, before=chains)
        return snap
    except (CertckptError, FileNotFoundError) as e:
        if isinstance(e, CertckptError):
            raise
        if remembered_genesis is not None:
            return _gone(trusted_keys, "the store is gone (deleted)")
        if is_missing_bucket(e):
            raise StorageError(f"{store}: cannot read the ledger ({remote_error_text(e)})") from e
        raise CheckpointNotFoundError(f"{store}: no such run store") from e
    except Exception as e:  # OSError, and botocore's own types (no credentials, unreachable endpoint)
        raise StorageError(f"{store}: cannot read the ledger ({remote_error_text(e)})") from e


_FORGET = "`certckpt status --forget-memory STORE` accepts a store re-created on purpose"


def _gone(trusted_keys: TrustedKeys | None, why: str) -> LedgerSnapshot:
    """A store this reader verified before that is not there now: a break, never an empty store."""
    snap = LedgerSnapshot(trusted_keys=trusted_keys, chained=True)
    snap.breaks.append(Break(writer="genesis", seq=0, scope="store", why=f"{why}; this reader verified it before"))
    snap.tampered["*"] = -1
    return snap


class _Reader:
    """One snapshot's reading, in the order the rules need: chains, records, events."""

    def __init__(
        self,
        store: str,
        trusted_keys: TrustedKeys | None,
        url_of: Callable[..., str],
        taken: Taken,
        remembered: dict[str, tuple[int, str]] | None,
        storage: Storage,
        cache: FactsCache | None,
    ) -> None:
        self.store, self.keys, self.url_of = store, trusted_keys, url_of
        self.taken, self.remembered, self.storage = taken, remembered, storage
        listing, contents = taken.listing, dict(taken.contents)
        self.listing, self.contents = listing, contents
        self.digests: dict[tuple[str, str], str] = {}
        self.cache: FactsCache | None = cache
        segments = set(listing.get("events", []))
        # segment name -> its change detector (see hash_segments), and its listed size (batches are
        # bounded by bytes)
        self.stamps = {p.rsplit("/", 1)[-1]: v for p, v in taken.stamps.items() if p in segments}
        self.sizes = {p.rsplit("/", 1)[-1]: v for p, v in taken.sizes.items() if p in segments}
        self.kept: dict[str, bytes] = {}  # segments hashed by this read, kept for folding (bounded)
        self.files: dict[str, list[str]] = {k: sorted(listing.get(k, [])) for k in KINDS}
        self.segment_names = [p.rsplit("/", 1)[-1] for p in self.files["events"]]
        for k in KINDS:
            if k == "events":
                continue
            for p in self.files[k]:
                self.digests[k, p.rsplit("/", 1)[-1]] = digest(contents[p])
        for p in listing.get("", []):
            self.digests["", p.rsplit("/", 1)[-1]] = digest(contents[p])
        self.snap = LedgerSnapshot(segments=len(self.files["events"]), trusted_keys=trusted_keys)
        self.snap.invalid.extend(taken.refused)
        self.check: ChainCheck | None = None
        self.source: str | None = None  # a vault's source run's store id, when the vault vouches for it
        # per writer, the store its first entry names: untrusted JSON (any value), only ever compared
        self.writer_store: dict[str, object] = {}
        self.remembered_genesis: str | None = None
        self._chains_checked = False

    # --- event segments: hashed first (the chains need their digests), parsed once they are judged --

    def _batches(self, names: list[str]) -> Iterator[tuple[str, bytes]]:
        """The segments' bytes in order, at most ``_BATCH`` segments and ``_BATCH_BYTES`` (as listed)
        fetched at a time; one kept since it was hashed (``kept``) is not fetched again."""
        by_name = {p.rsplit("/", 1)[-1]: p for p in self.files["events"]}
        i = 0
        while i < len(names):
            j, held = i, 0
            while j < len(names) and j - i < _BATCH and (j == i or held + self.sizes.get(names[j], 0) <= _BATCH_BYTES):
                held += 0 if names[j] in self.kept else self.sizes.get(names[j], 0)
                j += 1
            paths = [by_name[n] for n in names[i:j] if n not in self.kept]
            got = self.storage.get_many(paths)
            for n in names[i:j]:
                kept = self.kept.pop(n, None)
                yield (
                    n,
                    kept if kept is not None else got.get(by_name[n], b""),
                )  # a sealed segment gone breaks its chain
            i = j

    def hash_segments(self) -> None:
        """Every segment's SHA-256. A segment this reader verified before and whose stamp (size,
        times, inode; on an object store its ETag) has not moved since keeps the digest it had; any
        other is read and hashed (a rewritten segment then breaks its chain)."""
        known = self.cache.segments if self.cache is not None else {}
        stamps = self.cache.stamps if self.cache is not None else {}
        same = {n for n in self.segment_names if n in known and stamps.get(n) and stamps.get(n) == self.stamps.get(n)}
        fresh = [n for n in self.segment_names if n not in same]
        for n in same:
            self.digests["events", n] = known[n][0]
        kept = 0
        for n, data in self._batches(fresh):
            self.digests["events", n] = digest(data)
            if kept + len(data) <= _KEEP_BYTES:
                self.kept[n] = data  # folded soon after (a cold read of a big ledger reads the rest again)
                kept += len(data)

    # --- chains ----------------------------------------------------------------------------------

    def _top(self, name: str) -> bytes | None:
        return next((self.contents[p] for p in self.listing.get("", []) if p.rsplit("/", 1)[-1] == name), None)

    def check_chains(self) -> None:
        """Walk every chain (once; ``read`` needs it first)."""
        if not self._chains_checked:
            self._chains_checked = True
            self._chains()

    def _chains(self) -> None:
        snap = self.snap
        genesis = self._top(GENESIS)
        if genesis is None:
            self._no_genesis()
            return
        snap.chained = True
        gdoc = self._genesis(genesis)
        if gdoc is None:
            return
        own: str = gdoc["store_id"]  # genesis_problem checked it is a string
        snap.store_id = own
        snap.genesis = digest(genesis)
        if self.remembered_genesis is not None and snap.genesis != self.remembered_genesis:
            self._break_store(f"its genesis record is not the one this reader verified before (re-created); {_FORGET}")
            return
        stores = {own: snap.genesis}
        mark = self._mark()
        source = mark.get("source_store") if isinstance(mark, dict) else None
        self._source_genesis(source, stores)
        entries = self._chain_entries()
        proven = self.taken.proven
        if not entries and not proven and any(self.files[k] for k in KINDS):
            # Every record is written, then sealed: records with no chain at all lost their chains.
            self._break_store("records but no chain entry at all: the chains were deleted")
            return

        def record_digest(store_id: str, kind: str, name: str) -> str | None:
            return self.digests.get((kind, name))

        self.check = check_chains(
            entries,
            stores=stores,
            record_digest=record_digest,
            trusted_keys=self.keys,
            optional=lambda store_id, kind: store_id != own and kind not in MIRRORED_KINDS,
            remembered=self.remembered,
            proven=proven,
            claims=self.taken.claims,
        )
        if self.check.incomplete:
            return  # read again without the cache (read_snapshot)
        self._note_writer_stores(entries, proven)
        if self.source is not None:
            self._check_vault_mark(self.check, own)
        snap.heads = dict(self.check.heads)
        snap.memorable_heads = {w: h for w, h in snap.heads.items() if w not in self.check.unauthenticated}
        for writer, why in sorted(self.check.unauthenticated.items()):
            snap.invalid.append((f"{CHAINS_DIR}/{writer}", f"{why}: its records count only against trust"))
        snap.breaks.extend(self.check.breaks[w] for w in sorted(self.check.breaks))
        if self.source is None and isinstance(source, str):
            snap.notes.append(f"this vault's source run {source[:32]} has no authenticated genesis copy")

    def _no_genesis(self) -> None:
        """A store without a genesis record: chains without it lost it (deleted), records without
        chains were written before chained ledgers existed."""
        snap = self.snap
        anything = any(self.listing.values())
        if self.listing.get(CHAINS_DIR):
            # chains without the identity they link to: the genesis record was deleted
            self._break_store("genesis record missing (deleted)")
        elif self.remembered_genesis is not None:
            self._break_store(f"genesis record missing: this reader verified this store chained before; {_FORGET}")
        elif self.keys is not None and anything:
            # Under trusted keys an unchained store proves nothing about what is missing from it, and
            # deleting a genesis with its chains must not turn a store into an "old" one.
            self._break_store(
                "no genesis record: an unchained ledger proves nothing under trusted keys (deleted, or written "
                "before chained ledgers: start a new store)"
            )
        elif any(self.files[k] for k in KINDS):
            snap.notes.append(
                "unchained ledger (written before chained ledgers): a deleted or replayed record cannot be "
                "detected; start a new run store (an empty directory or prefix) to get a chained ledger"
            )

    def _break_store(self, why: str) -> None:
        """A store-wide break: every checkpoint of every branch is tampered."""
        self.snap.chained = True
        self.snap.breaks.append(Break(writer="genesis", seq=0, scope="store", why=why))
        self.snap.tampered["*"] = -1

    def _genesis(self, genesis: bytes) -> dict[str, Any] | None:
        """The genesis record, parsed and checked (None, with every branch marked, when it is not one)."""
        try:
            gdoc = json.loads(genesis)
        except (ValueError, RecursionError):
            gdoc = None
        why = genesis_problem(gdoc)
        if why is None and self.keys is not None and self.keys.problem(gdoc) is not None:
            # Anyone can create a store: an unsigned genesis over a re-created store would otherwise
            # read as a young, intact one (a registry without its convictions).
            why = "not signed by a trusted key (created by a writer without one, or re-created)"
        if why is not None:
            self._break_store(f"genesis record: {why}")
            return None
        return cast(dict[str, Any], gdoc)  # json.loads gives Any; genesis_problem found a JSON object

    def _source_genesis(self, source: object, stores: dict[str, str]) -> None:
        """A vault's copy of its source run's genesis record: when it is one, the source's entries
        belong here too (``stores``) and the vault vouches for that run (``self.source``)."""
        sources = {p.rsplit("/", 1)[-1]: p for p in self.listing.get(SOURCES_DIR, [])}
        if isinstance(source, str) and f"{source}.json" in sources:
            sdata = self.contents[sources[f"{source}.json"]]
            try:
                sdoc = json.loads(sdata)
            except (ValueError, RecursionError):
                sdoc = None
            if genesis_problem(sdoc) is None and sdoc["store_id"] == source:
                stores[source] = digest(sdata)  # its entries are what keys authenticate
                self.source = source

    def _chain_entries(self) -> dict[str, dict[int, bytes]]:
        """Every chain entry's bytes, by writer and sequence number (a file not named like an entry is
        recorded as invalid)."""
        entries: dict[str, dict[int, bytes]] = {}
        prefix = f"{CHAINS_DIR}/"
        for p in self.listing.get(CHAINS_DIR, []):
            writer, _, name = p[len(prefix) :].partition("/")
            seq = parse_entry_name(name)
            if seq is None or "/" in name:
                self.snap.invalid.append((f"{CHAINS_DIR}/{writer}/{name}"[:120], "not a chain entry name"))
                continue
            p_start = self.taken.proven.get(writer)
            if p_start is not None and seq <= len(p_start.shas):
                continue  # proven at an earlier read, unchanged since: its bytes were not fetched
            entries.setdefault(writer, {})[seq] = self.contents[p]
        return entries

    def _note_writer_stores(self, entries: dict[str, dict[int, bytes]], proven: dict[str, Proven]) -> None:
        """The store each writer's first entry names (a vault holds its source run's writers too)."""
        for writer, p in proven.items():
            self.writer_store[writer] = p.stores[0]
        for writer, files in entries.items():
            if writer in proven:
                continue
            first = files.get(min(files)) if files else None
            try:
                self.writer_store[writer] = json.loads(first).get("store") if first else None
            except (ValueError, AttributeError, RecursionError):
                pass

    def _check_vault_mark(self, check: ChainCheck, own: str) -> None:
        """A vault's source run counts only when the vault's own chain seals the mark that names it."""
        s = check.sealed.get(("", VAULT_MARK))
        if s is None or not s.counts or self.writer_store.get(s.writer) != own:
            self.snap.notes.append(
                "this vault's mark naming its source run is not sealed by the vault's own chain: "
                "the run's records count for nothing here"
            )
            self.source = None

    def _mark(self) -> object:
        data = self._top(VAULT_MARK)
        if data is None:
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError):
            return {}

    def counts(self, kind: str, name: str, *, branch: str | None = None) -> tuple[bool, str | None]:
        """Whether a record may count for trust, and why not."""
        if not self.snap.chained:
            return True, None  # unchained: the caller applies each record's own signature
        if self.check is None:
            return False, "the store's chains cannot be verified"
        s = self.check.sealed.get((kind, name))
        if s is None:
            return False, "sealed by no chain entry (written by someone other than a certckpt writer, or a crash)"
        if not s.counts:
            if s.writer in self.check.breaks:
                return False, f"sealed after a break in writer {s.writer}'s chain"
            return False, f"its chain is not authenticated ({self.check.unauthenticated.get(s.writer, 'unsigned')})"
        scope = self.check.scopes.get(s.writer)
        want = f"branch:{branch}" if branch is not None else ("cache" if kind == "certificates" else "store")
        if scope != want:
            return False, f"sealed by writer {s.writer} of scope {scope}, not {want}"
        store_id = self.writer_store.get(s.writer)
        if store_id != self.snap.store_id and not (
            store_id == self.source and kind in MIRRORED_KINDS | {"certificates"}
        ):
            return False, f"sealed by a writer of store {str(store_id)[:32]}, whose records do not count here"
        return True, None

    # --- records ---------------------------------------------------------------------------------

    def _load(self, path: str) -> object:
        try:
            return json.loads(self.contents[path])
        except (KeyError, ValueError, RecursionError):
            return None

    def _valid(self, kind: str, cls: type[_R]) -> Iterator[tuple[str, _R, bool]]:
        """(name, record, counts-for-trust) of every well-formed record of one kind, parsed once."""
        snap = self.snap
        for p in self.files[kind]:
            name = p.rsplit("/", 1)[-1]
            r = self._load(p)
            got = "not readable JSON" if r is None else parse_record(kind, name, r)
            ok = True
            if isinstance(got, Record):
                if snap.chained:
                    branch = got.sealing_branch() if kind in BRANCH_KINDS else None
                    ok, reason = self.counts(kind, name, branch=branch)
                elif self.keys is not None:
                    reason = self.keys.problem(got.raw)  # the record as stored: its signature covers it
                    ok = reason is None
                else:
                    reason = None
                if not ok and reason is not None and _for_trust(kind, got):
                    got = reason
            if isinstance(got, cls):
                yield name, got, ok
            else:
                snap.invalid.append((f"{kind}/{name}", got if isinstance(got, str) else f"not a {cls.__name__}"))

    def read(self) -> LedgerSnapshot:
        snap = self.snap
        self.check_chains()
        mark = self._mark()
        snap.is_vault = mark is not None or bool(self.files["holdings"])
        snap.mark_sealed = mark is not None and snap.chained and self.counts("", VAULT_MARK)[0]
        writer_steps: dict[str, int] = {}

        def note_step(kind: str, name: str, step: int) -> None:
            s = self.check.sealed.get((kind, name)) if self.check else None
            if s is not None and s.counts:
                writer_steps[s.writer] = max(writer_steps.get(s.writer, -1), step)

        parsed = snap.parsed
        for name, c, _ in self._valid("checkpoints", CommitRecord):
            parsed.commits[c.ckpt_id] = c
            note_step("checkpoints", name, c.step)
        snap.facts = AuditFacts()
        for _, h, _ in self._valid("holdings", HoldingRecord):
            parsed.holdings[h.ckpt_id] = h
        for _, t, _ in self._valid("retired", RetiredRecord):
            if not snap.is_vault or not snap.chained or self._own(("retired", f"{t.ckpt_id}.json")):
                parsed.retired[t.ckpt_id] = t
        if not snap.is_vault:
            for _, k, _ in self._valid("kept", KeptRecord):
                parsed.kept[k.ckpt_id] = k
        parsed.drills = [d for _, d, _ in self._valid("drills", DrillRecord)]
        parsed.incidents = [i for _, i, _ in self._valid("incidents", IncidentRecord)]
        for _, b, _ in self._valid("branches", BranchRecord):
            snap.branch_parents[b.branch] = b.parent
        self._fleet_records()
        source = mark.get("source") if isinstance(mark, dict) else None
        for c in parsed.commits.values():
            snap.checkpoints.append(self._entry(c, base=source if isinstance(source, str) else None))
        counted = self._fold_events(writer_steps)
        if not snap.chained and self.keys is not None:
            self._unchained_signed_passes(self.keys)
        authenticated = snap.chained or self.keys is not None
        for _, v, ok in self._valid("revocations", RevocationRecord):
            snap.revocations.append(
                Revocation(ckpt_id=v.ckpt_id, reason=v.reason, by=v.by, at=v.at, authenticated=ok and authenticated)
            )
        for _, cert, _ in self._valid("certificates", CertificateRecord):
            prev = parsed.certificates.get(cert.ckpt_id)
            if prev is None or cert.at >= prev.at:
                parsed.certificates[cert.ckpt_id] = cert
        snap.publish_raw()
        self._marks(writer_steps)
        snap.event_loader = lambda: self._events(counted)
        self.contents = {}  # the records are parsed; the bytes are not needed any more
        return snap

    def _entry(self, c: CommitRecord, *, base: str | None) -> CheckpointEntry:
        """The certifier's view of one commit; its file is where a vault holds it, where a rotation
        kept it, else where it was committed (a vault's mirrored records: relative to its source run)."""
        snap, parsed = self.snap, self.snap.parsed
        held: HoldingRecord | KeptRecord | None = parsed.holdings.get(c.ckpt_id)
        held = held if held is not None else parsed.kept.get(c.ckpt_id)
        return CheckpointEntry(
            ckpt_id=c.ckpt_id,
            branch=c.branch,
            step=c.step,
            parent=c.parent or snap.branch_parents.get(c.branch),
            consensus_fp=c.consensus_fp,
            committed_at=c.committed_at,
            url=self.url_of(held) if held is not None else self.url_of(c, base=base),
        )

    def _fleet_records(self) -> None:
        """A run's placements, and a fleet registry's records (each with whether it is authenticated)."""
        snap = self.snap
        snap.placements = [(r, ok) for _, r, ok in self._valid("placements", PlacementRecord)]
        authenticated = snap.chained or self.keys is not None

        def vouched(r: _F, ok: bool) -> _F:
            return replace(r, authenticated=ok and authenticated, raw=dict(r.raw, authenticated=ok and authenticated))

        fleet = snap.fleet
        fleet.convictions = [vouched(r, ok) for _, r, ok in self._valid("convictions", ConvictionRecord)]
        fleet.appeals = [vouched(r, ok) for _, r, ok in self._valid("appeals", AppealRecord)]
        fleet.clearances = [vouched(r, ok) for _, r, ok in self._valid("clearances", ClearanceRecord)]
        fleet.stores = [vouched(r, ok) for _, r, ok in self._valid("stores", StoreRecord)]

    def _segment_standing(self, name: str) -> tuple[bool, str | None, str | None, str | None]:
        """(counts, why not, its chain's branch, its writer) of one event segment."""
        if not self.snap.chained:
            return True, None, None, None
        s = self.check.sealed.get(("events", name)) if self.check else None
        scope = self.check.scopes.get(s.writer) if (self.check and s) else None
        branch = scope.removeprefix("branch:") if scope and scope.startswith("branch:") else None
        ok, reason = self.counts("events", name, branch=branch)
        return ok, reason, branch, s.writer if s else None

    def _usable_cache(self) -> FactsCache | None:
        """The cache, when every segment it lists still stands as it did (else None: start over)."""
        c, snap = self.cache, self.snap
        if c is None or not snap.chained or c.store_id != snap.store_id:
            return None
        if c.keys != (sorted(self.keys.keys) if self.keys is not None else []):
            return None
        present = set(self.segment_names)
        for name, (sha, counted) in c.segments.items():
            if name not in present or self._segment_standing(name)[0] != counted:
                return None
            if self.digests.get(("events", name)) != sha:
                return None  # rewritten since this reader folded it
            s = self.check.sealed.get(("events", name)) if self.check else None
            if s is None or s.sha256 != sha:
                return None
        return c

    def _fold_events(self, writer_steps: dict[str, int]) -> dict[str, bool]:
        """Fold every segment's events into the facts (from the cache where it still stands, the rest
        read again and parsed now); returns whether each segment counted."""
        snap = self.snap
        cache = self._usable_cache()
        counted: dict[str, bool] = {}
        if cache is not None:
            snap.facts = cache.facts
            snap.failures.extend(cache.failures)
            snap.invalid.extend(cache.invalid)
            for w, st in cache.writer_steps.items():
                writer_steps[w] = max(writer_steps.get(w, -1), st)
            counted.update({n: c for n, (_, c) in cache.segments.items()})
        out = FactsCache(
            store_id=snap.store_id or "",
            keys=sorted(self.keys.keys) if self.keys is not None else [],
            segments={n: (self.digests["events", n], c) for n, c in counted.items()},
            stamps=dict(self.stamps),
        )
        new_invalid_from = len(snap.invalid)
        fresh = [n for n in self.segment_names if n not in counted]
        for name, data in self._batches(fresh):
            ok, reason, branch, writer = self._segment_standing(name)
            counted[name] = ok
            top, failures = self._fold_segment(name, data, ok=ok, reason=reason, branch=branch)
            if snap.chained and ok and writer is not None:
                writer_steps[writer] = max(writer_steps.get(writer, -1), top)
                out.writer_steps[writer] = max(out.writer_steps.get(writer, -1), top)
            snap.failures.extend(failures)
            out.failures.extend(failures)
            out.segments[name] = (self.digests["events", name], ok)
        if snap.chained:
            if cache is not None:
                out.failures[:0] = cache.failures
                out.invalid = [*cache.invalid, *snap.invalid[new_invalid_from:]]
                for w, st in cache.writer_steps.items():
                    out.writer_steps[w] = max(out.writer_steps.get(w, -1), st)
            else:
                out.invalid = [x for x in snap.invalid[new_invalid_from:] if x[0].startswith("events/")]
            out.facts = snap.facts
            out.unchanged = cache is not None and not fresh and cache.stamps == self.stamps
            snap.facts_cache = out
        return counted

    def _fold_segment(
        self, name: str, data: bytes, *, ok: bool, reason: str | None, branch: str | None
    ) -> tuple[int, list[dict[str, Any]]]:
        """Fold one segment's events; returns the greatest step its counted passes vouch for and its
        failed events as stored. One pass, no intermediate lists: a cold read folds a million lines."""
        snap, keys, chained = self.snap, self.keys, self.snap.chained
        add, invalid = snap.facts.add, snap.invalid
        pass_counts = ok and (chained or keys is None)  # unchained with keys: each line on its signature
        top, failures, passed = -1, [], Outcome.PASS.value
        for n, value in enumerate(_segment_lines(data), 1):
            if type(value) is not dict:
                value = {}
            try:
                ev, why = read_event(value)
            except EventProblem as e:
                raise CertckptError(
                    f"{self.store}: ledger event segment {name}, line {n}, is not a readable audit event ({e}); "
                    "the store cannot be certified until it is restored from a good copy"
                ) from None
            if ev.outcome == passed:
                if pass_counts and why is None and (branch is None or ev.branch == branch):
                    add(ev)
                    if ev.step > top:
                        top = ev.step
                elif chained:
                    if branch is not None and ev.branch != branch:
                        why = why or f"names branch {ev.branch}, sealed in branch {branch}'s chain"
                    invalid.append((f"events/{name}#{n}", why or reason or "not counted"))
                elif why is not None:
                    invalid.append((f"events/{name}#{n}", why))
                continue
            failures.append(value)
            line_ok = ok
            if branch is not None and ev.branch != branch:
                line_ok, why = False, why or f"names branch {ev.branch}, sealed in branch {branch}'s chain"
            if not chained and keys is not None:
                line_ok = keys.problem(value) is None  # an unsigned failure is never contained
            if why is not None:
                invalid.append((f"events/{name}#{n}", why))
            add(ev, counts=line_ok and why is None)
        return top, failures

    def _own(self, key: tuple[str, str]) -> bool:
        s = self.check.sealed.get(key) if self.check else None
        return s is not None and self.writer_store.get(s.writer) == self.snap.store_id

    def _unchained_signed_passes(self, keys: TrustedKeys) -> None:
        """Unchained stores with trusted keys: each passing event counts only on its own signature.
        Read again line by line (these stores are small: they predate chains)."""
        passed = Outcome.PASS.value
        for name, data in self._batches(self.segment_names):
            for n, value in enumerate(_segment_lines(data), 1):
                if not isinstance(value, dict) or value.get("outcome") != passed:
                    continue
                why = keys.problem(value)
                if why is None:
                    ev, bad = read_event(value)
                    if bad is None:
                        self.snap.facts.add(ev)
                else:
                    self.snap.invalid.append((f"events/{name}#{n}", why))

    def _line_counts(self, value: dict[str, Any]) -> bool:
        """A passing line of a segment that counts: in an unchained store with keys, only signed."""
        return self.snap.chained or self.keys is None or self.keys.problem(value) is None

    def _marks(self, writer_steps: dict[str, int]) -> None:
        """Each break's reach: a branch writer's marks its branch after the last step it proved; a
        store writer's (or one whose scope is unknown) marks every branch; a cache writer's nothing."""
        for b in self.snap.breaks:
            if b.scope == "cache":
                continue
            key = b.branch if b.branch is not None else "*"
            last = writer_steps.get(b.writer, -1)
            self.snap.tampered[key] = min(self.snap.tampered.get(key, last), last)

    def _events(self, counted: dict[str, bool]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fail = Outcome.FAIL.value
        for p in self.files["events"]:
            name = p.rsplit("/", 1)[-1]
            for value in _segment_lines(self.storage.get(p, limit=MAX_RECORD_BYTES) or b""):
                if not isinstance(value, dict):
                    continue
                failed = value.get("outcome") == fail
                if failed or (counted.get(name, False) and self._line_counts(value)):
                    out.append(value)
        return out
