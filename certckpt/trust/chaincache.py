"""What a reader already verified of a chained ledger's chains and small records, so that its next
read fetches only what was written since.

Chain entries and records are written create-only and never change, so what a reader proved of an
entry holds as long as the entry is the object it read. The listing says so: every object carries a
stamp that moves when it is rewritten (locally its size, times and inode; on S3 its size, ETag and
time of writing). The cache keeps, per writer, the stamps of the entries it proved and what they
proved (``chain.Proven``: their digests, the records they seal), the greatest head each writer's
entries claim of the others, and the bytes of the small records (commit records, placements,
revocations...) with their stamps. It is used only for what the listing taken now shows under the
same name with the same stamp; anything else is read again, and every record a proven entry seals is
held again to its bytes now (``chain.check_chains``). It lives outside the store
(``certckpt.trust.memory``), and anyone may delete it. No torch import.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .chain import Proven

__all__ = ["CHAINS_VERSION", "ChainCache"]

CHAINS_VERSION = 1


@dataclass(kw_only=True, slots=True)
class ChainCache:
    """A verified, intact start of every writer's chain in one store, and the store's small records.

    Attributes:
        store_id: the store it belongs to.
        keys: the trusted key ids it was verified with (sorted; empty: none).
        writers: per writer, the listing stamps of its entries 1, 2, ... and what they proved.
        claims: per writer, the greatest entry number those entries say they saw of it.
        records: per ledger path (``checkpoints/main@10.json``, ``genesis.json``), its stamp and bytes.
        unchanged: the same as the cache this read started from: nothing to write.
    """

    store_id: str
    keys: list[str]
    writers: dict[str, tuple[list[str], Proven]] = field(default_factory=dict)
    claims: dict[str, int] = field(default_factory=dict)
    records: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    unchanged: bool = False

    def proven(self, stamps: Mapping[str, str], entry_path: Any) -> dict[str, Proven]:
        """The writers whose every cached entry is listed now under its name with the same stamp
        (``entry_path(writer, seq)``: its name in ``stamps``); the others are read again."""
        out = {}
        for writer, (kept, p) in self.writers.items():
            if kept and all(s and stamps.get(entry_path(writer, seq)) == s for seq, s in enumerate(kept, 1)):
                out[writer] = p
        return out

    def record(self, path: str, stamp: str) -> bytes | None:
        """A record's bytes, when it is listed now with the stamp it had when they were read."""
        kept = self.records.get(path)
        return kept[1] if kept is not None and stamp and kept[0] == stamp else None

    def to_json(self) -> dict[str, object]:
        return {
            "version": CHAINS_VERSION,
            "store_id": self.store_id,
            "keys": self.keys,
            "writers": {
                w: {
                    "stamps": stamps,
                    "shas": p.shas,
                    "stores": p.stores,
                    "genesis": p.genesis,
                    "scope": p.scope,
                    "unauthenticated": p.unauthenticated,
                    "records": [list(r) for r in p.records],
                }
                for w, (stamps, p) in self.writers.items()
            },
            "claims": self.claims,
            "records": {
                path: [stamp, base64.b64encode(data).decode("ascii")] for path, (stamp, data) in self.records.items()
            },
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ChainCache | None:
        """The cache a file holds, or None when it is not one this version wrote (never an error)."""
        try:
            if doc.get("version") != CHAINS_VERSION:
                return None
            writers = {}
            for w, d in doc["writers"].items():
                unauth = d["unauthenticated"]
                p = Proven(
                    shas=[str(x) for x in d["shas"]],
                    stores=[str(x) for x in d["stores"]],
                    genesis=str(d["genesis"]),
                    scope=str(d["scope"]),
                    unauthenticated=None if unauth is None else str(unauth),
                    records=[(int(s), str(k), str(n), str(h)) for s, k, n, h in d["records"]],
                )
                stamps = [str(s) for s in d["stamps"]]
                if len(stamps) != len(p.shas):
                    return None
                writers[str(w)] = (stamps, p)
            return cls(
                store_id=str(doc["store_id"]),
                keys=[str(k) for k in doc["keys"]],
                writers=writers,
                claims={str(w): int(s) for w, s in doc["claims"].items()},
                records={
                    str(path): (str(v[0]), base64.b64decode(str(v[1]), validate=True))
                    for path, v in doc["records"].items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, binascii.Error):
            return None
