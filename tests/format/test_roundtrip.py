"""save/load round trips: every supported value, real training states, sharing, refusals."""

import collections
import io
import math
import os

import pytest
import torch
from safetensors import safe_open

import certckpt


def assert_same(a, b, path="obj"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        assert (
            torch.equal(
                a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8) if b.dtype == torch.bool else b
            )
            if a.numel()
            else True
        ), path
        assert a.requires_grad == b.requires_grad, path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    else:
        assert a == b, path


def roundtrip(obj, tmp_path, name="c.safetensors", **kw):
    p = tmp_path / name
    certckpt.save(obj, p, **kw)
    return certckpt.load(p), p


ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
]


def test_every_storable_dtype_roundtrips(tmp_path):
    g = torch.Generator().manual_seed(0)
    obj = {}
    for dt in ALL_DTYPES:
        nbytes = 6 * torch.empty((), dtype=dt).element_size()
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            data %= 2
        obj[str(dt)] = data.view(dt).reshape(2, 3)
    out, p = roundtrip(obj, tmp_path)
    for k, t in obj.items():
        assert out[k].dtype == t.dtype and torch.equal(out[k].view(torch.uint8), t.view(torch.uint8))
    assert certckpt.verify(p, deep=True).ok


def test_python_values_roundtrip_exactly(tmp_path):
    obj = {
        "ints": [0, -1, 2**100, -(3**400), 10**5000],  # arbitrary size, past str()'s 4300-digit limit
        "floats": (float("nan"), float("inf"), float("-inf"), -0.0, 0.1, 1e-310),
        "flags": [True, False, None],
        "text": 'ünïcode \n "quoted"',
        7: {"int key": 1, 3: "int key"},
        "dtype": torch.bfloat16,
        "dtype_unstorable": torch.complex128,
        "size": torch.Size([2, 0, 5]),
        "device": torch.device("cpu"),
        "empty": ({}, [], ()),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty_tensor": torch.zeros(0, 4),
    }
    out, _ = roundtrip(obj, tmp_path)
    assert_same(obj, out)


def test_plain_tensor_and_list_at_top_level(tmp_path):
    t = torch.randn(3, 3)
    out, p = roundtrip(t, tmp_path)
    assert torch.equal(out, t)
    out, _ = roundtrip([t, 1], tmp_path, name="l.safetensors")
    assert torch.equal(out[0], t) and out[1] == 1


def _train_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied weights
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    sched = torch.optim.lr_scheduler.OneCycleLR(opts[0], max_lr=0.1, total_steps=10)
    for _ in range(2):
        loss = model(torch.randint(0, 10, (4,))).square().mean()
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        sched.step()
    return model, {
        "model": model.state_dict(),
        "adamw": opts[0].state_dict(),
        "sgd": opts[1].state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
    }


def test_real_training_state_roundtrips(tmp_path):
    model, state = _train_state()
    out, p = roundtrip(state, tmp_path, step=2, run="r")
    assert_same(state, out)
    # tied weights: one stored tensor, shared again after load
    assert (
        out["model"]["0.weight"].untyped_storage().data_ptr() == out["model"]["1.weight"].untyped_storage().data_ptr()
    )
    with safe_open(p, "pt") as f:
        # f is a safe_open handle, not a dict: it has keys() but no __iter__ or __contains__
        assert len([k for k in f.keys() if k.startswith("model.")]) == 1  # noqa: SIM118
    fresh = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    fresh[1].weight = fresh[0].weight
    fresh.load_state_dict(out["model"])
    o = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    o.load_state_dict(out["adamw"])  # the optimizer accepts what we give back
    torch.set_rng_state(out["rng"])


def test_views_of_one_storage_share_again(tmp_path):
    a = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"a": a, "row": a[1], "t": a.t(), "bytes": a.view(torch.int32)[2:], "col": a[:, 3]}
    out, p = roundtrip(obj, tmp_path)
    assert_same(obj, out)
    ptrs = {out[k].untyped_storage().data_ptr() for k in obj}
    assert len(ptrs) == 1
    out["a"][1, 0] = 100.0
    assert out["row"][0] == 100.0  # writes through, as with torch.load
    with safe_open(p, "pt") as f:
        assert list(f.keys()) == ["a"]


def test_views_without_covering_base_are_stored_as_raw_bytes(tmp_path):
    base = torch.arange(100, dtype=torch.float32)
    obj = {"x": base[10:30], "y": base[20:50].view(5, 6)}
    out, _ = roundtrip(obj, tmp_path)
    assert_same(obj, out)
    assert out["x"].untyped_storage().data_ptr() == out["y"].untyped_storage().data_ptr()
    out["x"][15] = -1
    assert out["y"][0, 5] == -1


def test_noncontiguous_unshared_tensor_is_saved_compactly(tmp_path):
    big = torch.randn(1000, 10)
    obj = {"col": big[:, 0]}
    out, p = roundtrip(obj, tmp_path)
    assert torch.equal(out["col"], big[:, 0])
    assert os.path.getsize(p) < 1000 * 4 + 4096  # the slice, not the 40 kB storage


def test_parameters_and_requires_grad_survive(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    q = torch.randn(2, requires_grad=True)
    out, _ = roundtrip({"p": p, "q": q, "frozen": torch.nn.Parameter(torch.ones(1), requires_grad=False)}, tmp_path)
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["q"]) is torch.Tensor and out["q"].requires_grad
    assert type(out["frozen"]) is torch.nn.Parameter and not out["frozen"].requires_grad


