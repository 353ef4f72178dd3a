"""Everyday Python and numpy values in checkpoints (issue 18, part 1): round trips, the class
registry and its plain-data fallback, every refusal in one error, known-answer encodings, the
leaves fixture, and a typical training checkpoint."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import fractions
import hashlib
import io
import json
import math
import os
import pathlib
import random
import warnings
import zoneinfo
from typing import NamedTuple

import numpy as np
import pytest
import torch

import certckpt
from certckpt.format.header import canonical_json
from certckpt.format.skeleton import flatten, rebuild
from tests.support.helpers import ROOT

FIXTURES = str(ROOT / "fixtures" / "v1")


def roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    certckpt.save(obj, buf)
    buf.seek(0)
    return certckpt.load(buf, **load_kw)


def same(a, b, path="obj"):
    """Deep equality that also compares types, numpy dtypes/shapes, tensor bytes and tz info."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path  # exact, NaN and NaT included (C order)
    elif isinstance(a, (dict, argparse.Namespace)):
        da, db = (a, b) if isinstance(a, dict) else (vars(a), vars(b))
        assert list(da) == list(db) and [type(k) for k in da] == [type(k) for k in db], path
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, path
        for k in da:
            same(da[k], db[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, datetime.datetime):
        assert a == b and a.tzinfo == b.tzinfo and a.utcoffset() == b.utcoffset() and a.fold == b.fold, path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    else:
        assert a == b, path


# --- values ---------------------------------------------------------------------------------------

NP_ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array([True, False, True]),
    np.arange(5, dtype=np.int8) - 2,
    np.array([1, 65535], dtype=np.uint16),
    np.array([2**32 - 1], dtype=np.uint32),
    np.array([2**64 - 1], dtype=np.uint64),
    np.array([0.5, np.nan, -np.inf], dtype=np.float16),
    np.array([1e300, -0.0]),
    np.array([1 + 2j], dtype=np.complex64),
    np.array([1 + 2j, np.nan * 1j]),  # complex128: no safetensors code, stored as bytes
    np.array(["a", "bcd"]),
    np.array([b"xy", b"z"]),
    np.array(["2024-01-01", "NaT"], dtype="datetime64[D]"),
    np.array([5, -3], dtype="timedelta64[s]"),
    np.array([1.5, 2.5], dtype=">f8"),  # big-endian
    np.array(3.25),  # 0-d
    np.zeros((0, 4), dtype=np.int32),
    np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2],  # non-contiguous
    np.arange(6, dtype=np.float64)[::-1],  # negative stride
    np.broadcast_to(np.arange(3.0), (4, 3)),  # read-only, stride 0
]


