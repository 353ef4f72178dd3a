"""One trust configuration (certckpt.TrustConfig): library calls take it explicitly; the environment is
read in one place, ``TrustConfig.from_env()``."""

from __future__ import annotations

import os

import pytest
import torch

import certckpt
from certckpt import TrustConfig
from certckpt.errors import ConfigurationError, UntrustedCheckpointError
from certckpt.format.signing import SigningKey, TrustedKeys, generate_key
from certckpt.trust.ledger import Ledger


@pytest.fixture
def keys(tmp_path):
    priv, pub = generate_key(tmp_path / "keys" / "k")
    _, other = generate_key(tmp_path / "keys" / "other")
    return {"priv": priv, "pub": pub, "other": other}


def test_from_env_reads_the_three_variables_and_nothing_else_does(tmp_path, keys, monkeypatch):
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["pub"])
    monkeypatch.setenv("CERTCKPT_NO_MMAP", "1")
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "mem"))
    cfg = TrustConfig.from_env()
    assert cfg.trusted_keys is not None and not cfg.mmap and cfg.memory_dir == str(tmp_path / "mem")
    assert TrustConfig().memory_dir.endswith(os.path.join(".cache", "certckpt", "ledgers"))
    assert TrustConfig().with_keys(keys["pub"]).trusted_keys == cfg.trusted_keys
    with pytest.raises(ConfigurationError, match="TrustedKeys or None"):
        TrustConfig(trusted_keys=keys["pub"])  # a path is loaded with with_keys, never taken for keys


def test_an_explicit_configuration_wins_over_the_environment_for_reads_and_memory(tmp_path, keys, monkeypatch):
    store = tmp_path / "run"
    store.mkdir()
    key = SigningKey.load(keys["priv"])
    led = Ledger(str(store), signing_key=key, trusted_keys=None)
    certckpt.save({"w": torch.ones(3)}, str(store / "s5.safetensors"), ledger=led, step=5, signing_key=key)
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", keys["other"])  # the environment trusts another key
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "env-mem"))
    mine = TrustConfig(trusted_keys=TrustedKeys.load([keys["pub"]]), state_dir=str(tmp_path / "my-mem"))
    _, chosen = certckpt.find_latest_good(str(store), accept="verified", trust=mine)
    assert chosen == "main@5"
    assert os.listdir(tmp_path / "my-mem") and not (tmp_path / "env-mem").exists()  # memory where it was told
    _, by_env = certckpt.find_latest_good(str(store), accept="verified")  # the environment's key: nothing counts
    assert by_env is None


def test_load_and_verify_take_the_configuration_and_the_same_key_forms(tmp_path, keys):
    signed, plain = tmp_path / "signed.safetensors", tmp_path / "plain.safetensors"
    certckpt.save({"w": torch.ones(3)}, str(signed), signing_key=SigningKey.load(keys["priv"]))
    certckpt.save({"w": torch.ones(3)}, str(plain), signing_key=None)
    mine = TrustConfig().with_keys(keys["pub"])
    assert certckpt.verify(str(signed), trust=mine).ok and not certckpt.verify(str(plain), trust=mine).ok
    assert certckpt.load(str(signed), trust=mine)["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(UntrustedCheckpointError):
        certckpt.load(str(plain), trust=mine)
    assert certckpt.verify(str(signed), trusted_keys=keys["pub"]).ok  # the form load takes too
