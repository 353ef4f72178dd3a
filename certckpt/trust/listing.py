"""What one read of a ledger takes from the store: its listing, and the bytes of its chain entries
and small records, each fetched only where the reader's cache (``chaincache``) cannot show it
unchanged; and, when a chain looks behind what another writer saw of it, that chain listed again.

Event segments are not fetched here: they are hashed and folded by the snapshot, batch by batch
(``snapshot._Reader``). No torch import.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from certckpt.errors import StorageError
from certckpt.storage import Entry, Storage

from .chain import CHAINS_DIR, ChainCheck, Proven, entry_name, is_writer_id, parse_entry_name
from .chaincache import ChainCache
from .records import KINDS

__all__ = [
    "MAX_LEDGER_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_SMALL_RECORD_BYTES",
    "MAX_SMALL_TOTAL_BYTES",
    "Taken",
    "keep",
    "take",
    "take_again",
]

MAX_RECORD_BYTES = 1 << 30  # no event segment is this large (a segment holds 4,096 events)
# Every other file of a ledger (a commit record, a chain entry, a revocation...) is a small JSON object,
# and all of them are held at once while a ledger is read: each is bounded, and so is their sum and
# the sum of everything one read takes in (a sparse file counts by its size, not its blocks).
MAX_SMALL_RECORD_BYTES = 16 << 20
MAX_SMALL_TOTAL_BYTES = 1 << 30
MAX_LEDGER_BYTES = 64 << 30


@dataclass(kw_only=True, slots=True)
class Taken:
    """One read's view of a ledger.

    Attributes:
        listing: every ledger name, by top-level entry (kind, ``chains``, ``sources``, ``""`` for files).
        contents: the bytes of every listed name but the event segments and the proven entries.
        stamps: per listed name, its change detector (``Entry.stamp``; empty when the store has none).
        sizes: per listed name, its size as listed.
        refused: names never opened, with why (not regular files, or too large).
        proven: per writer, the start of its chain the cache proved (its entries are not in ``contents``).
        claims: the cache's claims, which go with ``proven``.
        fetched: names whose bytes this read fetched (0: the cache held everything).
    """

    listing: dict[str, list[str]] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)
    stamps: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    refused: list[tuple[str, str]] = field(default_factory=list)
    proven: dict[str, Proven] = field(default_factory=dict)
    claims: dict[str, int] = field(default_factory=dict)
    fetched: int = 0
    _small: int = 0
    _total: int = 0

    def admit(self, e: Entry) -> bool:
        """Add one listed object (refusing what is not a regular file, or larger than any record)."""
        if e.kind != "file":
            what = "a directory nested too deep" if e.kind == "directory" else e.what
            self.refused.append((e.name, f"not a regular file ({what}); never opened"))
            return False
        top, _, rest = e.name.partition("/")
        segment = top == "events" and bool(rest)
        limit = MAX_RECORD_BYTES if segment else MAX_SMALL_RECORD_BYTES
        if e.size is not None and e.size > limit:
            self.refused.append(
                (e.name, f"{e.size} bytes, more than any {'segment' if segment else 'record'}; never read")
            )
            return False
        size = e.size or 0
        self._total += size
        self._small += 0 if segment else size
        if self._small > MAX_SMALL_TOTAL_BYTES or self._total > MAX_LEDGER_BYTES:
            budget = MAX_SMALL_TOTAL_BYTES if self._small > MAX_SMALL_TOTAL_BYTES else MAX_LEDGER_BYTES
            raise StorageError(
                f"the ledger holds more than {budget} bytes of records, more than one read takes in (files planted "
                "to exhaust memory?); nothing is certified from it until they are removed"
            )
        self.stamps[e.name] = e.stamp
        self.sizes[e.name] = size
        self.listing.setdefault(top if rest else "", []).append(e.name)
        return True

    def fetch(self, storage: Storage, names: list[str]) -> None:
        """Read these names' bytes (listed, then gone: read as empty, and they fail their checks,
        as records are never removed)."""
        got = storage.get_many(names)
        self.contents.update({p: got.get(p, b"") for p in names})
        self.fetched += len(names)


def _entry_path(writer: str, seq: int) -> str:
    return f"{CHAINS_DIR}/{writer}/{entry_name(seq)}"


def _proven_seq(path: str, proven: dict[str, Proven]) -> bool:
    """Whether a listed chain entry lies in a proven start (its bytes are not needed)."""
    parts = path.split("/")
    if len(parts) != 3 or parts[1] not in proven:
        return False
    seq = parse_entry_name(parts[2])
    return seq is not None and seq <= len(proven[parts[1]].shas)


def take(storage: Storage, *, chains: ChainCache | None, keys: list[str], segments: Iterable[str] = ()) -> Taken:
    """List the ledger and fetch what the checks need, from ``chains`` where the listing shows it
    unchanged (a cache verified with other trusted keys is not used). What the caches name (their
    entries, records and ``segments``) only helps split the listing into parts listed at once.

    The chains are listed first: a writer seals a record only after writing it, and records are
    never removed, so every record an entry listed here seals is there when the rest is listed (a
    writer at work meanwhile cannot make a sealed record look deleted)."""
    out = Taken()
    entries: list[str] = []
    records: list[str] = [f"events/{n}" for n in segments]
    if chains is not None:
        entries = [
            _entry_path(w, seq) for w, (stamps, _) in chains.writers.items() for seq in range(1, len(stamps) + 1)
        ]
        records += chains.records
    listed = storage.walk(CHAINS_DIR, depth=2, hint=sorted(entries))
    listed += storage.walk(depth=3, skip=(CHAINS_DIR,), hint=sorted(records))
    for e in listed:
        out.admit(e)
    cache = chains if chains is not None and chains.keys == keys else None
    if cache is not None:
        out.proven = cache.proven(out.stamps, _entry_path)
        out.claims = dict(cache.claims)
    wanted = []
    for top, names in out.listing.items():
        if top == "events":
            continue
        for p in names:
            if top == CHAINS_DIR and _proven_seq(p, out.proven):
                continue
            data = cache.record(p, out.stamps[p]) if cache is not None and top != CHAINS_DIR else None
            if data is None:
                wanted.append(p)
            else:
                out.contents[p] = data
    out.fetch(storage, wanted)
    return out


def take_again(storage: Storage, taken: Taken, writers: set[str]) -> Taken:
    """``taken`` with these writers' chains listed again, and the records their new entries seal
    (written before them, possibly after the first listing). Chains are listed one after another:
    a writer that appends to chain A after A was listed and then to chain B (whose entry sees A's
    new head) makes A look truncated; entries are never removed, so listing A again shows them,
    and a truncation stays."""
    out = Taken(
        listing={k: list(v) for k, v in taken.listing.items()},
        contents=dict(taken.contents),
        stamps=dict(taken.stamps),
        sizes=dict(taken.sizes),
        refused=list(taken.refused),
        proven=taken.proven,
        claims=taken.claims,
        fetched=taken.fetched,
        _small=taken._small,
        _total=taken._total,
    )
    new = []
    for w in sorted(writers):
        if not is_writer_id(w):  # a claim names a writer id; never a path of its own making
            continue
        for e in storage.walk(f"{CHAINS_DIR}/{w}", depth=1):
            if e.name not in out.stamps and out.admit(e):
                new.append(e.name)
    out.fetch(storage, new)
    records = []
    for p in new:
        for kind, name in _sealed_names(out.contents[p]):
            path = f"{kind}/{name}" if kind else name
            if path not in out.stamps and path not in records:
                records.append(path)
    for path in records:
        found = storage.stat(path)
        if found is not None and out.admit(found) and not path.startswith("events/"):
            out.fetch(storage, [path])
    return out


def _sealed_names(data: bytes) -> list[tuple[str, str]]:
    """The ``(kind, name)`` an entry's bytes say it seals, where they name a ledger record file
    (untrusted: the chain check judges the entry; this only finds what to fetch)."""
    import json

    try:
        doc = json.loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return []
    recs = doc.get("records") if isinstance(doc, dict) else None
    out = []
    for r in recs if isinstance(recs, list) else []:
        if isinstance(r, list) and len(r) == 3 and all(isinstance(x, str) for x in r[:2]):
            kind, name = r[0], r[1]
            plain = 0 < len(name) < 256 and "/" not in name and name not in (".", "..")
            if (kind == "" or kind in KINDS) and plain:
                out.append((kind, name))
    return out


def keep(
    taken: Taken, check: ChainCheck | None, *, store_id: str, keys: list[str], before: ChainCache | None
) -> ChainCache | None:
    """What the next read may start from: every writer the check proved intact to its head, with
    its entries' stamps, and the small records' bytes with theirs (only objects with a stamp);
    ``unchanged`` when it is what ``before`` (the cache this read started from) held."""
    if check is None or check.incomplete:
        return None
    writers = {}
    for w, p in check.proven.items():
        stamps = [taken.stamps.get(_entry_path(w, seq), "") for seq in range(1, len(p.shas) + 1)]
        if all(stamps):
            writers[w] = (stamps, p)
    records = {
        p: (taken.stamps[p], data)
        for p, data in taken.contents.items()
        if not p.startswith(f"{CHAINS_DIR}/") and taken.stamps.get(p) and len(data) == taken.sizes.get(p)
    }
    out = ChainCache(store_id=store_id, keys=keys, writers=writers, claims=dict(check.claims), records=records)
    out.unchanged = (
        before is not None
        and taken.fetched == 0
        and (before.store_id, before.keys, before.claims) == (store_id, keys, out.claims)
        and before.records.keys() == records.keys()
        and {w: len(v[0]) for w, v in before.writers.items()} == {w: len(v[0]) for w, v in writers.items()}
    )
    return out