@pytest.mark.parametrize("arr", NP_ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_numpy_arrays_roundtrip_as_numpy(arr):
    out = roundtrip({"a": arr})["a"]
    same(np.array(arr), out)  # equal values, same dtype (byte order included) and shape
    assert out.flags.writeable


def test_numpy_arrays_are_stored_as_tensors_where_safetensors_has_the_dtype(tmp_path):
    p = tmp_path / "n.safetensors"
    certckpt.save({"f": np.ones((2, 3), np.float32), "u": np.ones(4, np.uint16), "c": np.ones(2, np.complex128)}, p)
    entries = {e.name: e for e in certckpt.inspect(p).header.entries}
    assert (entries["f"].dtype, entries["f"].shape) == ("F32", (2, 3))
    assert (entries["u"].dtype, entries["u"].shape) == ("U16", (4,))
    assert (entries["c"].dtype, entries["c"].shape) == ("U8", (32,))  # bytes of a dtype safetensors lacks
    # any safetensors reader sees the float array as a plain tensor
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        assert torch.equal(f.get_tensor("f"), torch.ones(2, 3))


def test_numpy_arrays_stay_on_cpu_whatever_map_location(tmp_path):
    p = tmp_path / "n.safetensors"
    certckpt.save({"a": np.arange(3), "t": torch.arange(3)}, p)
    out = certckpt.load(p, map_location={"cpu": "meta"})
    assert isinstance(out["a"], np.ndarray) and out["t"].device.type == "meta"


NP_SCALARS = [
    np.float64(0.1),
    np.float32(-1.5),
    np.float16(np.inf),
    np.int64(-(2**63)),
    np.int8(-1),
    np.uint64(2**64 - 1),
    np.bool_(True),
    np.complex128(1 - 1j),
    np.str_("héllo"),
    np.bytes_(b"ab"),
    np.datetime64("2024-02-29T12:00", "m"),
    np.timedelta64(-7, "ms"),
    np.longdouble(1) / 3,
]


@pytest.mark.parametrize("x", NP_SCALARS, ids=lambda x: x.dtype.str)
def test_numpy_scalars_roundtrip_with_their_type(x):
    same(x, roundtrip([x])[0])


class Point(NamedTuple):
    x: int
    y: float


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float
    layers: tuple
    name: str = "tiny"


class Color(enum.Enum):
    RED = 1
    GREEN = "g"


class Level(enum.IntEnum):
    LOW = 1


@pytest.fixture
def registered():
    """The leaves fixture's classes, registered under the fixture's names (and forgotten after)."""
    for cls, name in ((Point, "fixtures.Point"), (Config, "fixtures.Config"), (Color, "fixtures.Color")):
        certckpt.register_type(cls, name=name)
    certckpt.register_type(Level)
    yield
    for cls in (Point, Config, Color, Level):
        certckpt.unregister_type(cls)


EVERYDAY = {
    "path": pathlib.Path("/tmp/run") / "ckpt",
    "pure_windows": pathlib.PureWindowsPath("C:/data/x"),
    "set": {1, "a", (2, 3)},
    "frozenset": frozenset({1.5, None}),
    "empty_set": set(),
    "naive": datetime.datetime(2024, 11, 3, 1, 30, fold=1),
    "utc": datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc),
    "offset": datetime.datetime(2024, 1, 1, 8, tzinfo=datetime.timezone(datetime.timedelta(hours=5, minutes=30))),
    "zone": datetime.datetime(2024, 11, 3, 1, 30, tzinfo=zoneinfo.ZoneInfo("America/New_York"), fold=1),
    "date": datetime.date(1999, 12, 31),
    "time": datetime.time(23, 59, 59, 999999, tzinfo=datetime.timezone.utc),
    "timedelta": datetime.timedelta(days=-3, microseconds=1),
    "bytes": bytes(range(256)),
    "bytearray": bytearray(b"\x00\x01"),
    "complex": complex(-0.0, float("-inf")),
    "slice": slice(None, 5, None),
    "range": range(-5, 100, 7),
    "namespace": argparse.Namespace(lr=0.1, betas=(0.9, 0.99), out=pathlib.Path("out"), nested={"k": [1]}),
    "defaultdict": collections.defaultdict(int, {"seen": 3}),
    "defaultdict_none": collections.defaultdict(None, {1: 2}),
    "counter": collections.Counter("hello"),
    "deque": collections.deque([torch.ones(2), 3], maxlen=4),
    "keys": {1.5: 0, None: 1, False: 2, (1, (2, "x")): 3, -7: 4, frozenset({1}): 5, 2**80: 6, "s": 7},
}


@pytest.mark.parametrize("key", list(EVERYDAY))
def test_everyday_values_roundtrip(key):
    value = EVERYDAY[key]
    out = roundtrip({key: value})[key]
    if isinstance(value, collections.deque):
        assert type(out) is collections.deque and out.maxlen == 4 and torch.equal(out[0], value[0]) and out[1] == 3
    elif isinstance(value, (set, frozenset)):
        assert type(out) is type(value) and out == value
    else:
        same(value, out)
    if key == "zone":
        assert out.tzinfo is zoneinfo.ZoneInfo("America/New_York") and out.utcoffset() == datetime.timedelta(hours=-5)


