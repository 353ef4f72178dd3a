"""The manifest of a sharded checkpoint: what every shard file holds, DCP's metadata as data, and the
sharding-independent fingerprints. Parsed from untrusted bytes; written by the coordinator last.

The manifest is itself a certckpt file (``manifest.safetensors``): one U8 tensor holding the
document below as canonical JSON, so its bytes are covered by the format's digests like any
checkpoint's, and the header stays small however many shards there are. No torch import here:
``certckpt verify DIR`` reads it with the format layer alone. The schema is in ``docs/format.md``
("Sharded checkpoints (DCP)").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TypeGuard

import xxhash

from certckpt.errors import CorruptCheckpointError, NotACheckpointError
from certckpt.format.header import DTYPE_SIZES, MAX_DIMS, canonical_json, gc_paused, printable, strict_json_loads
from certckpt.format.record import check_header
from certckpt.format.verify import CheckpointInfo, read_checkpoint_header
from certckpt.storage import open_read, resolve

from .composition import compose, hex64, is_partition, state_fp
from .layout import MANIFEST_MARK, MANIFEST_NAME, MANIFEST_TENSOR, is_shard_name, join

__all__ = [
    "MANIFEST_VERSION",
    "ShardFile",
    "Chunk",
    "TensorInfo",
    "ValueInfo",
    "Manifest",
    "parse_manifest",
    "read_manifest",
    "MAX_MANIFEST_BYTES",
    "consistency_problems",
]

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 30  # a bound on what a hostile header can make a reader allocate
_MAX_DIM = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One rank's data file.

    Attributes:
        name: its file name in the directory (``shard-RRRRR.safetensors``).
        rank: the rank that wrote it.
        nbytes: its size.
        header_digest: its record's header digest, which covers every tensor's xxh3 digest.
    """

    name: str
    rank: int
    nbytes: int
    header_digest: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored piece of a tensor (DCP's chunk).

    Attributes:
        offsets: where it starts in the global tensor.
        sizes: its extent.
        file: index into ``Manifest.files``.
        entry: its tensor name inside that file.
        raw: its contribution to the global tensor's fingerprint sum (16 hex digits).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: int
    entry: str
    raw: str


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A global tensor of the saved state.

    Attributes:
        fqn: DCP's flattened name (``model.layers.0.weight``).
        dtype: safetensors dtype code.
        shape: global shape.
        requires_grad: as DCP recorded it.
        fp: the fingerprint v1 of the whole tensor, composed from the chunks' contributions.
        chunks: the pieces that partition it.
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    fp: str
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """A non-tensor value of the saved state (a learning rate, a list of names...).

    Attributes:
        fqn: DCP's flattened name.
        node: the value as a certckpt skeleton node (``docs/format.md`` section 6): data, never pickle.
    """

    fqn: str
    node: Any


@dataclass(frozen=True, slots=True)
class Manifest:
    """The parsed manifest document.

    Attributes:
        files: the shard files, in rank order.
        tensors: every tensor, in DCP's metadata order.
        values: every non-tensor value.
        state_fp: the whole-state fingerprint over ``tensors[*].fp`` (sharding-independent).
        dcp: DCP's own metadata fields as data: ``version``, ``planner_data`` (a skeleton node or
            null), ``storage_meta`` (``checkpoint_id``, ``save_id``, ``modules``) or null.
    """

    files: tuple[ShardFile, ...]
    tensors: tuple[TensorInfo, ...]
    values: tuple[ValueInfo, ...]
    state_fp: str
    dcp: dict[str, Any]

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": "certckpt-dcp",
            "version": MANIFEST_VERSION,
            "files": [
                {"name": f.name, "rank": f.rank, "bytes": f.nbytes, "header_digest": f.header_digest}
                for f in self.files
            ],
            "tensors": [
                {
                    "fqn": t.fqn,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "requires_grad": t.requires_grad,
                    "fp": t.fp,
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "file": c.file,
                            "entry": c.entry,
                            "raw": c.raw,
                        }
                        for c in t.chunks
                    ],
                }
                for t in self.tensors
            ],
            "values": [{"fqn": v.fqn, "node": v.node} for v in self.values],
            "state_fp": self.state_fp,
            "dcp": self.dcp,
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_doc()).encode("ascii")

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the shard files hold."""
        return sum(t.nbytes for t in self.tensors)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{source}: malformed manifest: {what}")


def _is_hex(v: object, width: int) -> bool:
    if not isinstance(v, str) or len(v) != width:
        return False
    try:
        int(v, 16)
    except ValueError:
        return False
    return v == v.lower()


def _nonneg(v: object) -> bool:
    return type(v) is int and 0 <= v <= _MAX_DIM


def _dims(v: object) -> bool:
    return isinstance(v, list) and len(v) <= MAX_DIMS and all(_nonneg(x) for x in v)


def _exact_keys(d: object, keys: set[str]) -> TypeGuard[dict[str, Any]]:
    return isinstance(d, dict) and set(d) == keys


def _parse_files(doc: Any, source: str) -> tuple[ShardFile, ...]:
    if not isinstance(doc, list):
        raise _bad(source, "`files` is not a list")
    out, names = [], set()
    for i, f in enumerate(doc):
        if not (
            _exact_keys(f, {"name", "rank", "bytes", "header_digest"})
            and is_shard_name(f["name"])
            and _nonneg(f["rank"])
            and _nonneg(f["bytes"])
            and _is_hex(f["header_digest"], 32)
        ):
            raise _bad(source, f"file entry {i} is not a shard file record")
        if f["name"] in names:
            raise _bad(source, f"file {f['name']} is listed twice")
        names.add(f["name"])
        out.append(ShardFile(f["name"], f["rank"], f["bytes"], f["header_digest"]))
    return tuple(out)


def _parse_tensor(t: Any, nfiles: int, source: str) -> TensorInfo:
    if not (
        _exact_keys(t, {"fqn", "dtype", "shape", "requires_grad", "fp", "chunks"})
        and isinstance(t["fqn"], str)
        and t["dtype"] in DTYPE_SIZES
        and _dims(t["shape"])
        and type(t["requires_grad"]) is bool
        and _is_hex(t["fp"], 16)
        and isinstance(t["chunks"], list)
    ):
        raise _bad(source, f"tensor entry {printable(str(t.get('fqn', '?')) if isinstance(t, dict) else '?')}")
    shape = tuple(t["shape"])
    chunks = []
    for c in t["chunks"]:
        if not (
            _exact_keys(c, {"offsets", "sizes", "file", "entry", "raw"})
            and _dims(c["offsets"])
            and _dims(c["sizes"])
            and len(c["offsets"]) == len(c["sizes"]) == len(shape)
            and type(c["file"]) is int
            and 0 <= c["file"] < nfiles
            and isinstance(c["entry"], str)
            and _is_hex(c["raw"], 16)
        ):
            raise _bad(source, f"tensor `{printable(t['fqn'])}` has a malformed chunk")
        if any(o + s > g for o, s, g in zip(c["offsets"], c["sizes"], shape)):
            raise _bad(
                source,
                f"tensor `{printable(t['fqn'])}` has a chunk at {c['offsets']} of {c['sizes']} outside its shape"
                f" {list(shape)}",
            )
        chunks.append(Chunk(tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["entry"], c["raw"]))
    return TensorInfo(t["fqn"], t["dtype"], shape, t["requires_grad"], t["fp"], tuple(chunks))


def _parse_dcp(d: Any, source: str) -> dict[str, Any]:
    if not _exact_keys(d, {"version", "planner_data", "storage_meta"}):
        raise _bad(source, "`dcp` must hold version, planner_data and storage_meta")
    if d["version"] is not None and not isinstance(d["version"], str):
        raise _bad(source, "`dcp.version` is not a string")
    sm = d["storage_meta"]
    if sm is not None and not (
        _exact_keys(sm, {"checkpoint_id", "save_id", "modules"})
        and all(sm[k] is None or isinstance(sm[k], str) for k in ("checkpoint_id", "save_id"))
        and isinstance(sm["modules"], list)
        and all(isinstance(m, str) for m in sm["modules"])
    ):
        raise _bad(source, "`dcp.storage_meta` is malformed")
    return d


def parse_manifest(data: bytes, *, source: str) -> Manifest:
    """Validate a manifest document (untrusted bytes) and return it.

    Raises:
        CorruptCheckpointError: anything malformed, inconsistent or out of bounds.
        NotACheckpointError: a manifest of a newer version.
    """
    try:
        doc = strict_json_loads(data)
    except (ValueError, RecursionError) as e:
        raise _bad(source, "not valid JSON") from e
    if not isinstance(doc, dict) or doc.get("format") != "certckpt-dcp" or type(doc.get("version")) is not int:
        raise _bad(source, "not a certckpt-dcp document")
    if doc["version"] > MANIFEST_VERSION:
        raise NotACheckpointError(
            f"{source}: a sharded checkpoint manifest of version {doc['version']}; this certckpt reads up to"
            f" {MANIFEST_VERSION} — upgrade certckpt (pip install -U certckpt)"
        )
    if set(doc) != {"format", "version", "files", "tensors", "values", "state_fp", "dcp"}:
        raise _bad(source, "unexpected or missing fields")
    files = _parse_files(doc["files"], source)
    if not isinstance(doc["tensors"], list) or not isinstance(doc["values"], list):
        raise _bad(source, "`tensors` and `values` must be lists")
    tensors = tuple(_parse_tensor(t, len(files), source) for t in doc["tensors"])
    values = []
    for v in doc["values"]:
        if not (_exact_keys(v, {"fqn", "node"}) and isinstance(v["fqn"], str)):
            raise _bad(source, "a value entry is malformed")
        values.append(ValueInfo(v["fqn"], v["node"]))
    fqns = [t.fqn for t in tensors] + [v.fqn for v in values]
    if len(set(fqns)) != len(fqns):
        raise _bad(source, "a name is listed twice")
    if not _is_hex(doc["state_fp"], 16):
        raise _bad(source, "`state_fp` is not 16 hex digits")
    return Manifest(files, tensors, tuple(values), doc["state_fp"], _parse_dcp(doc["dcp"], source))


def consistency_problems(m: Manifest) -> list[str]:
    """What in a well-formed manifest does not add up: chunk coverage and the composed fingerprints."""
    out = []
    for t in m.tensors:
        where = f"tensor `{printable(t.fqn)}`"
        if not is_partition([(c.offsets, c.sizes) for c in t.chunks], t.shape):
            out.append(f"{where}: its chunks do not partition its shape {list(t.shape)}")
            continue
        composed = hex64(compose((int(c.raw, 16) for c in t.chunks), t.dtype, t.shape))
        if composed != t.fp:
            out.append(
                f"{where}: fingerprint {t.fp} does not compose from its chunks' contributions (found {composed})"
            )
    found = state_fp({t.fqn: t.fp for t in m.tensors})
    if found != m.state_fp:
        out.append(f"the whole-state fingerprint {m.state_fp} does not match the tensors' fingerprints ({found})")
    return out


def read_manifest(location: str) -> tuple[Manifest, CheckpointInfo]:
    """Read and check the manifest of the checkpoint directory ``location`` (no torch).

    Every byte of the manifest file is checked against its digests before the document is parsed.

    Raises:
        CheckpointNotFoundError: no manifest: the directory holds no committed checkpoint.
        CorruptCheckpointError: damaged or malformed.
        NotACheckpointError: the file is not a certckpt-dcp manifest.
    """
    url = join(location, MANIFEST_NAME)
    target = resolve(url)
    with open_read(target) as (fh, size):
        info = read_checkpoint_header(fh, size, target.display)
        problem = check_header(info.header, info.record)
        if problem:
            raise CorruptCheckpointError(f"{target.display}: {problem}")
        entries = info.header.entries
        if (
            info.record.user.get(MANIFEST_MARK) is None
            or len(entries) != 1
            or entries[0].name != MANIFEST_TENSOR
            or entries[0].dtype != "U8"
        ):
            raise NotACheckpointError(f"{target.display}: not a certckpt sharded-checkpoint manifest")
        e = entries[0]
        if e.nbytes > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"{target.display}: manifest of {e.nbytes} bytes exceeds the bound")
        data = fh.read(e.nbytes)
        if len(data) != e.nbytes:
            raise CorruptCheckpointError(f"{target.display}: truncated: the manifest ends early")
        found = xxhash.xxh3_128_hexdigest(data)
        expected = info.record.tensors[e.name]["xxh3"]
        if found != expected:
            raise CorruptCheckpointError(
                f"{target.display}: manifest xxh3 digest mismatch (expected {expected}, found {found});"
                " the manifest changed after writing — restore this checkpoint from a good copy"
            )
    return _parsed(data, target.display), info


# The last manifest parsed, by its bytes: one load reads the same manifest more than once (Megatron's
# common strategy, its sharded strategy, the DCP reader), each time checking every byte, and the
# same bytes always parse to the same (immutable) Manifest. Errors are never kept; nor are manifests
# over _KEEP_BYTES (about 20,000 tensors), so that a process never holds a large one for nothing.
_last: tuple[bytes, Manifest] | None = None
_last_lock = threading.Lock()
_KEEP_BYTES = 4 << 20


def _parsed(data: bytes, source: str) -> Manifest:
    global _last
    with _last_lock:
        if _last is not None and _last[0] == data:
            return _last[1]
    with gc_paused():  # thousands of small objects and no cycles (header.gc_paused)
        manifest = parse_manifest(data, source=source)
    if len(data) <= _KEEP_BYTES:
        with _last_lock:
            _last = (data, manifest)
    return manifest
