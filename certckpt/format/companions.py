"""Companion files: a certified file whose record lists other files of its directory, each bound by
its size and digest, so that one committed file certifies a whole checkpoint directory (the Hugging
Face Trainer's ``checkpoint-N/``: weights, RNG states, ``trainer_state.json`` beside the file that
holds the optimizer).

The list is the record's ``user["files"]``: canonical JSON ``{name: {"bytes": N, "header_digest":
HEX}}`` for a certified file (its header digest covers every tensor's xxh3-128 digest) or ``{name:
{"bytes": N, "xxh3": HEX}}`` for any other file (xxh3-128 of its bytes), beside ``user["layout"]``
naming the layout. Names are plain file names in the listing file's own directory. No torch import.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import xxhash

from certckpt.errors import CertckptError

from .record import CheckpointRecord
from .signing import TrustedKeys
from .storage import join, open_read, resolve
from .verify import inspect, verify

__all__ = ["companion_marker", "FILES_KEY", "LAYOUT_KEY", "companions_of", "companion_problems"]

FILES_KEY = "files"
LAYOUT_KEY = "layout"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")  # a plain name: no separator, no leading dot
_CHUNK = 16 << 20


def companions_of(record: CheckpointRecord) -> dict[str, dict[str, Any]] | None:
    """The files a record lists, or None when it lists none.

    Raises:
        ValueError: the list is there but malformed (a damaged or hostile record).
    """
    text = record.user.get(FILES_KEY) if isinstance(record.user, dict) else None
    if text is None or LAYOUT_KEY not in record.user:
        return None
    files = json.loads(text)
    if not isinstance(files, dict) or not all(
        isinstance(k, str)
        and _NAME.match(k)
        and isinstance(v, dict)
        and type(v.get("bytes")) is int
        and isinstance(v.get("header_digest", v.get("xxh3")), str)
        for k, v in files.items()
    ):
        raise ValueError("malformed files table")
    return files


def companion_marker(directory: str) -> str | None:
    """The certified file of a local directory-shaped checkpoint (a Trainer ``checkpoint-N/``...):
    the one ``.safetensors`` file whose record lists the others; None when there is not exactly one."""
    found = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors") and not n.startswith("."))
    except OSError:
        return None
    for name in names:
        try:
            if companions_of(inspect(os.path.join(directory, name)).record):  # headers only
                found.append(name)
        except (CertckptError, ValueError, RecursionError):
            continue
    return os.path.join(directory, found[0]) if len(found) == 1 else None


def _xxh3_and_size(url: str, limit: int) -> tuple[str, int]:
    """xxh3-128 and size of a file, reading at most ``limit + 1`` bytes (the size its record states,
    and one more to tell it grew): a file that never ends is never read to its end."""
    h = xxhash.xxh3_128()
    n = 0
    with open_read(resolve(url)) as (fh, _):
        while n <= limit and (chunk := fh.read(min(_CHUNK, limit + 1 - n))):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def companion_problems(
    location: str, record: CheckpointRecord, *, trusted_keys: TrustedKeys | None = None
) -> list[str]:
    """Check every file ``record`` (the record of the file at ``location``) lists: present, same size,
    same digest; certified ones verified whole (and signed, with ``trusted_keys``). One line each."""
    try:
        files = companions_of(record)
    except (ValueError, RecursionError) as e:
        return [f"{location}: the record's table of companion files is unreadable ({e})"]
    if not files:
        return []
    base = location.rsplit("/", 1)[0] if "/" in location else "."
    problems = []
    for name, want in sorted(files.items()):
        member = join(base, name)
        try:
            if "header_digest" in want:
                got = verify(member, trusted_keys=trusted_keys)
                if not got.ok:
                    msg = got.problems[0].message
                    problems.append(msg if msg.startswith(member) else f"{member}: {msg}")
                elif got.info.record.header_digest != want["header_digest"] or got.nbytes != want["bytes"]:
                    problems.append(
                        f"{member}: another certified file than the one saved (header digest "
                        f"{got.info.record.header_digest}, the manifest says {want['header_digest']})"
                    )
                continue
            digest, size = _xxh3_and_size(member, want["bytes"])
        except CertckptError as e:
            text = str(e)
            problems.append(
                f"{member}: missing (the manifest lists it)"
                if "not found" in text.lower() or "no such" in text.lower()
                else text
            )
            continue
        if size != want["bytes"]:
            problems.append(
                f"{member}: {size} bytes, the manifest says {want['bytes']}; the file changed after the save"
            )
        elif digest != want.get("xxh3"):
            problems.append(f"{member}: xxh3 digest differs from the manifest's; the file changed after the save")
    return problems