def test_registered_classes_are_rebuilt(registered):
    obj = {"p": Point(1, 2.5), "c": Config(0.1, (2, 3)), "e": Color.GREEN, "lvl": Level.LOW, "pts": [Point(0, 0.0)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = roundtrip(obj)
    assert type(out["p"]) is Point and out["p"] == Point(1, 2.5) and out["p"].y == 2.5
    assert type(out["c"]) is Config and out["c"] == Config(0.1, (2, 3))
    assert out["e"] is Color.GREEN and out["lvl"] is Level.LOW and type(out["pts"][0]) is Point


def test_unregistered_classes_come_back_as_plain_data_with_a_warning():
    buf = io.BytesIO()
    certckpt.register_type(Point, name="fixtures.Point")
    try:
        certckpt.save({"p": Point(1, 2.5), "c": Config(0.1, (2, 3)), "e": Color.RED}, buf)
    finally:
        certckpt.unregister_type(Point)
    buf.seek(0)
    with pytest.warns(UserWarning, match="not registered") as rec:
        out = certckpt.load(buf)
    names = " ".join(str(w.message) for w in rec)
    assert "fixtures.Point" in names and "Config" in names and "Color" in names
    assert out["p"] == (1, 2.5) and out["p"].x == 1 and type(out["p"]) is not Point  # fields kept, class not imported
    assert out["c"] == {"lr": 0.1, "layers": (2, 3), "name": "tiny"}
    assert out["e"] == 1


def test_custom_codec_registration_and_fallback():
    certckpt.register_type(
        fractions.Fraction,
        name="Fraction",
        encode=lambda f: [f.numerator, f.denominator],
        decode=lambda v: fractions.Fraction(*v),
    )
    try:
        buf = io.BytesIO()
        certckpt.save({"f": fractions.Fraction(3, 7)}, buf)
        buf.seek(0)
        assert certckpt.load(buf)["f"] == fractions.Fraction(3, 7)
    finally:
        certckpt.unregister_type(fractions.Fraction)
    buf.seek(0)
    with pytest.warns(UserWarning, match="'Fraction'"):
        assert certckpt.load(buf)["f"] == [3, 7]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: certckpt.register_type(fractions.Fraction), "encode="),
        (lambda: certckpt.register_type(Point, encode=lambda p: p), "both"),
        (lambda: certckpt.register_type(Point(1, 2)), "takes a class"),
        (lambda: certckpt.register_type(Point, name="bad name!"), "name"),
    ],
)
def test_register_type_refuses_bad_registrations(call, words):
    with pytest.raises(certckpt.ConfigurationError, match=words):
        call()


def test_register_type_refuses_a_name_taken_by_another_class(registered):
    with pytest.raises(certckpt.ConfigurationError, match="registered for"):
        certckpt.register_type(Level, name="fixtures.Point")


# --- refusals -------------------------------------------------------------------------------------


def test_every_refusal_is_listed_in_one_error_with_advice(tmp_path):
    model = torch.nn.Linear(2, 2)
    bad = {
        "model": model,
        "optim": torch.optim.SGD(model.parameters(), lr=0.1),
        "sched": {"fn": lambda s: s},
        "gen": torch.Generator(),
        "rng": np.random.default_rng(0),
        "objs": np.array([object()]),
        "dd": collections.defaultdict(lambda: 0),
        "ok": torch.ones(2),
        "nested": [1, {"thing": object()}],
    }
    p = tmp_path / "x.safetensors"
    with pytest.raises(certckpt.UnsupportedObjectError) as ei:
        certckpt.save(bad, p)
    msg = str(ei.value)
    assert len(ei.value.problems) == 8 and msg.startswith("8 values cannot be stored") and "Nothing was written" in msg
    for where, advice in [
        ("obj['model']", "model.state_dict()"),
        ("obj['optim']", "optimizer.state_dict()"),
        ("obj['sched']['fn']", "a function"),
        ("obj['gen']", "get_state()"),
        ("obj['rng']", "bit_generator.state"),
        ("obj['objs']", "dtype object"),
        ("obj['dd']", "dict(d)"),
        ("obj['nested'][1]['thing']", "register_type"),
    ]:
        line = next(line for line in msg.splitlines() if line.strip().startswith(f"- {where}:"))
        assert advice in line, line
    assert os.listdir(tmp_path) == []


def test_a_single_refusal_keeps_the_one_line_form(tmp_path):
    with pytest.raises(certckpt.UnsupportedObjectError) as ei:
        certckpt.save({"m": torch.nn.ReLU()}, tmp_path / "x")
    assert str(ei.value).startswith("obj['m']: a module") and "state_dict()" in str(ei.value)


@pytest.mark.parametrize(
    "node",
    [
        ["nps", ["|O", "00" * 8]],  # object dtype: would read bytes as pointers
        ["nps", ["<f8", "00"]],  # wrong byte length
        ["nps", ["i4,f8", "00" * 12]],  # structured
        ["np", {"dt": "<f4", "sh": [5], "T": {"e": "t"}}],  # shape disagrees with the stored tensor
        ["np", {"dt": "<c16", "sh": [2], "r": 1, "T": {"e": "t"}}],  # byte length disagrees
        ["path", ["os.system", "x"]],  # not a path class
        ["dd", {"f": "os.system", "i": []}],  # not a builtin factory
        ["dt", ["not a date", None, 0]],
        ["set", [["l", []]]],  # unhashable member
        ["d", [[["l", []], 1]]],  # unhashable key
        ["sl", [None]],
        ["b", "not base64!"],
        ["zz", 1],
    ],
)
def test_malformed_leaf_nodes_are_corrupt_not_tracebacks(node):
    with pytest.raises(certckpt.CorruptCheckpointError, match="malformed skeleton"):
        rebuild(node, {"t": torch.zeros(4)})


