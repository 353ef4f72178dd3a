"""A hostile-input corpus: skeletons, ledger records and event lines an attacker with write access
could put in a store. Every reader must answer or raise a certckpt error: never another exception
(a traceback in the CLI)."""

from __future__ import annotations

import json
import os

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import certckpt
from certckpt.errors import CertckptError
from certckpt.format.leaves import DECODERS
from certckpt.format.record import CheckpointRecord, build_header, state_fingerprint
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store, find_latest_good

SETTINGS = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=300)
TAGS = sorted({"T", "i", "f", "dtype", "size", "dev", "l", "t", "d", "od", *DECODERS})
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["nan", "inf", "-inf", "ff", "-1", "1e400", "Europe/Paris", "<f8", "|O", "float32", "w", "../x"]),
)
JSON = st.recursive(
    SCALAR,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=4), kids, max_size=4)),
    max_leaves=20,
)
NODE = st.recursive(
    JSON,
    lambda kids: st.tuples(
        st.sampled_from(TAGS),
        st.one_of(
            kids,
            st.lists(kids, max_size=4),
            st.dictionaries(st.sampled_from(["n", "f", "v", "i", "e", "dt", "sh", "r", "m", "k"]), kids, max_size=4),
        ),
    ).map(list),
    max_leaves=25,
)


def _sealed(path, skeleton) -> str:
    """A file with a correct (unkeyed) header digest around a hostile skeleton: what an attacker writes."""
    from certckpt.format.header import TensorEntry

    data = bytes(range(16))
    entries = [TensorEntry("w", "F32", (4,), 0, 16)]
    tensors = {"w": {"fp": "0" * 16, "xxh3": xxhash.xxh3_128_hexdigest(data)}}
    record = CheckpointRecord(tensors=tensors, state_fp=state_fingerprint({"w": "0" * 16}), skeleton=skeleton)
    path.write_bytes(build_header(entries, record) + data)
    return str(path)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus") / "hostile.safetensors"


@SETTINGS
@given(skeleton=NODE)
def test_hostile_skeletons_load_or_raise_a_certckpt_error(scratch, skeleton):
    path = _sealed(scratch, skeleton)
    try:
        certckpt.load(path)
    except CertckptError:
        pass


RECORD = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {},
        optional={
            "ckpt_id": st.one_of(st.sampled_from(["main@5", "main@10", "../x@1", "main@-1", "b@1"]), SCALAR),
            "branch": st.one_of(st.sampled_from(["main", "b", ".."]), SCALAR),
            "step": st.one_of(st.integers(-2, 20), SCALAR),
            "url": st.one_of(st.sampled_from(["main@5.safetensors", "/etc/passwd", "../x"]), SCALAR),
            "parent": st.one_of(st.sampled_from(["main@5", "x"]), SCALAR),
            "reason": SCALAR,
            "at": SCALAR,
            "incident_id": SCALAR,
            "record": st.sampled_from(["opened", "decision"]),
            "action": SCALAR,
            "consensus_fp": SCALAR,
            "header_digest": SCALAR,
            "committed_at": SCALAR,
            "verdict": SCALAR,
        },
    ),
)
KINDS = ["checkpoints", "branches", "revocations", "certificates", "holdings", "retired", "drills", "incidents"]


@pytest.mark.slow  # 150 stores written and certified twice: ~15 s
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=150)
@given(
    kind=st.sampled_from(KINDS),
    name=st.sampled_from(["main@5.json", "main@15.json", "x.json", "a--1.json"]),
    doc=RECORD,
    event=st.one_of(st.none(), JSON, RECORD),
)
def test_hostile_ledger_records_never_escape_as_tracebacks(tmp_path_factory, kind, name, doc, event):
    root = tmp_path_factory.mktemp("store")
    led = Ledger(str(root))
    led.commit_checkpoint(branch="main", step=5, location=str(root / "main@5.safetensors"), consensus_fp="f")
    d = root / "_ledger" / kind
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(doc))
    if event is not None:
        (root / "_ledger" / "events").mkdir(exist_ok=True)
        (root / "_ledger" / "events" / "zz.jsonl").write_text(json.dumps(event) + "\n")
    for read in (lambda: certify_store(str(root)), lambda: find_latest_good(str(root))):
        try:
            read()
        except CertckptError:
            pass
    assert not any(p.name.startswith("..") for p in root.parent.iterdir())  # nothing escaped the store
    assert os.path.isdir(root / "_ledger")


