"""The vault on real S3-protocol servers on 127.0.0.1, through s3fs: moto's standalone server and a real
SeaweedFS (each test on both, except where marked ``moto_only``).

The bucket has Object Lock enabled, as a production vault's should.
"""

import datetime
import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

import certckpt
from certckpt.errors import CheckpointExistsError, StorageError
from certckpt.storage.s3 import precondition_failed
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import find_latest_good
from certckpt.vault import copy_once, holdings, promote, prune, restore
from certckpt.vault.retention import KeepLatest
from tests.support.helpers import console_script
from tests.support.s3 import moto_only

pytestmark = pytest.mark.slow


@pytest.fixture
def lock_bucket(s3_server):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"vault-{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=name, ObjectLockEnabledForBucket=True)
    yield name, fs
    s3fs.S3FileSystem.clear_instance_cache()


def versions(fs, bucket, key):
    out = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=key)
    return [v for v in out.get("Versions", []) if v["Key"] == key]


def test_promote_locks_objects_refuses_overwrite_and_locked_deletes(copy_run, lock_bucket, tmp_path):
    bucket, fs = lock_bucket
    run, vault = copy_run("faulty"), f"s3://{bucket}/run1"
    done = promote(run, vault, retain_days=7)
    assert [p.ckpt_id for p in done] == ["main@5", "main@10"]
    key = "run1/main@10.safetensors"
    head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    assert head["ObjectLockMode"] == "GOVERNANCE"
    until = head["ObjectLockRetainUntilDate"]
    assert (
        datetime.timedelta(days=6.9)
        < until - datetime.datetime.now(datetime.timezone.utc)
        < datetime.timedelta(days=7.1)
    )
    assert done[1].lock["version_id"] == head["VersionId"]
    # overwrite refused by the server (create-only PUT)
    stranger = tmp_path / "other.bin"
    stranger.write_bytes(b"not a checkpoint")
    with pytest.raises(OSError) as refused:  # FileExistsError on moto and AWS; see precondition_failed
        fs.put_file(str(stranger), f"{bucket}/{key}", mode="create")
    assert isinstance(refused.value, FileExistsError) or precondition_failed(refused.value)
    # deleting the locked version is refused by the server
    with pytest.raises(PermissionError):
        fs.call_s3("delete_object", Bucket=bucket, Key=key, VersionId=head["VersionId"])
    assert len(versions(fs, bucket, key)) == 1
    # the vault certifies from its mirrored evidence; latest-good precedes the suspect interval
    status, good = find_latest_good(vault)
    assert good == "main@10" and status.entry(good).url == f"{vault}/main@10.safetensors"
    r = restore(vault, "latest-good", str(tmp_path / "node") + "/")
    assert certckpt.load(r.dest)["step"] == 10
    # the incident the training job opened is mirrored: retention deletes nothing while it is open
    res = prune(vault, KeepLatest(0), apply=True)
    assert res.deleted == [] and res.plan.blocked_by == ["inc-main-20-replay"]


def test_prune_deletes_every_version_once_retention_expires_and_never_a_locked_one(copy_run, lock_bucket):
    bucket, fs = lock_bucket
    run, vault = copy_run("clean"), f"s3://{bucket}/run1"
    promote(run, vault, ckpts=["main@5"], retain_days=7)
    short = promote(run, vault, retain_days=2 / 86400)  # the others: two seconds from each one's upload
    # wait for the event itself, the last of those dates (as the store reported them) going by
    last = max(datetime.datetime.fromisoformat(p.lock["retain_until"]) for p in short if p.lock)
    time.sleep(max(0.0, (last - datetime.datetime.now(datetime.timezone.utc)).total_seconds()) + 0.5)
    res = prune(vault, KeepLatest(0), apply=True)
    assert res.deleted == ["main@10", "main@15", "main@20", "main@25"] and res.plan.guarded == {
        "main@30": "latest-good"
    }
    # what Object Lock still protects is reported, kept, and not marked pruned
    assert "Object Lock GOVERNANCE retention until" in res.refused["main@5"]
    assert versions(fs, bucket, "run1/main@5.safetensors")
    assert versions(fs, bucket, "run1/main@10.safetensors") == []  # gone, not hidden behind a delete marker
    _, rows = holdings(vault)
    assert {r["ckpt_id"] for r in rows if r["pruned"]} == {"main@10", "main@15", "main@20", "main@25"}


