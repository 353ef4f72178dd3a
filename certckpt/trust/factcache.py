"""What a reader already verified and folded from a chained ledger's event segments, so the next read
parses only what was appended since.

The cache holds, per segment, the SHA-256 its chain sealed and whether it counted, and the audit
facts folded from them. It is never trusted beyond what the chains prove: it is used only when every
segment it lists is still sealed, with the same digest and the same standing, by the chains read now
(a break, a rewritten segment or other trusted keys make the reader start over), and it lives
outside the store (``certckpt.trust.memory``). Anyone may delete it. No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .facts import AuditFacts, BranchFacts, Event

__all__ = ["FactsCache", "FACTS_VERSION"]

FACTS_VERSION = 3


@dataclass(kw_only=True, slots=True)
class FactsCache:
    """A verified, folded prefix of one store's event segments.

    Attributes:
        store_id: the store it belongs to.
        keys: the trusted key ids it was verified with (sorted; empty: none).
        segments: per segment name, ``(sha256, counted)``.
        facts: the audit facts folded from those segments.
        failures: their failed events, as stored.
        invalid: their lines used for nothing (or read pessimistically), with the reason.
        writer_steps: per writer, the greatest step its counted segments vouch for.
        stamps: per segment, its size, times and inode (an object store: its ETag) when it was read.
    """

    store_id: str
    keys: list[str]
    segments: dict[str, tuple[str, bool]] = field(default_factory=dict)
    facts: AuditFacts = field(default_factory=AuditFacts)
    failures: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[tuple[str, str]] = field(default_factory=list)
    writer_steps: dict[str, int] = field(default_factory=dict)
    stamps: dict[str, str] = field(default_factory=dict)  # per segment, its change detector when read
    unchanged: bool = False  # the same as the cache this read started from: nothing to write

    def to_json(self) -> dict[str, object]:
        return {
            "version": FACTS_VERSION,
            "store_id": self.store_id,
            "keys": self.keys,
            "segments": {n: [sha, c] for n, (sha, c) in self.segments.items()},
            "branches": {n: b.to_json() for n, b in self.facts.branches.items()},
            "count": self.facts.count,
            "doubtful": [
                [e.branch, e.step, e.kind, e.outcome, e.contained, list(e.suspect_ranks), e.fp, e.found_by]
                for e in self.facts.doubtful
            ],
            "failures": self.failures,
            "invalid": [list(x) for x in self.invalid],
            "writer_steps": self.writer_steps,
            "stamps": self.stamps,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> FactsCache | None:
        """The cache a file holds, or None when it is not one this version wrote (never an error)."""
        try:
            if doc.get("version") != FACTS_VERSION:
                return None
            facts = AuditFacts(
                branches={str(n): BranchFacts.from_json(b) for n, b in doc["branches"].items()},
                count=int(doc["count"]),
                doubtful=[
                    Event(str(b), int(s), str(k), str(o), bool(c), tuple(int(x) for x in r), fp, bool(f))
                    for b, s, k, o, c, r, fp, f in doc["doubtful"]
                ],
            )
            return cls(
                store_id=str(doc["store_id"]),
                keys=[str(k) for k in doc["keys"]],
                segments={str(n): (str(v[0]), bool(v[1])) for n, v in doc["segments"].items()},
                facts=facts,
                failures=[f for f in doc["failures"] if isinstance(f, dict)],
                invalid=[(str(a), str(b)) for a, b in doc["invalid"]],
                writer_steps={str(w): int(s) for w, s in doc["writer_steps"].items()},
                stamps={str(n): str(v) for n, v in doc["stamps"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # binascii.Error is a ValueError
            return None
