"""Chained ledgers: a store identity fixed by a genesis record, one hash chain per writer, and the pure
check that finds the first broken link.

A record signed on its own proves nothing about the records that are missing: deleting a revocation
or a failed check, replaying a record from another store, or truncating a writer's tail passes every
signature. So a chained store (``docs/signing.md``, "Chained ledgers") adds:

- ``_ledger/genesis.json``: ``{"format", "store_id", "created_at"}``, signed by the first writer. Every
  chain entry names the store it belongs to; an entry of another store is a break.
- ``_ledger/chains/<writer>/<seq>.json``: one entry per block a writer writes (an event segment, a
  commit record, a revocation...), signed: ``{"store", "writer", "seq", "prev", "scope", "records":
  [[kind, name, sha256], ...], "seen": {writer: seq}, "at"}``. ``prev`` is the SHA-256 of the
  writer's previous entry file (of the genesis for the first), so the entries of one writer form a
  chain; ``records`` seals each record file by its SHA-256 (one signature per block, however many
  lines it holds); ``seen`` seals the heads of the other writers this writer has listed (a page of the
  chains directory per commit, going round: ``Ledger._heads``) that moved since its chain's previous
  entry (a chain's claims on a writer are their greatest), so a truncated or deleted chain is
  noticed by the next entries of anyone else; ``scope`` says what a
  writer may write (``branch:<name>`` for a branch's events, commits and forks, ``store`` for
  revocations, incidents, retirements and vault records, ``cache`` for certificates).

This module is pure: the ledger reads the bytes and hands them over. No torch import.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from certckpt.format.signing import TrustedKeys

__all__ = [
    "CHAINS_DIR",
    "FORMAT",
    "GENESIS",
    "Break",
    "ChainCheck",
    "Proven",
    "Sealed",
    "check_chains",
    "digest",
    "entry_doc",
    "entry_name",
    "genesis_problem",
    "new_genesis",
    "parse_entry_name",
    "scope_of",
]

GENESIS = "genesis.json"
CHAINS_DIR = "chains"
FORMAT = "certckpt-ledger/2"
_WRITER = re.compile(r"^w[0-9a-f]{16}$")
_ENTRY = re.compile(r"^([0-9]{12})\.json$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_STORE_ID = re.compile(r"^[0-9a-f]{32}$")
_SCOPE = re.compile(r"^(store|cache|branch:[A-Za-z0-9._-]{1,100})$")
_MAX_SEQ = 10**11  # twelve digits in the entry's name


def digest(data: bytes) -> str:
    """SHA-256 of ``data``, hex: what chains link and seal with (xxh3 stops accidents, not people)."""
    return hashlib.sha256(data).hexdigest()


def new_genesis(*, store_id: str, now: float) -> dict[str, object]:
    return {"format": FORMAT, "store_id": store_id, "created_at": now}


def genesis_problem(doc: object) -> str | None:
    """Why a genesis record is not one (None when it is)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return f"not a {FORMAT} genesis record"
    if not isinstance(doc.get("store_id"), str) or not _STORE_ID.match(doc["store_id"]):
        return "its store id is not 32 hex digits"
    return None


def entry_name(seq: int) -> str:
    return f"{seq:012d}.json"


def parse_entry_name(name: str) -> int | None:
    m = _ENTRY.match(name)
    return int(m.group(1)) if m else None


def is_writer_id(value: object) -> bool:
    return isinstance(value, str) and _WRITER.match(value) is not None


def scope_of(kind: str, branch: str | None = None) -> str:
    """The chain a record of ``kind`` belongs to."""
    if kind in ("events", "checkpoints", "branches", "placements"):
        return f"branch:{branch}"
    return "cache" if kind == "certificates" else "store"


def entry_doc(
    *,
    store: str,
    writer: str,
    seq: int,
    prev: str,
    scope: str,
    records: list[tuple[str, str, str]],
    seen: Mapping[str, int],
    now: float,
) -> dict[str, Any]:
    """A chain entry (unsigned): the writer signs it before it is written."""
    return {
        "store": store,
        "writer": writer,
        "seq": seq,
        "prev": prev,
        "scope": scope,
        "records": [list(r) for r in records],
        "seen": dict(sorted(seen.items())),
        "at": now,
    }