# --- issue 41, "bounds": view and shape numbers are untrusted input ---------------------------------


def _refused(path, match, **load_args):
    from certckpt.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match=match) as caught:
        certckpt.load(path, **load_args)
    assert "\n" not in str(caught.value)  # one line


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize(
    "view",
    [
        ["F32", 0, [2**31, 2**31, 4], [0, 0, 0]],  # torch: "numel: integer multiplication overflow"
        ["F32", 0, [2**40, 2**40], [0, 0]],
        ["F32", 0, [2**62], [0]],  # 2**62 elements of one: 2**64 bytes
        ["F32", 0, [2**64], [0]],  # past int64
    ],
)
def test_finding3a_a_skeleton_view_of_a_huge_size_is_refused(scratch, view, mmap):
    path = _sealed(scratch, ["T", {"e": "w", "v": view}])
    _refused(
        path, r"malformed skeleton: view of 'w' has (more elements than a tensor can hold|an offset, size)", mmap=mmap
    )


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize(
    "view",
    [
        ["F32", 0, [2**62, 2**62, 0], [1, 1, 1]],  # torch: "numel: integer multiplication overflow"
        ["F32", 0, [3, 0], [2**63 - 1, 1]],  # an empty view whose strides overflow int64
        ["F32", 0, [0, 2], [2**63, 1]],  # a stride past int64
        ["F32", 2**63 - 1, [2, 0], [1, 1]],
        ["F32", 5, [0], [1]],  # an empty view that starts past its storage's 16 bytes
    ],
)
def test_finding3b_a_zero_numel_view_whose_strides_overflow_is_refused(scratch, view, mmap):
    path = _sealed(scratch, ["T", {"e": "w", "v": view}])
    _refused(path, r"malformed skeleton: view of 'w' (has|starts outside)", mmap=mmap)
    path = _sealed(scratch, ["np", {"dt": "<f4", "sh": [0], "T": {"e": "w", "v": view}}])
    _refused(path, r"malformed skeleton: view of 'w'", mmap=mmap)


def _with_empty_entry(path, shape) -> str:
    """A sealed file whose tensor table holds an empty tensor ``z`` of ``shape`` (its span is 0 bytes)."""
    from certckpt.format.header import TensorEntry

    data = bytes(range(16))
    entries = [TensorEntry("w", "F32", (4,), 0, 16), TensorEntry("z", "F32", tuple(shape), 16, 16)]
    fp = {"fp": "0" * 16}
    tensors = {
        "w": {**fp, "xxh3": xxhash.xxh3_128_hexdigest(data)},
        "z": {**fp, "xxh3": xxhash.xxh3_128_hexdigest(b"")},
    }
    record = CheckpointRecord(
        tensors=tensors, state_fp=state_fingerprint({"w": "0" * 16, "z": "0" * 16}), skeleton=["T", {"e": "z"}]
    )
    path.write_bytes(build_header(entries, record) + data)
    return str(path)


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("shape", [[2**62, 2**62, 0], [0, 2**62, 2**62], [2**40, 2**40, 0]])
def test_finding3b_a_zero_numel_tensor_entry_whose_strides_overflow_is_refused(scratch, shape, mmap):
    path = _with_empty_entry(scratch, shape)
    _refused(path, r"malformed header: tensor `z` shape .* holds no element but its sizes overflow", mmap=mmap)
    report = certckpt.verify(path)
    assert not report.ok and "holds no element" in report.problems[0].message


def test_empty_tensors_torch_can_make_still_round_trip(tmp_path):
    import torch

    p = tmp_path / "empty.safetensors"
    state = {"a": torch.empty(2**62, 0), "b": torch.empty(2**62, 0, 4), "c": torch.empty(0, 3), "d": torch.empty(0)}
    certckpt.save(state, p)
    for mmap in (False, True):
        back = certckpt.load(p, mmap=mmap)
        assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in state.items()}


