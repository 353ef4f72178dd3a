"""Issue 41, "keyed means checked, always" and "bounds": a keyed load returns only bytes it checked
(mmap=True included), ``verify`` and ``load`` take the same ``trusted_keys`` forms, and hostile
skeleton views and tensor tables are refused with one ``CorruptCheckpointError`` line, never a torch
traceback."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import certckpt
from certckpt.errors import ConfigurationError, CorruptCheckpointError

# --- keyed reads ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    pytest.importorskip("cryptography")
    from certckpt.format.signing import SigningKey, TrustedKeys, generate_key

    d = tmp_path_factory.mktemp("keys")
    priv, pub = generate_key(d / "writer")
    _, other_pub = generate_key(d / "second")
    return {"signing": SigningKey.load(priv), "trusted": TrustedKeys.load([pub]), "pub": pub, "other_pub": other_pub}


def _state():
    torch.manual_seed(7)
    return {"big": torch.randn(64, 64), "small": torch.arange(10, dtype=torch.int64), "step": 4}


def _overwrite_data_in_place(path) -> None:
    """Every data byte rewritten through the same inode (what another process writing the file does)."""
    info = certckpt.inspect(path)
    before = os.stat(path).st_ino
    with open(path, "r+b") as fh:
        fh.seek(info.header.data_start)
        fh.write(b"\x5a" * info.header.data_length)
        fh.flush()
        os.fsync(fh.fileno())
    assert os.stat(path).st_ino == before


def test_finding1_a_keyed_mmap_load_keeps_the_verified_bytes_when_the_file_changes_on_disk(tmp_path, keys):
    p = tmp_path / "ck.safetensors"
    state = _state()
    certckpt.save(state, p, signing_key=keys["signing"])
    back = certckpt.load(p, trusted_keys=keys["trusted"], mmap=True)
    _overwrite_data_in_place(p)
    assert torch.equal(back["big"], state["big"]) and torch.equal(back["small"], state["small"])
    with pytest.raises(CorruptCheckpointError):  # the file itself is now damaged, and a new load says so
        certckpt.load(p, trusted_keys=keys["trusted"], mmap=True)


def test_finding1_an_unkeyed_mmap_load_still_maps_the_file(tmp_path, keys):
    p = tmp_path / "ck.safetensors"
    state = _state()
    certckpt.save(state, p, signing_key=keys["signing"])
    back = certckpt.load(p, trusted_keys=None, mmap=True)
    assert torch.equal(back["big"], state["big"]) and back["step"] == 4
    _overwrite_data_in_place(p)
    if sys.platform.startswith("linux"):  # a private mapping's untouched pages follow the file (as documented)
        assert not torch.equal(back["big"], state["big"])


def test_finding1_keyed_mmap_still_refuses_what_is_not_a_local_file(tmp_path, keys):
    import io

    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p, signing_key=keys["signing"])
    with pytest.raises(ConfigurationError, match="mmap=True needs a local file"):
        certckpt.load(io.BytesIO(p.read_bytes()), trusted_keys=keys["trusted"], mmap=True)