@dataclass(frozen=True, slots=True)
class Break:
    """The first broken link of one writer's chain: nothing it wrote from ``seq`` on counts for trust.

    Attributes:
        writer: the writer's id.
        seq: the first entry that is missing, altered or does not link.
        scope: what the writer wrote (``branch:NAME``, ``store``, ``cache``; ``store`` when unknown).
        why: one line.
    """

    writer: str
    seq: int
    scope: str
    why: str

    @property
    def branch(self) -> str | None:
        return self.scope.removeprefix("branch:") if self.scope.startswith("branch:") else None

    def describe(self) -> str:
        return f"writer {self.writer} ({self.scope}) entry {self.seq}: {self.why}"


@dataclass(frozen=True, slots=True)
class Sealed:
    """Where a record file is sealed: by which writer's entry, and whether that entry is in the
    intact, authenticated part of its chain (``counts``: may move a verdict toward trusted)."""

    sha256: str
    writer: str
    seq: int
    counts: bool


@dataclass(kw_only=True, slots=True)
class Proven:
    """What the intact start of one writer's chain proved: enough to carry on from its head without
    reading those entries again (``check_chains(proven=...)``; a reader keeps it, ``chaincache``).

    Attributes:
        shas: the SHA-256 of entries 1, 2, ... in order (the last is the head).
        stores: per entry, the store it names.
        genesis: what its first entry links to (the genesis record's SHA-256 of that store).
        scope: the writer's scope.
        unauthenticated: with trusted keys, why its first entry is not signed by one (None: it is,
            or there are no keys).
        records: ``(seq, kind, name, sha256)`` of every record those entries seal, in order.
    """

    shas: list[str]
    stores: list[str]
    scope: str
    genesis: str
    unauthenticated: str | None = None
    records: list[tuple[int, str, str, str]] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class ChainCheck:
    """What the chains prove about a store's records.

    Attributes:
        sealed: ``(kind, name)`` -> where it is sealed (the first intact entry that lists it, else the
            first one after a break).
        breaks: per writer, its first broken link.
        heads: per writer, ``(seq, sha256 of the entry)`` of its last intact entry.
        scopes: per writer, its declared scope.
        unauthenticated: writers whose chain starts unsigned or signed by an untrusted key (with
            trusted keys): their records count only against trust; not a break.
        behind: writers broken only because another writer's entry saw more of their chain than was
            given: truncation, or (for a reader listing one chain after another) entries appended
            between the two listings; a reader lists again before it calls that a break.
        claims: per writer, the greatest entry number an entry that counts for truncation (intact,
            and with trusted keys authenticated) says it saw.
        proven: per writer whose chain is intact to its head, what it proved (for the next read).
        incomplete: a check resumed from ``proven`` that cannot say by itself what broke (a proven
            start that no longer holds, a claim beyond a head: its exact break needs the entries the
            reader skipped); the reader checks again from every entry.
    """

    sealed: dict[tuple[str, str], Sealed] = field(default_factory=dict)
    breaks: dict[str, Break] = field(default_factory=dict)
    heads: dict[str, tuple[int, str]] = field(default_factory=dict)
    scopes: dict[str, str] = field(default_factory=dict)
    unauthenticated: dict[str, str] = field(default_factory=dict)
    behind: set[str] = field(default_factory=set)
    claims: dict[str, int] = field(default_factory=dict)
    proven: dict[str, Proven] = field(default_factory=dict)
    incomplete: bool = False

    def counts(self, kind: str, name: str) -> bool:
        """Whether the record may move a verdict toward trusted: sealed by an intact, authenticated entry."""
        s = self.sealed.get((kind, name))
        return s is not None and s.counts


def _entry_problem(doc: object, *, writer: str, seq: int) -> str | None:
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("writer") != writer or doc.get("seq") != seq:
        return (
            f"names writer {str(doc.get('writer'))[:40]!r} entry {str(doc.get('seq'))[:20]}, stored as {writer}/{seq}"
        )
    if not isinstance(doc.get("scope"), str) or not _SCOPE.match(doc["scope"]):
        return "has no valid scope"
    if not isinstance(doc.get("prev"), str) or not _HEX64.match(doc["prev"]):
        return "has no valid link to its predecessor"
    recs = doc.get("records")
    if not isinstance(recs, list) or not all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, str) for x in r) and _HEX64.match(r[2]) for r in recs
    ):
        return "its record list is malformed"
    seen = doc.get("seen")
    if not isinstance(seen, dict) or not all(
        is_writer_id(k) and isinstance(v, int) and not isinstance(v, bool) and 0 < v < _MAX_SEQ for k, v in seen.items()
    ):
        return "its list of sealed heads is malformed"
    return None


