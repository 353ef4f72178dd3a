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
from certckpt.errors import ConfigurationError, CorruptCheckpointError, UntrustedCheckpointError

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


def _forged(tmp_path, p):
    """``p`` with tensor ``big`` replaced by an xxh3 second preimage (header and signature unchanged)."""
    from tests.support.xxh3_forge import forge

    info = certckpt.inspect(p)
    e = next(e for e in info.header.entries if e.name == "big")
    raw = p.read_bytes()
    start, end = info.header.data_start + e.begin, info.header.data_start + e.end
    out = tmp_path / "forged.safetensors"
    out.write_bytes(raw[:start] + forge(raw[start:end]) + raw[end:])
    return out


KEY_FORMS = ["TrustedKeys", "path-str", "PathLike", "comma-list", "environment"]


def _form(form, keys, monkeypatch):
    from certckpt.format.signing import KEYS_FROM_ENV

    if form == "TrustedKeys":
        return keys["trusted"]
    if form == "path-str":
        return keys["pub"]
    if form == "PathLike":
        import pathlib

        return pathlib.Path(keys["pub"])
    if form == "comma-list":
        return f"{keys['other_pub']}, {keys['pub']}"
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["pub"])
    return KEYS_FROM_ENV


@pytest.mark.parametrize("form", KEY_FORMS)
def test_finding2_verify_and_load_take_the_same_trusted_keys_forms(tmp_path, keys, monkeypatch, form):
    p = tmp_path / "ck.safetensors"
    state = _state()
    certckpt.save(state, p, signing_key=keys["signing"])
    forged = _forged(tmp_path, p)
    assert certckpt.verify(forged).ok  # the forgery keeps every xxh3 digest
    tk = _form(form, keys, monkeypatch)
    report = certckpt.verify(p, trusted_keys=tk)
    assert report.ok, report.problems
    assert torch.equal(certckpt.load(p, trusted_keys=tk)["big"], state["big"])
    bad = certckpt.verify(forged, trusted_keys=tk)
    assert not bad.ok and "differs from the one signed" in bad.problems[0].message, bad.problems
    with pytest.raises(CorruptCheckpointError, match="differs from the one signed"):
        certckpt.load(forged, trusted_keys=tk)
    unsigned = tmp_path / "unsigned.safetensors"
    certckpt.save(state, unsigned)
    r = certckpt.verify(unsigned, trusted_keys=tk)
    assert not r.ok and "unsigned" in r.problems[0].message
    with pytest.raises(UntrustedCheckpointError, match="unsigned"):
        certckpt.load(unsigned, trusted_keys=tk)


@pytest.mark.parametrize("bad", [",", " , ", 3])
def test_finding2_verify_and_load_refuse_the_same_bad_trusted_keys_alike(tmp_path, keys, bad):
    p = tmp_path / "ck.safetensors"
    certckpt.save(_state(), p, signing_key=keys["signing"])
    with pytest.raises(ConfigurationError) as from_load:
        certckpt.load(p, trusted_keys=bad)
    with pytest.raises(ConfigurationError) as from_verify:
        certckpt.verify(p, trusted_keys=bad)
    assert str(from_load.value) == str(from_verify.value)


def test_finding2_verify_without_keys_ignores_the_environment_as_before(tmp_path, keys, monkeypatch):
    p = tmp_path / "u.safetensors"
    certckpt.save(_state(), p)
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["pub"])
    assert certckpt.verify(p).ok  # verify's default stays "no keys"; load's is the environment's
    with pytest.raises(UntrustedCheckpointError):
        certckpt.load(p)
