"""Issue 45, item 6: ``certckpt vault promote`` with trusted keys but no signing key (or one the
trusted keys do not list) is refused before anything is copied, in one line naming the cause (the
vault's own records would be unsigned, so under trusted keys they certify nothing) and the fix
(``CERTCKPT_SIGNING_KEY`` for the promoter), exit 2; with the key set the same promotion works."""

from __future__ import annotations

import os

import torch
from click.testing import CliRunner

import certckpt
from certckpt.format.signing import generate_key
from certckpt_cli.main import main


def _signed_run(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("CERTCKPT_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))
    priv, pub = generate_key(str(tmp_path / "writer"))
    other_priv, _ = generate_key(str(tmp_path / "other"))
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", priv)
    certckpt.save({"model": {"w": torch.ones(3)}}, str(run / "main@5.safetensors"), ledger=str(run), step=5)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY")
    return run, priv, pub, other_priv


def test_vault_promote_with_trusted_keys_and_no_signing_key_says_why_and_copies_nothing(tmp_path, monkeypatch):
    run, priv, pub, other_priv = _signed_run(tmp_path, monkeypatch)
    vault = tmp_path / "vault"
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", pub)
    runner = CliRunner()
    r = runner.invoke(main, ["vault", "promote", str(run), str(vault), "--accept", "verified"])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert "no signing key" in line and "unsigned record certifies nothing" in line, line
    assert "set CERTCKPT_SIGNING_KEY" in line and "Nothing was copied" in line
    assert not vault.exists()  # nothing copied, not even the vault's mark

    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", other_priv)  # a key the trusted keys do not list
    r = runner.invoke(main, ["vault", "promote", str(run), str(vault), "--accept", "verified"])
    assert r.exit_code == 2 and "is not among the trusted keys" in r.output and r.output.count("\n") == 1, r.output
    assert not vault.exists()

    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", priv)  # the fix the line names
    r = runner.invoke(main, ["vault", "promote", str(run), str(vault), "--accept", "verified"])
    assert r.exit_code == 0 and "main@5" in r.output, r.output
