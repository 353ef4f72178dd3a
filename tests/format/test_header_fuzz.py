"""Fuzzing the header parser and ``verify`` with hostile bytes.

Properties:
    (a) any bytes in a file: ``verify`` returns a report or raises a ``CertckptError``, quickly;
    (b) any single-byte change or truncation of a valid checkpoint is detected (never ok);
    (c) any JSON-ish header: ``parse_header`` raises ``CorruptCheckpointError`` or returns a
        contiguous, length-consistent table;
    (d) an absurd declared header length is refused at once, without allocating.

Plus regression tests for the library bugs found this way.
"""

from __future__ import annotations

import json
import re
import struct
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import certckpt
from certckpt.errors import CertckptError, CorruptCheckpointError, NotACheckpointError
from certckpt.format.header import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    canonical_json,
    encode_header,
    padded_json,
    parse_header,
    read_header_length,
)
from certckpt.format.record import RECORD_KEY, header_digest

# database=None: nothing is written under the working directory.
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)


@pytest.fixture(scope="module", autouse=True)
def hypothesis_home_in_tmp(tmp_path_factory):
    """Hypothesis caches (unicode tables, constants, failure patches) go to a temp dir, not the cwd."""
    from hypothesis import configuration

    configuration.set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis-home"))
    yield
    configuration.set_hypothesis_home_dir(None)


# Header lengths whose first two little-endian bytes read as a pickle opcode (0x80, protocol 2..5);
# see test_header_length_that_looks_like_a_pickle_is_still_safetensors below.
PICKLE_LOOKALIKE = {0x0280, 0x0380, 0x0480, 0x0580}


def check_verify(path) -> certckpt.VerifyReport | None:
    """Run verify; only a report or a CertckptError may come out, and fast."""
    t0 = time.perf_counter()
    try:
        report = certckpt.verify(path)
    except CertckptError:
        report = None
    assert time.perf_counter() - t0 < 2.0
    return report


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A file path the fuzz examples overwrite (hypothesis and function-scoped tmp_path do not mix)."""
    return tmp_path_factory.mktemp("fuzz-scratch") / "f.safetensors"


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> bytes:
    """A valid small checkpoint's bytes (several dtypes, an empty and a 0-dim tensor)."""
    torch.manual_seed(1)
    obj = {
        "w": torch.randn(3, 4),
        "b": torch.zeros(3, dtype=torch.float16),
        "i": torch.arange(5, dtype=torch.int64),
        "e": torch.empty(0, 2),
        "s": torch.tensor(True),
        "n": 5,
        "x": [1.5, "y"],
    }
    d = tmp_path_factory.mktemp("fuzz-ckpt")
    path = d / "small.safetensors"
    certckpt.save(obj, path, step=7, run="fuzz")
    data = path.read_bytes()
    assert certckpt.verify(path).ok
    assert certckpt.verify(path, deep=True).ok
    return data


# --- strategies ------------------------------------------------------------------------------------

HUGE_INTS = st.sampled_from(
    [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 8, 10**30, 2**200, -1, -(2**63), -(2**64)]
)
INTS = st.one_of(st.integers(-4, 64), st.integers(-(2**70), 2**70), HUGE_INTS)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(sorted(DTYPE_SIZES)),
)
JSONISH = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)
NAMES = st.one_of(st.text(max_size=8), st.sampled_from(["a", "b", "w", "__metadata__", "", "a.b", "\u00e9\u4e2d"]))

# An entry with each field drawn from a random mix of plausible and absurd values.
RANDOM_ENTRY = st.one_of(
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(st.sampled_from(sorted(DTYPE_SIZES)), JSONISH),
            "shape": st.one_of(st.lists(INTS, max_size=5), JSONISH),
            "data_offsets": st.one_of(st.lists(INTS, max_size=3), st.tuples(INTS, INTS).map(list), JSONISH),
        },
        optional={"extra": JSONISH},
    ),
    JSONISH,
)
METADATA = st.one_of(
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    st.fixed_dictionaries({"certckpt": st.one_of(st.text(max_size=20), JSONISH.map(lambda v: json.dumps(v)))}),
    JSONISH,
)


