"""Loading straight into device memory through staging buffers (certckpt/format/staging.py).

On the CPU (the same code as on CUDA, with plain buffers instead of pinned ones): tensors of every
layout come back equal to ``certckpt.load``'s with tiny staging buffers (pieces that split tensors
and alternate buffers across tensor boundaries); a flipped data bit and a short file are refused,
naming the tensor. Which ``map_location`` forms take this path. On CUDA (skipped without):
``certckpt.load(path, map_location="cuda")`` returns the saved object, numpy values on the CPU,
shared tensors shared, and refuses a damaged file."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import certckpt
from certckpt.errors import CorruptCheckpointError
from certckpt.format.reader import staging_device
from certckpt.format.staging import read_to_device
from certckpt.format.verify import read_checkpoint_header


def _state(big: int = 300_000):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(50, 37, generator=g)
    return {
        "w": base,
        "view": base[3:9, ::2],  # shares base's storage
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (333,), dtype=torch.int8, generator=g),
        "flags": torch.rand(17, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(big, generator=g),
        "np": np.arange(12, dtype=np.int16).reshape(3, 4),
        "step": 7,
    }


def _read(path, *, expected=True, **kwargs):
    """``read_to_device`` on the CPU over a file's data section, as ``certckpt.load`` calls it."""
    with open(path, "rb") as fh:
        info = read_checkpoint_header(fh, None, str(path))
        digests = {e.name: info.record.tensors[e.name]["xxh3"] for e in info.header.entries} if expected else None
        return info, read_to_device(
            fh, info.header.entries, torch.device("cpu"), expected=digests, source="f", **kwargs
        )


@pytest.mark.parametrize("stage_bytes", [1, 1000, 4096, 1 << 26])
def test_tensors_read_through_staging_buffers_equal_a_plain_load(tmp_path, stage_bytes):
    path = tmp_path / "s.safetensors"
    # one-byte buffers cross every boundary already; a 1.2 MB tensor through them took 27 s
    certckpt.save(_state(big=300_000 if stage_bytes > 1 else 3_000), path)
    plain = certckpt.load(path)  # the regular path: every tensor read into its own CPU memory
    info, got = _read(path, stage_bytes=stage_bytes)
    from certckpt.format.skeleton import rebuild

    back = rebuild(info.record.skeleton, got, map_location="cpu")
    for k, v in plain.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
        elif isinstance(v, np.ndarray):
            assert np.array_equal(back[k], v)
        else:
            assert back[k] == v
    assert back["view"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()


def test_a_flipped_bit_and_a_short_file_are_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "s.safetensors"
    certckpt.save({"a": torch.arange(1000.0), "b": torch.ones(5000)}, path)
    data = bytearray(path.read_bytes())
    with open(path, "rb") as fh:
        info = read_checkpoint_header(fh, None, "s")
    b = next(e for e in info.header.entries if e.name == "b")
    data[info.header.data_start + b.begin + 100] ^= 0x10
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="`b`"):
        _read(bad, stage_bytes=512)
    short = tmp_path / "short.safetensors"
    short.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated|ends"):
        _read(short, expected=False)


def test_the_reader_thread_ends_with_every_load_and_its_errors_reach_the_caller(tmp_path):
    import threading

    path = tmp_path / "s.safetensors"
    certckpt.save({"a": torch.arange(4000.0), "b": torch.ones(50_000)}, path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # in `b`, the last tensor: the consumer raises while the reader may still run
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))

    def readers():
        return [t for t in threading.enumerate() if t.name == "certckpt-staging-reader"]

    _read(path, stage_bytes=256)
    assert readers() == []
    with pytest.raises(CorruptCheckpointError, match="`b`"):
        _read(bad, stage_bytes=256)
    assert readers() == []

    class Failing(io.BufferedReader):
        """A file whose reads fail after the header (a network file system going away)."""

        def readinto(self, b):
            if self.tell() > 200:
                raise OSError(5, "Input/output error")
            return super().readinto(b)

    with Failing(io.FileIO(str(path))) as fh:
        info = read_checkpoint_header(fh, None, "s")
        with pytest.raises(OSError, match="Input/output"):
            read_to_device(fh, info.header.entries, torch.device("cpu"), expected=None, source="s", stage_bytes=128)
    assert readers() == []


def test_which_map_locations_read_straight_to_the_device():
    for form in ("cpu", None, {"cuda:0": "cuda:1"}, lambda s, loc: s):
        assert staging_device(form, mmap=False) is None
    assert staging_device("cuda", mmap=True) is None  # a mapped file stays mapped
    assert staging_device("cuda:64", mmap=False) is None  # no such device: the regular path says so
    if torch.cuda.is_available():
        assert staging_device("cuda", mmap=False) == torch.device("cuda")
        assert staging_device(torch.device("cuda", 0), mmap=False) == torch.device("cuda", 0)
    else:
        assert staging_device("cuda", mmap=False) is None  # DeviceUnavailableError comes from rebuild


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_to_cuda_returns_the_object_with_numpy_on_the_cpu(tmp_path):
    path = tmp_path / "s.safetensors"
    state = _state()
    certckpt.save(state, path)
    back = certckpt.load(path, map_location="cuda")
    assert back["w"].device.type == "cuda" and torch.equal(back["w"].cpu(), state["w"])
    assert back["view"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert isinstance(back["np"], np.ndarray) and np.array_equal(back["np"], state["np"])
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        certckpt.load(tmp_path / "bad.safetensors", map_location="cuda")