def check_chains(
    entries: Mapping[str, Mapping[int, bytes]],
    *,
    stores: Mapping[str, str],
    record_digest: Callable[[str, str, str], str | None],
    trusted_keys: TrustedKeys | None,
    optional: Callable[[str, str], bool] = lambda store, kind: False,
    remembered: Mapping[str, tuple[int, str]] | None = None,
    proven: Mapping[str, Proven] | None = None,
    claims: Mapping[str, int] | None = None,
) -> ChainCheck:
    """Check every writer's chain and what it seals.

    Args:
        entries: per writer id, its entry files' bytes by sequence number.
        stores: the store ids whose entries belong here, each with its genesis's SHA-256 (the first
            entry's ``prev``): a run store's own; a vault's own and its source run's.
        record_digest: ``(store, kind, name)`` -> the SHA-256 of that record file now (None: absent).
        trusted_keys: when set, a chain whose first entry a trusted key signed must stay signed by
            trusted keys; a chain that starts otherwise is unauthenticated (counts only against).
        optional: ``(store, kind)`` -> True when records of that kind from that store may be absent
            (a vault mirrors a run's evidence, not its retirements or drills).
        remembered: per writer, the head this reader verified last time (a chain that is shorter now,
            or whose entry at that head changed, was truncated or rewritten: a break).
        proven: per writer, what the start of its chain proved when an earlier check (with the same
            stores and trusted keys) read it, for a caller that knows those entries are unchanged
            since; ``entries`` then holds only the writer's later entries. Every record a proven
            start seals is held again to its bytes now; a start that no longer holds, or a claim
            beyond a head, leaves the check ``incomplete`` (the caller checks again from every entry).
        claims: the ``claims`` of the check that proved them.
    """
    rules = _Rules(stores=stores, record_digest=record_digest, trusted_keys=trusted_keys, optional=optional)
    found = _Findings()
    out = found.out
    out.claims.update(claims or {})
    proven = proven or {}
    for writer in sorted(set(entries) | set(proven)):
        p = proven.get(writer)
        link = _Link() if p is None else _resume(writer, p, rules=rules, found=found)
        if link is None:
            out.incomplete = True
            return out
        _walk_chain(writer, entries.get(writer, {}), link=link, rules=rules, found=found)
    _break_truncated(out, found.seals, resumed=bool(proven))
    _break_rolled_back(out, remembered or {}, found.at_seq)
    if out.breaks:
        _demote_after_breaks(out)
        for writer in out.breaks:
            out.proven.pop(writer, None)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class _Rules:
    """What ``check_chains`` was told to hold every entry to (its arguments, but the entries)."""

    stores: Mapping[str, str]
    record_digest: Callable[[str, str, str], str | None]
    trusted_keys: TrustedKeys | None
    optional: Callable[[str, str], bool]


@dataclass(slots=True)
class _Findings:
    """What the walk over every chain has found so far (the result, and what its last steps need)."""

    out: ChainCheck = field(default_factory=ChainCheck)
    at_seq: dict[tuple[str, int], str] = field(default_factory=dict)  # (writer, seq) -> the intact entry's SHA-256
    # (sealer, its seq, its seen): read again only to name the first entry that saw a missing tail
    seals: list[tuple[str, int, dict[str, int]]] = field(default_factory=list)


@dataclass(slots=True)
class _Link:
    """One writer's chain as it is walked: where its intact part ends."""

    prev: str | None = None  # the SHA-256 of its last intact entry
    authenticated: bool | None = None  # with trusted keys: whether its first entry is signed by one
    expected: int = 1  # the seq the next entry must have
    broken: Break | None = None


