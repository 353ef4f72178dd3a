"""A reader's memory of the chain heads it verified: what makes a rollback visible.

Anyone who can write a store can delete a record together with everything written after it; what is
left is a smaller ledger that is perfectly consistent. The Update Framework answers that attack with
client state (a client never accepts metadata older than what it has seen); certckpt does the same:
each reader keeps, per store, the head of every writer's chain it verified, outside the store
(``$CERTCKPT_STATE_DIR``, default ``~/.cache/certckpt/ledgers``). A chain that is shorter or
different on the next read is a break. The memory is a cache in the other direction too: deleting
it forgets nothing that matters except the rollback check (the chains themselves prove the rest).

Beside the heads, the reader keeps the store's identity: the SHA-256 of the genesis record it
verified. A store whose genesis is then gone, or another one, was deleted or re-created at the same
URL, which no chain inside it can show: a break, until someone accepts the new store deliberately
(``forget``; ``certckpt status --forget-memory STORE``). With trusted keys only the heads of
authenticated writers are kept: an unsigned writer's entries must not become a memory that later
reads as a rollback when they disappear.
No torch import.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import TYPE_CHECKING, Any

from certckpt.format.trustconfig import default_state_dir, state_dir_from_env

from .chaincache import ChainCache
from .factcache import FactsCache

if TYPE_CHECKING:
    from .snapshot import LedgerSnapshot

__all__ = [
    "STATE_ENV",
    "forget",
    "recall",
    "recall_chains",
    "recall_facts",
    "recall_genesis",
    "recall_view",
    "remember",
    "remember_chains",
    "remember_facts",
    "remember_snapshot",
    "remember_view",
    "state_dir",
]

STATE_ENV = "CERTCKPT_STATE_DIR"  # (certckpt.format.trustconfig.STATE_ENV)
_MAX_BYTES = 16 << 20  # a memory file larger than this is not ours
_MAX_FACTS_BYTES = 1 << 30


def state_dir(given: str | None = None) -> str:
    """The memory's directory: ``given`` (a ``TrustConfig``'s), else the environment's, else the default."""
    return given or state_dir_from_env() or default_state_dir()


def _path(store: str, suffix: str = ".json", base: str | None = None) -> str:
    key = os.path.abspath(store) if "://" not in store else store.rstrip("/")
    return os.path.join(state_dir(base), hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + suffix)


def _write(path: str, doc: object) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".certckpt-")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))  # the C encoder: json.dump's is pure Python
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the next read just starts over


def recall_facts(store: str, *, base: str | None = None) -> FactsCache | None:
    """The event segments this reader verified and folded for ``store`` (None: none, or unreadable)."""
    try:
        with open(_path(store, ".facts.json", base), "rb") as f:
            doc = json.loads(f.read(_MAX_FACTS_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return FactsCache.from_json(doc) if isinstance(doc, dict) else None


def remember_facts(store: str, cache: FactsCache | None, *, base: str | None = None) -> None:
    """Keep what this read verified (skipped when it added nothing to what was kept before)."""
    if cache is not None and cache.segments and not cache.unchanged:
        _write(_path(store, ".facts.json", base), cache.to_json())


def recall_chains(store: str, *, base: str | None = None) -> ChainCache | None:
    """The chain entries and small records this reader verified for ``store`` (None: none, or unreadable)."""
    try:
        with open(_path(store, ".chains.json", base), "rb") as f:
            doc = json.loads(f.read(_MAX_FACTS_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return ChainCache.from_json(doc) if isinstance(doc, dict) else None


def remember_chains(store: str, cache: ChainCache | None, *, base: str | None = None) -> None:
    """Keep what this read verified of the chains (skipped when it added nothing to what was kept)."""
    if cache is not None and cache.writers and not cache.unchanged:
        _write(_path(store, ".chains.json", base), cache.to_json())


def _recall_doc(store: str, base: str | None) -> dict[str, Any]:
    try:
        with open(_path(store, base=base), "rb") as f:
            doc: object = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def recall_genesis(store: str, *, base: str | None = None) -> str | None:
    """The SHA-256 of the genesis record this reader verified for ``store`` (None: never, or forgot)."""
    g = _recall_doc(store, base).get("genesis")
    return g if isinstance(g, str) and len(g) == 64 else None


def recall(store: str, *, base: str | None = None) -> dict[str, tuple[int, str]]:
    """The heads this reader verified for ``store`` (empty when it never read it, or forgot)."""
    heads = _recall_doc(store, base).get("heads")
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


def remember(
    store: str, heads: dict[str, tuple[int, str]], *, genesis: str | None = None, base: str | None = None
) -> None:
    """Keep the newest heads seen (never a shorter one) and the store's identity (``genesis``: the
    SHA-256 of its genesis record; a different one is never written over the one kept: only
    ``forget`` accepts a re-created store); silently skipped where nothing can be written."""
    doc = _recall_doc(store, base)
    before = recall(store, base=base)
    merged = dict(before)
    for w, (seq, h) in heads.items():
        if seq >= merged.get(w, (0, ""))[0]:
            merged[w] = (seq, h)
    kept = recall_genesis(store, base=base)
    identity = kept or genesis
    if merged != before or identity != doc.get("genesis"):
        out: dict[str, object] = {"store": store, "heads": {w: list(v) for w, v in sorted(merged.items())}}
        if identity is not None:
            out["genesis"] = identity
        _write(_path(store, base=base), out)


def remember_snapshot(store: str, snap: LedgerSnapshot, *, base: str | None = None) -> None:
    """Keep what a read of ``store`` proved: its identity and the heads of the writers that count."""
    if snap.chained and snap.genesis is not None:
        remember(store, snap.memorable_heads, genesis=snap.genesis, base=base)


def recall_view(store: str, key: str, *, base: str | None = None) -> dict[str, object] | None:
    """What a verified read of ``store`` concluded, when it was kept under ``key`` (the store's
    listing stamp, the heads remembered and the keys it was read with; None: another key, none
    kept, or unreadable: read the store again)."""
    try:
        with open(_path(store, ".view.json", base), "rb") as f:
            doc = json.loads(f.read(_MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or not isinstance(doc.get("view"), dict):
        return None
    view: dict[str, object] = doc["view"]
    return view


def remember_view(store: str, key: str, view: dict[str, object], *, base: str | None = None) -> None:
    """Keep what a verified read of ``store`` concluded, under ``key`` (see ``recall_view``)."""
    _write(_path(store, ".view.json", base), {"key": key, "view": view})


def forget(store: str, *, base: str | None = None) -> list[str]:
    """Forget what this reader verified of ``store`` (its identity, heads, chains and folded segments): the
    deliberate way to accept a store re-created at the same URL, or to drop heads an earlier version
    remembered of unauthenticated writers. Returns the files removed."""
    removed = []
    for suffix in (".json", ".facts.json", ".chains.json", ".view.json"):
        p = _path(store, suffix, base)
        try:
            os.remove(p)
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
