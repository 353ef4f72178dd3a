"""The suite's S3 servers, by name: ``moto`` (moto's standalone server, a mock that agrees with what
it was taught) and ``seaweedfs`` (a real object store with Object Lock, tests/support/seaweed.py).

Both are started once per pytest process (session fixtures in tests/conftest.py) and accept the same
credentials; ``use_s3`` points one test at one of them (the environment s3fs and the CLI read).
"""

from __future__ import annotations

import uuid

import pytest

S3_BACKENDS = ("moto", "seaweedfs")
# A test whose store behaviour cannot differ between the two (the request never reaches the server, or
# what it checks is the client's, and SeaweedFS would only repeat it at a cost the CI's 15 minutes
# cannot spare) runs on moto alone: ``@moto_only``. docs/operations.md lists which tests do.
moto_only = pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
ACCESS_KEY = SECRET_KEY = "testing"  # what both servers accept (tests pass them to CLI processes)


def use_s3(request: pytest.FixtureRequest, backend: str) -> str:
    """Point this test's environment (and s3fs) at the ``backend`` server; returns its endpoint."""
    import s3fs

    env = request.getfixturevalue(f"{backend}_server")
    mp = request.getfixturevalue("monkeypatch")
    for k, v in env.items():
        mp.setenv(k, v)
    # s3fs caches one filesystem per set of arguments, not per endpoint: drop the other server's
    s3fs.S3FileSystem.clear_instance_cache()
    request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)
    return str(env["AWS_ENDPOINT_URL"])


def new_bucket(*, object_lock: bool = False, prefix: str = "certckpt") -> str:
    """A new bucket on the server the environment names; returns its name."""
    import s3fs

    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem()
    if object_lock:
        fs.call_s3("create_bucket", Bucket=name, ObjectLockEnabledForBucket=True)
    else:
        fs.call_s3("create_bucket", Bucket=name)
    fs.invalidate_cache()
    return name