def test_views_load_with_their_entry_s_values_mapped_or_read(tmp_path):
    """Views count from their entry's first byte, also when the load maps the file (every entry then
    lies in one storage, the whole file: mapped views used to read from the file's start, header
    included), and also when a mapped entry's offset is one the view's dtype cannot address."""
    import torch

    base = torch.arange(24.0)
    state = {
        "base": base,
        "t": base.view(4, 6).t(),
        "expanded": base[:1].expand(1000),
        "strided": base[1::3],
        "unfolded": base.unfold(0, 4, 2),
    }
    a = torch.arange(10.0)  # two views with no view covering both: stored as one U8 entry at offset 6
    unaligned = {"h": torch.ones(3, dtype=torch.float16), "lo": a[0:4], "hi": a[6:10]}
    for name, obj in (("views", state), ("unaligned", unaligned)):
        p = tmp_path / f"{name}.safetensors"
        certckpt.save(obj, p)
        for mmap in (False, True):
            back = certckpt.load(p, mmap=mmap)
            for k, v in obj.items():
                assert torch.equal(back[k], v), (name, mmap, k)
            if name == "views":
                assert back["t"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
            else:
                assert back["lo"].untyped_storage().data_ptr() == back["hi"].untyped_storage().data_ptr()


@pytest.mark.parametrize("flags", [{"g": 1}, {"p": 1, "g": 1}])
def test_finding3_an_integer_tensor_that_requires_grad_is_refused(scratch, flags):
    import torch

    path = _sealed(scratch, ["T", {"e": "w", "v": ["I32", 0, [4], [1]], **flags}])
    _refused(path, r"malformed skeleton: tensor 'w' of torch.int32 requires grad")  # torch: a RuntimeError
    back = certckpt.load(_sealed(scratch, ["T", {"e": "w", "v": ["I32", 0, [4], [1]], "p": 1}]))
    assert back.dtype == torch.int32 and not back.requires_grad  # an integer Parameter without grad loads


EXTREME = st.one_of(
    st.integers(-3, 20),
    st.sampled_from([2**31, 2**32, 2**40, 2**61, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -(2**63)]),
    st.integers(-(2**70), 2**70),
)
FLAGS = st.dictionaries(st.sampled_from(["p", "g", "d"]), st.sampled_from([1, 0, "cpu", "meta"]), max_size=2)


@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=250)
@given(
    dtype=st.sampled_from(["BOOL", "U8", "I16", "F16", "BF16", "I32", "F32", "C64", "F64", "I64"]),
    offset=EXTREME,
    size=st.lists(EXTREME, max_size=5),
    stride=st.lists(EXTREME, max_size=5),
    aligned=st.booleans(),
    flags=FLAGS,
    numpy=st.booleans(),
    mmap=st.booleans(),
)
def test_finding3_views_of_extreme_sizes_and_strides_load_or_raise_a_certckpt_error(
    scratch, dtype, offset, size, stride, aligned, flags, numpy, mmap
):
    """Issue 41: no RuntimeError, OverflowError, TypeError or ValueError gets out of load (fast: ~1 s)."""
    import warnings

    if aligned:  # one stride per size, so the search reaches torch rather than the list-length check
        stride = (stride + [1] * len(size))[: len(size)]
    leaf = {"e": "w", "v": [dtype, offset, size, stride], **flags}
    node = ["np", {"dt": "<f4", "sh": [abs(s) for s in size][:3], "T": leaf}] if numpy else ["T", leaf]
    path = _sealed(scratch, node)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a numpy array of another dtype warns nothing; a device may)
            certckpt.load(path, mmap=mmap)
    except CertckptError:
        pass


@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=150)
@given(
    shape=st.lists(
        st.one_of(st.just(0), st.integers(1, 20), st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1])), max_size=4
    )
    .map(lambda s: [*s, 0])
    .flatmap(st.permutations),
    mmap=st.booleans(),
)
def test_finding3_empty_tensor_entries_of_extreme_shapes_load_or_raise_a_certckpt_error(scratch, shape, mmap):
    path = _with_empty_entry(scratch, shape)
    try:
        certckpt.load(path, mmap=mmap)
    except CertckptError:
        pass
    certckpt.verify(path)  # a report, never an exception
