"""The storage interface's contract, run against each backend for real: a local directory, fsspec's
in-memory filesystem, and S3 through s3fs against moto's server and a real SeaweedFS (with an Object Lock
bucket)."""

from __future__ import annotations

import datetime
import os
import uuid

import pytest

from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from certckpt.storage import LocalStorage, LockRequest, Storage, storage_for, storage_of
from certckpt.storage.fsspec_store import FsspecStorage
from certckpt.storage.s3 import S3Storage
from tests.support.s3 import S3_BACKENDS, moto_only, new_bucket, use_s3


@pytest.fixture(params=["local", "memory", *S3_BACKENDS])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        return storage_for(str(tmp_path / "store"))
    if request.param == "memory":
        return storage_for(f"memory://certckpt-{uuid.uuid4().hex[:8]}")
    use_s3(request, request.param)  # moto, or a real SeaweedFS: the contract holds on both
    return storage_for(f"s3://{new_bucket()}/store")


def test_a_walk_split_by_hints_or_skipping_a_name_lists_what_a_plain_walk_lists(storage, monkeypatch):
    """S3 lists a split walk in parts at once, each ending where it sees the next cut (pages of two
    keys here). SeaweedFS lists a directory's keys before the names that sort between them ("a/b"
    before "a.txt"), and moto in plain key order: every key is listed once either way, whatever the
    cuts (stale, unsorted, inside a skipped name) or the names planted around a skipped one."""
    import certckpt.storage.s3 as s3

    monkeypatch.setattr(s3, "_PAGE", 2)
    names = ["a/b", "a.txt", "a-c", "a0", "a/c/d", "ab", "chains/w1/1", "chains/w1/2", "chains.x", "chains-y"]
    names += ["chains0", "chains/w2/1", "chains/w1x/3", "b", "z/z"]
    for n in names:
        storage.put_once(n, n.encode())
    storage.refresh()
    plain = sorted(e.name for e in storage.walk())
    assert plain == sorted(names)
    for hint in ([], sorted(names), names[::-1], ["gone", "a/zz", "chains/w1/2", "zz"], names[::3]):
        assert sorted(e.name for e in storage.walk(hint=hint)) == plain
        assert sorted(e.name for e in storage.walk(skip=("chains",), hint=hint)) == [
            n for n in plain if not n.startswith("chains/")
        ]
        assert sorted(e.name for e in storage.walk("chains", depth=2, hint=hint)) == [
            n for n in plain if n.startswith("chains/")
        ]


@moto_only  # no request reaches the server's storage
def test_storage_for_picks_the_backend(tmp_path, s3_bucket):
    assert type(storage_for(str(tmp_path))) is LocalStorage
    assert type(storage_for(f"file://{tmp_path}")) is LocalStorage
    assert type(storage_for("memory://x")) is FsspecStorage
    assert type(storage_for(s3_bucket)) is S3Storage


def test_put_once_is_create_only_and_idempotent(storage):
    assert storage.put_once("_ledger/checkpoints/a.json", b"one") is True
    assert storage.put_once("_ledger/checkpoints/a.json", b"one") is False  # a retried write
    with pytest.raises(CheckpointExistsError, match="already exists"):
        storage.put_once("_ledger/checkpoints/a.json", b"two")
    assert storage.get("_ledger/checkpoints/a.json") == b"one"
    assert storage.get("_ledger/checkpoints/missing.json") is None


