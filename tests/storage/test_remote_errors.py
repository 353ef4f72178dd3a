"""Object-store failures as one line and exit 2 (issue 18, part 5): no credentials, a refused
endpoint, a missing bucket; ``certckpt.load`` raises ``StorageError`` (a refused connection is named
as such, never "file not found")."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.helpers import console_script
from tests.support.s3 import moto_only

# starts the S3 server and a dozen CLI processes; on moto only: none of these requests is answered by
# the server's storage (no credentials and a refused endpoint never reach it; the missing bucket is
# also checked on SeaweedFS in test_s3.py and test_storage.py)
pytestmark = pytest.mark.slow


def cli_env(**overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true"
    )
    env.update(overrides)
    return env


CREDS = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")


def _cases(s3_server, bucket):
    return {
        "no credentials": (
            cli_env(AWS_ENDPOINT_URL=s3_server, AWS_DEFAULT_REGION="us-east-1"),
            f"s3://{bucket}/run",
            "no credentials",
        ),
        "refused endpoint": (
            cli_env(AWS_ENDPOINT_URL="http://127.0.0.1:9", **CREDS),
            f"s3://{bucket}/run",
            "cannot reach",
        ),
        "missing bucket": (cli_env(AWS_ENDPOINT_URL=s3_server, **CREDS), "s3://no-such-bucket-x/run", "bucket"),
    }


@moto_only
@pytest.mark.parametrize("what", ["no credentials", "refused endpoint", "missing bucket"])
def test_cli_reads_of_an_unusable_store_are_one_line_and_exit_2(s3_bucket, s3_server, what):
    import torch

    import certckpt

    run = f"{s3_bucket}/run"
    certckpt.save({"w": torch.ones(3)}, f"{run}/s1.safetensors", ledger=run, step=1)
    env, store, expected = _cases(s3_server, s3_bucket.removeprefix("s3://"))[what]
    for args in (
        ["verify", f"{store}/s1.safetensors"],
        ["inspect", f"{store}/s1.safetensors"],
        ["latest-good", store],
        ["status", store],
    ):
        # botocore retries a refused connection for ~12 s per command: once is enough to show the
        # line after every retry; the other commands ask for one attempt (AWS_MAX_ATTEMPTS, a user's knob too)
        quick = {} if args[0] == "status" else {"AWS_MAX_ATTEMPTS": "1"}
        r = subprocess.run(
            [console_script("certckpt"), *args], capture_output=True, text=True, env=env | quick, timeout=120
        )
        assert r.returncode == 2, (what, args, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (what, args, r.stderr)
        assert expected in r.stderr.lower() or expected in r.stderr, (what, args, r.stderr)
        assert what != "refused endpoint" or "not found" not in r.stderr, (args, r.stderr)


@moto_only
def test_load_of_an_unreachable_store_raises_storage_error(s3_bucket, monkeypatch):
    import s3fs

    import certckpt

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(certckpt.StorageError, match="cannot reach the endpoint") as e:
            certckpt.load(f"{s3_bucket}/none.safetensors")
        assert "not found" not in str(e.value)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