# --- known answers (docs/format.md section 6) ----------------------------------------------------------------

KNOWN = [
    (np.float32(1.5), ["nps", ["<f4", "0000c03f"]]),
    (np.bool_(False), ["nps", ["|b1", "00"]]),
    (np.str_("ab"), ["nps", ["<U2", "6100000062000000"]]),
    (complex(1, -0.5), ["c", ["0x1.0000000000000p+0", "-0x1.0000000000000p-1"]]),
    (b"\x00\xff", ["b", "AP8="]),
    (bytearray(b"a"), ["ba", "YQ=="]),
    ({"b", "a"}, ["set", ["a", "b"]]),
    (frozenset({2, 1}), ["fset", [["i", "0x1"], ["i", "0x2"]]]),
    (slice(None, 3), ["sl", [None, ["i", "0x3"], None]]),
    (range(1, 9, 2), ["rg", ["0x1", "0x9", "0x2"]]),
    (pathlib.PurePosixPath("/a/b"), ["path", ["PurePosixPath", "/a/b"]]),
    (datetime.datetime(2024, 1, 2, 3, 4, 5), ["dt", ["2024-01-02T03:04:05", None, 0]]),
    (
        datetime.datetime(2024, 7, 1, 12, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")),
        ["dt", ["2024-07-01T12:00:00+02:00", "Europe/Paris", 0]],
    ),
    (datetime.date(2024, 2, 29), ["date", "2024-02-29"]),
    (datetime.time(1, 2, 3), ["tm", "01:02:03"]),
    (datetime.timedelta(days=-1, seconds=5), ["td", [-1, 5, 0]]),
    (datetime.timezone(datetime.timedelta(hours=-5), "EST"), ["tz", [-1, 68400, 0, "EST"]]),
    (argparse.Namespace(lr=0.5), ["ns", [["lr", ["f", "0x1.0000000000000p-1"]]]]),
    (collections.defaultdict(list, {"a": []}), ["dd", {"f": "list", "i": [["a", ["l", []]]]}]),
    (collections.Counter({"x": 2}), ["ctr", [["x", ["i", "0x2"]]]]),
    (collections.deque([1], maxlen=2), ["dq", {"v": [["i", "0x1"]], "m": 2}]),
    (
        {1.5: 1, None: 2, (1,): 3},
        [
            "d",
            [
                [["f", "0x1.8000000000000p+0"], ["i", "0x1"]],
                [None, ["i", "0x2"]],
                [["t", [["i", "0x1"]]], ["i", "0x3"]],
            ],
        ],
    ),
    (
        Point(1, 2.0),
        ["nt", {"n": "fixtures.Point", "f": ["x", "y"], "v": [["i", "0x1"], ["f", "0x1.0000000000000p+1"]]}],
    ),
    (Color.GREEN, ["enum", {"n": "fixtures.Color", "v": "g"}]),
    (
        Config(1.0, ()),
        [
            "dc",
            {
                "n": "fixtures.Config",
                "f": [["lr", ["f", "0x1.0000000000000p+0"]], ["layers", ["t", []]], ["name", "tiny"]],
            },
        ],
    ),
    (np.arange(3, dtype=np.int16), ["np", {"dt": "<i2", "sh": [3], "T": {"e": "tensor"}}]),
    (np.array(["x"]), ["np", {"dt": "<U1", "sh": [1], "r": 1, "T": {"e": "tensor"}}]),
]


def _known_id(v: object) -> str:
    # a set's repr follows string hashing, which differs between processes (pytest-xdist workers
    # must collect the same ids): sets are named by their sorted items
    return (f"{type(v).__name__}{sorted(v, key=repr)}" if isinstance(v, (set, frozenset)) else repr(v))[:40]


@pytest.mark.parametrize("value, node", KNOWN, ids=[_known_id(v) for v, _ in KNOWN])
def test_known_answer_encodings(registered, value, node):
    assert flatten(value).skeleton == node


def test_leaves_fixture_bytes_and_skeleton_are_pinned(registered):
    path = os.path.join(FIXTURES, "leaves_small.safetensors")
    with open(os.path.join(FIXTURES, "leaves_small.expected.json"), encoding="utf-8") as f:
        expected = json.load(f)
    with open(path, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == expected["sha256"]
    assert certckpt.verify(path, deep=True).ok
    skeleton = certckpt.inspect(path).record.skeleton
    assert hashlib.sha256(canonical_json(skeleton).encode("ascii")).hexdigest() == expected["skeleton_sha256"]
    # the encoder today writes exactly the skeleton pinned in the file (the format did not drift)
    obj = certckpt.load(path)
    assert flatten(obj).skeleton == skeleton


def test_leaves_fixture_loads_to_the_known_values(registered):
    obj = certckpt.load(os.path.join(FIXTURES, "leaves_small.safetensors"))
    same(obj["np_f32"], np.arange(6, dtype=np.float32).reshape(2, 3))
    same(obj["np_c128"], np.array([1 + 2j, -0.5j]))
    same(obj["np_be"], np.array([1.5, -2.0], dtype=">f4"))
    same(obj["np_dt64"], np.array(["2024-01-02T03:04"], dtype="datetime64[m]"))
    state = np.random.RandomState(0).get_state()
    same(obj["np_state"], state)
    same(obj["nps"], [np.float64(0.1), np.float32(-1.5), np.int64(-3), np.bool_(True), np.uint8(255), np.str_("s")])
    assert obj["set"] == {1, 2, 3} and obj["frozenset"] == frozenset("ab")
    same(obj["datetime_zone"], datetime.datetime(2024, 7, 1, 12, tzinfo=zoneinfo.ZoneInfo("Europe/Paris")))
    same(
        obj["keys"],
        {1.5: "float", None: "none", True: "bool", (1, "a"): "tuple", frozenset({2}): "frozenset", -4: "int"},
    )
    assert obj["point"] == Point(1, 2.5) and type(obj["point"]) is Point
    assert obj["config"] == Config(lr=0.1, layers=(2, 3)) and obj["color"] is Color.GREEN


def test_new_tags_do_not_change_old_files():
    """The v1 golden file (written before these tags) still loads, and its skeleton uses none of them."""
    path = os.path.join(FIXTURES, "golden_small.safetensors")
    tags = set()

    def walk(n):
        if not isinstance(n, list):
            return
        tag, val = n
        tags.add(tag)
        if tag in ("l", "t"):
            for x in val:
                walk(x)
        elif tag in ("d", "od"):
            for k, v in val:
                walk(k)
                walk(v)

    walk(certckpt.inspect(path).record.skeleton)
    assert tags <= {"d", "od", "l", "t", "i", "f", "T", "dtype", "size", "dev"}
    assert certckpt.load(path)["extra"]["big"] == 2**100


# --- a typical checkpoint ------------------------------------------------------------------------------------


def _resnet_like() -> torch.nn.Module:
    def block(c):
        return torch.nn.Sequential(
            torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c), torch.nn.ReLU()
        )

    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        block(8),
        block(8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 10),
    )


