"""Multi-file checkpoints in a vault: what a committed checkpoint consists of, where it is held, and
how its files are copied in order (every member first, the file that commits the whole one last).

Three kinds, told apart by the commit record's url:

* ``file``: one certified file, held as ``<ckpt_id>.safetensors`` (unchanged since the first vault);
* ``sharded``: a DCP directory (``shard-RRRRR.safetensors`` and ``manifest.safetensors``, the manifest
  listing every shard with its size and header digest, and its record any companion files: Megatron's
  common state, ShardedObjects and ``metadata.json``), held as the directory ``<ckpt_id>``;
* ``companions``: one certified file whose record lists other files of its directory (size and header
  digest or xxh3), held as ``<ckpt_id>/<its name>`` with its companions beside it.

The member list is read from the manifest or the file's record only after that file's header digest
was matched against the commit (or holding) record, and every name in it is a plain file name: no
member can lie outside the held directory. No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from certckpt.errors import CertckptError, CorruptCheckpointError
from certckpt.format.companions import companions_of, plain_problem
from certckpt.format.record import CheckpointRecord
from certckpt.format.sharded.layout import MANIFEST_NAME, is_directory
from certckpt.format.sharded.manifest import read_manifest
from certckpt.format.signing import TrustedKeys
from certckpt.format.verify import inspect, verify
from certckpt.storage import join

__all__ = ["KINDS", "Member", "Bundle", "bundle_of", "describe", "held_name", "member_check", "parent_of"]

KINDS = ("file", "sharded", "companions")
# a member's name: a plain file name in the checkpoint's directory (no separator, no leading dot)
_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_CHUNK = 16 << 20


@dataclass(frozen=True, slots=True)
class Member:
    """One file of a multi-file checkpoint, as its manifest or listing file binds it.

    Attributes:
        name: its plain file name in the checkpoint's directory.
        nbytes: its size.
        header_digest: its record's header digest (a certified file), else None.
        xxh3: the xxh3-128 of its bytes (any other file), else None.
        entry: the listing's whole entry of an uncertified file (its cryptographic digest too), else None.
    """

    name: str
    nbytes: int
    header_digest: str | None = None
    xxh3: str | None = None
    entry: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Bundle:
    """A committed checkpoint's files.

    Attributes:
        kind: one of ``KINDS``.
        directory: the directory holding every file (for ``file``, the file's own directory).
        marker: the file that commits the whole: the manifest, the listing file, or the one file.
        members: every other file, copied before the marker and deleted after it.
    """

    kind: str
    directory: str
    marker: str
    members: tuple[Member, ...] = ()

    @property
    def url(self) -> str:
        """What a commit or holding record names: the directory (sharded) or the marker file."""
        return self.directory if self.kind == "sharded" else join(self.directory, self.marker)


def parent_of(url: str) -> str:
    """The directory a file url is in (``.`` for a bare name)."""
    return url.rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."


def bundle_of(url: str, *, header_digest: str | None) -> Bundle:
    """Read what the checkpoint at ``url`` consists of.

    Args:
        url: a commit or holding record's location (a file or a sharded checkpoint's directory).
        header_digest: the committed header digest of the file that commits the whole (the manifest,
            or the checkpoint file); its member list is trusted only when it matches.

    Raises:
        CorruptCheckpointError: the marker is not the committed one, or its member list is
            malformed or names a file outside its directory.
        CheckpointNotFoundError, NotACheckpointError, StorageError: it cannot be read.
    """
    if not url.endswith(".safetensors") and is_directory(url):
        manifest, info = read_manifest(url)
        where = join(url, MANIFEST_NAME)
        _committed(where, info.record.header_digest, header_digest)
        shards = tuple(Member(f.name, f.nbytes, header_digest=f.header_digest) for f in manifest.files)
        # the manifest's record may bind files beside the shards (Megatron's common state and
        # ShardedObjects): without them a copy's manifest does not verify, nor does the checkpoint load
        members = shards + _companions(where, info.record, MANIFEST_NAME)
        return Bundle(kind="sharded", directory=url.rstrip("/"), marker=MANIFEST_NAME, members=_plain(url, members))
    record = inspect(url).record
    _committed(url, record.header_digest, header_digest)
    marker = url.rstrip("/").rsplit("/", 1)[-1]
    members = _companions(url, record, marker)
    if not members:
        return Bundle(kind="file", directory=parent_of(url), marker=marker)
    return Bundle(kind="companions", directory=parent_of(url), marker=marker, members=_plain(url, members))


def _companions(where: str, record: CheckpointRecord, marker: str) -> tuple[Member, ...]:
    """The companion files ``record`` lists (``format.companions``), as members; none when it lists none."""
    try:
        files = companions_of(record)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: the record's table of companion files is unreadable ({e})") from e
    if not files:
        return ()
    if marker in files:
        raise CorruptCheckpointError(f"{where}: its table of companion files lists the file itself")
    return tuple(
        Member(
            name,
            want["bytes"],
            header_digest=want.get("header_digest"),
            xxh3=want.get("xxh3"),
            entry=None if "header_digest" in want else dict(want),
        )
        for name, want in sorted(files.items())
    )


def _committed(where: str, found: str, want: str | None) -> None:
    if want and found != want:
        raise CorruptCheckpointError(
            f"{where}: not the file that was committed (header digest {found}, committed {want}); its list of "
            "files is not trusted"
        )


def _plain(url: str, members: tuple[Member, ...]) -> tuple[Member, ...]:
    """Refuse a member list naming anything but plain files of the checkpoint's own directory (the
    format's parsers already refuse them; a vault re-checks what decides where it writes and deletes)."""
    seen = set()
    for m in members:
        if not _PLAIN.match(m.name) or m.name in seen:
            raise CorruptCheckpointError(
                f"{url}: lists {m.name[:80]!r}, not a plain file name of its own directory (or listed twice); refused"
            )
        seen.add(m.name)
    return members