def _resume(writer: str, p: Proven, *, rules: _Rules, found: _Findings) -> _Link | None:
    """Carry on from a proven start: it seals what it sealed, it is the writer's head, and the walk
    goes on after it. None when it does not hold now (a record it seals is gone or changed, or it
    does not start this store's chain): which entry broke is for a walk over the entries to say."""
    if not p.shas or len(p.stores) != len(p.shas) or p.stores[0] not in rules.stores:
        return None
    if rules.stores[p.stores[0]] != p.genesis or any(s not in rules.stores for s in p.stores):
        return None
    for seq, kind, name, sha in p.records:
        if not 1 <= seq <= len(p.shas):
            return None
        store = p.stores[seq - 1]
        have = rules.record_digest(store, kind, name)
        if have != sha and not (have is None and rules.optional(store, kind)):
            return None
    out = found.out
    out.scopes[writer] = p.scope
    if p.unauthenticated is not None:
        out.unauthenticated[writer] = p.unauthenticated
    keyed = rules.trusted_keys is not None
    counts = not keyed or p.unauthenticated is None
    for seq, sha in enumerate(p.shas, 1):
        found.at_seq[writer, seq] = sha
    out.heads[writer] = (len(p.shas), p.shas[-1])
    sealed = out.sealed
    for seq, kind, name, sha in p.records:
        was = sealed.get((kind, name))
        if was is None or (counts and not was.counts):  # a seal that counts wins (as _accept_entry)
            sealed[kind, name] = Sealed(sha, writer, seq, counts)
    out.proven[writer] = replace(p, shas=list(p.shas), stores=list(p.stores), records=list(p.records))
    authenticated = (p.unauthenticated is None) if keyed else None
    return _Link(prev=p.shas[-1], authenticated=authenticated, expected=len(p.shas) + 1)


def _walk_chain(writer: str, files: Mapping[int, bytes], *, link: _Link, rules: _Rules, found: _Findings) -> None:
    """Walk one writer's entries in order (from ``link``: its start, or where a proven start ends):
    the intact ones seal their records, the first one that is missing, altered or does not link is
    the writer's break, and what comes after it only counts against trust."""
    out = found.out
    for seq in sorted(files):
        data = files[seq]
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError, UnicodeDecodeError):
            doc = None
        if link.broken is None:
            declared: str | None = None  # the scope a sound entry names (kept if a record it seals is not)
            if seq != link.expected:
                why: str | None = f"entry {link.expected} is missing (the chain jumps to {seq})"
                seq_at = link.expected
            else:
                seq_at = seq
                why = _link_problem(doc, writer=writer, seq=seq, link=link, rules=rules, out=out)
                if why is None:
                    why = _record_problem(doc, rules.record_digest, rules.optional)
                    declared = doc["scope"]  # the entry itself is sound: what it says it wrote stands
            if why is not None:
                scope = out.scopes.get(writer) or declared or "store"
                link.broken = out.breaks[writer] = Break(writer=writer, seq=seq_at, scope=scope, why=why)
            else:
                _accept_entry(
                    writer,
                    seq,
                    data,
                    doc,
                    link=link,
                    counts=rules.trusted_keys is None or bool(link.authenticated),
                    found=found,
                    claims_count=rules.trusted_keys is None or writer not in out.unauthenticated,
                )
                continue
        _seal_against_trust(out, doc, writer=writer, seq=seq)


def _link_problem(doc: Any, *, writer: str, seq: int, link: _Link, rules: _Rules, out: ChainCheck) -> str | None:
    """Why the entry due next in a writer's chain does not continue it (None when it does), checked in
    this order: its form, its store, its link, its scope, its signature."""
    why = _entry_problem(doc, writer=writer, seq=seq)
    if why is None and doc["store"] not in rules.stores:
        why = f"belongs to store {str(doc['store'])[:40]!r}, not this one (replayed from elsewhere)"
    if why is None:
        want = rules.stores[doc["store"]] if seq == 1 else link.prev
        if doc["prev"] != want:
            why = "does not link to the entry before it (reordered, replaced or spliced)"
    if why is None and writer in out.scopes and doc["scope"] != out.scopes[writer]:
        why = f"changes the writer's scope from {out.scopes[writer]} to {doc['scope']}"
    if why is None and rules.trusted_keys is not None:
        why = _signature_problem(doc, writer=writer, seq=seq, link=link, keys=rules.trusted_keys, out=out)
    return why


def _signature_problem(
    doc: dict[str, Any], *, writer: str, seq: int, link: _Link, keys: TrustedKeys, out: ChainCheck
) -> str | None:
    """The first entry decides whether the chain is authenticated (an unauthenticated chain is no
    break: its records count only against trust); after an authenticated start, an entry no
    trusted key signed is a break."""
    sig_problem = keys.problem(doc)
    if seq == 1:
        link.authenticated = sig_problem is None
        if sig_problem is not None:
            out.unauthenticated[writer] = sig_problem
    elif link.authenticated and sig_problem is not None:
        return sig_problem
    return None