def test_typical_checkpoint_roundtrips_equal(tmp_path):
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    model = _resnet_like()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    step = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(3):
        loss = model(torch.randn(4, 3, 8, 8)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        seq.step()
        step.step()
        plateau.step(loss.item())
    hparams = argparse.Namespace(lr=0.1, epochs=90, arch="resnet-like", data=pathlib.Path("/data/imagenet"), seed=0)
    ckpt = {
        "epoch": 3,
        "global_step": np.int64(300),
        "best_acc1": np.float64(0.7321),
        "state_dict": model.state_dict(),
        "optimizer": opt.state_dict(),
        "schedulers": [seq.state_dict(), plateau.state_dict(), step.state_dict()],
        "scaler": scaler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "numpy_generator": np.random.default_rng(5).bit_generator.state,
        },
        "hyper_parameters": hparams,
        "output_dir": pathlib.Path("/runs/exp1"),
        "saved_at": datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.timezone.utc),
        "metrics": {"top1": np.float32(73.2), "loss_history": np.array([2.3, 1.9, 1.7])},
    }
    p = tmp_path / "checkpoint.safetensors"
    certckpt.save(ckpt, p, step=300)
    assert certckpt.verify(p, deep=True).ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = certckpt.load(p, map_location="cpu")
    same(ckpt, out)
    # and it is usable: states restore into fresh objects
    model2 = _resnet_like()
    model2.load_state_dict(out["state_dict"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    opt2.load_state_dict(out["optimizer"])
    torch.amp.GradScaler("cpu").load_state_dict(out["scaler"])
    random.setstate(out["rng"]["python"])
    np.random.set_state(out["rng"]["numpy"])
    torch.set_rng_state(out["rng"]["torch"])
    assert np.random.rand() == (np.random.set_state(ckpt["rng"]["numpy"]), np.random.rand())[1]