def test_promoting_different_content_under_a_locked_name_fails_and_changes_nothing(copy_run, lock_bucket, tmp_path):
    bucket, fs = lock_bucket
    run, vault = copy_run("clean"), f"s3://{bucket}/run1"
    squatter = tmp_path / "squatter.safetensors"
    certckpt.save({"x": __import__("torch").ones(2)}, str(squatter))
    fs.put_file(str(squatter), f"{bucket}/run1/main@10.safetensors")
    with pytest.raises(CheckpointExistsError, match="already holds different content"):
        promote(run, vault, ckpts=["main@10"])
    assert fs.cat_file(f"{bucket}/run1/main@10.safetensors") == squatter.read_bytes()
    assert "main@10" not in Ledger(vault).snapshot().holdings


def _promote_in_process(args):
    run, vault, endpoint = args
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    from certckpt.vault import promote as p

    return [(x.ckpt_id, x.written) for x in p(run, vault, ckpts=["main@10"])]


@moto_only  # 8 processes importing torch (20 s); test_storage races eight writers on SeaweedFS too
def test_eight_concurrent_promoters_one_write(copy_run, lock_bucket, s3_server):
    import multiprocessing as mp

    bucket, fs = lock_bucket
    run, vault = copy_run("clean"), f"s3://{bucket}/run1"
    with mp.get_context("spawn").Pool(8) as pool:
        results = pool.map(_promote_in_process, [(run, vault, s3_server)] * 8)
    assert sum(r[0][1] for r in results) == 1 and all(r[0][0] == "main@10" for r in results)
    assert len(versions(fs, bucket, "run1/main@10.safetensors")) == 1  # exactly one write
    assert len(versions(fs, bucket, "run1/_ledger/holdings/main@10.json")) == 1
    assert certckpt.verify(f"{vault}/main@10.safetensors", deep=True).ok


