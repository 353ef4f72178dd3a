"""The safetensors header: parse and validate untrusted bytes, and serialize canonically.

Nothing here imports torch: ``certckpt verify`` and ``certckpt inspect`` run on this module alone.
Every check runs before a value from the file is used to size an allocation or a loop, so a hostile
header can cost at most ``MAX_HEADER_BYTES`` of reading and one JSON parse.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from certckpt.errors import (
    CorruptCheckpointError,
    NotACheckpointError,
    TruncatedCheckpointError,
    UnsupportedObjectError,
)

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "TensorEntry",
    "Header",
    "canonical_json",
    "read_header_length",
    "parse_header",
    "encode_header",
    "padded_json",
    "is_canonical",
    "CanonicalForm",
    "OpenValue",
    "Slice",
    "printable",
    "gc_paused",
    "nesting_depth",
    "strict_json_loads",
    "json_object_fields",
    "sniff_foreign_format",
    "MAX_DIMS",
]

# Bytes per element of every dtype safetensors 0.8 stores (its `Dtype` enum).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# The Rust reader allows 100,000,000 bytes and huggingface_hub 25 MB; we refuse above the former
# without allocating, and our writer refuses to produce a header above the latter.
MAX_HEADER_BYTES = 100_000_000
MAX_WRITTEN_HEADER_BYTES = 25_000_000
# Tensors per file. Validating an entry costs ~10-20 us of Python, so this bounds what a header can
# cost a reader (about 2 s and 150 MB); the writer refuses more, so certckpt never writes a file it
# would refuse to read. Real states that large are saved in shards.
MAX_TENSORS = 100_000
MAX_DIMS = 64
MAX_DIM = 2**63 - 1  # torch sizes and file offsets are int64
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One row of the tensor table: offsets are relative to the start of the data buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class HeaderCache(TypedDict, total=False):
    """What a ``Header`` keeps after parsing (see ``Header.cache``)."""

    doc: dict[str, Any]
    form: CanonicalForm | None
    canonical: bool
    # where the record's skeleton lies in the record text when it was checked canonical and dropped
    # (``record.parse_record(keep_skeleton=False)``); None when it was not canonical
    skeleton_span: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Header:
    """A validated header.

    Attributes:
        length: N, the header's byte length as declared by the first 8 bytes.
        raw: the N header bytes exactly as read.
        entries: the tensor table in data order (ascending offsets).
        metadata: the ``__metadata__`` map (string to string), empty when absent.
        data_start: byte offset of the data buffer in the file (``8 + N``).
        data_length: total bytes of the data buffer.
    """

    length: int
    raw: bytes
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_start: int
    data_length: int
    # "doc": the parsed JSON of ``raw``, kept until its canonical form is made (record.canonical_form)
    # so that the header is never parsed twice, then dropped: for 100,000 tensors it holds ~60 MB of
    # small dicts that ``entries`` already says. "form": that canonical form.
    cache: HeaderCache = field(default_factory=HeaderCache, compare=False, repr=False)

    def parsed(self) -> dict[str, Any]:
        """A copy of the parsed header whose ``__metadata__`` map may be changed by the caller."""
        doc = self.cache.get("doc")
        doc = doc if doc is not None else strict_json_loads(self.raw)
        return {**doc, METADATA_KEY: dict(doc.get(METADATA_KEY) or {})}

    @property
    def file_length(self) -> int:
        return self.data_start + self.data_length


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json_loads(text: str | bytes) -> Any:
    """``json.loads`` without NaN/Infinity (which the canonical form cannot write back)."""
    return json.loads(text, parse_constant=_reject_constant)


_STRICT = json.JSONDecoder(parse_constant=_reject_constant)
_WS = frozenset(" \t\n\r")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def json_object_fields(text: str) -> Iterator[tuple[str, int, int, Any]]:
    """The members of the JSON object ``text``, one at a time: ``(key, start, end, value)`` with the
    value's span in ``text``. A caller that drops a value before asking for the next one never holds
    two large members at once. As strict as ``strict_json_loads``; a later duplicate key is yielded
    again (``json.loads`` keeps the last).

    Raises:
        ValueError: ``text`` is not one JSON object.
    """
    i = _skip_ws(text, 0)
    if not text.startswith("{", i):
        raise ValueError("expected a JSON object")
    i = _skip_ws(text, i + 1)
    if text.startswith("}", i):
        i += 1
    else:
        while True:
            key, i = _STRICT.raw_decode(text, i)
            if not isinstance(key, str):
                raise ValueError("object keys must be strings")
            i = _skip_ws(text, i)
            if not text.startswith(":", i):
                raise ValueError("expected ':'")
            start = _skip_ws(text, i + 1)
            value, i = _STRICT.raw_decode(text, start)
            yield key, start, i, value
            del value
            i = _skip_ws(text, i)
            if text.startswith(",", i):
                i = _skip_ws(text, i + 1)
            elif text.startswith("}", i):
                i += 1
                break
            else:
                raise ValueError("expected ',' or '}'")
    if _skip_ws(text, i) != len(text):
        raise ValueError("extra data after the object")


def nesting_depth(value: object, *, limit: int) -> int:
    """How deeply lists and dicts nest in a parsed JSON value, counted without recursion (so a hostile
    header cannot exhaust the stack here); stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children: Iterable[object]
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a header's JSON becomes objects.

    Parsing allocates hundreds of thousands of small dicts and lists and no reference cycles; each
    allocation burst triggers collections that walk every object made so far (measured on a
    100,000-tensor header: 1.36 s with the collector, 0.76 s without). Reference counting still frees
    everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def printable(name: str, limit: int = 200) -> str:
    """A tensor name safe to print on one line: control characters escaped, length bounded."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name[:limit])
    return out + ("..." if len(name) > limit else "")


def canonical_json(obj: object) -> str:
    """The one serialization certckpt writes: compact separators, ASCII only, insertion order."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def sniff_foreign_format(prefix: bytes) -> str | None:
    """Name the format of a file that is clearly not safetensors, from its first bytes."""
    if prefix.startswith(b"PK\x03\x04"):
        return (
            "a torch.save zip archive (pickle-based); "
            "load it with torch.load(weights_only=True) and re-save with certckpt.save"
        )
    if len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5:
        return (
            "a raw pickle (legacy torch.save); certckpt never unpickles — "
            "convert it with torch.load(weights_only=True) and certckpt.save"
        )
    if prefix.startswith(b"\x1f\x8b"):
        return "a gzip archive"
    return None