@st.composite
def consistent_table(draw):
    """A header document whose tensors tile the data buffer, optionally with one defect."""
    n = draw(st.integers(0, 5))
    names = draw(
        st.lists(
            st.text(min_size=1, max_size=6).filter(lambda s: s != "__metadata__"), min_size=n, max_size=n, unique=True
        )
    )
    doc, offset = {}, 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * DTYPE_SIZES[dtype]
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    order = draw(st.permutations(list(doc)))
    doc = {k: doc[k] for k in order}
    if doc and draw(st.booleans()):
        victim = draw(st.sampled_from(list(doc)))
        field = draw(st.sampled_from(["data_offsets", "shape", "dtype"]))
        doc[victim] = {**doc[victim], field: draw(JSONISH)}
    if draw(st.booleans()):
        doc = {"__metadata__": draw(METADATA), **doc}
    return doc, offset


@st.composite
def header_doc(draw):
    """(header document, data length that would be consistent with it when it is valid)."""
    if draw(st.booleans()):
        return draw(consistent_table())
    doc = draw(st.dictionaries(NAMES, RANDOM_ENTRY, max_size=4))
    if draw(st.booleans()):
        doc["__metadata__"] = draw(METADATA)
    return doc, draw(st.integers(0, 64))


def wrap(doc: dict, data_length: int, slack: int = 0, pad: bool = False) -> bytes:
    """A safetensors-shaped file: 8-byte length, the JSON header, and ``data_length + slack`` bytes."""
    body = json.dumps(doc, allow_nan=True).encode("utf-8")
    if pad:
        body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + b"\x00" * max(0, data_length + slack)


# --- (a) arbitrary bytes ---------------------------------------------------------------------------

ARBITRARY = st.one_of(
    st.binary(max_size=512),
    # past the first checks: a plausible length, then '{' and noise
    st.builds(
        lambda n, body: struct.pack("<Q", n) + b"{" + body,
        st.one_of(st.integers(0, 600), st.integers(0, 2**64 - 1)),
        st.binary(max_size=512),
    ),
    # a parseable header with a random tail
    st.builds(lambda hd, slack: wrap(hd[0], hd[1], slack), header_doc(), st.integers(-8, 8)),
)


@fuzz(400)
@given(blob=ARBITRARY)
@example(blob=b"")
@example(blob=b"\x00" * 8)
@example(blob=b"PK\x03\x04rest")
@example(blob=b"\x80\x04\x95")
@example(blob=b"\x1f\x8b\x08\x00")
@example(blob=struct.pack("<Q", 2) + b"{}")
@example(blob=struct.pack("<Q", 2**63) + b"{}")
def test_verify_arbitrary_bytes(scratch, blob):
    scratch.write_bytes(blob)
    report = check_verify(scratch)
    if report is not None:
        assert report.ok is (not report.problems)
        assert all(isinstance(p.message, str) and p.message for p in report.problems)


# Fields of the certckpt record replaced by random JSON values, the header re-encoded canonically:
# exercises the record parser and the header check (NaN is left to its own test below).
RECORD_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)
RECORD_FIELDS = [
    "schema",
    "run",
    "branch",
    "step",
    "step_range",
    "parent",
    "lineage",
    "consensus_fp",
    "state_fp",
    "tensors",
    "skeleton",
    "writer",
    "user",
    "header_digest",
]


def replace_record_field(data: bytes, field: str, value) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8 : 8 + n])
    record = json.loads(doc["__metadata__"]["certckpt"])
    if value is _DELETE:
        record.pop(field, None)
    else:
        record[field] = value
    doc["__metadata__"]["certckpt"] = json.dumps(record, separators=(",", ":"))
    return encode_header(doc) + data[8 + n :]


_DELETE = object()


@fuzz(200)
@given(field=st.sampled_from(RECORD_FIELDS), value=st.one_of(RECORD_VALUES, st.just(_DELETE)))
def test_verify_random_record_fields(small_ckpt, scratch, field, value):
    blob = replace_record_field(small_ckpt, field, value)
    if blob == small_ckpt:  # the field already held that value
        return
    scratch.write_bytes(blob)
    report = check_verify(scratch)
    if report is not None:
        assert not report.ok  # the header digest no longer matches (or the record is refused)


# --- (b) mutations and truncations of a valid checkpoint -------------------------------------------


@pytest.mark.slow  # every bit of a small file: ~30 s on 2 cores
def test_every_single_bit_flip_is_detected(small_ckpt, scratch):
    """Exhaustive: each of the file's bits flipped in turn; a damaged certckpt file is a failure (exit 1),
    never "not a certckpt checkpoint" or "upgrade certckpt" (exit 2): the opening brace, the record's
    key, the metadata key and the schema number are all bits an accident can flip."""
    for i in range(len(small_ckpt)):
        for bit in range(8):
            data = bytearray(small_ckpt)
            data[i] ^= 1 << bit
            scratch.write_bytes(bytes(data))
            try:
                report = certckpt.verify(scratch)
            except NotACheckpointError as e:
                raise AssertionError(f"byte {i} bit {bit} flipped was called a foreign file: {e}") from None
            except CertckptError:
                report = None
            assert report is None or not report.ok, f"byte {i} bit {bit} flipped went unnoticed"


