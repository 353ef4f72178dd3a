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

__all__ = ["STATE_ENV", "recall", "remember"]

STATE_ENV = "CERTCKPT_STATE_DIR"
_MAX_BYTES = 16 << 20  # a memory file larger than this is not ours


def _path(store: str) -> str:
    base = os.environ.get(STATE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "certckpt", "ledgers")
    key = os.path.abspath(store) if "://" not in store else store.rstrip("/")
    return os.path.join(base, hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + ".json")


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
    merged = recall(store)
    for w, (seq, h) in heads.items():
        if seq >= merged.get(w, (0, ""))[0]:
            merged[w] = (seq, h)
    path = _path(store)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".heads-")
        with os.fdopen(fd, "w") as f:
            json.dump({"store": store, "heads": {w: list(v) for w, v in sorted(merged.items())}}, f)
        os.replace(tmp, path)
    except OSError:
        pass
