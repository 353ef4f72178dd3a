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
