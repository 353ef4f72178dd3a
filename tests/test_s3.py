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
    # create-only PUT: the server refuses an existing key, and the object is unchanged
    with pytest.raises(certckpt.CheckpointExistsError, match="overwrite=True"):
        certckpt.save({"w": torch.zeros(1)}, url)
    assert torch.equal(certckpt.load(url)["w"], state["w"])


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