def test_safe_open_sees_the_same_tensors(tmp_path):
    sd = torch.nn.Linear(5, 3).state_dict()
    p = tmp_path / "m.safetensors"
    certckpt.save(sd, p)
    with safe_open(str(p), "pt") as f:
        assert f.metadata()["format"] == "pt"
        assert set(f.keys()) == set(sd)
        for k in sd:
            assert torch.equal(f.get_tensor(k), sd[k])


@pytest.mark.parametrize(
    "bad, where, words",
    [
        ({"extra": {"sampler": object()}}, "obj['extra']['sampler']", "builtins.object"),
        ({"f": lambda: 1}, "obj['f']", "function"),
        ({"s": torch.eye(3).to_sparse()}, "obj['s']", "sparse"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "obj['q']", "quantized"),
        ({"c": torch.zeros(2, dtype=torch.complex128)}, "obj['c']", "complex128"),
        ({"k": {torch.ones(1): 3}}, "obj['k']", "dict key"),
        ({"set": {object()}}, "obj['set'][0]", "builtins.object"),
        ([1, {"deep": [torch.ones(1), __import__("numpy").array([None])]}], "obj[1]['deep'][1]", "dtype object"),
        ({"np": __import__("numpy").ma.masked_array([1.0])}, "obj['np']", "np.asarray"),
        ({"mod": torch.nn.Linear(1, 1)}, "obj['mod']", "state_dict()"),
        ({"sub": type("MyInt", (int,), {})(3)}, "obj['sub']", "int(...)"),
        ({"m": torch.empty(2, device="meta")}, "obj['m']", "meta"),
    ],
)
def test_unsupported_values_are_refused_before_writing(tmp_path, bad, where, words):
    p = tmp_path / "x.safetensors"
    with pytest.raises(certckpt.UnsupportedObjectError) as ei:
        certckpt.save(bad, p)
    msg = str(ei.value)
    assert msg.startswith(where + ":") and words in msg and "Nothing was written" in msg
    assert os.listdir(tmp_path) == []


def test_self_containing_object_is_refused(tmp_path):
    d = {"a": 1}
    d["me"] = d
    with pytest.raises(certckpt.UnsupportedObjectError, match="contains itself"):
        certckpt.save(d, tmp_path / "x")


def test_file_objects_and_pathlike(tmp_path):
    state = {"w": torch.randn(4, 4), "n": 3}
    buf = io.BytesIO()
    certckpt.save(state, buf, step=5)
    buf.seek(0)
    out = certckpt.load(buf)
    assert_same(state, out)
    buf.seek(0)
    assert certckpt.verify(buf).ok
    with open(tmp_path / "f.safetensors", "wb") as f:
        certckpt.save(state, f)
    assert certckpt.verify(str(tmp_path / "f.safetensors")).ok


def test_memory_and_file_urls(tmp_path, memroot):
    state = {"w": torch.randn(8)}
    for url in (f"{memroot}/a/ck.safetensors", f"file://{tmp_path}/ck.safetensors"):
        certckpt.save(state, url, step=1)
        assert_same(state, certckpt.load(url))
        assert certckpt.verify(url).ok
        with pytest.raises(certckpt.CheckpointExistsError, match="overwrite=True"):
            certckpt.save({"w": torch.zeros(8)}, url, overwrite=False)
        assert_same(state, certckpt.load(url))  # the refused write changed nothing
        certckpt.save({"w": torch.zeros(8)}, url)  # replaces, like torch.save
        assert torch.equal(certckpt.load(url)["w"], torch.zeros(8))


def test_map_location(tmp_path):
    out, p = roundtrip({"w": torch.ones(2)}, tmp_path)
    assert certckpt.load(p, map_location="cpu")["w"].device.type == "cpu"
    assert certckpt.load(p, map_location={"cpu": "meta"})["w"].device.type == "meta"
    with pytest.raises(TypeError, match="callable"):
        certckpt.load(p, map_location=3)


def test_record_holds_run_step_metadata_and_inventory(tmp_path):
    p = tmp_path / "c.safetensors"
    res = certckpt.save({"w": torch.ones(3)}, p, step=12, run="exp", metadata={"note": "hi"})
    rec = certckpt.inspect(p).record
    assert (rec.run, rec.step, rec.user, rec.schema) == ("exp", 12, {"note": "hi"}, 1)
    assert rec.state_fp == res.state_fp
    assert rec.writer["torch"] == torch.__version__ and rec.writer["devices"] == ["cpu"] and rec.writer["host"]
    assert rec.tensors["w"]["fp"] == certckpt.fingerprint_hex(torch.ones(3))
    assert rec.step_range is None and rec.lineage is None  # filled by the auditor (detection issue)


@pytest.mark.parametrize("bad", [{"step": -1}, {"step": 1.5}, {"run": 3}, {"metadata": {"a": 1}}])
def test_bad_options_are_refused(tmp_path, bad):
    with pytest.raises((TypeError, ValueError)):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "c", **bad)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_roundtrip(tmp_path):
    state = {"w": torch.randn(1000, device="cuda"), "c": torch.arange(3)}
    out, p = roundtrip(state, tmp_path)
    assert out["w"].device.type == "cuda" and torch.equal(out["w"].cpu(), state["w"].cpu())
    assert certckpt.inspect(p).record.tensors["w"]["fp"] == certckpt.fingerprint_hex(state["w"].cpu())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_device_is_a_clear_error(tmp_path):
    p = tmp_path / "c.safetensors"
    certckpt.save({"w": torch.ones(2)}, p)
    with pytest.raises(certckpt.DeviceUnavailableError, match="map_location='cpu'"):
        certckpt.load(p, map_location="cuda:0")