def test_publish_publishes_whole_and_refuses_an_existing_name(storage, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    storage.publish(str(src), "main@5.safetensors")
    assert storage.get("main@5.safetensors") == b"x" * 1000
    src.write_bytes(b"y" * 10)
    with pytest.raises(CheckpointExistsError):
        storage.publish(str(src), "main@5.safetensors")
    assert storage.get("main@5.safetensors") == b"x" * 1000
    storage.publish(str(src), "main@5.safetensors", create_only=False)
    storage.refresh()
    assert storage.get("main@5.safetensors") == b"y" * 10


def test_walk_lists_relative_names_skips_hidden_and_skipped(storage):
    for name in ("chains/w1/000001.json", "checkpoints/a.json", "genesis.json", ".tmp-writer", "checkpoints/.x"):
        storage.put_once(name, name.encode())
    names = sorted(e.name for e in storage.walk())
    assert names == ["chains/w1/000001.json", "checkpoints/a.json", "genesis.json"]
    assert sorted(e.name for e in storage.walk(skip=("chains",))) == ["checkpoints/a.json", "genesis.json"]
    assert [e.name for e in storage.walk("chains", depth=2)] == ["chains/w1/000001.json"]
    entry = storage.stat("genesis.json")
    assert entry is not None and entry.kind == "file" and entry.size == len(b"genesis.json") and entry.stamp
    assert ".tmp-writer" in {e.name for e in storage.walk(hidden=True)}
    assert storage.walk("nothing-here") == []
    assert storage.get_many(["genesis.json", "checkpoints/a.json", "gone.json"]) == {
        "genesis.json": b"genesis.json",
        "checkpoints/a.json": b"checkpoints/a.json",
    }


def test_get_refuses_an_object_larger_than_its_limit(storage):
    storage.put_once("big.json", b"z" * 100)
    assert storage.get("big.json", limit=100) == b"z" * 100
    with pytest.raises(StorageError, match="more than the 99"):
        storage.get("big.json", limit=99)


def test_delete_answers_and_forgets(storage):
    storage.put_once("a.json", b"a")
    assert storage.delete("a.json") is None
    storage.refresh()
    assert storage.get("a.json") is None
    assert storage.delete("a.json") is None  # already gone: nothing to refuse


def test_local_walk_reports_links_and_fifos_and_never_opens_them(tmp_path):
    root = tmp_path / "store"
    (root / "events").mkdir(parents=True)
    os.mkfifo(root / "events" / "seg.jsonl")
    os.symlink("/dev/zero", root / "genesis.json")
    (root / "a" / "b" / "c").mkdir(parents=True)
    storage = storage_for(str(root))
    kinds = {e.name: (e.kind, e.what) for e in storage.walk(depth=2)}
    assert kinds["events/seg.jsonl"] == ("special", "a FIFO")
    assert kinds["genesis.json"] == ("link", "a symbolic link")
    assert kinds["a/b"][0] == "directory"  # deeper than the walk goes: reported, not entered
    assert {e.name: e.kind for e in storage.walk(depth=2, detail=False)} == {n: k for n, (k, _) in kinds.items()}
    with pytest.raises(StorageError, match="FIFO, not a file; refused unopened"):
        storage.get("events/seg.jsonl")  # returns at once: a FIFO opened for reading would block
    with pytest.raises(StorageError, match="symbolic link, not a file; refused unopened"):
        storage.get("genesis.json")


@moto_only  # no request reaches the server's storage
def test_storage_of_splits_an_object_from_its_store(tmp_path, s3_bucket):
    st, name = storage_of(str(tmp_path / "d" / "x.json"))
    assert (type(st), st.url, name) == (LocalStorage, str(tmp_path / "d"), "x.json")
    st, name = storage_of("x.json")
    assert (st.location(name), os.path.abspath("x.json")) == ("./x.json", os.path.join(st.root, name))
    st, name = storage_of(f"{s3_bucket}/a/b.json")
    assert (type(st), st.location(name)) == (S3Storage, f"{s3_bucket}/a/b.json")
    with pytest.raises(StorageError, match="not an object inside a store"):
        storage_of("s3://just-a-bucket")


def test_s3_protection_locks_and_versions(s3_server, tmp_path):
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    name = f"certckpt-lock-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().call_s3("create_bucket", Bucket=name, ObjectLockEnabledForBucket=True)
    storage = storage_for(f"s3://{name}/vault")
    assert isinstance(storage, S3Storage)
    found = storage.protection()
    assert (found.object_lock, found.versioned, found.bucket) == (True, True, name)
    src = tmp_path / "f"
    src.write_bytes(b"held")
    day = datetime.timedelta(days=1)
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)  # stores keep whole seconds
    storage.publish(str(src), "held.bin", lock=LockRequest(mode="GOVERNANCE", retain_for=day))
    after = datetime.datetime.now(datetime.timezone.utc)
    lock = storage.lock_of("held.bin")
    assert lock is not None and lock.mode == "GOVERNANCE" and lock.active() and lock.version_id
    assert lock.retain_until is not None and before <= lock.retain_until - day <= after  # dated at the write
    assert storage.lock_of("missing.bin") is None
    versions = storage.versions("held.bin")
    assert versions is not None and (versions.versions, versions.delete_markers, versions.deleted) == (1, 0, False)
    refused = storage.delete("held.bin")  # every version is held: the store says so, nothing raised
    assert refused is not None and refused.startswith("Object Lock GOVERNANCE retention until")
    assert storage.get("held.bin") == b"held"
    storage.publish(str(src), "free.bin")
    assert storage.lock_of("free.bin") is None
    assert storage.delete("free.bin") is None
    storage.refresh()
    assert storage.get("free.bin") is None
    assert storage.versions("free.bin").versions == 0  # every version went, not just hidden by a marker


def test_s3_missing_bucket_is_one_line_with_the_fix(s3_server):
    storage = storage_for(f"s3://certckpt-absent-{uuid.uuid4().hex[:8]}/vault")
    with pytest.raises(CheckpointNotFoundError, match="does not exist; create it with Object Lock enabled"):
        storage.protection()


def test_an_object_in_a_vault_at_the_bucket_root_is_never_replaced(s3_bucket, tmp_path):
    """The vault mark is looked for in every prefix above the object, the bucket itself included."""
    from certckpt.errors import ProtectedCheckpointError
    from certckpt.storage import refuse_protected

    root = storage_for(s3_bucket)
    root.put_once("_ledger/vault.json", b"{}")
    root.put_once("main@5.safetensors", b"held")
    root.put_once("exp/main@6.safetensors", b"held")
    for url in (f"{s3_bucket}/main@5.safetensors", f"{s3_bucket}/exp/main@6.safetensors"):
        with pytest.raises(ProtectedCheckpointError, match="inside the vault"):
            refuse_protected(url)


def test_racing_create_only_writes_of_one_name_leave_one_winner(storage):
    """Eight writers put different bytes under one name at once: exactly one is written, every other
    is refused as taken (on S3 the server's If-None-Match decides; on SeaweedFS its 412 names no
    condition, see ``storage.s3.precondition_failed``), and the winner's bytes stay."""
    import threading

    if type(storage) is FsspecStorage:
        pytest.skip("a generic fsspec store's create-only write is check-then-write: not race-free (documented)")
    barrier = threading.Barrier(8)
    outcomes: dict[int, str] = {}

    def write(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = "written" if storage.put_once("_ledger/holdings/main@5.json", b"%d" % i) else "same"
        except CheckpointExistsError:
            outcomes[i] = "refused"

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcomes.items() if o == "written"]
    assert len(winners) == 1 and sorted(outcomes.values()).count("refused") == 7, outcomes
    assert storage.get("_ledger/holdings/main@5.json") == b"%d" % winners[0]
