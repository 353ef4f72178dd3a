"""The certckpt record: the versioned JSON document stored under ``__metadata__["certckpt"]``.

The schema is documented in ``docs/format.md``. Every hash in the record has a fixed width, so the
header's byte length is known before any fingerprint is computed; the writer relies on that to write
the data first and the header last. No torch import here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import xxhash

from certckpt.errors import CorruptCheckpointError, NotACheckpointError

from .datahash import DIGEST_FIELDS
from .header import (
    METADATA_KEY,
    CanonicalForm,
    Header,
    OpenValue,
    Slice,
    TensorEntry,
    canonical_json,
    encode_header,
    gc_paused,
    json_object_fields,
    nesting_depth,
    padded_json,
    printable,
    strict_json_loads,
)

if TYPE_CHECKING:  # the keys are duck-typed here; cryptography is imported only where keys are used
    from .signing import SigningKey, TrustedKeys

__all__ = [
    "SCHEMA_VERSION",
    "RECORD_KEY",
    "SIG_KEY",
    "signature_problem",
    "CheckpointRecord",
    "RecordFields",
    "build_header",
    "parse_record",
    "check_header",
    "state_fingerprint",
]

SCHEMA_VERSION = 1
RECORD_KEY = "certckpt"
FP_HEX = 16  # 64-bit device fingerprint
DIGEST_HEX = 32  # xxh3-128
_PLACEHOLDER_DIGEST = "0" * DIGEST_HEX
# A signed file's header holds one more metadata entry (docs/format.md, "Signed files"). Its values are
# fixed-width too, so signing does not change the header's planned length.
SIG_KEY = "certckpt.sig"
SIGNATURE_DOMAIN = b"certckpt file signature v1\n"
_PLACEHOLDER_SIG = "0" * 88  # base64 of a 64-byte Ed25519 signature
_PLACEHOLDER_SHA256 = "0" * 64


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordFields:
    """What a checkpoint's record carries besides the file's own contents: who wrote it, at which
    step, on which line of training, and the audit evidence. The writer puts them in the file's
    record (``save_certified``, ``AsyncSaver.save``); a ledger commit (``trust.commit.commit_saved``)
    puts all but ``lineage`` in its commit record. It lives here, beside ``CheckpointRecord``, because
    the writer needs it and ``format`` cannot import ``trust``.

    Attributes:
        step: the optimizer update count the weights correspond to (a commit needs it).
        run: the training run's name.
        branch: the line of training within the run (a commit needs it; None for a plain save).
        parent: the id of the checkpoint this branch resumed from.
        step_range: ``[first, last]`` updates since the previous checkpoint (from the auditor).
        lineage: the audits since the previous checkpoint and their outcomes (from the auditor).
        consensus_fp: the state fingerprint every replica agreed on at ``step`` (from the auditor).
    """

    step: int | None = None
    run: str | None = None
    branch: str | None = None
    parent: str | None = None
    step_range: list[int] | None = None
    lineage: dict[str, Any] | None = None
    consensus_fp: str | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The fields one by one, as ``CheckpointRecord`` and ``save_certified`` take them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(kw_only=True, slots=True)
class CheckpointRecord:
    """Everything certckpt knows about one checkpoint file.

    Attributes:
        schema: record schema version (``SCHEMA_VERSION`` when written by this certckpt).
        run: the training run's name, or None.
        branch: the line of training within the run (set by the auditor), or None.
        step: optimizer update count the weights correspond to, or None.
        step_range: ``[first, last]`` updates since the previous checkpoint (filled by the auditor).
        parent: id of the checkpoint this branch resumed from, or None.
        lineage: audits run since the previous checkpoint and their outcomes (filled by the auditor).
        consensus_fp: whole-state fingerprint every replica agreed on at ``step``, or None.
        state_fp: whole-state fingerprint of this file's tensors (hex, 16 digits).
        tensors: per stored tensor, ``{"fp": device fingerprint, "xxh3": xxh3-128 of its bytes}``.
        skeleton: the structure that rebuilds the saved object (see ``skeleton.py``).
        writer: inventory of the writing process (host, torch version, devices, time).
        user: the caller's own string metadata.
        header_digest: xxh3-128 of the canonical header with this field zeroed.
    """

    schema: int = SCHEMA_VERSION
    run: str | None = None
    branch: str | None = None
    step: int | None = None
    step_range: list[int] | None = None
    parent: str | None = None
    lineage: dict[str, Any] | None = None
    consensus_fp: str | None = None
    state_fp: str = "0" * FP_HEX
    tensors: dict[str, dict[str, str]] = field(default_factory=dict)
    skeleton: Any = None
    writer: dict[str, Any] = field(default_factory=dict)
    user: dict[str, str] = field(default_factory=dict)
    header_digest: str = _PLACEHOLDER_DIGEST

    def to_json(self) -> str:
        return canonical_json(self.as_doc())

    def as_doc(self) -> dict[str, Any]:
        """The record as a JSON document (shallow: its values are JSON already; ``dataclasses.asdict``
        would copy them recursively, and a hostile file can nest them deeper than the stack)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def state_fingerprint(named_fps: dict[str, str] | Iterable[tuple[str, str]]) -> str:
    """Whole-state fingerprint: xxh3-64 (hex) of the sorted ``name=fingerprint`` lines (a dict or its
    items)."""
    pairs = named_fps.items() if isinstance(named_fps, dict) else named_fps
    lines = sorted(f"{name}={fp}" for name, fp in pairs)
    return xxhash.xxh3_64_hexdigest("\n".join(lines).encode("utf-8"))