def read_header_length(prefix: bytes, *, file_length: int | None, source: str) -> int:
    """Decode and bound the 8-byte little-endian header length.

    Raises:
        NotACheckpointError: the bytes are a known foreign format or not safetensors at all.
        CorruptCheckpointError: a safetensors-shaped file whose declared length is impossible.
    """
    if len(prefix) < 8:
        foreign = sniff_foreign_format(prefix)
        if foreign:
            raise NotACheckpointError(f"{source}: not a certckpt checkpoint: it is {foreign}")
        raise TruncatedCheckpointError(
            f"{source}: truncated: the file has {len(prefix)} bytes, fewer than the 8-byte header length;"
            " restore it from a good copy"
        )
    n: int
    (n,) = struct.unpack("<Q", prefix[:8])
    # A safetensors header is a JSON object: the byte after the length is '{'. Only when it is not do
    # we look for foreign formats (a length like 896 begins with the bytes of a pickle opcode), and a
    # file that is neither was never safetensors: "not a checkpoint", not "corrupt".
    if len(prefix) > 8 and prefix[8:9] != b"{":
        foreign = sniff_foreign_format(prefix) or "not a safetensors file (no JSON header after the length)"
        raise NotACheckpointError(f"{source}: not a certckpt checkpoint: it is {foreign}")
    if n < 2:
        raise CorruptCheckpointError(f"{source}: malformed header: declared header length {n} bytes is too small")
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{source}: malformed header: declared header length {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit;"
            " the length field is damaged or the file is hostile"
        )
    if file_length is not None and 8 + n > file_length:
        raise TruncatedCheckpointError(
            f"{source}: truncated: header declares {n} bytes but the file has only {file_length} bytes"
        )
    return n


