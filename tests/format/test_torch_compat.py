"""torch.save / torch.load drop-in (issue 18, parts 2 and 3): the signatures, callable
map_location, mmap, and replacing files like torch.save while certified files stay write-once."""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings

import pytest
import torch

import certckpt
from certckpt.format import reader
from certckpt.format.writer import save_certified
from certckpt.trust.ledger import Ledger


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(reader, "_warned", set())


def test_torch_save_arguments_are_accepted_with_one_warning(tmp_path, fresh_warnings):
    p = tmp_path / "c.pt"
    with pytest.warns(UserWarning, match="pickle_module, pickle_protocol") as rec:
        certckpt.save({"w": torch.ones(2)}, p, pickle_protocol=4, pickle_module=object())
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second save is silent
        certckpt.save({"w": torch.ones(2)}, p, pickle_protocol=2)
    with pytest.warns(UserWarning, match="_use_new_zipfile_serialization, _disable_byteorder_record"):
        certckpt.save({"w": torch.ones(2)}, p, None, 2, False, True)  # torch.save's positional order
    assert torch.equal(certckpt.load(p)["w"], torch.ones(2))


def test_options_stay_keyword_only(tmp_path):
    with pytest.raises(TypeError):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "c", None, 4, True, False, 10)  # step positionally


def test_load_takes_torch_load_arguments(tmp_path, fresh_warnings):
    p = tmp_path / "c.pt"
    certckpt.save({"w": torch.arange(3)}, p)
    assert certckpt.load(p, "cpu")["w"].device.type == "cpu"  # map_location positional
    assert torch.equal(certckpt.load(p, torch.device("cpu"), weights_only=False)["w"], torch.arange(3))
    with pytest.warns(UserWarning, match="pickle_module, encoding") as rec:
        certckpt.load(p, None, object(), encoding="latin1")
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        certckpt.load(p, encoding="bytes")


def test_callable_map_location_follows_torch(tmp_path):
    p = tmp_path / "c.pt"
    base = torch.arange(12.0)
    certckpt.save({"a": base, "b": base[2:8].view(2, 3), "c": torch.ones(2, dtype=torch.int64)}, p)
    calls = []

    def fn(storage, location):
        calls.append((type(storage), storage.device.type, location))
        return storage

    out = certckpt.load(p, map_location=fn)
    # called once per stored tensor (the views share one entry), with the CPU tensor and its saved location
    assert sorted(calls) == [(torch.Tensor, "cpu", "cpu")] * 2
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert torch.equal(out["b"], base[2:8].view(2, 3))
    # None means "where it was saved"; a storage means "its device"; a tensor moves it (meta here)
    assert certckpt.load(p, map_location=lambda s, loc: None)["c"].device.type == "cpu"
    assert certckpt.load(p, map_location=lambda s, loc: torch.UntypedStorage(0))["c"].device.type == "cpu"
    assert certckpt.load(p, map_location=lambda s, loc: s.to("meta"))["c"].device.type == "meta"
    with pytest.raises(certckpt.ArgumentTypeError, match="map_location returned str"):
        certckpt.load(p, map_location=lambda s, loc: "cuda")


