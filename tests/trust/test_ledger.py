"""The ledger and the store-level commands: status, latest-good, revoke, verify --ledger."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import certckpt
from certckpt.trust.certify import CheckpointEntry
from certckpt.trust.ledger import Ledger, LedgerSink
from certckpt_cli.main import main
from tests.support.helpers import event_dict


def test_records_are_write_once_and_read_back(memroot):
    led = Ledger(f"{memroot}/run")
    cid = led.commit_checkpoint(
        branch="main", step=10, location=f"{memroot}/run/step10.safetensors", consensus_fp="ab" * 8
    )
    assert cid == "main@10"
    with pytest.raises(certckpt.CheckpointExistsError):
        led.commit_checkpoint(branch="main", step=10, location=f"{memroot}/run/other.safetensors")
    sink = LedgerSink(led)
    sink.emit(
        {
            "branch": "main",
            "step": 10,
            "kind": "consensus",
            "outcome": "pass",
            "details": {"fp": "x"},
            "suspect_ranks": [],
            "contained": False,
        }
    )
    sink.flush()
    sink.flush()  # nothing buffered: no empty segment
    led.start_branch("b2", parent="main@10")
    led.start_branch("b2", parent="main@10")  # identical retry is a no-op
    snap = led.snapshot()
    assert [c.ckpt_id for c in snap.checkpoints] == ["main@10"] and snap.segments == 1 and len(snap.events) == 1
    assert snap.checkpoints[0].url == f"{memroot}/run/step10.safetensors"
    assert snap.records["main@10"]["url"] == "step10.safetensors"  # stored relative to the run store
    assert snap.branch_parents == {"b2": "main@10"}
    led.revoke("main@10", reason="operator said so", by="alice")
    assert led.snapshot().revocations[0].by == "alice"
    with pytest.raises(certckpt.CheckpointNotFoundError):
        led.revoke("main@99", reason="x")
    with pytest.raises(ValueError):
        led.commit_checkpoint(branch="bad/name", step=1, location="x")


def test_missing_store_and_empty_store(tmp_path):
    with pytest.raises(certckpt.CheckpointNotFoundError):
        Ledger(str(tmp_path / "nope" / "deeper")).snapshot()
    assert Ledger(str(tmp_path)).snapshot().checkpoints == []


@pytest.fixture(scope="module")
def drill_stores(tmp_path_factory):
    """Run stores left by `certckpt drill faults --dir` (3 real gloo ranks)."""
    from certckpt.detect.drill import matrix_cases, run_matrix

    d = tmp_path_factory.mktemp("drill")
    cases = [
        c
        for c in matrix_cases(audit_every=10, ckpt_every=5)
        if (c["fault"], c["timing"])
        in {("backward", "persistent"), ("forward", "one-time-between-audits"), ("non-finite", "persistent")}
        and "magnitude" not in c  # the small faults: the one between audits escapes
    ]
    run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=str(d), cases=cases)
    return d


def invoke(*args):
    return CliRunner().invoke(main, list(map(str, args)))


@pytest.mark.slow
def test_status_and_latest_good_on_a_detected_fault(drill_stores, tmp_path):
    store = tmp_path / "bp"
    shutil.copytree(drill_stores / "backward-persistent", store)
    r = invoke("status", store, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    verdicts = {c["ckpt_id"]: (c["verdict"], c["reasons"]) for c in doc["checkpoints"]}
    assert verdicts == {"main@5": ("trusted", []), "main@10": ("trusted", []), "main@15": ("suspect", ["after-fault"])}
    (det,) = doc["detections"]
    assert (det["step"], det["kind"], det["suspect_ranks"], det["suspect_interval"], det["rollback_window"]) == (
        20,
        "replay",
        [1],
        [10, 20],
        10,
    )
    r = invoke("latest-good", store, "--json")
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["ckpt_id"] == "main@10" and out["step"] == 10 and out["branch"] == "main"
    assert out["url"].endswith("step000010.safetensors") and out["verdict"] == "trusted"
    assert out["suspect_intervals"][0]["from"] == 10 and out["suspect_intervals"][0]["to"] == 20
    # certificates were recorded, one per checkpoint, and not again while nothing changes
    certs = os.listdir(store / "_ledger" / "certificates")
    assert len(certs) == 3
    invoke("status", store)
    assert len(os.listdir(store / "_ledger" / "certificates")) == 3
    # verify with the verdict
    assert invoke("verify", store / "step000015.safetensors", "--ledger", store).exit_code == 1
    r = invoke("verify", store / "step000010.safetensors", "--ledger", store)
    assert r.exit_code == 0 and "verdict: trusted" in r.output


@pytest.mark.slow
def test_latest_good_falls_back_when_bytes_fail_and_ignores_uncommitted(drill_stores, tmp_path):
    store = tmp_path / "esc"
    shutil.copytree(drill_stores / "forward-one-time-between-audits", store)  # the escape: all trusted
    assert invoke("latest-good", store).output.strip().endswith("step000030.safetensors")
    # an uncommitted file with a later step is ignored, and listed by status
    certckpt.save({"x": __import__("torch").ones(1)}, store / "step000099.safetensors", step=99)
    assert invoke("latest-good", store).output.strip().endswith("step000030.safetensors")
    assert "uncommitted (ignored)" in invoke("status", store).output
    # damage the newest: latest-good says so and falls back
    p = store / "step000030.safetensors"
    data = bytearray(p.read_bytes())
    data[-2] ^= 1
    p.write_bytes(bytes(data))
    r = invoke("latest-good", store)
    assert r.exit_code == 0 and r.stdout.strip().endswith("step000025.safetensors")
    assert "skipping main@30" in r.stderr and "digest mismatch" in r.stderr
    st = json.loads(invoke("status", store, "--json", "--verify-bytes").output)
    assert dict((c["ckpt_id"], c["reasons"]) for c in st["checkpoints"])["main@30"] == ["corrupt"]


@pytest.mark.slow
def test_revoke_and_no_trusted_checkpoint(drill_stores, tmp_path):
    store = tmp_path / "nf"
    shutil.copytree(drill_stores / "non-finite-persistent", store)
    # the non-finite fault at 13 was contained: it taints nothing
    assert invoke("latest-good", store, "--json").exit_code == 0
    r = invoke("revoke", store, "main@5", "--reason", "bad data shard", "--by", "alice")
    assert r.exit_code == 0 and "revoked main@5" in r.output
    r = invoke("latest-good", store, "--json")
    assert r.exit_code == 1
    assert "none of 2 committed checkpoints is trusted" in json.loads(r.output)["reason"]
    assert invoke("revoke", store, "main@77", "--reason", "x").exit_code == 2


def test_latest_good_on_unreadable_or_empty_store(tmp_path):
    r = invoke("latest-good", tmp_path / "missing" / "store")
    assert r.exit_code == 2 and "no such run store" in r.output
    r = invoke("latest-good", tmp_path)
    assert r.exit_code == 1 and "no committed checkpoint" in r.output


@pytest.mark.slow
def test_latest_good_does_not_import_torch(drill_stores):
    code = (
        "import sys\nfrom certckpt_cli.main import main\n"
        f"try:\n    main(['latest-good', {str(drill_stores / 'backward-persistent')!r}])\n"
        "except SystemExit as e:\n    print('exit', e.code)\n"
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "exit 0" in out.stdout, out.stderr


def test_checkpoint_entry_from_snapshot_carries_branch_parent(tmp_path):
    led = Ledger(str(tmp_path))
    led.start_branch("b2", parent="main@10")
    led.commit_checkpoint(branch="b2", step=15, location=str(tmp_path / "b2-15.safetensors"))
    (c,) = led.snapshot().checkpoints
    assert isinstance(c, CheckpointEntry) and c.parent == "main@10" and c.url == str(tmp_path / "b2-15.safetensors")


def test_files_in_subdirectories_are_recorded_relative_so_a_copied_store_still_finds_them(tmp_path):
    import torch

    from certckpt.trust.runstore import find_latest_good

    store = tmp_path / "out"
    (store / "checkpoint-5").mkdir(parents=True)
    certckpt.save({"w": torch.ones(2)}, store / "checkpoint-5" / "m.safetensors", ledger=str(store), step=5)
    rec = json.loads((store / "_ledger" / "checkpoints" / "main@5.json").read_text())
    assert rec["url"] == "checkpoint-5/m.safetensors"
    moved = tmp_path / "elsewhere"
    shutil.copytree(store, moved)
    shutil.rmtree(store)
    _, good = find_latest_good(str(moved), accept="verified", write_certificates=False)
    assert good == "main@5"


def test_a_relative_file_location_that_climbs_out_of_the_store_is_invalid(tmp_path):
    led = Ledger(str(tmp_path), signing_key=None, trusted_keys=None)
    led.commit_checkpoint(branch="main", step=5, location=str(tmp_path / "a.safetensors"))
    path = tmp_path / "_ledger" / "checkpoints" / "main@5.json"
    doc = json.loads(path.read_text())
    doc["url"] = "sub/../../outside.safetensors"
    os.chmod(path, 0o644)
    path.write_text(json.dumps(doc))
    snap = led.snapshot()
    assert snap.records == {} and "climbs out of the store" in snap.invalid[0][1]


def _stopped_before_its_chain_entry(monkeypatch, write) -> None:
    """``write()`` stopped where a crash stops it: its record written, the PUT of its chain entry failed."""
    import certckpt.trust.ledger as ledger_module
    from certckpt.errors import StorageError

    real = ledger_module.put_once

    def put_once(location: str, data: bytes) -> bool:
        if "/chains/" in location:
            raise StorageError(f"{location}: connection reset (the gateway died)")
        return real(location, data)

    with monkeypatch.context() as m:
        m.setattr(ledger_module, "put_once", put_once)
        with pytest.raises(certckpt.StorageError, match="gateway died"):
            write()


def _killed_before_its_chain_entry(led: Ledger, monkeypatch, **commit) -> bytes:
    """``led.commit_checkpoint(**commit)`` stopped before its chain entry. Returns the record's bytes,
    which nothing seals."""
    _stopped_before_its_chain_entry(monkeypatch, lambda: led.commit_checkpoint(**commit))
    return (Path(led.store) / "_ledger" / "checkpoints" / f"{commit['branch']}@{commit['step']}.json").read_bytes()


_AFTER_THE_DELETE = {
    "retired": lambda led, reason, url: led.retire("main@5", reason=reason, policy="trainer"),
    "kept": lambda led, reason, url: led.keep("main@5", url=url, replaced="main@5.safetensors", reason=reason),
}


@pytest.mark.parametrize("kind", sorted(_AFTER_THE_DELETE))
def test_a_retirement_or_keep_killed_before_its_chain_entry_counts_for_nothing_until_its_retry_completes_it(
    tmp_path, monkeypatch, kind
):
    # The Trainer's and Accelerate's rotations retire every committed checkpoint whose directory is gone,
    # on each commit: a record left unsealed by a crash used to make that retry fail, and training with it.
    store = str(tmp_path / "run")
    Ledger(store, signing_key=None).commit_checkpoint(branch="main", step=5, location=f"{store}/main@5.safetensors")
    write = _AFTER_THE_DELETE[kind]
    url = "certckpt-kept-main@5.safetensors"
    _stopped_before_its_chain_entry(monkeypatch, lambda: write(Ledger(store, signing_key=None), "rotated", url))
    path = Path(store) / "_ledger" / kind / "main@5.json"
    orphan = path.read_bytes()
    snap = Ledger(store, signing_key=None).snapshot()
    assert "main@5" not in getattr(snap, kind) and snap.available("main@5")  # meanwhile it counts for nothing
    assert any(r == f"{kind}/main@5.json" and "sealed by no chain entry" in why for r, why in snap.invalid)
    if kind == "kept":  # a keep that names another place is another fact: refused, nothing sealed
        chains = sorted(p.relative_to(tmp_path) for p in (Path(store) / "_ledger" / "chains").rglob("*"))
        with pytest.raises(certckpt.CheckpointExistsError, match="main@5 has a keep record already, another one .*url"):
            write(Ledger(store, signing_key=None), "rotated", "elsewhere.safetensors")
        assert sorted(p.relative_to(tmp_path) for p in (Path(store) / "_ledger" / "chains").rglob("*")) == chains
    # the retry (its reason worded otherwise: another step's rotation) completes it, as first written
    write(Ledger(store, signing_key=None), "rotated again, later", url)
    assert path.read_bytes() == orphan
    snap = Ledger(store, signing_key=None).snapshot()
    assert getattr(snap, kind)["main@5"]["at"] == json.loads(orphan)["at"] and snap.breaks == [] and not snap.invalid
    assert snap.available("main@5") is (kind == "kept")


def test_a_commit_killed_before_its_chain_entry_counts_for_nothing_and_running_it_again_completes_it(
    tmp_path, monkeypatch, caplog
):
    import logging

    from certckpt.trust.runstore import certify_store

    store = str(tmp_path / "run")
    commit = {"branch": "main", "step": 10, "location": f"{store}/main@10.safetensors", "consensus_fp": "ab" * 8}
    led = Ledger(store, signing_key=None)
    led.append_events([event_dict("main", 10, "nonfinite")])  # a run's audit events come before its commits
    orphan = _killed_before_its_chain_entry(led, monkeypatch, **commit)
    # what a reader sees meanwhile: no commit, no break, the unsealed record named as such
    st = certify_store(store, write_certificates=False)
    assert st.snapshot.breaks == [] and st.snapshot.checkpoints == []
    assert any(r == "checkpoints/main@10.json" and "sealed by no chain entry" in why for r, why in st.snapshot.invalid)
    with caplog.at_level(logging.INFO, logger="certckpt"):
        assert Ledger(store, signing_key=None).commit_checkpoint(**commit) == "main@10"
    assert any("completed the commit of checkpoint main@10" in r.getMessage() for r in caplog.records)
    rec = Path(store) / "_ledger" / "checkpoints" / "main@10.json"
    assert rec.read_bytes() == orphan  # adopted as written: its first commit time stays
    (entry,) = certify_store(store, write_certificates=False).snapshot.checkpoints
    assert entry.ckpt_id == "main@10" and entry.committed_at == json.loads(orphan)["committed_at"]
    # a retry of a commit that had succeeded (its answer lost) changes nothing but one more seal
    assert Ledger(store, signing_key=None).commit_checkpoint(**commit) == "main@10"
    st = certify_store(store, write_certificates=False)
    assert st.snapshot.breaks == [] and [c.ckpt_id for c in st.snapshot.checkpoints] == ["main@10"]


def test_an_unsealed_record_of_another_checkpoint_is_never_adopted_nor_replaced(tmp_path, monkeypatch):
    from certckpt.format.signing import SigningKey, generate_key

    store = str(tmp_path / "run")
    commit = {"branch": "main", "step": 10, "location": f"{store}/main@10.safetensors", "consensus_fp": "ab" * 8}
    orphan = _killed_before_its_chain_entry(Ledger(store, signing_key=None), monkeypatch, **commit)
    chains = sorted(p.relative_to(tmp_path) for p in (Path(store) / "_ledger" / "chains").rglob("*"))
    for other, named in (
        ({"consensus_fp": "cd" * 8}, "its consensus_fp is 'abababababababab', not 'cdcdcdcdcdcdcdcd'"),
        ({"location": f"{store}/other.safetensors"}, "its url is 'main@10.safetensors', not 'other.safetensors'"),
        ({"run": "r2"}, "its run is 'None', not 'r2'"),
    ):
        with pytest.raises(certckpt.CheckpointExistsError, match="main@10 has a commit record already") as ei:
            Ledger(store, signing_key=None).commit_checkpoint(**{**commit, **other})
        assert named in str(ei.value) and "new step or branch" in str(ei.value)
    # the same checkpoint, signed by a key that did not sign the record: not this writer's record either
    key = SigningKey.load(generate_key(tmp_path / "keys" / "k")[0])
    with pytest.raises(certckpt.CheckpointExistsError, match="signed by another key"):
        Ledger(store, signing_key=key).commit_checkpoint(**commit)
    # nothing replaced, nothing sealed: the name still holds the orphan, which still counts for nothing
    assert (Path(store) / "_ledger" / "checkpoints" / "main@10.json").read_bytes() == orphan
    assert sorted(p.relative_to(tmp_path) for p in (Path(store) / "_ledger" / "chains").rglob("*")) == chains
    assert Ledger(store, signing_key=None).snapshot().checkpoints == []


def test_certify_with_a_ledger_run_again_after_it_stopped_before_its_commit_completes_it(tmp_path, monkeypatch):
    import torch

    import certckpt.trust.ledger as ledger_module
    from certckpt.trust.runstore import find_latest_good

    store = tmp_path / "run"
    store.mkdir()
    src, other = tmp_path / "w.pt", tmp_path / "other.pt"
    torch.save({"w": torch.arange(6.0)}, src)
    torch.save({"w": torch.zeros(6)}, other)
    real = ledger_module.put_once
    for lost in ("/checkpoints/", "/chains/"):  # the commit record, or its chain entry, never lands
        dest = str(store / f"lost-{lost.strip('/')}.safetensors")
        step = 5 if lost == "/checkpoints/" else 10
        args = ["certify", str(src), dest, "--ledger", str(store), "--step", str(step)]

        def put_once(location, data, lost=lost):
            if lost in location:
                raise certckpt.StorageError(f"{location}: connection reset")
            return real(location, data)

        with monkeypatch.context() as m:
            m.setattr(ledger_module, "put_once", put_once)
            assert invoke(*args).exit_code != 0
        good = find_latest_good(str(store), accept="verified", write_certificates=False)[1]
        assert os.path.exists(dest) and good != f"main@{step}"  # the file is there, committed by nothing
        # another file's content under the name: the name stays taken, one line, nothing written
        r = invoke("certify", str(other), dest, "--ledger", str(store), "--step", str(step))
        assert r.exit_code != 0 and "already exists under this name" in r.output and "Traceback" not in r.output
        r = invoke(*args)  # the same command again completes the commit
        assert r.exit_code == 0 and f"as main@{step}" in r.output, r.output
        status, good = find_latest_good(str(store), accept="verified", write_certificates=False)
        assert good == f"main@{step}" and status.entry(good).url == dest and status.uncommitted == []