def _header_doc(
    entries: list[TensorEntry], record: CheckpointRecord, sig: dict[str, str] | None = None
) -> dict[str, Any]:
    doc: dict[str, Any] = {METADATA_KEY: {"format": "pt", RECORD_KEY: record.to_json()}}
    if sig is not None:
        doc[METADATA_KEY][SIG_KEY] = canonical_json(sig)
    for e in entries:
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    return doc


def header_digest(header_bytes_without_digest: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(header_bytes_without_digest)


def build_header(
    entries: list[TensorEntry],
    record: CheckpointRecord,
    *,
    signer: SigningKey | None = None,
    data_digest: tuple[str, str | None] = ("data_blake3", None),
) -> bytes:
    """The complete header (8-byte length + padded JSON), with ``record.header_digest`` filled in and,
    with a ``signer``, signed over its own bytes and the data's digest (``data_digest``: the
    signature entry's field, ``data_blake3`` or ``data_sha256``, and its hex value).

    The length does not depend on hash values: all are fixed-width strings.
    """
    sig = None
    if signer is not None:
        field_name, value = data_digest
        if field_name not in DIGEST_FIELDS:
            raise ValueError(f"unknown data digest {field_name!r}")
        sig = {"key": signer.key_id, field_name: value or _PLACEHOLDER_SHA256, "ed25519": _PLACEHOLDER_SIG}
    record.header_digest = _PLACEHOLDER_DIGEST
    blank = encode_header(_header_doc(entries, record, sig))
    record.header_digest = header_digest(blank[8:])
    final = encode_header(_header_doc(entries, record, sig))
    if signer is not None and sig is not None:
        # Signed: the whole header as written, with only the signature itself blank.
        sig = {**sig, "ed25519": signer.sign_bytes(SIGNATURE_DOMAIN + final[8:])}
        final = encode_header(_header_doc(entries, record, sig))
    assert len(final) == len(blank)
    return final


_FIELDS = {f: None for f in CheckpointRecord.__dataclass_fields__}


def parse_record(header: Header, *, source: str, keep_skeleton: bool = True) -> CheckpointRecord:
    """Extract and validate the certckpt record from a parsed header.

    Args:
        keep_skeleton: False for a reader that never rebuilds the object (``verify``): the skeleton is
            parsed and its canonical form checked, then dropped before the next field is parsed
            (``record.skeleton`` is None), so it and the per-tensor digests are never in memory
            together (100,000 tensors: each about 40 MB parsed).

    Raises:
        NotACheckpointError: a plain safetensors file, or one written by a newer schema.
        CorruptCheckpointError: the record is present but damaged.
    """
    text = header.metadata.get(RECORD_KEY)
    if text is None:
        if _holds_record_text(header.raw):
            # The record's text is there under a damaged key (or the metadata map's own key is
            # damaged): a damaged certckpt file, which is a failure (exit 1), not a foreign file.
            raise CorruptCheckpointError(
                f"{source}: malformed header: the certckpt record is present but its key is damaged;"
                " restore the file from a good copy"
            )
        raise NotACheckpointError(
            f"{source}: not a certckpt checkpoint: a plain safetensors file without certckpt metadata;"
            " open it with safetensors.safe_open, or re-save it with certckpt.save to certify it"
        )
    try:
        doc = strict_json_loads(text) if keep_skeleton else _loads_dropping_skeleton(text, header)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{source}: malformed header: the certckpt record is not valid JSON") from e
    if not isinstance(doc, dict) or type(doc.get("schema")) is not int:
        raise CorruptCheckpointError(f"{source}: malformed header: the certckpt record has no schema version")
    for key, limit in _DEPTH_LIMITS.items():
        depth = nesting_depth(doc.get(key) if key else doc, limit=limit)
        if depth > limit:
            raise CorruptCheckpointError(
                f"{source}: damaged or hostile header: the certckpt record's {key} nests more than"
                f" {limit} levels deep; restore the file from a good copy"
            )
    if doc["schema"] > SCHEMA_VERSION:
        if not _digest_holds(header, doc if keep_skeleton else strict_json_loads(text)):
            # Every schema keeps `header_digest` over the header with that field zeroed
            # (docs/format.md), so a newer file still proves its own header: a schema number that
            # does not is a damaged one, not a newer certckpt.
            raise CorruptCheckpointError(
                f"{source}: header digest mismatch: the record claims schema {doc['schema']} but its header"
                " digest does not hold (the header is damaged); restore the file from a good copy"
            )
        raise NotACheckpointError(
            f"{source}: written with certckpt record schema {doc['schema']}; this certckpt reads up to"
            f" schema {SCHEMA_VERSION} — upgrade certckpt (pip install -U certckpt)"
        )
    unknown = set(doc) - set(_FIELDS)
    missing = set(_FIELDS) - set(doc)
    if unknown or missing:
        raise CorruptCheckpointError(
            f"{source}: malformed header: certckpt record fields differ from schema {doc['schema']}"
            f" (unknown {sorted(unknown)[:5]}, missing {sorted(missing)[:5]})"
        )
    record = CheckpointRecord(**doc)
    _validate(record, header, source)
    return record


def _loads_dropping_skeleton(text: str, header: Header) -> dict[str, Any]:
    """The record document with ``skeleton`` None; ``header.cache["skeleton_span"]`` is the skeleton's
    span in ``text`` when it was written canonically, else None (``check_header`` then fails the
    header as not in certckpt's form, as it would with the skeleton kept).

    The per-tensor digests come before the skeleton, and each is about as large parsed: they are
    parsed, dropped once their span is known, and parsed again from that span after the skeleton is
    gone, so the two are never in memory together (one more parse of the digests, ~0.1 s for
    100,000 tensors, for half the peak).
    """
    doc: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    for key, start, end, value in json_object_fields(text):
        if key == "skeleton":
            try:
                canonical = canonical_json(value) == text[start:end]
            except (ValueError, RecursionError):
                canonical = False
            header.cache["skeleton_span"] = (start, end) if canonical else None
            value = None
        elif key == "tensors" and isinstance(value, dict):
            spans[key] = (start, end)
            value = None
        doc[key] = value
        del value
    for key, (start, end) in spans.items():
        doc[key] = strict_json_loads(text[start:end])
    return doc


# How deep the record's small fields may nest (they are flat by construction). The skeleton is bounded
# where it is decoded (skeleton.MAX_DEPTH), and nothing recurses over it in Python before that.
_DEPTH_LIMITS = {"lineage": 16, "writer": 16, "user": 2}


def _is_hex(value: object, width: int) -> bool:
    if not isinstance(value, str) or len(value) != width:
        return False
    try:
        int(value, 16)
    except ValueError:
        return False
    return True


def _validate(record: CheckpointRecord, header: Header, source: str) -> None:
    tensors = record.tensors
    # (compared without building sets of 100,000 names)
    if (
        not isinstance(tensors, dict)
        or len(tensors) != len(header.entries)
        or any(e.name not in tensors for e in header.entries)
    ):
        raise CorruptCheckpointError(
            f"{source}: malformed header: the certckpt record's tensor list does not match the tensor table"
        )
    for name, d in record.tensors.items():
        if not isinstance(d, dict) or not _is_hex(d.get("fp"), FP_HEX) or not _is_hex(d.get("xxh3"), DIGEST_HEX):
            raise CorruptCheckpointError(
                f"{source}: malformed header: tensor `{printable(name)}` has no valid fingerprint and digest"
            )
    if not _is_hex(record.header_digest, DIGEST_HEX) or not _is_hex(record.state_fp, FP_HEX):
        raise CorruptCheckpointError(f"{source}: malformed header: the certckpt record's digests are malformed")
    for name, ok in (
        ("run", record.run is None or isinstance(record.run, str)),
        ("branch", record.branch is None or isinstance(record.branch, str)),
        ("step", record.step is None or type(record.step) is int),
        (
            "step_range",
            record.step_range is None
            or (
                isinstance(record.step_range, list)
                and len(record.step_range) == 2
                and all(type(x) is int for x in record.step_range)
            ),
        ),
        ("parent", record.parent is None or isinstance(record.parent, str)),
        ("lineage", record.lineage is None or isinstance(record.lineage, dict)),
        ("consensus_fp", record.consensus_fp is None or _is_hex(record.consensus_fp, FP_HEX)),
        ("writer", isinstance(record.writer, dict)),
        ("user", isinstance(record.user, dict) and all(isinstance(v, str) for v in record.user.values())),
    ):
        if not ok:
            raise CorruptCheckpointError(
                f"{source}: malformed header: the certckpt record's `{name}` has the wrong type"
            )


def _holds_record_text(raw: bytes) -> bool:
    # Field names of every schema's record, as they appear escaped inside the metadata string.
    return b'\\"header_digest\\"' in raw and b'\\"schema\\"' in raw


def _digest_holds(header: Header, record_doc: dict[str, Any]) -> bool:
    """Whether ``header_digest`` verifies under the rule every schema keeps: xxh3-128 of the canonical
    header with the record's ``header_digest`` set to zeros."""
    claimed = record_doc.get("header_digest")
    if not _is_hex(claimed, DIGEST_HEX):
        return False
    try:
        doc = _blank_signature(header.parsed())
        doc[METADATA_KEY][RECORD_KEY] = canonical_json({**record_doc, "header_digest": _PLACEHOLDER_DIGEST})
        return header_digest(padded_json(doc)) == claimed
    except (ValueError, RecursionError, KeyError, TypeError):
        return False


def _signature_entry(doc: dict[str, Any]) -> dict[str, str] | None:
    """The header's signature entry, or None when unsigned; ValueError when it is malformed."""
    text = doc.get(METADATA_KEY, {}).get(SIG_KEY)
    if text is None:
        return None
    sig = strict_json_loads(text) if isinstance(text, str) else None
    fields_named = [f for f in DIGEST_FIELDS if isinstance(sig, dict) and f in sig]
    if not (
        isinstance(sig, dict)
        and len(fields_named) == 1
        and set(sig) == {"key", fields_named[0], "ed25519"}
        and all(isinstance(v, str) for v in sig.values())
        and len(sig["ed25519"]) == len(_PLACEHOLDER_SIG)
        and _is_hex(sig[fields_named[0]], 64)
    ):
        raise ValueError("malformed signature entry")
    return sig


def _blank_signature(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its signature (if any) replaced by the placeholder the signer signed over."""
    sig = _signature_entry(doc)
    if sig is not None:
        doc[METADATA_KEY][SIG_KEY] = canonical_json({**sig, "ed25519": _PLACEHOLDER_SIG})
    return doc


def signature_problem(header: Header, trusted_keys: TrustedKeys) -> tuple[str | None, tuple[str, str] | None]:
    """Check the header's signature: ``(problem or None, (digest field, signed data digest) or None)``.

    The caller must still compare the data's digest (``datahash.BackgroundDigest(field)``) with the
    signed one: the signature covers the data only through it.
    """
    try:
        sig = _signature_entry({METADATA_KEY: header.metadata})
    except (ValueError, RecursionError, AttributeError) as e:
        return f"the header's signature entry is malformed ({e})", None
    if sig is None:
        return "unsigned: the file carries no signature (it was saved without a signing key)", None
    form = canonical_form(header)
    if form is None:
        return "the header is not in the form certckpt writes, so no signature can hold over it", None
    signed = form.render({**header.metadata, SIG_KEY: _blank_signature_text(sig)})
    field_name = next(f for f in DIGEST_FIELDS if f in sig)
    return trusted_keys.bytes_problem(sig, SIGNATURE_DOMAIN + signed, what="the header"), (field_name, sig[field_name])


def canonical_form(header: Header) -> CanonicalForm | None:
    """The header's canonical serialization with the record and signature strings open, made once per
    header (its form, its digest and its signature are each checked over it); None when the header
    cannot be written canonically at all (NaN or Infinity in it), which no certckpt file is.

    Making it drops the header's parsed document (``Header.cache``), which nothing needs after.
    """
    if "form" not in header.cache:
        doc = header.cache.pop("doc", None)
        try:
            form = CanonicalForm(doc if doc is not None else header.parsed(), (RECORD_KEY, SIG_KEY))
        except (ValueError, RecursionError):
            form = None
        del doc
        # Compared with the file's bytes at once: on a match the form points into them and frees its
        # own copy before the record is parsed (what check_header asks first).
        header.cache["canonical"] = form is not None and form.matches(header.metadata, header.raw)
        header.cache["form"] = form
    return header.cache["form"]


def _is_record_text(text: str | None, record: CheckpointRecord, skeleton_span: tuple[int, int] | None = None) -> bool:
    """Whether ``text`` is exactly ``record.to_json()``, compared in place a slice at a time
    (re-serializing a 100,000-tensor record at once held ~36 MB). ``skeleton_span``: where a skeleton
    already checked canonical and dropped (``parse_record(keep_skeleton=False)``) lies in ``text``."""
    if not isinstance(text, str):
        return False
    at = 0
    for i, f in enumerate(fields(record)):
        key = ("{" if i == 0 else ",") + canonical_json(f.name) + ":"
        if not text.startswith(key, at):
            return False
        at += len(key)
        if f.name == "skeleton" and skeleton_span is not None and record.skeleton is None:
            at = skeleton_span[1] if skeleton_span[0] == at else -1
        else:
            at = _json_at(text, at, getattr(record, f.name))
        if at < 0:
            return False
    return at + 1 == len(text) and text.endswith("}")


def _json_at(text: str, at: int, value: Any, batch: int = 4096) -> int:
    """Where ``canonical_json(value)`` ends if ``text`` holds it at ``at``, else -1; a large dict
    (the per-tensor digests) is serialized ``batch`` items at a time."""
    if not isinstance(value, dict) or len(value) <= batch:
        piece = canonical_json(value)
        return at + len(piece) if text.startswith(piece, at) else -1
    items = iter(value.items())
    for k in range(0, len(value), batch):
        piece = canonical_json(dict(itertools.islice(items, batch)))  # "{...}" of these items
        piece = ("{" if k == 0 else ",") + piece[1:-1] + ("}" if k + batch >= len(value) else "")
        if not text.startswith(piece, at):
            return -1
        at += len(piece)
    return at


def _blank_signature_text(sig: dict[str, str]) -> str:
    return canonical_json({**sig, "ed25519": _PLACEHOLDER_SIG})


def _blank_record_text(text: str, record: CheckpointRecord) -> str | tuple[Slice, str]:
    """The record's canonical text with ``header_digest`` zeroed. ``header_digest`` is the record's
    last field, so on canonical text that is a change of suffix, given as parts (re-serializing a
    100,000-tensor record cost ~0.3 s, and a copy of it 11 MB)."""
    suffix = f'"header_digest":"{record.header_digest}"}}'
    if text.endswith(suffix):
        return (Slice(text, 0, len(text) - len(suffix)), f'"header_digest":"{_PLACEHOLDER_DIGEST}"}}')
    return CheckpointRecord(**{**record.as_doc(), "header_digest": _PLACEHOLDER_DIGEST}).to_json()


def check_header(header: Header, record: CheckpointRecord) -> str | None:
    """Return a one-line problem when the header bytes differ from what was written, else None."""
    text = header.metadata.get(RECORD_KEY)
    form = canonical_form(header)
    with gc_paused():
        canonical = (
            form is not None
            and header.cache["canonical"]
            and _is_record_text(text, record, header.cache.get("skeleton_span"))
        )
    # (canonical implies a form and a record string; the last two tests say so to the type checker)
    if not canonical or form is None or text is None:
        return "header bytes are not in the form certckpt writes (whitespace, order or encoding changed)"
    try:
        sig = _signature_entry({METADATA_KEY: header.metadata})
    except (ValueError, AttributeError):
        return "the header's signature entry is malformed"
    blank: dict[str, OpenValue] = {RECORD_KEY: _blank_record_text(text, record)}
    if sig is not None:
        blank[SIG_KEY] = _blank_signature_text(sig)
    h = xxhash.xxh3_128()
    for piece in form.pieces(blank):
        h.update(piece)
    found = h.hexdigest()
    if found != record.header_digest:
        return (
            f"header digest mismatch (expected {record.header_digest}, found {found}):"
            " the tensor table or metadata changed after writing"
        )
    return None