def test_mmap_tensors_are_backed_by_the_file_and_still_verified(tmp_path):
    p = tmp_path / "c.safetensors"
    state = {"w": torch.randn(256, 64), "h": torch.arange(7, dtype=torch.float16), "n": 3}
    certckpt.save(state, p)
    size = p.stat().st_size
    before = hashlib.sha256(p.read_bytes()).hexdigest()
    out = certckpt.load(p, mmap=True)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["h"], state["h"]) and out["n"] == 3
    assert out["w"].untyped_storage().nbytes() == size  # one mapping of the whole file
    assert out["h"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    out["w"].add_(1)  # copy-on-write: the file never changes
    assert hashlib.sha256(p.read_bytes()).hexdigest() == before
    # a damaged byte is caught with mmap too
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(certckpt.CorruptCheckpointError, match="digest mismatch"):
        certckpt.load(bad, mmap=True)
    assert certckpt.load(bad, mmap=True, verify=False)["n"] == 3
    with pytest.raises(certckpt.ConfigurationError, match="local file"):
        certckpt.load(io.BytesIO(p.read_bytes()), mmap=True)


# --- replacing ---------------------------------------------------------------------------------------


def test_plain_save_replaces_like_torch_save(tmp_path):
    p = tmp_path / "last.ckpt"
    for i in range(3):  # Lightning rewrites last.ckpt on every save
        certckpt.save({"epoch": i, "w": torch.full((2,), float(i))}, p)
    assert certckpt.load(p)["epoch"] == 2 and certckpt.verify(p).ok
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temp file left
    with pytest.raises(certckpt.CheckpointExistsError, match="overwrite=True"):
        certckpt.save({"epoch": 9}, p, overwrite=False)
    with pytest.raises(certckpt.ArgumentTypeError):
        certckpt.save({"epoch": 9}, p, overwrite="yes")


def test_failed_replace_keeps_the_previous_file(tmp_path, monkeypatch):
    from certckpt.format import writer

    p = tmp_path / "c.safetensors"
    certckpt.save({"w": torch.ones(3)}, p)
    before = p.read_bytes()

    def broken(self, fd, **kwargs):
        os.write(fd, b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer.SaveJob, "write_fd", broken)
    with pytest.raises(certckpt.StorageError, match="previous checkpoint is untouched"):
        certckpt.save({"w": torch.zeros(3)}, p)
    assert p.read_bytes() == before and os.listdir(tmp_path) == ["c.safetensors"]


def test_certified_saves_stay_create_only(tmp_path):
    p = tmp_path / "c.safetensors"
    save_certified({"w": torch.ones(1)}, p, step=1)
    with pytest.raises(certckpt.CheckpointExistsError):
        save_certified({"w": torch.zeros(1)}, p, step=1)


def test_a_vault_copy_is_never_replaced(tmp_path):
    vault = tmp_path / "vault"
    (vault / "_ledger").mkdir(parents=True)
    (vault / "_ledger" / "vault.json").write_text(json.dumps({"kind": "certckpt-vault"}))
    (vault / "copies").mkdir()
    for p in (vault / "main@10.safetensors", vault / "copies" / "main@20.safetensors"):
        certckpt.save({"w": torch.ones(2)}, p)  # a new name: nothing is replaced
        before = p.read_bytes()
        for overwrite in (True, False):
            with pytest.raises(certckpt.CheckpointExistsError) as ei:
                certckpt.save({"w": torch.zeros(2)}, p, overwrite=overwrite)
        assert isinstance(ei.value, FileExistsError)
        assert p.read_bytes() == before


def test_protected_error_names_the_vault(tmp_path):
    (tmp_path / "_ledger").mkdir()
    (tmp_path / "_ledger" / "vault.json").write_text("{}")
    p = tmp_path / "x.safetensors"
    certckpt.save({"w": torch.ones(1)}, p)
    with pytest.raises(certckpt.ProtectedCheckpointError, match="inside the vault"):
        certckpt.save({"w": torch.ones(1)}, p)


def test_a_committed_file_is_never_replaced(tmp_path):
    p = tmp_path / "step10.safetensors"
    res = certckpt.save({"w": torch.ones(2)}, p, step=10)
    Ledger(str(tmp_path)).commit_checkpoint(branch="main", step=10, location=str(p), header_digest=res.header_digest)
    with pytest.raises(certckpt.ProtectedCheckpointError, match="commit record"):
        certckpt.save({"w": torch.zeros(2)}, p)
    assert torch.equal(certckpt.load(p)["w"], torch.ones(2))
    certckpt.save({"w": torch.zeros(2)}, tmp_path / "scratch.safetensors")  # others in the store: fine
    certckpt.save({"w": torch.ones(2)}, tmp_path / "scratch.safetensors")


def test_a_read_only_file_is_never_replaced(tmp_path):
    p = tmp_path / "c.safetensors"
    certckpt.save({"w": torch.ones(2)}, p)
    p.chmod(0o444)
    with pytest.raises(certckpt.ProtectedCheckpointError, match="read-only"):
        certckpt.save({"w": torch.zeros(2)}, p)
    assert torch.equal(certckpt.load(p)["w"], torch.ones(2))


def test_a_non_blocking_stream_without_data_is_an_error_not_stale_bytes(tmp_path):
    """``readinto`` answers None when a non-blocking stream has nothing ready: it used to slice the
    whole read buffer (stale bytes) into the digests; it is now one clear error."""
    import io

    buf = io.BytesIO()
    certckpt.save({"w": torch.arange(1000.0)}, buf)

    class NotReady(io.BytesIO):
        def readinto(self, b):
            return None

    with pytest.raises(certckpt.StorageError, match="non-blocking stream had no data ready"):
        certckpt.load(NotReady(buf.getvalue()))
    with pytest.raises(certckpt.StorageError, match="non-blocking stream had no data ready"):
        certckpt.verify(NotReady(buf.getvalue()))
