"""A reader's memory of the chain heads it verified: what makes a rollback visible.

Anyone who can write a store can delete a record together with everything written after it; what is
left is a smaller ledger that is perfectly consistent. The Update Framework answers that attack with
client state (a client never accepts metadata older than what it has seen); certckpt does the same:
each reader keeps, per store, the head of every writer's chain it verified, outside the store
(``$CERTCKPT_STATE_DIR``, default ``~/.cache/certckpt/ledgers``). A chain that is shorter or
different on the next read is a break. The memory is a cache in the other direction too: deleting
it forgets nothing that matters except the rollback check (the chains themselves prove the rest).
No torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

from .factcache import FactsCache

__all__ = ["STATE_ENV", "recall", "remember", "recall_facts", "remember_facts"]

STATE_ENV = "CERTCKPT_STATE_DIR"
_MAX_BYTES = 16 << 20  # a memory file larger than this is not ours
_MAX_FACTS_BYTES = 1 << 30


def _path(store: str, suffix: str = ".json") -> str:
    base = os.environ.get(STATE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "certckpt", "ledgers")
    key = os.path.abspath(store) if "://" not in store else store.rstrip("/")
    return os.path.join(base, hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + suffix)


def _write(path: str, doc: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".certckpt-")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))  # the C encoder: json.dump's is pure Python
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next read just starts over


def recall_facts(store: str) -> FactsCache | None:
    """The event segments this reader verified and folded for ``store`` (None: none, or unreadable)."""
    try:
        with open(_path(store, ".facts.json"), "rb") as f:
            doc = json.loads(f.read(_MAX_FACTS_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return FactsCache.from_json(doc) if isinstance(doc, dict) else None


def remember_facts(store: str, cache: FactsCache | None) -> None:
    """Keep what this read verified (skipped when it added nothing to what was kept before)."""
    if cache is not None and cache.segments and not cache.unchanged:
        _write(_path(store, ".facts.json"), cache.to_json())


def recall(store: str) -> dict[str, tuple[int, str]]:
    """The heads this reader verified for ``store`` (empty when it never read it, or forgot)."""
    try:
        with open(_path(store), "rb") as f:
            doc: Any = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    heads = doc.get("heads") if isinstance(doc, dict) else None
    if not isinstance(heads, dict):
        return {}
    out = {}
    for w, v in heads.items():
        if (
            isinstance(w, str)
            and isinstance(v, list)
            and len(v) == 2
            and isinstance(v[0], int)
            and isinstance(v[1], str)
        ):
            out[w] = (v[0], v[1])
    return out


def remember(store: str, heads: dict[str, tuple[int, str]]) -> None:
    """Keep the newest heads seen (never a shorter one); silently skipped where nothing can be written."""
    if not heads:
        return
    before = recall(store)
    merged = dict(before)
    for w, (seq, h) in heads.items():
        if seq >= merged.get(w, (0, ""))[0]:
            merged[w] = (seq, h)
    if merged != before:
        _write(_path(store), {"store": store, "heads": {w: list(v) for w, v in sorted(merged.items())}})