def _as_nonneg_int(value: object, name: str, what: str, source: str) -> int:
    # bool is an int subclass; JSON `true` must not pass as 1.
    if type(value) is not int or value < 0:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} {what} must be a non-negative integer, found {value!r:.80}"
        )
    return value


def _where(name: str) -> str:
    # Built only for a message: escaping every name up front cost ~8 us a tensor (0.8 s for 100,000).
    return f"tensor `{printable(name)}`"


def parse_header(raw: bytes, *, source: str, file_length: int | None) -> Header:
    """Parse and validate header bytes (without the 8-byte length prefix).

    Checks: UTF-8 JSON object; entries shaped ``{"dtype", "shape", "data_offsets"}``; known dtypes;
    shape product times element size equals the byte span; offsets contiguous from 0 without holes
    or overlaps; the file length equals ``8 + N + data length`` when known.
    """
    n = len(raw)
    _refuse_too_many_tensors(raw, source)
    doc = _json_object(raw, source)
    metadata = _metadata(doc, source)
    entries = [_tensor_entry(name, spec, source) for name, spec in doc.items() if name != METADATA_KEY]
    entries.sort(key=lambda e: (e.begin, e.end))
    data_length = _contiguous_length(entries, source)
    data_start = 8 + n
    if file_length is not None:
        _check_file_length(data_start + data_length, file_length, source)
    return Header(
        length=n,
        raw=bytes(raw),
        entries=tuple(entries),
        metadata=metadata,
        data_start=data_start,
        data_length=data_length,
        cache={"doc": doc},
    )


def _refuse_too_many_tensors(raw: bytes, source: str) -> None:
    # Counted on the raw bytes, before the JSON parse: a hostile header costs one scan, not a parse.
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        raise CorruptCheckpointError(
            f"{source}: the header lists more than {MAX_TENSORS:,} tensors, more than certckpt writes or reads in "
            "one file; a certckpt checkpoint never has that many (save large states in shards)"
        )


def _json_object(raw: bytes, source: str) -> dict[str, Any]:
    try:
        doc = strict_json_loads(raw.decode("utf-8"))  # (the decoded text is freed at once)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{source}: malformed header: not valid UTF-8 JSON ({e.__class__.__name__})"
        ) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{source}: malformed header: expected a JSON object, found {type(doc).__name__}")
    return doc


def _metadata(doc: dict[str, Any], source: str) -> dict[str, str]:
    if METADATA_KEY not in doc:
        return {}
    meta = doc[METADATA_KEY]
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CorruptCheckpointError(f"{source}: malformed header: __metadata__ must map strings to strings")
    return meta


def _tensor_entry(name: str, spec: object, source: str) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} must have exactly dtype, shape and data_offsets"
        )
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CorruptCheckpointError(f"{source}: malformed header: {_where(name)} has unknown dtype {dtype!r:.40}")
    dims = _shape(name, spec["shape"], source)
    begin, end = _data_offsets(name, spec["data_offsets"], source)
    numel = 1
    for d in dims:
        numel *= d  # bounded: at most 64 factors below 2**63, so at most 4032 bits
    if numel * DTYPE_SIZES[dtype] != end - begin:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} shape {list(dims)} of {dtype} needs "
            f"{numel * DTYPE_SIZES[dtype]} bytes but its offsets span {end - begin}"
        )
    if not numel and _empty_shape_overflows(dims):
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} shape {list(dims)} holds no element but its sizes"
            " overflow a tensor's element count or strides (int64)"
        )
    return TensorEntry(name, dtype, dims, begin, end)


def _empty_shape_overflows(dims: tuple[int, ...]) -> bool:
    """Whether torch, making a tensor of this shape (which holds no element), overflows int64: it
    multiplies the sizes in order into the element count (overflowing before it reaches a zero, as
    with [2**62, 2**62, 0]) and every size after the first, a zero counting as 1, into the strides
    ([0, 2**62, 2**62]). Both raise a RuntimeError in torch; a non-empty shape is bounded by its span."""
    count = stride = 1
    for d in dims:
        count *= d
        if count > MAX_DIM:
            return True
    for d in dims[1:]:
        stride *= max(d, 1)
        if stride > MAX_DIM:
            return True
    return False


