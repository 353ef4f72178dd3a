"""Issue 47: a promote that brings nothing new writes nothing. Every promoting process used to seal
the vault's mark again, starting one more writer chain in the vault (kept for good under Object
Lock): an hourly promote gained 8,760 writers a year. The mark is sealed again only when its seal
does not count for the promoter (keys rotated, a broken chain): doubt still re-proves, never skips."""

from __future__ import annotations

import os

import pytest
import torch

import certckpt
from certckpt.format.signing import generate_key
from certckpt.format.trustconfig import TrustConfig
from certckpt.storage import VAULT_MARK
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import find_latest_good
from certckpt.vault import promote
from tests.support.s3 import new_bucket


def _run(tmp_path, monkeypatch, *, key: str | None = None) -> str:
    """A run store with two verified checkpoints (one process, no auditor), signed with ``key``."""
    for k in [k for k in os.environ if k.startswith("CERTCKPT_") and k not in ("CERTCKPT_LOG",)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CERTCKPT_STATE_DIR", str(tmp_path / "state"))
    run = tmp_path / "run"
    run.mkdir()
    if key is not None:
        monkeypatch.setenv("CERTCKPT_SIGNING_KEY", key)
    for step in (5, 10):
        certckpt.save(
            {"w": torch.full((3,), float(step))}, str(run / f"main@{step}.safetensors"), ledger=str(run), step=step
        )
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    return str(run)


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def test_a_second_promote_with_nothing_new_writes_no_file_in_a_local_vault(tmp_path, monkeypatch):
    run, vault = _run(tmp_path, monkeypatch), str(tmp_path / "vault")
    assert [p.ckpt_id for p in promote(run, vault, accept="verified")] == ["main@5", "main@10"]
    before = _files(vault)
    assert promote(run, vault, accept="verified") == []
    assert _files(vault) == before  # not one more chain entry, certificate or mark
    assert find_latest_good(vault, accept="verified")[1] == "main@10"  # and the vault still vouches for it
    # something new is still written: a third checkpoint enters, sealed by the new promoter's chain
    certckpt.save({"w": torch.ones(3)}, os.path.join(run, "main@15.safetensors"), ledger=run, step=15)
    assert [p.ckpt_id for p in promote(run, vault, accept="verified")] == ["main@15"]
    added = _files(vault) - before
    assert "main@15.safetensors" in added and any(f.startswith("_ledger/chains/") for f in added), added


def test_a_mark_left_unsealed_by_a_crash_is_sealed_by_the_next_promote(tmp_path, monkeypatch):
    """Absence of a counting seal is not a seal: a promoter that died between writing the vault's
    mark and sealing it left a mark that counts for nothing (the run's records would count for
    nothing in the vault); the next promote finds the mark already there and seals it all the same."""
    run, vault = _run(tmp_path, monkeypatch), str(tmp_path / "vault")
    real_seal = Ledger._seal

    def dies_at_the_mark(self, scope, records):
        if any(name == VAULT_MARK for _, name, _ in records):
            raise SystemExit("killed between the mark and its seal")
        real_seal(self, scope, records)

    monkeypatch.setattr(Ledger, "_seal", dies_at_the_mark)
    with pytest.raises(SystemExit):
        promote(run, vault, accept="verified")
    monkeypatch.setattr(Ledger, "_seal", real_seal)
    snap = Ledger(vault).snapshot()
    assert snap.is_vault and not snap.mark_sealed
    assert [p.ckpt_id for p in promote(run, vault, accept="verified")] == ["main@5", "main@10"]
    assert Ledger(vault).snapshot().mark_sealed
    assert find_latest_good(vault, accept="verified")[1] == "main@10"


def test_under_trusted_keys_a_second_promote_with_nothing_new_writes_nothing_either(tmp_path, monkeypatch):
    priv, pub = generate_key(str(tmp_path / "writer"))
    run, vault = _run(tmp_path, monkeypatch, key=priv), str(tmp_path / "vault")
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", priv)
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", pub)
    trust = TrustConfig.from_env()
    assert len(promote(run, vault, accept="verified", trust=trust)) == 2
    before = _files(vault)
    assert promote(run, vault, accept="verified", trust=trust) == [] and _files(vault) == before
    snap = Ledger(vault, trust=trust).snapshot()
    assert snap.mark_sealed and snap.breaks == []
    assert find_latest_good(vault, accept="verified", trust=trust)[1] == "main@10"


@pytest.mark.slow
def test_a_second_promote_with_nothing_new_writes_no_object_in_an_s3_vault(tmp_path, monkeypatch, s3_server):
    import s3fs

    run = _run(tmp_path, monkeypatch)
    bucket = new_bucket(object_lock=True, prefix="vault")
    vault = f"s3://{bucket}/run1"
    fs = s3fs.S3FileSystem()

    def objects() -> list[tuple[str, str]]:
        """Every version and delete marker in the bucket: what Object Lock would keep."""
        out = fs.call_s3("list_object_versions", Bucket=bucket)
        assert not out.get("IsTruncated")
        return sorted((v["Key"], v["VersionId"]) for v in out.get("Versions", []) + out.get("DeleteMarkers", []))

    assert len(promote(run, vault, accept="verified")) == 2
    before = objects()
    assert promote(run, vault, accept="verified") == []
    assert objects() == before
    assert find_latest_good(vault, accept="verified")[1] == "main@10"