class CuttingProxy:
    """A TCP proxy to the S3 server that dies in the middle of the first checkpoint upload: it
    forwards half of that request, then drops every connection and stops listening, as a server
    that is killed mid-upload does. Everything else passes through."""

    def __init__(self, upstream_port):
        self.upstream = upstream_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.cut = threading.Event()
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.cut.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, upstream):
        try:
            while data := src.recv(1 << 16):
                if upstream and b"PUT /" in data and b".safetensors" in data.split(b"\r\n", 1)[0]:
                    dst.sendall(data[: len(data) // 2])
                    self.die()
                    return
                dst.sendall(data)
        except OSError:
            pass

    def die(self):
        self.cut.set()
        self.sock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass


@moto_only  # the client's side of a cut connection; a real cluster's crashes are issue 47's next part
def test_server_dying_mid_upload_gives_a_clear_error_no_object_and_a_retry_succeeds(
    copy_run, lock_bucket, s3_server, monkeypatch
):
    import s3fs

    bucket, fs = lock_bucket
    run, vault = copy_run("clean"), f"s3://{bucket}/run1"
    proxy = CuttingProxy(int(s3_server.rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    s3fs.S3FileSystem.clear_instance_cache()
    t0 = time.time()
    with pytest.raises(StorageError) as e:
        promote(run, vault, ckpts=["main@10"])
    assert proxy.cut.is_set() and time.time() - t0 < 60
    msg = str(e.value)
    assert "\n" not in msg and "main@10.safetensors" in msg and "nothing was published under this name" in msg
    assert "cannot reach the endpoint" in msg
    # nothing under the final name, not recorded as held
    assert not fs.exists(f"{bucket}/run1/main@10.safetensors")
    assert versions(fs, bucket, "run1/main@10.safetensors") == []
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    s3fs.S3FileSystem.clear_instance_cache()
    assert "main@10" not in Ledger(vault).snapshot().holdings
    done = promote(run, vault, ckpts=["main@10"])  # the retry
    assert done[0].written and find_latest_good(vault)[1] == "main@10"


def test_copy_once_uploads_large_files_in_parts_with_progress(lock_bucket, tmp_path):
    import torch

    bucket, fs = lock_bucket
    src = tmp_path / "big.safetensors"
    res = certckpt.save({"w": torch.randn(30 << 20)}, str(src))  # 120 MB: a multipart upload
    seen = []
    written, n = copy_once(
        str(src),
        f"s3://{bucket}/big.safetensors",
        header_digest=res.header_digest,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert written and n == os.path.getsize(src)
    assert seen and seen[-1] == (n, n)
    assert fs.cat_file(f"{bucket}/big.safetensors", start=0, end=64) == src.read_bytes()[:64]


def cli_env(**overrides):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true"
    )
    env.update(overrides)
    return env


@moto_only  # three CLI processes; two never reach the server, the missing bucket is checked on both in test_s3
def test_missing_credentials_wrong_endpoint_missing_bucket_one_line_each_nothing_written(
    copy_run, lock_bucket, s3_server, tmp_path
):
    import s3fs

    bucket, fs = lock_bucket
    run = copy_run("faulty")
    creds = dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    cases = {
        "no credentials": (
            cli_env(AWS_ENDPOINT_URL=s3_server, AWS_DEFAULT_REGION="us-east-1"),
            f"s3://{bucket}/v",
            "no credentials: set AWS_ACCESS_KEY_ID",
        ),
        # one attempt: botocore's retries of a refused connection (~6 s) only delay the same line
        # (test_remote_errors waits them out once; AWS_MAX_ATTEMPTS is a user's knob too)
        "wrong endpoint": (
            cli_env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_MAX_ATTEMPTS="1", **creds),
            f"s3://{bucket}/v",
            "cannot reach the endpoint",
        ),
        "missing bucket": (
            cli_env(AWS_ENDPOINT_URL=s3_server, **creds),
            "s3://no-such-vault-bucket/v",
            "bucket 'no-such-vault-bucket' does not exist",
        ),
    }
    ledger_before = sorted(os.walk(os.path.join(run, "_ledger")))
    for what, (env, url, expected) in cases.items():
        r = subprocess.run(
            [console_script("certckpt"), "vault", "promote", run, url],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert r.returncode == 2, (what, r.stderr)
        assert r.stderr.count("\n") == 1 and expected in r.stderr and "Traceback" not in r.stderr, (what, r.stderr)
    s3fs.S3FileSystem.clear_instance_cache()
    assert fs.ls(bucket) == []  # nothing written
    assert not fs.exists("no-such-vault-bucket")  # and no bucket created on the way
    # the run store was not touched either: the vault is checked before anything is certified
    assert sorted(os.walk(os.path.join(run, "_ledger"))) == ledger_before


def test_ls_verify_reports_a_deleted_copy_and_promote_repair_puts_it_back_locked(copy_run, lock_bucket):
    """GOVERNANCE lets a plain delete add a delete marker (the locked version stays): `vault ls`
    still lists the holding, `--verify` says it is deleted, and `--repair` uploads it again, locked."""
    bucket, fs = lock_bucket
    run, vault = copy_run("faulty"), f"s3://{bucket}/run1"
    promote(run, vault, retain_days=7)
    key = "run1/main@10.safetensors"
    fs.call_s3("delete_object", Bucket=bucket, Key=key)  # no version id: a delete marker, allowed
    fs.invalidate_cache()
    _, rows = holdings(vault)
    assert "copy" not in rows[1]  # without verify nothing is read
    _, rows = holdings(vault, verify=True)
    row = {r["ckpt_id"]: r for r in rows}["main@10"]
    assert row["versions"] == {"versions": 1, "delete_markers": 1, "deleted": True}
    assert row["copy"] != "ok"
    r = subprocess.run(
        [console_script("certckpt"), "vault", "ls", "--verify", vault], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and "deleted: a delete marker hides it" in r.stdout, r.stdout + r.stderr
    done = promote(run, vault, repair=True, retain_days=7)
    assert [(p.ckpt_id, bool(p.repaired)) for p in done] == [("main@10", True)]
    assert fs.call_s3("head_object", Bucket=bucket, Key=key)["ObjectLockMode"] == "GOVERNANCE"
    fs.invalidate_cache()
    _, rows = holdings(vault, verify=True)
    row = {r["ckpt_id"]: r for r in rows}["main@10"]
    assert row["copy"] == "ok" and row["versions"] == {"versions": 2, "delete_markers": 1, "deleted": False}
