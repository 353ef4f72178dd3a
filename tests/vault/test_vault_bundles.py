"""Multi-file checkpoints in the vault: a sharded DCP directory (written by ``certckpt.dcp.CertifiedWriter``
in one process) and a file certifying its companions (the Hugging Face Trainer's layout) are promoted
member by member (the manifest or listing file last), checked whole, repaired file by file, pruned
manifest first, restored and drilled without torch.distributed.

Runs without the auditor: their checkpoints are verified, not trusted, so the vault calls use
``accept="verified"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import certckpt
from certckpt.dcp import CertifiedWriter
from certckpt.detect.launch import importable
from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError
from certckpt.format.header import canonical_json
from certckpt.format.sharded.manifest import read_manifest
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import check_file
from certckpt.vault import drill_restore, holdings, promote, prune, restore
from certckpt.vault.bundles import bundle_of
from certckpt.vault.retention import KeepLatest
from tests.support.helpers import console_script

KINDS = ("sharded", "companions")


def build() -> torch.nn.Module:
    """The drill's model factory (also used by the CLI drill, as ``--model tests.vault.test_vault_bundles:build``)."""
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def evaluate(model) -> dict[str, float]:
    with torch.no_grad():
        return {"out": float(model(torch.ones(1, 3)).sum())}