def _with_record(path, edit) -> bytes:
    """The file's bytes with its record edited and the header digest recomputed under the rule."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    doc = json.loads(data[8 : 8 + n])
    rec = json.loads(doc[METADATA_KEY][RECORD_KEY])
    edit(rec)
    rec["header_digest"] = "0" * 32
    doc[METADATA_KEY][RECORD_KEY] = canonical_json(rec)
    rec["header_digest"] = header_digest(padded_json(doc))
    doc[METADATA_KEY][RECORD_KEY] = canonical_json(rec)
    body = padded_json(doc)
    return struct.pack("<Q", len(body)) + body + data[8 + n :]


def test_a_newer_schema_with_a_holding_digest_asks_for_an_upgrade(tmp_path):
    """A file from a newer certckpt (its header digest holds) is exit 2 with "upgrade"; the same schema
    number in a header whose digest does not hold is damage (exit 1)."""
    p = tmp_path / "a.safetensors"
    certckpt.save({"w": torch.ones(3)}, p)
    newer = tmp_path / "newer.safetensors"
    newer.write_bytes(_with_record(p, lambda r: r.update(schema=r["schema"] + 1, new_field="x")))
    with pytest.raises(NotACheckpointError, match="upgrade certckpt"):
        certckpt.verify(newer)
    damaged = tmp_path / "damaged.safetensors"
    raw = bytearray(newer.read_bytes())
    at = raw.index(b"new_field") + 2
    raw[at] ^= 1  # any byte the digest covers
    damaged.write_bytes(bytes(raw))
    report = certckpt.verify(damaged)
    assert not report.ok and "header digest" in str(report.problems)


def test_every_truncation_is_detected(small_ckpt, scratch):
    """Exhaustive: every proper prefix of the file."""
    for n in range(len(small_ckpt)):
        scratch.write_bytes(small_ckpt[:n])
        report = check_verify(scratch)
        assert report is None or not report.ok, f"truncated to {n} bytes went unnoticed"
        if report is not None and n >= 8:
            assert any("truncated" in p.message or "malformed" in p.message for p in report.problems)


@fuzz(300)
@given(data=st.data())
def test_random_byte_mutation_is_detected(small_ckpt, scratch, data):
    pos = data.draw(st.integers(0, len(small_ckpt) - 1), label="position")
    new = data.draw(st.integers(0, 255).filter(lambda b: b != small_ckpt[pos]), label="new byte")
    mutated = bytearray(small_ckpt)
    mutated[pos] = new
    scratch.write_bytes(bytes(mutated))
    report = check_verify(scratch)
    assert report is None or not report.ok, f"byte {pos} set to {new:#04x} went unnoticed"


@fuzz(200)
@given(data=st.data())
def test_random_multi_edit_is_detected(small_ckpt, scratch, data):
    """A few byte changes, insertions or deletions, then maybe a truncation."""
    blob = bytearray(small_ckpt)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        pos = data.draw(st.integers(0, len(blob) - 1))
        if op == "set":
            blob[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            blob.insert(pos, data.draw(st.integers(0, 255)))
        else:
            del blob[pos]
    blob = blob[: data.draw(st.integers(0, len(blob)))]
    if bytes(blob) == small_ckpt:
        return
    scratch.write_bytes(bytes(blob))
    report = check_verify(scratch)
    assert report is None or not report.ok


# --- (c) JSON-ish headers through the parser -------------------------------------------------------


@fuzz(500)
@given(hd=header_doc(), slack=st.one_of(st.just(0), st.integers(-8, 8)), pad=st.booleans())
def test_parse_header_random_documents(hd, slack, pad):
    doc, data_length = hd
    blob = wrap(doc, data_length, slack, pad)
    n = read_header_length(blob[:9], file_length=len(blob), source="fuzz")
    try:
        header = parse_header(blob[8 : 8 + n], source="fuzz", file_length=len(blob))
    except CorruptCheckpointError as e:
        assert str(e).startswith("fuzz: ")
        event("refused")
        return
    event(f"accepted with {min(len(header.entries), 2)}+ tensors")
    # Accepted: the table is sound.
    assert header.length == n and header.data_start == 8 + n
    cursor = 0
    for e in header.entries:
        assert e.begin == cursor, "entries must be contiguous from 0"
        assert e.end >= e.begin
        assert e.dtype in DTYPE_SIZES
        numel = 1
        for d in e.shape:
            assert type(d) is int and d >= 0
            numel *= d
        assert numel * DTYPE_SIZES[e.dtype] == e.nbytes
        cursor = e.end
    assert header.data_length == cursor
    assert header.file_length == len(blob)
    names = {k for k in json.loads(blob[8 : 8 + n]) if k != "__metadata__"}
    assert {e.name for e in header.entries} == names
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


@fuzz(200)
@given(
    raw=st.one_of(st.binary(max_size=200), st.text(max_size=100).map(lambda s: s.encode("utf-8"))),
    length=st.one_of(st.none(), st.integers(0, 10**6)),
)
@example(raw=b"[" * 100_000, length=None)
@example(raw=b'{"a":' * 50_000, length=None)
@example(raw=b"\xff\xfe{}", length=None)
@example(raw=b'{"a": NaN}', length=None)
def test_parse_header_random_bytes(raw, length):
    try:
        header = parse_header(raw, source="fuzz", file_length=length)
    except CorruptCheckpointError:
        return
    assert isinstance(header.entries, tuple)


# --- (d) absurd header lengths ---------------------------------------------------------------------


@pytest.mark.parametrize("declared", [2**63, 10**9, 2**64 - 1, MAX_HEADER_BYTES + 1])
def test_absurd_header_length_is_refused_without_allocating(tmp_path, declared):
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(
        struct.pack("<Q", declared) + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' + b"\x00" * 64
    )
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        report = certckpt.verify(path)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 0.5
    assert peak < 1 << 20, f"verify allocated {peak} bytes for a {declared}-byte header claim"
    assert not report.ok and report.info is None
    [p] = report.problems
    assert p.kind == "malformed"
    assert "header" in p.message and "exceeds" in p.message and str(declared) in p.message
    with pytest.raises(CorruptCheckpointError, match="exceeds"):
        certckpt.load(path)
    with pytest.raises(CorruptCheckpointError, match="exceeds"):
        certckpt.inspect(path)


@pytest.mark.parametrize("declared", [2**63, 10**9])
def test_absurd_header_length_in_a_stream(declared):
    import io

    class Unseekable(io.RawIOBase):
        def __init__(self, data):
            self._b = io.BytesIO(data)

        def readable(self):
            return True

        def readinto(self, b):
            return self._b.readinto(b)

    stream = io.BufferedReader(Unseekable(struct.pack("<Q", declared) + b"{}"))
    t0 = time.perf_counter()
    report = certckpt.verify(stream)
    assert time.perf_counter() - t0 < 0.5
    assert not report.ok and "exceeds" in report.problems[0].message


def test_header_length_beyond_file_is_truncated_without_allocating(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES) + b"{}")
    tracemalloc.start()
    try:
        report = certckpt.verify(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert [p.kind for p in report.problems] == ["truncated"]


@fuzz(200)
@given(declared=st.integers(MAX_HEADER_BYTES + 1, 2**64 - 1))
def test_read_header_length_bounds(declared):
    with pytest.raises(CorruptCheckpointError, match="exceeds"):
        read_header_length(struct.pack("<Q", declared) + b"{", file_length=None, source="fuzz")


# --- regressions: library bugs found by fuzzing ---------------------------------------------


@fuzz(50)
@given(n=st.integers(2, MAX_HEADER_BYTES))
@example(n=896)
def test_header_length_that_looks_like_a_pickle_is_still_safetensors(n):
    assert read_header_length(struct.pack("<Q", n) + b"{", file_length=None, source="fuzz") == n


def test_own_checkpoint_with_pickle_lookalike_header_length(tmp_path):
    for pad in range(1200):
        path = tmp_path / f"c{pad}.safetensors"
        certckpt.save({"w": torch.ones(2)}, path, metadata={"pad": "x" * pad})
        if struct.unpack("<Q", path.read_bytes()[:8])[0] % 65536 in PICKLE_LOOKALIKE:
            break
        path.unlink()
    else:
        pytest.fail("no padding reached a pickle-lookalike header length")
    assert certckpt.verify(path).ok
    assert torch.equal(certckpt.load(path)["w"], torch.ones(2))


def test_parse_header_giant_dims():
    raw = json.dumps({"a": {"dtype": "F32", "shape": [10**4000, 10**4000], "data_offsets": [0, 0]}}).encode()
    with pytest.raises(CorruptCheckpointError):
        parse_header(raw, source="fuzz", file_length=None)


def _crafted(tmp_path, entries, data: bytes, **record_fields) -> str:
    """A certckpt file with a canonical header and a correct header digest around any tensor table."""
    import xxhash

    from certckpt.format.record import CheckpointRecord, build_header, state_fingerprint

    tensors = {e.name: {"fp": "0" * 16, "xxh3": xxhash.xxh3_128_hexdigest(data[e.begin : e.end])} for e in entries}
    record = CheckpointRecord(
        tensors=tensors, state_fp=state_fingerprint({k: v["fp"] for k, v in tensors.items()}), **record_fields
    )
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(build_header(list(entries), record) + data)
    return str(path)


@pytest.mark.parametrize("how", ["load", "deep"])
def test_zero_element_tensor_with_huge_dim(tmp_path, how):
    from certckpt.format.header import TensorEntry

    path = _crafted(tmp_path, [TensorEntry("z", "F32", (0, 2**70), 0, 0)], b"", skeleton=["T", {"e": "z"}])
    if how == "load":
        with pytest.raises(CorruptCheckpointError):
            certckpt.load(path)
    else:
        report = certckpt.verify(path, deep=True)
        assert not report.ok


def _with_record_text(tmp_path, text_from_record) -> str:
    from certckpt.format.record import CheckpointRecord, build_header

    header = build_header([], CheckpointRecord(skeleton=None))
    doc = json.loads(header[8:])
    doc["__metadata__"]["certckpt"] = text_from_record(doc["__metadata__"]["certckpt"])
    path = tmp_path / "record.safetensors"
    path.write_bytes(encode_header(doc))
    return str(path)


def test_record_with_nan(tmp_path):
    path = _with_record_text(tmp_path, lambda t: t.replace('"skeleton":null', '"skeleton":NaN'))
    report = certckpt.verify(path)
    assert not report.ok


def test_record_deeply_nested(tmp_path):
    path = _with_record_text(tmp_path, lambda t: "[" * 100_000)
    report = check_verify(path)
    assert report is None or not report.ok


def test_problem_message_is_one_line_whatever_the_tensor_name(tmp_path):
    from click.testing import CliRunner

    from certckpt_cli.main import main as cli_main

    doc = {"x\nOK  forged.safetensors  1 tensors": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}
    path = tmp_path / "names.safetensors"
    path.write_bytes(wrap(doc, 2))
    report = certckpt.verify(path)
    assert not report.ok
    result = CliRunner().invoke(cli_main, ["verify", str(path)])
    assert result.exit_code == 1
    assert len(result.stdout.splitlines()) == 1 + len(report.problems)


def test_cli_inspect_record_writer_not_an_object(tmp_path):
    from click.testing import CliRunner

    from certckpt.format.record import CheckpointRecord, build_header, state_fingerprint
    from certckpt_cli.main import main as cli_main

    path = tmp_path / "writer.safetensors"
    path.write_bytes(
        build_header([], CheckpointRecord(writer=["not", "a", "dict"], skeleton=None, state_fp=state_fingerprint({})))
    )
    report = certckpt.verify(path)  # digest-consistent, but the field's type is refused
    assert not report.ok and "`writer` has the wrong type" in report.problems[0].message
    result = CliRunner().invoke(cli_main, ["inspect", str(path)])
    assert result.exit_code == 1 and "wrong type" in result.output and "Traceback" not in result.output


def _nested(depth: int) -> dict:
    deep: dict = {}
    cur = deep
    for _ in range(depth):
        cur["a"] = {}
        cur = cur["a"]
    return deep


@pytest.mark.parametrize("field, depth", [("lineage", 900), ("writer", 900), ("skeleton", 900), ("lineage", 40)])
def test_deeply_nested_records_are_one_line_damaged_or_hostile_never_a_recursion_error(
    tmp_path, small_ckpt, field, depth
):
    from click.testing import CliRunner

    from certckpt.format.header import padded_json
    from certckpt_cli.main import main

    n = struct.unpack("<Q", small_ckpt[:8])[0]
    hdr, data = json.loads(small_ckpt[8 : 8 + n]), small_ckpt[8 + n :]
    rec = json.loads(hdr["__metadata__"][RECORD_KEY])
    deep = _nested(depth)
    rec[field] = {"t": "dict", "i": [[{"t": "str", "v": "x"}, deep]]} if field == "skeleton" else deep
    hdr["__metadata__"][RECORD_KEY] = json.dumps(rec, sort_keys=True, separators=(",", ":"))
    body = padded_json(hdr)  # canonical: only the depth is wrong with it
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    # the skeleton is bounded where it is decoded; one nested past what can be written back is not in
    # the canonical form: either way one line, exit 1
    why = "damaged or hostile header" if field != "skeleton" else "damaged or hostile header|not in the form certckpt"
    t = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match=why):
        certckpt.load(str(path))
    for cmd in ("verify", "inspect"):
        r = CliRunner().invoke(main, [cmd, str(path)])
        assert r.exit_code == 1 and re.search(why, r.output) and "Traceback" not in r.output
    assert time.monotonic() - t < 1


def test_the_deepest_object_save_accepts_still_loads(tmp_path):
    from certckpt.format.skeleton import MAX_DEPTH

    obj: object = torch.ones(1)
    for _ in range(MAX_DEPTH - 2):
        obj = [obj]
    certckpt.save({"x": obj}, str(tmp_path / "a.safetensors"))
    assert certckpt.verify(str(tmp_path / "a.safetensors")).ok
    out = certckpt.load(str(tmp_path / "a.safetensors"))["x"]
    levels = 0
    while isinstance(out, list):
        out, levels = out[0], levels + 1
    assert levels == MAX_DEPTH - 2 and torch.equal(out, torch.ones(1))


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6)),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=12,
)


@fuzz(150)
@given(
    doc=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=6),
    indent=st.sampled_from([None, 0, 2]),
    tail=st.sampled_from(["", " ", "\n", "x", "}", ",", "{}"]),
)
def test_json_object_fields_reads_what_json_loads_reads(doc, indent, tail):
    """The member-by-member reader behind verify's lean record parse: the same members, each span
    holding exactly its value, and the same refusals (trailing data, non-objects)."""
    from certckpt.format.header import json_object_fields, strict_json_loads

    text = json.dumps(doc, indent=indent) + tail
    try:
        expected = strict_json_loads(text)
    except ValueError:
        expected = None
    try:
        members = list(json_object_fields(text))
    except ValueError:
        members = None
    if expected is None or not isinstance(expected, dict):
        assert members is None
        return
    assert members is not None
    assert {k: v for k, _, _, v in members} == expected
    for _k, start, end, v in members:
        assert json.loads(text[start:end]) == v


@pytest.mark.parametrize(
    "rewrite, canonical",
    [
        (lambda sk: sk, True),  # the control: the same bytes, the digest recomputed, verifies
        (lambda sk: json.dumps(json.loads(sk), indent=1), False),  # whitespace inside the skeleton
        (lambda sk: sk + ' ,"skeleton":' + sk, False),  # the key twice
    ],
    ids=["unchanged", "whitespace", "duplicate-key"],
)
def test_verify_drops_the_skeleton_yet_refuses_one_not_written_canonically(tmp_path, rewrite, canonical):
    """verify parses the skeleton only to check its form, then drops it (``keep_skeleton=False``): a
    skeleton rewritten with the header digest recomputed must still fail as not certckpt's form."""
    path = tmp_path / "ck.safetensors"
    certckpt.save({"a": {"w": torch.ones(3)}, "n": [torch.zeros(2), 4]}, path)
    report = certckpt.verify(path)
    assert report.ok and report.info is not None and report.info.record.skeleton is None
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8 : 8 + n])
    text = doc[METADATA_KEY][RECORD_KEY]
    start = text.index('"skeleton":') + len('"skeleton":')
    end = text.index(',"writer":')
    text = text[:start] + rewrite(text[start:end]) + text[end:]
    record = json.loads(text)  # still the same document
    assert record["skeleton"] == json.loads(json.loads(data[8 : 8 + n])[METADATA_KEY][RECORD_KEY])["skeleton"]
    digest = re.search(r'"header_digest":"([0-9a-f]{32})"', text)
    assert digest is not None
    text = text.replace(digest.group(1), "0" * 32)
    doc[METADATA_KEY][RECORD_KEY] = text
    text = text.replace("0" * 32, header_digest(padded_json(doc)))
    doc[METADATA_KEY][RECORD_KEY] = text
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(encode_header(doc) + data[8 + n :])
    report = certckpt.verify(bad)
    if canonical:
        assert report.ok, report.problems
        return
    assert not report.ok and "not in the form certckpt writes" in report.problems[0].message, report.problems