def _shape(name: str, shape: object, source: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} shape must be a list of at most {MAX_DIMS} sizes"
        )
    dims = tuple(_as_nonneg_int(d, name, "shape entry", source) for d in shape)
    if any(d > MAX_DIM for d in dims):
        raise CorruptCheckpointError(f"{source}: malformed header: {_where(name)} has a dimension above 2**63 - 1")
    return dims


def _data_offsets(name: str, offsets: object, source: str) -> tuple[int, int]:
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise CorruptCheckpointError(f"{source}: malformed header: {_where(name)} data_offsets must be [begin, end]")
    begin = _as_nonneg_int(offsets[0], name, "begin offset", source)
    end = _as_nonneg_int(offsets[1], name, "end offset", source)
    if end < begin:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {_where(name)} ends ({end}) before it begins ({begin})"
        )
    if begin > MAX_DIM or end > MAX_DIM:
        raise CorruptCheckpointError(f"{source}: malformed header: {_where(name)} has an offset above 2**63 - 1")
    return begin, end


def _contiguous_length(entries: list[TensorEntry], source: str) -> int:
    """The data buffer's length, once the entries (sorted by offset) are known to tile it from 0."""
    cursor = 0
    for entry in entries:
        if entry.begin != cursor:
            kind = "overlaps the previous tensor" if entry.begin < cursor else "leaves a hole before it"
            raise CorruptCheckpointError(
                f"{source}: malformed header: tensor `{printable(entry.name)}` at offset {entry.begin} {kind} "
                f"(expected {cursor})"
            )
        cursor = entry.end
    return cursor


def _check_file_length(needed: int, file_length: int, source: str) -> None:
    if needed > file_length:
        raise TruncatedCheckpointError(
            f"{source}: truncated: the tensors need {needed} bytes but the file has {file_length}"
        )
    if needed < file_length:
        raise CorruptCheckpointError(
            f"{source}: {file_length - needed} unexpected trailing bytes after the last tensor"
        )


def padded_json(doc: dict[str, Any]) -> bytes:
    """Canonical JSON of a header document, space-padded to a multiple of 8 bytes (no length prefix)."""
    body = canonical_json(doc).encode("ascii")
    return body + b" " * (-len(body) % 8)


def encode_header(doc: dict[str, Any]) -> bytes:
    """Serialize a header document canonically, padded with spaces to a multiple of 8 bytes."""
    if len(doc) - (METADATA_KEY in doc) > MAX_TENSORS:
        raise UnsupportedObjectError(
            f"the checkpoint would hold {len(doc) - (METADATA_KEY in doc):,} tensors (limit {MAX_TENSORS:,} per file); "
            "save large states in shards (one file per part of the state)"
        )
    body = padded_json(doc)
    if len(body) > MAX_WRITTEN_HEADER_BYTES:
        raise UnsupportedObjectError(
            f"the checkpoint header would be {len(body)} bytes (limit {MAX_WRITTEN_HEADER_BYTES}); "
            "the object has too many tensors or too large a skeleton — save large parts separately"
        )
    return struct.pack("<Q", len(body)) + body


_ESCAPE_SLICE = 1 << 20
_escape_ascii = json.encoder.encode_basestring_ascii  # what json.dumps(ensure_ascii=True) writes for a str


class Slice:
    """``text[start:end]`` without the copy; sliceable again (what ``CanonicalForm`` needs of it)."""

    __slots__ = ("text", "start", "end")

    def __init__(self, text: str, start: int, end: int) -> None:
        self.text, self.start, self.end = text, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, s: slice) -> str:
        a, b, _ = s.indices(len(self))
        return self.text[self.start + a : self.start + b]


# An open string's value in a ``CanonicalForm``: the string, or it in parts (a prefix as a ``Slice``).
OpenValue = str | tuple[str | Slice, ...]


