"""The safetensors header: parse and validate untrusted bytes, and serialize canonically.

Nothing here imports torch: ``certckpt verify`` and ``certckpt inspect`` run on this module alone.
Every check runs before a value from the file is used to size an allocation or a loop, so a hostile
header can cost at most ``MAX_HEADER_BYTES`` of reading and one JSON parse.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from certckpt.errors import CorruptCheckpointError, NotACheckpointError, UnsupportedObjectError

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
    "printable",
    "nesting_depth",
    "strict_json_loads",
    "nesting_depth",
    "sniff_foreign_format",
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
    # the parsed JSON of ``raw``, kept so that checks over it never parse the header twice
    doc: dict | None = field(default=None, compare=False, repr=False)

    def parsed(self) -> dict:
        """A copy of the parsed header whose ``__metadata__`` map may be changed by the caller."""
        doc = self.doc if self.doc is not None else strict_json_loads(self.raw)
        return {**doc, METADATA_KEY: dict(doc.get(METADATA_KEY) or {})}

    @property
    def file_length(self) -> int:
        return self.data_start + self.data_length


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json_loads(text: str | bytes):
    """``json.loads`` without NaN/Infinity (which the canonical form cannot write back)."""
    return json.loads(text, parse_constant=_reject_constant)


def nesting_depth(value: object, *, limit: int) -> int:
    """How deeply lists and dicts nest in a parsed JSON value, counted without recursion (so a hostile
    header cannot exhaust the stack here); stops counting past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
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
        raise CorruptCheckpointError(
            f"{source}: truncated: the file has {len(prefix)} bytes, fewer than the 8-byte header length;"
            " restore it from a good copy"
        )
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
        raise CorruptCheckpointError(
            f"{source}: truncated: header declares {n} bytes but the file has only {file_length} bytes"
        )
    return n


def _as_nonneg_int(value: object, what: str, source: str) -> int:
    # bool is an int subclass; JSON `true` must not pass as 1.
    if type(value) is not int or value < 0:
        raise CorruptCheckpointError(
            f"{source}: malformed header: {what} must be a non-negative integer, found {value!r:.80}"
        )
    return value


def parse_header(raw: bytes, *, source: str, file_length: int | None) -> Header:
    """Parse and validate header bytes (without the 8-byte length prefix).

    Checks: UTF-8 JSON object; entries shaped ``{"dtype", "shape", "data_offsets"}``; known dtypes;
    shape product times element size equals the byte span; offsets contiguous from 0 without holes
    or overlaps; the file length equals ``8 + N + data length`` when known.
    """
    n = len(raw)
    # Counted on the raw bytes, before the JSON parse: a hostile header costs one scan, not a parse.
    if raw.count(b'"data_offsets"') > MAX_TENSORS:
        raise CorruptCheckpointError(
            f"{source}: the header lists more than {MAX_TENSORS:,} tensors, more than certckpt writes or reads in "
            "one file; a certckpt checkpoint never has that many (save large states in shards)"
        )
    try:
        text = raw.decode("utf-8")
        doc = strict_json_loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(
            f"{source}: malformed header: not valid UTF-8 JSON ({e.__class__.__name__})"
        ) from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{source}: malformed header: expected a JSON object, found {type(doc).__name__}")

    metadata: dict[str, str] = {}
    if METADATA_KEY in doc:
        meta = doc[METADATA_KEY]
        if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise CorruptCheckpointError(f"{source}: malformed header: __metadata__ must map strings to strings")
        metadata = meta

    entries: list[TensorEntry] = []
    for name, spec in doc.items():
        if name == METADATA_KEY:
            continue
        where = f"tensor `{printable(name)}`"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise CorruptCheckpointError(
                f"{source}: malformed header: {where} must have exactly dtype, shape and data_offsets"
            )
        dtype = spec["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CorruptCheckpointError(f"{source}: malformed header: {where} has unknown dtype {dtype!r:.40}")
        shape = spec["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise CorruptCheckpointError(
                f"{source}: malformed header: {where} shape must be a list of at most {MAX_DIMS} sizes"
            )
        dims = tuple(_as_nonneg_int(d, f"{where} shape entry", source) for d in shape)
        if any(d > MAX_DIM for d in dims):
            raise CorruptCheckpointError(f"{source}: malformed header: {where} has a dimension above 2**63 - 1")
        offsets = spec["data_offsets"]
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise CorruptCheckpointError(f"{source}: malformed header: {where} data_offsets must be [begin, end]")
        begin = _as_nonneg_int(offsets[0], f"{where} begin offset", source)
        end = _as_nonneg_int(offsets[1], f"{where} end offset", source)
        if end < begin:
            raise CorruptCheckpointError(f"{source}: malformed header: {where} ends ({end}) before it begins ({begin})")
        if begin > MAX_DIM or end > MAX_DIM:
            raise CorruptCheckpointError(f"{source}: malformed header: {where} has an offset above 2**63 - 1")
        numel = 1
        for d in dims:
            numel *= d  # bounded: at most 64 factors below 2**63, so at most 4032 bits
        if numel * DTYPE_SIZES[dtype] != end - begin:
            raise CorruptCheckpointError(
                f"{source}: malformed header: {where} shape {list(dims)} of {dtype} needs "
                f"{numel * DTYPE_SIZES[dtype]} bytes but its offsets span {end - begin}"
            )
        entries.append(TensorEntry(name, dtype, dims, begin, end))

    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.begin != cursor:
            kind = "overlaps the previous tensor" if e.begin < cursor else "leaves a hole before it"
            raise CorruptCheckpointError(
                f"{source}: malformed header: tensor `{printable(e.name)}` at offset {e.begin} {kind} "
                f"(expected {cursor})"
            )
        cursor = e.end
    data_start = 8 + n
    if file_length is not None:
        if data_start + cursor > file_length:
            raise CorruptCheckpointError(
                f"{source}: truncated: the tensors need {data_start + cursor} bytes but the file has {file_length}"
            )
        if data_start + cursor < file_length:
            raise CorruptCheckpointError(
                f"{source}: {file_length - data_start - cursor} unexpected trailing bytes after the last tensor"
            )
    return Header(
        length=n,
        raw=bytes(raw),
        entries=tuple(entries),
        metadata=metadata,
        data_start=data_start,
        data_length=cursor,
        doc=doc,
    )


def padded_json(doc: dict) -> bytes:
    """Canonical JSON of a header document, space-padded to a multiple of 8 bytes (no length prefix)."""
    body = canonical_json(doc).encode("ascii")
    return body + b" " * (-len(body) % 8)


def encode_header(doc: dict) -> bytes:
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


def is_canonical(header: Header) -> bool:
    """True when the raw header bytes are exactly what ``encode_header`` writes for their content.

    JSON tolerates whitespace and escapes, so a flipped padding or separator byte can leave the parsed
    content unchanged; comparing bytes to the canonical form catches every such change.
    """
    try:
        return padded_json(header.doc if header.doc is not None else strict_json_loads(header.raw)) == header.raw
    except (ValueError, RecursionError):  # NaN/Infinity literals parse but cannot be re-serialized canonically
        return False
