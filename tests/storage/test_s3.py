"""save / load / verify on s3:// through s3fs against a real S3-protocol server on 127.0.0.1."""

import pytest
import torch

import certckpt


def test_s3_roundtrip_and_create_only(s3_bucket):
    url = f"{s3_bucket}/run/step10.safetensors"
    state = {"w": torch.randn(64, 64), "step": 10}
    certckpt.save(state, url, step=10)
    out = certckpt.load(url)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 10
    report = certckpt.verify(url, deep=True)
    assert report.ok and report.info.record.step == 10
    # overwrite=False: a create-only PUT, the server refuses an existing key, the object is unchanged
    with pytest.raises(certckpt.CheckpointExistsError, match="overwrite=True"):
        certckpt.save({"w": torch.zeros(1)}, url, overwrite=False)
    assert torch.equal(certckpt.load(url)["w"], state["w"])
    # a plain save replaces, like torch.save
    certckpt.save({"w": torch.zeros(1)}, url)
    assert torch.equal(certckpt.load(url)["w"], torch.zeros(1))


def test_s3_plain_save_never_replaces_a_vault_copy(s3_bucket):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    base = s3_bucket.removeprefix("s3://")
    fs.pipe_file(f"{base}/vault1/_ledger/vault.json", b'{"kind": "certckpt-vault"}')
    url = f"{s3_bucket}/vault1/copies/main@10.safetensors"
    certckpt.save({"w": torch.ones(2)}, url)  # a new name: nothing to replace
    with pytest.raises(certckpt.ProtectedCheckpointError, match="inside the vault"):
        certckpt.save({"w": torch.zeros(2)}, url)
    assert torch.equal(certckpt.load(url)["w"], torch.ones(2))


def test_s3_missing_bucket_is_one_clear_error_and_creates_nothing(s3_server):
    import s3fs

    with pytest.raises(certckpt.StorageError) as ei:
        certckpt.save({"w": torch.ones(1)}, "s3://certckpt-no-such-bucket/x.safetensors")
    assert "no-such-bucket" in str(ei.value)
    s3fs.S3FileSystem.clear_instance_cache()
    assert not s3fs.S3FileSystem().exists("certckpt-no-such-bucket")


def test_s3_missing_object(s3_bucket):
    with pytest.raises(certckpt.CheckpointNotFoundError):
        certckpt.verify(f"{s3_bucket}/nope.safetensors")


def test_ledger_on_s3_is_create_only(s3_bucket):
    from certckpt.trust.ledger import Ledger
    from certckpt.trust.runstore import certify_store

    store = f"{s3_bucket}/run"
    certckpt.save({"w": torch.ones(2)}, f"{store}/step10.safetensors", step=10)
    led = Ledger(store)
    led.commit_checkpoint(branch="main", step=10, location=f"{store}/step10.safetensors", consensus_fp="0" * 16)
    with pytest.raises(certckpt.CheckpointExistsError):
        led.commit_checkpoint(branch="main", step=10, location=f"{store}/elsewhere.safetensors")
    led.append_events(
        [
            {
                "branch": "main",
                "step": 10,
                "kind": k,
                "outcome": "pass",
                "details": {"fp": "0" * 16} if k == "consensus" else {},
                "suspect_ranks": [],
                "contained": False,
            }
            for k in ("replay", "nonfinite", "consensus")
        ]
    )
    st = certify_store(store)
    assert st.certification.latest_good == "main@10" and st.uncommitted == []
    assert len(led.snapshot().certificates) == 1