def _accept_entry(
    writer: str,
    seq: int,
    data: bytes,
    doc: dict[str, Any],
    *,
    link: _Link,
    counts: bool,
    found: _Findings,
    claims_count: bool,
) -> None:
    """An intact entry: it becomes the writer's head, seals the records it lists (for trust when
    ``counts``) and notes the other writers' heads it saw (``claims_count``: its word on them counts
    toward a truncation: with trusted keys, only an authenticated writer's)."""
    out = found.out
    out.scopes.setdefault(writer, doc["scope"])
    h = digest(data)
    found.at_seq[writer, seq] = h
    out.heads[writer] = (seq, h)
    if link.prev is None:
        out.proven[writer] = Proven(
            shas=[], stores=[], scope=doc["scope"], genesis=doc["prev"], unauthenticated=out.unauthenticated.get(writer)
        )
    link.prev, link.expected = h, seq + 1
    p = out.proven[writer]
    p.shas.append(h)
    p.stores.append(doc["store"])
    for kind, name, sha in doc["records"]:
        p.records.append((seq, kind, name, sha))
        have = out.sealed.get((kind, name))
        if have is None or (counts and not have.counts):  # a seal that counts wins
            out.sealed[kind, name] = Sealed(sha, writer, seq, counts)
    seen: dict[str, int] = doc["seen"]
    if claims_count:
        claims = out.claims
        for w, s in seen.items():
            if w != writer and s > claims.get(w, 0):
                claims[w] = s
        found.seals.append((writer, seq, seen))


def _seal_against_trust(out: ChainCheck, doc: object, *, writer: str, seq: int) -> None:
    """An entry at or after a break: what it lists still counts against trust, never for it."""
    if isinstance(doc, dict) and isinstance(doc.get("records"), list):
        for r in doc["records"]:
            if isinstance(r, list) and len(r) == 3 and all(isinstance(x, str) for x in r):
                out.sealed.setdefault((r[0], r[1]), Sealed(r[2], writer, seq, False))


def _break_truncated(out: ChainCheck, seals: list[tuple[str, int, dict[str, int]]], *, resumed: bool) -> None:
    """A writer whose head is behind what another writer's entry saw of it lost its tail. With
    trusted keys, only an authenticated writer's word counts (``claims`` holds only that): anyone
    can write an unsigned entry claiming to have seen entry 999 of a real writer.

    The greatest claims say whether any tail is missing; which entry saw it first (what the break
    names) is looked up only then, in the entries' own claims, which a resumed check does not hold."""
    late = {w for w, seq in out.claims.items() if out.heads.get(w, (0, ""))[0] < seq and w not in out.breaks}
    if not late:
        return
    if resumed:
        out.incomplete = True
        out.behind |= late
        return
    for sealer, at, seen in seals:
        for writer, seq in seen.items():
            if writer == sealer or writer not in late:
                continue
            have = out.heads.get(writer, (0, ""))[0]
            if have < seq and writer not in out.breaks:
                out.breaks[writer] = Break(
                    writer=writer,
                    seq=have + 1,
                    scope=out.scopes.get(writer, "store"),
                    why=(
                        f"entries up to {seq}, sealed by writer {sealer} entry {at}, are missing (truncated or deleted)"
                    ),
                )
                out.behind.add(writer)


def _break_rolled_back(
    out: ChainCheck, remembered: Mapping[str, tuple[int, str]], at_seq: Mapping[tuple[str, int], str]
) -> None:
    """A writer whose chain is shorter than, or different at, the head this reader verified before."""
    for writer, (seq, h) in remembered.items():
        if writer in out.breaks:
            continue
        head = out.heads.get(writer)
        if head is None or head[0] < seq or at_seq.get((writer, seq)) != h:
            out.breaks[writer] = Break(
                writer=writer,
                seq=(head[0] + 1) if head else 1,
                scope=out.scopes.get(writer, "store"),
                why=f"shorter or different than when this reader last verified it (entry {seq}): rolled back",
            )


def _demote_after_breaks(out: ChainCheck) -> None:
    """Records sealed only by entries at or after a break count only against trust."""
    for key, s in list(out.sealed.items()):
        b = out.breaks.get(s.writer)
        if b is not None and s.seq >= b.seq and s.counts:
            out.sealed[key] = Sealed(s.sha256, s.writer, s.seq, False)


def _record_problem(
    doc: dict[str, Any], record_digest: Callable[[str, str, str], str | None], optional: Callable[[str, str], bool]
) -> str | None:
    for kind, name, sha in doc["records"]:
        have = record_digest(doc["store"], kind, name)
        if have is None:
            if optional(doc["store"], kind):
                continue
            return f"the record it seals, {kind}/{name}, is missing (deleted)"
        if have != sha:
            return f"the record it seals, {kind}/{name}, changed after it was sealed"
    return None