class CanonicalForm:
    """A header's canonical bytes with some ``__metadata__`` strings left open, checked and hashed
    many ways after one serialization.

    Checking a header needs its canonical bytes with only the record or the signature string changed
    (the form check, the header digest, the signed bytes); for a 100,000-tensor header each
    re-serialization cost ~0.4 s and ~40 MB. Here the header is serialized once with a random marker
    in place of each open string and cut at the markers; every variant is the fixed pieces around
    the strings' own encodings: byte for byte what ``padded_json`` writes for the changed document.

    Raises:
        ValueError: the document cannot be written canonically (NaN or Infinity in it).
    """

    __slots__ = ("_text", "_spans", "_order")

    def __init__(self, doc: dict[str, Any], holes: tuple[str, ...]) -> None:
        import secrets  # a marker no file can predict, so none can hold it already

        meta = doc.get(METADATA_KEY)
        open_meta: dict[str, Any] = meta if isinstance(meta, dict) else {}
        marks = {k: secrets.token_hex(16) for k in holes if k in open_meta}
        shadow = {**doc, METADATA_KEY: {k: marks.get(k, v) for k, v in open_meta.items()}} if marks else doc
        text = canonical_json(shadow).encode("ascii")
        at = sorted((text.index(f'"{m}"'.encode()), k, len(m) + 2) for k, m in marks.items())
        self._order = tuple(k for _, k, _ in at)
        spans, cursor = [], 0
        for pos, _, width in at:
            spans.append((cursor, pos))
            cursor = pos + width
        spans.append((cursor, len(text)))
        self._text, self._spans = text, tuple(spans)

    def _parts(self, values: Mapping[str, OpenValue]) -> Iterator[tuple[bool, Any]]:
        """``(fixed, bytes)`` in order: the fixed pieces, the open strings' encodings between them (a
        string escapes code point by code point, so it is encoded a slice at a time and a 10 MB record
        never exists twice), and the padding. A value may be a tuple of strings (one string in parts:
        a prefix of a long one is given as a ``Slice``)."""
        view, length = memoryview(self._text), 0
        for i, (a, b) in enumerate(self._spans):
            if i:
                value = values[self._order[i - 1]]
                yield False, b'"'
                for text in value if isinstance(value, tuple) else (value,):
                    for at in range(0, len(text), _ESCAPE_SLICE):
                        part = _escape_ascii(text[at : at + _ESCAPE_SLICE])[1:-1].encode("ascii")
                        length += len(part)
                        yield False, part
                yield False, b'"'
                length += 2
            length += b - a
            yield True, view[a:b]
        yield False, b" " * (-length % 8)

    def pieces(self, values: Mapping[str, OpenValue]) -> Iterator[Any]:
        """The padded canonical bytes with each open string set to ``values[key]``, as pieces."""
        return (piece for _, piece in self._parts(values))

    def render(self, values: dict[str, str]) -> bytes:
        """The padded canonical bytes with each open string set to ``values[key]``."""
        return b"".join(self.pieces(values))

    def matches(self, values: dict[str, str], raw: bytes) -> bool:
        """Whether ``raw`` is exactly ``render(values)``, compared piece by piece (no copy is made).

        On a match the form keeps pointing into ``raw`` (which holds the same fixed pieces) and drops
        its own copy of them.
        """
        view, at, spans = memoryview(raw), 0, []
        for fixed, piece in self._parts(values):
            if view[at : at + len(piece)] != piece:
                return False
            if fixed:
                spans.append((at, at + len(piece)))
            at += len(piece)
        if at != len(raw):
            return False
        self._text, self._spans = raw, tuple(spans)
        return True


def is_canonical(header: Header) -> bool:
    """True when the raw header bytes are exactly what ``encode_header`` writes for their content.

    JSON tolerates whitespace and escapes, so a flipped padding or separator byte can leave the parsed
    content unchanged; comparing bytes to the canonical form catches every such change.
    """
    try:
        return padded_json(header.parsed()) == header.raw
    except (ValueError, RecursionError):  # NaN/Infinity literals parse but cannot be re-serialized canonically
        return False