def _weights(step: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(step)
    return build().state_dict()


def _sharded(store, step: int) -> None:
    state = {"model": _weights(step), "epoch": step}
    dcp.save(
        state, storage_writer=CertifiedWriter(str(store / f"step{step}"), ledger=str(store), step=step), no_dist=True
    )


def _companions(store, step: int) -> None:
    d = store / f"checkpoint-{step}"
    d.mkdir(parents=True)
    w = certckpt.save(_weights(step), d / "model.safetensors")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    files = {
        "model.safetensors": {"bytes": (d / "model.safetensors").stat().st_size, "header_digest": w.header_digest},
        "trainer_state.json": {
            "bytes": (d / "trainer_state.json").stat().st_size,
            "xxh3": xxhash.xxh3_128_hexdigest((d / "trainer_state.json").read_bytes()),
        },
    }
    meta = {"layout": "test-trainer/1", "files": json.dumps(files, sort_keys=True, separators=(",", ":"))}
    certckpt.save({"optim": torch.ones(2)}, d / "trainer.safetensors", ledger=str(store), step=step, metadata=meta)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run store per kind, checkpoints at steps 5 and 10 (built once)."""
    import warnings

    out = {}
    for kind, make in (("sharded", _sharded), ("companions", _companions)):
        store = tmp_path_factory.mktemp(kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's "torch.distributed is disabled ... single process"
            for step in (5, 10):
                make(store, step)
        out[kind] = str(store)
    return out


@pytest.fixture
def run_of(runs, tmp_path):
    import shutil

    def copy(kind: str) -> str:
        dst = tmp_path / f"run-{kind}"
        shutil.copytree(runs[kind], dst)
        return str(dst)

    return copy


def _held(vault: str, kind: str, cid: str = "main@10") -> tuple[str, str]:
    """(the held directory, the member a test damages)."""
    return os.path.join(vault, cid), "shard-00000.safetensors" if kind == "sharded" else "trainer_state.json"


def _flip(path: str) -> None:
    os.chmod(path, 0o644)  # vault copies are read-only; an attacker with write access changes that
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("kind", KINDS)
def test_promote_copies_every_member_verify_names_a_damaged_one_and_repair_replaces_only_it(kind, run_of, tmp_path):
    run, vault = run_of(kind), str(tmp_path / "vault")
    done = promote(run, vault, accept="verified")
    assert [p.ckpt_id for p in done] == ["main@5", "main@10"] and all(p.written for p in done)
    held, member = _held(vault, kind)
    snap = Ledger(vault).snapshot()
    h = snap.holdings["main@10"]
    if kind == "sharded":
        assert h["url"] == "main@10" and h["layout"]["files"][-1] == "manifest.safetensors"
        assert sorted(os.listdir(held)) == ["manifest.safetensors", "shard-00000.safetensors"]
    else:
        assert h["url"] == "main@10/trainer.safetensors" and h["layout"]["files"][-1] == "trainer.safetensors"
        assert sorted(os.listdir(held)) == ["model.safetensors", "trainer.safetensors", "trainer_state.json"]
    assert not snap.invalid and all(not os.stat(os.path.join(held, n)).st_mode & 0o222 for n in os.listdir(held))
    # promoting again writes nothing
    assert promote(run, vault, ckpts=["main@10"], accept="verified")[0].written is False

    _, rows = holdings(vault, verify=True)
    assert [r["copy"] for r in rows] == ["ok", "ok"]
    other = next(n for n in os.listdir(held) if n != member)
    before = os.stat(os.path.join(held, other)).st_ino
    _flip(os.path.join(held, member))
    _, rows = holdings(vault, verify=True)
    row = {r["ckpt_id"]: r for r in rows}
    assert row["main@5"]["copy"] == "ok" and member in row["main@10"]["copy"]
    r = subprocess.run(
        [console_script("certckpt"), "vault", "ls", "--verify", vault], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and member in r.stdout, r.stdout + r.stderr

    fixed = promote(run, vault, repair=True, accept="verified")
    assert [(p.ckpt_id, member in (p.repaired or "")) for p in fixed] == [("main@10", True)]
    assert os.stat(os.path.join(held, other)).st_ino == before  # only the damaged member was rewritten
    _, rows = holdings(vault, verify=True)
    assert [r["copy"] for r in rows] == ["ok", "ok"]
    # the manifest or listing file itself damaged: named, and repaired last
    marker = "manifest.safetensors" if kind == "sharded" else "trainer.safetensors"
    _flip(os.path.join(held, marker))
    _, rows = holdings(vault, verify=True)
    assert marker in {r["ckpt_id"]: r for r in rows}["main@10"]["copy"]
    assert [p.ckpt_id for p in promote(run, vault, repair=True, accept="verified")] == ["main@10"]
    _, rows = holdings(vault, verify=True)
    assert [r["copy"] for r in rows] == ["ok", "ok"]


@pytest.mark.parametrize("kind", KINDS)
def test_restore_latest_good_copies_the_whole_and_the_drill_loads_it_without_distributed(kind, run_of, tmp_path):
    run, vault = run_of(kind), str(tmp_path / "vault")
    promote(run, vault, accept="verified")
    out = tmp_path / "out"
    out.mkdir()
    r = restore(vault, "latest-good", str(out), accept="verified")
    assert r.ckpt_id == "main@10" and r.written
    directory = out / "main@10"
    if kind == "sharded":
        assert r.dest == str(directory) and sorted(os.listdir(directory)) == [
            "manifest.safetensors",
            "shard-00000.safetensors",
        ]
    else:
        assert r.dest == str(directory / "trainer.safetensors") and len(os.listdir(directory)) == 3
    rec = Ledger(vault).snapshot().records["main@10"]
    assert check_file(r.dest, rec["header_digest"], committed=rec) is None
    # again: already there, nothing written; into a directory holding other files: refused
    assert restore(vault, "main@10", str(out), accept="verified").written is False
    busy = tmp_path / "busy" / "main@10"  # restoring into busy/ puts the checkpoint in busy/main@10/
    busy.mkdir(parents=True)
    (busy / "notes.txt").write_text("x")
    with pytest.raises(CheckpointExistsError, match="holds other files"):
        restore(vault, "main@10", str(tmp_path / "busy"), accept="verified")
    assert os.listdir(busy) == ["notes.txt"]

    result = drill_restore(vault, model_factory=build, eval_fn=evaluate, accept="verified", record=False)
    assert result.ckpt_id == "main@10" and result.step == 10, result.stages
    assert result.stages["bytes"]["ok"] and result.stages["fingerprints"]["ok"], result.stages
    assert result.stages["load"]["ok"], result.stages
    want = "assembled from its shards" if kind == "sharded" else "from model.safetensors"
    assert want in result.stages["load"]["detail"]
    model = build()
    model.load_state_dict(_weights(10))
    assert result.metrics == evaluate(model.eval())  # the restored model is step 10's, bit for bit
    assert result.outcome == "incomplete"  # no reference metrics given


def test_cli_drill_of_a_sharded_vault_passes_with_a_reference(run_of, tmp_path):
    run, vault = run_of("sharded"), str(tmp_path / "vault")
    promote(run, vault, accept="verified")
    model = build()
    model.load_state_dict(_weights(10))
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"10": evaluate(model.eval())}))
    (model, root), (evaluation, _) = importable(build), importable(evaluate)  # "tests.vault.test_vault_bundles:build"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [console_script("certckpt"), "drill", "restore", vault, "--model", model]
        + ["--eval", evaluation, "--reference", str(ref), "--accept", "verified"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0 and "outcome: PASS" in r.stdout, r.stdout + r.stderr
    assert "assembled from its shards" in r.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_prune_deletes_the_manifest_or_listing_file_first_then_the_members(kind, run_of, tmp_path):
    run, vault = run_of(kind), str(tmp_path / "vault")
    promote(run, vault, accept="verified")
    held, _ = _held(vault, kind, "main@5")
    marker = "manifest.safetensors" if kind == "sharded" else "trainer.safetensors"
    deleted: list[str] = []

    def hook(event, args):  # the real unlinks, in order (an audit hook observes, it replaces nothing)
        if event == "os.remove" and str(args[0]).startswith(held):
            deleted.append(os.path.basename(str(args[0])))

    sys.addaudithook(hook)  # stays for the process (hooks cannot be removed); it only sees this tmp path
    res = prune(vault, KeepLatest(1), apply=True)
    assert res.deleted == ["main@5"] and not res.refused
    assert deleted[0] == marker and sorted(deleted) == sorted(
        Ledger(vault).snapshot().holdings["main@5"]["layout"]["files"]
    )
    assert not os.path.exists(held)
    with pytest.raises(CheckpointNotFoundError, match="pruned"):
        restore(vault, "main@5", str(tmp_path / "x"), accept="verified")
    _, rows = holdings(vault, verify=True)
    assert [(r["ckpt_id"], r["pruned"], r.get("copy")) for r in rows] == [
        ("main@5", True, None),
        ("main@10", False, "ok"),
    ]


def test_hostile_member_lists_and_holdings_are_refused(run_of, tmp_path):
    run, vault = run_of("sharded"), str(tmp_path / "vault")
    promote(run, vault, ckpts=["main@5"], accept="verified")
    # a holding naming a file outside its own held directory is not a holding
    ledger = Ledger(vault)
    rec = ledger.snapshot().holdings["main@5"]
    bad = dict(rec, ckpt_id="main@10", step=10, url="main@10/../main@5")
    ledger.put_raw("holdings", "main@10.json", json.dumps(bad).encode())
    snap = Ledger(vault).snapshot()
    assert "main@10" not in snap.holdings and any("main@10/../main@5" in why for _, why in snap.invalid)
    with pytest.raises(CheckpointNotFoundError, match="holds no checkpoint 'main@10'"):
        restore(vault, "main@10", str(tmp_path / "out"), accept="verified")

    # a manifest naming a shard outside its directory: refused before any name is used
    d = tmp_path / "evil"
    d.mkdir()
    manifest, _ = read_manifest(os.path.join(run, "step10"))
    doc = manifest.to_doc()
    doc["files"][0]["name"] = "../outside.safetensors"
    data = torch.frombuffer(bytearray(canonical_json(doc).encode("ascii")), dtype=torch.uint8)
    w = certckpt.save(
        {"certckpt.dcp.manifest": data},
        d / "manifest.safetensors",
        metadata={"certckpt.dcp": "1", "state_fp": manifest.state_fp},
    )
    with pytest.raises(CorruptCheckpointError, match="malformed manifest: file entry 0"):
        bundle_of(str(d), header_digest=w.header_digest)
    # a listing file naming a companion outside its directory
    meta = {"layout": "x", "files": json.dumps({"../../etc/passwd": {"bytes": 1, "xxh3": "0" * 32}})}
    w = certckpt.save({"a": torch.ones(1)}, d / "t.safetensors", metadata=meta)
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        bundle_of(str(d / "t.safetensors"), header_digest=w.header_digest)
    # a manifest or listing file that is not the committed one: its list is not trusted
    with pytest.raises(CorruptCheckpointError, match="not the file that was committed"):
        bundle_of(os.path.join(run, "step10"), header_digest="0" * 32)


@pytest.mark.slow
def test_s3_vault_promotes_restores_and_prunes_both_kinds_under_object_lock(run_of, s3_server, tmp_path):
    import time
    import uuid

    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    bucket = f"vault-{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=bucket, ObjectLockEnabledForBucket=True)
    for kind in KINDS:
        run, vault = run_of(kind), f"s3://{bucket}/{kind}"
        # sharded: main@5 locked for a week; companions: for two seconds
        promote(run, vault, ckpts=["main@5"], accept="verified", retain_days=7 if kind == "sharded" else 2 / 86400)
        promote(run, vault, ckpts=["main@10"], accept="verified", retain_days=7)
        marker = "manifest.safetensors" if kind == "sharded" else "trainer.safetensors"
        head = fs.call_s3("head_object", Bucket=bucket, Key=f"{kind}/main@10/{marker}")
        assert head["ObjectLockMode"] == "GOVERNANCE"
        _, rows = holdings(vault, verify=True)
        assert [r["copy"] for r in rows] == ["ok", "ok"]
        r = restore(vault, "latest-good", str(tmp_path / f"out-{kind}") + "/", accept="verified")
        rec = Ledger(vault).snapshot().records["main@10"]
        assert r.ckpt_id == "main@10" and check_file(r.dest, rec["header_digest"], committed=rec) is None
    time.sleep(2.5)
    for kind in KINDS:
        vault = f"s3://{bucket}/{kind}"
        res = prune(vault, KeepLatest(0), apply=True)
        assert res.plan.guarded == {"main@10": "latest-good"}
        fs.invalidate_cache()
        listing = fs.call_s3("list_object_versions", Bucket=bucket, Prefix=f"{kind}/main@5/")
        if kind == "sharded":  # still locked: refused before anything was deleted, still held whole
            assert "Object Lock GOVERNANCE retention until" in res.refused["main@5"] and not res.deleted
            assert len(listing.get("Versions", [])) == 2 and not listing.get("DeleteMarkers")
            _, rows = holdings(vault, verify=True)
            assert [(r["pruned"], r["copy"]) for r in rows] == [(False, "ok"), (False, "ok")]
        else:  # retention over: every file goes, every version, not hidden behind delete markers
            assert res.deleted == ["main@5"] and not res.refused
            assert not listing.get("Versions") and not listing.get("DeleteMarkers")
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_s3_prune_refuses_a_held_directory_whose_member_is_under_legal_hold_before_deleting_anything(run_of, s3_server):
    import time
    import uuid

    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    bucket = f"vault-{uuid.uuid4().hex[:12]}"
    fs.call_s3("create_bucket", Bucket=bucket, ObjectLockEnabledForBucket=True)
    run, vault = run_of("sharded"), f"s3://{bucket}/sharded"
    promote(run, vault, ckpts=["main@5"], accept="verified", retain_days=2 / 86400)  # retention: 2 seconds
    promote(run, vault, ckpts=["main@10"], accept="verified", retain_days=7)
    listing = fs.call_s3("list_object_versions", Bucket=bucket, Prefix="sharded/main@5/")
    member = next(v["Key"] for v in listing["Versions"] if not v["Key"].endswith("manifest.safetensors"))
    # a legal hold on one shard file (no date: it outlives the retention)
    fs.call_s3("put_object_legal_hold", Bucket=bucket, Key=member, LegalHold={"Status": "ON"})
    time.sleep(2.5)
    res = prune(vault, KeepLatest(0), apply=True)
    assert "legal hold" in res.refused["main@5"] and member.rsplit("/", 1)[-1] in res.refused["main@5"]
    assert not res.deleted
    fs.invalidate_cache()
    after = fs.call_s3("list_object_versions", Bucket=bucket, Prefix="sharded/main@5/")
    assert len(after["Versions"]) == len(listing["Versions"]) and not after.get("DeleteMarkers")  # manifest kept
    _, rows = holdings(vault, verify=True)
    assert [(r["ckpt_id"], r["pruned"], r["copy"]) for r in rows] == [("main@5", False, "ok"), ("main@10", False, "ok")]
    # the hold lifted, the same prune deletes the directory, every version of every file
    fs.call_s3("put_object_legal_hold", Bucket=bucket, Key=member, LegalHold={"Status": "OFF"})
    res = prune(vault, KeepLatest(0), apply=True)
    assert res.deleted == ["main@5"] and not res.refused
    fs.invalidate_cache()
    gone = fs.call_s3("list_object_versions", Bucket=bucket, Prefix="sharded/main@5/")
    assert not gone.get("Versions") and not gone.get("DeleteMarkers")
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_certified_writer_with_overwrite_never_touches_a_held_copy(run_of, tmp_path):
    from certckpt.errors import ProtectedCheckpointError

    run, vault = run_of("sharded"), str(tmp_path / "vault")
    promote(run, vault, accept="verified")
    held = os.path.join(vault, "main@10")

    def contents() -> dict[str, bytes]:
        out = {}
        for n in os.listdir(held):
            with open(os.path.join(held, n), "rb") as fh:
                out[n] = fh.read()
        return out

    before = contents()
    with pytest.raises(BaseException) as got:  # DCP's CheckpointException is a BaseException
        dcp.save({"model": _weights(99)}, storage_writer=CertifiedWriter(held, overwrite=True), no_dist=True)
    assert "inside the vault" in str(got.value) and (
        isinstance(got.value, ProtectedCheckpointError) or "ProtectedCheckpointError" in str(got.value)
    )
    assert contents() == before
    assert check_file(held, None) is None  # the held copy still verifies whole
