"""Companion files: a certified file whose record lists other files of its directory, each bound by
its size and digest, so that one committed file certifies a whole checkpoint directory (the Hugging
Face Trainer's ``checkpoint-N/``: weights, RNG states, ``trainer_state.json`` beside the file that
holds the optimizer).

The list is the record's ``user["files"]``: canonical JSON ``{name: {"bytes": N, "header_digest":
HEX}}`` for a certified file (its header digest covers every tensor's xxh3-128 digest) or ``{name:
{"bytes": N, "xxh3": HEX, "blake3": HEX}}`` for any other file, beside ``user["layout"]`` naming
the layout. Names are plain file names in the listing file's own directory. No torch import.

A file that is not certified (``trainer_state.json``, a config, a tokenizer) is bound by two digests of
its bytes: xxh3-128 catches accidents cheaply, and a cryptographic one (BLAKE3, or SHA-256 where the
``blake3`` package is missing) is what stops a forger: xxh3 has practical second preimages, so a keyed
read (trusted keys given) requires the cryptographic digest and refuses an entry that has none
(written before certckpt recorded one).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import xxhash

from certckpt.errors import CertckptError
from certckpt.storage import join, open_read, refuse_special, resolve

from .datahash import new_hash, preferred_digest_field
from .header import MAX_HEADER_BYTES
from .record import CheckpointRecord
from .signing import TrustedKeys
from .verify import inspect, verify

__all__ = [
    "companion_marker",
    "companion_listing",
    "FILES_KEY",
    "LAYOUT_KEY",
    "CRYPTO_FIELDS",
    "companions_of",
    "companion_problems",
    "check_companions",
    "CompanionCheck",
    "CompanionFile",
    "plain_entry",
    "plain_problem",
]

FILES_KEY = "files"
LAYOUT_KEY = "layout"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")  # a plain name: no separator, no leading dot
_CHUNK = 16 << 20
CRYPTO_FIELDS = ("blake3", "sha256")  # an uncertified file's cryptographic digest: entry key = algorithm
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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
        and all(isinstance(v[f], str) and _HEX64.match(v[f]) for f in CRYPTO_FIELDS if f in v)
        for k, v in files.items()
    ):
        raise ValueError("malformed files table")
    return files


def companion_marker(directory: str) -> str | None:
    """The certified file of a local directory-shaped checkpoint (a Trainer ``checkpoint-N/``...):
    the one ``.safetensors`` file whose record lists the others; None when there is not exactly one."""
    listing = companion_listing(directory)
    return listing[0] if listing is not None else None


def companion_listing(directory: str) -> tuple[str, dict[str, dict[str, Any]]] | None:
    """``(the listing file's path, the files it lists)`` of a local directory-shaped checkpoint, read
    from the headers only; None when not exactly one file of the directory lists companions."""
    found = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors") and not n.startswith("."))
    except OSError:
        return None
    for name in names:
        path = os.path.join(directory, name)
        if not _may_list_companions(path):
            continue
        try:
            files = companions_of(inspect(path).record)
        except (CertckptError, ValueError, RecursionError):
            continue
        if files:
            found.append((path, files))
    return found[0] if len(found) == 1 else None


def _may_list_companions(path: str) -> bool:
    """Whether the header's bytes hold the two keys of a companion table (escaped, inside the record's
    text): a scan of the raw header, so that looking for the listing file of a directory never parses
    the headers of every other file in it (a 100,000-tensor header is ~0.5 s to parse)."""
    try:
        refuse_special(path, path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            raw = f.read(min(n, MAX_HEADER_BYTES))
    except (OSError, CertckptError):
        return False
    return f'\\"{LAYOUT_KEY}\\"'.encode() in raw and f'\\"{FILES_KEY}\\"'.encode() in raw


def _digests(url: str, limit: int | None, crypto: str | None) -> tuple[str, str | None, int]:
    """(xxh3-128, the ``crypto`` digest or None, size) of a file in one pass; with ``limit``, reading
    at most ``limit + 1`` bytes (the size its record states, and one more to tell it grew): a file that
    never ends is never read to its end."""
    h, c = xxhash.xxh3_128(), new_hash(crypto) if crypto else None
    n = 0
    with open_read(resolve(url)) as (fh, _):
        while (limit is None or n <= limit) and (
            chunk := fh.read(_CHUNK if limit is None else min(_CHUNK, limit + 1 - n))
        ):
            h.update(chunk)
            if c is not None:
                c.update(chunk)
            n += len(chunk)
    return h.hexdigest(), c.hexdigest() if c is not None else None, n


def plain_entry(url: str) -> dict[str, Any]:
    """What a listing records of an uncertified file: ``{"bytes", "xxh3", "blake3" | "sha256"}``."""
    crypto = preferred_digest_field().removeprefix("data_")
    xxh3, digest, size = _digests(url, None, crypto)
    return {"bytes": size, "xxh3": xxh3, crypto: digest}


def plain_problem(url: str, want: dict[str, Any], *, trusted_keys: TrustedKeys | None = None) -> str | None:
    """Why the uncertified file at ``url`` is not the one ``want`` (a ``plain_entry``) describes, or
    None. With ``trusted_keys``, an entry without a cryptographic digest is refused (xxh3 alone can be
    forged).

    Raises:
        CertckptError: it cannot be read (missing, not a regular file, ...).
    """
    crypto = next((f for f in CRYPTO_FIELDS if f in want), None)
    if crypto is None and trusted_keys is not None:
        return (
            f"{url}: its listing binds it by xxh3 only (written by an older certckpt), which a forger can match;"
            " a keyed read needs its BLAKE3 or SHA-256: re-save the checkpoint with this certckpt"
        )
    xxh3, digest, size = _digests(url, want["bytes"], crypto)
    if size != want["bytes"]:
        return f"{url}: {size} bytes, the manifest says {want['bytes']}; the file changed after the save"
    if xxh3 != want.get("xxh3") or (crypto is not None and digest != want[crypto]):
        # (crypto is None only when xxh3 differs; the test says so to the type checker)
        which = "xxh3" if xxh3 != want.get("xxh3") or crypto is None else crypto.upper().replace("SHA256", "SHA-256")
        return f"{url}: {which} digest differs from the manifest's; the file changed after the save"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompanionFile:
    """One companion file that verified.

    Attributes:
        name: its name in the listing file's directory.
        certified: a certckpt file (checked whole: every tensor's digest), else a plain file (its
            size and digests checked against the listing's).
        nbytes: its size.
        tensors: tensors checked (0 for a plain file).
    """

    name: str
    certified: bool
    nbytes: int
    tensors: int = 0

    def to_dict(self) -> dict[str, Any]:
        kind = "certified" if self.certified else "plain"
        return {"name": self.name, "kind": kind, "bytes": self.nbytes, "tensors": self.tensors}


@dataclass(frozen=True, kw_only=True, slots=True)
class CompanionCheck:
    """What ``check_companions`` found: one line per problem, and every file that verified."""

    problems: list[str] = field(default_factory=list)
    verified: list[CompanionFile] = field(default_factory=list)


def companion_problems(
    location: str, record: CheckpointRecord, *, trusted_keys: TrustedKeys | None = None
) -> list[str]:
    """Check every file ``record`` (the record of the file at ``location``) lists: present, same size,
    same digest; certified ones verified whole (and signed, with ``trusted_keys``). One line each."""
    return check_companions(location, record, trusted_keys=trusted_keys).problems


def check_companions(
    location: str, record: CheckpointRecord, *, trusted_keys: TrustedKeys | None = None
) -> CompanionCheck:
    """``companion_problems``, also saying what was verified (each file, its bytes and tensors)."""
    out = CompanionCheck()
    problems = out.problems
    try:
        files = companions_of(record)
    except (ValueError, RecursionError) as e:
        problems.append(f"{location}: the record's table of companion files is unreadable ({e})")
        return out
    if not files:
        return out
    base = location.rsplit("/", 1)[0] if "/" in location else "."
    for name, want in sorted(files.items()):
        member = join(base, name)
        if "://" not in member and os.path.islink(member):
            # the listing binds its directory's own files: a link makes it vouch for a file held elsewhere
            problems.append(f"{member}: a symbolic link where a file of the checkpoint should be; refused unopened")
            continue
        try:
            if "header_digest" in want:
                got = verify(member, trusted_keys=trusted_keys)
                if not got.ok:
                    msg = got.problems[0].message
                    problems.append(msg if msg.startswith(member) else f"{member}: {msg}")
                elif got.info is not None and (  # (a report that is ok always has its info)
                    got.info.record.header_digest != want["header_digest"] or got.nbytes != want["bytes"]
                ):
                    problems.append(
                        f"{member}: another certified file than the one saved (header digest "
                        f"{got.info.record.header_digest}, the manifest says {want['header_digest']})"
                    )
                else:
                    out.verified.append(
                        CompanionFile(name=name, certified=True, nbytes=got.nbytes, tensors=got.tensors)
                    )
                continue
            problem = plain_problem(member, want, trusted_keys=trusted_keys)
        except CertckptError as e:
            text = str(e)
            problems.append(
                f"{member}: missing (the manifest lists it)"
                if "not found" in text.lower() or "no such" in text.lower()
                else text
            )
            continue
        if problem:
            problems.append(problem)
        else:
            out.verified.append(CompanionFile(name=name, certified=False, nbytes=want["bytes"]))
    return out