def held_name(ckpt_id: str, bundle: Bundle) -> str:
    """The holding's url, relative to the vault: ``<id>.safetensors``, ``<id>`` or ``<id>/<marker>``."""
    if bundle.kind == "file":
        return f"{ckpt_id}.safetensors"
    if bundle.kind == "sharded":
        return ckpt_id
    return f"{ckpt_id}/{bundle.marker}"


def member_check(member: Member, *, trusted_keys: TrustedKeys | None = None) -> Callable[[str], str | None]:
    """A check of one copied member: ``check(url)`` is None when the file at ``url`` is that member
    (verified whole and the same header digest and size, or the same size and digests), else why not."""

    def check(url: str) -> str | None:
        try:
            if member.header_digest is not None:
                rep = verify(url, trusted_keys=trusted_keys)
                if not rep.ok or rep.info is None:
                    return rep.problems[0].message if rep.problems else f"{url}: unreadable"
                if rep.info.record.header_digest != member.header_digest or rep.nbytes != member.nbytes:
                    return (
                        f"{url}: not the {member.name} its checkpoint lists (header digest "
                        f"{rep.info.record.header_digest}, {rep.nbytes} bytes; listed {member.header_digest}, "
                        f"{member.nbytes} bytes)"
                    )
                return None
            problem = plain_problem(
                url, member.entry or {"bytes": member.nbytes, "xxh3": member.xxh3}, trusted_keys=trusted_keys
            )
        except CertckptError as e:
            return str(e)
        return f"{problem} (not the {member.name} its checkpoint lists)" if problem else None

    return check


def describe(bundle: Bundle) -> dict[str, Any]:
    """The bundle as a holding's ``layout`` field (what the vault copied, in order)."""
    return {"kind": bundle.kind, "files": [m.name for m in bundle.members] + [bundle.marker]}
