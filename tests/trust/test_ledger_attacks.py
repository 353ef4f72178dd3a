"""An attacker who can write a store and holds no key, against real signed runs (3 gloo ranks, every
writer signing, every read with trusted keys): deleting, editing, reordering, truncating or splicing
ledger records never makes the attacked checkpoint latest-good, nothing held is deleted on unsigned
evidence, and nothing ends in a traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("cryptography")

from certckpt.format.signing import SigningKey, generate_key
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store, find_latest_good
from certckpt_cli.main import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def signed_runs(tmp_path_factory):
    """``victim``: a persistent backward fault on rank 1 from step 23, caught by the replay audit at 30
    (main@5..20 trusted, main@25 suspect); ``clean``: no fault (main@5..30 trusted); ``continue``: the
    same fault with ``on_fault="continue"`` (the failed events at 30, then main@30 committed)."""
    from certckpt.detect.drill import run_matrix

    root = tmp_path_factory.mktemp("signed")
    priv, pub = generate_key(root / "writer")
    cases = [
        {"fault": "backward", "timing": "persistent", "rank": 1, "injected_step": 23, "name": "victim"},
        {"fault": "backward", "timing": "persistent", "rank": 1, "injected_step": 10**6, "name": "clean"},
        {
            "fault": "backward",
            "timing": "persistent",
            "rank": 1,
            "injected_step": 23,
            "name": "continue",
            "on_fault": "continue",
        },
    ]
    old = os.environ.get("CERTCKPT_SIGNING_KEY")
    os.environ["CERTCKPT_SIGNING_KEY"] = priv
    try:
        m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=str(root / "runs"), cases=cases)
    finally:
        os.environ.pop("CERTCKPT_SIGNING_KEY") if old is None else os.environ.__setitem__("CERTCKPT_SIGNING_KEY", old)
    by = {c["name"]: c for c in m["cases"]}
    assert (by["victim"]["caught_by"], by["victim"]["detected_step"]) == ("replay", 30)
    return {"priv": priv, "pub": pub, **{n: str(root / "runs" / n) for n in by}}


@pytest.fixture
def attack(signed_runs, tmp_path, monkeypatch):
    """``attack("victim")`` -> a private copy of that store, read with the writer's public key trusted."""
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", signed_runs["pub"])
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)

    def copy(name: str) -> Path:
        dst = tmp_path / name
        n = 1
        while dst.exists():
            n, dst = n + 1, tmp_path / f"{name}-{n + 1}"
        shutil.copytree(signed_runs[name], dst)
        return dst

    return copy


def _status(store: Path):
    return certify_store(str(store), write_certificates=False)


def _segments_with(store: Path, predicate) -> list[Path]:
    out = []
    for p in sorted((store / "_ledger" / "events").iterdir()):
        if any(predicate(json.loads(line)) for line in p.read_text().splitlines() if line.strip()):
            out.append(p)
    return out


def _failed_at(step: int):
    return lambda e: e.get("outcome") == "fail" and e.get("step") == step


def test_a_signed_run_is_chained_and_certifies_as_designed(attack):
    st = _status(attack("victim"))
    assert st.snapshot.chained and st.snapshot.breaks == [] and st.snapshot.invalid == []
    assert st.latest_good == "main@20"
    assert st.certification.verdicts["main@25"].reasons == ("after-fault",)


def test_deleting_a_signed_revocation_is_a_broken_chain_not_a_second_chance(attack, signed_runs):
    store = attack("victim")
    Ledger(str(store), signing_key=SigningKey.load(signed_runs["priv"])).revoke(
        "main@20", reason="bad data shard", by="alice"
    )
    assert _status(store).latest_good == "main@15"  # this reader now remembers the revocation's chain
    # 1. the revocation alone: its chain entry still seals it
    for p in (store / "_ledger" / "revocations").iterdir():
        p.unlink()
    st = _status(store)
    assert st.latest_good is None and any("revocations/main@20--" in b.why for b in st.snapshot.breaks)
    assert all("tampered" in v.reasons for v in st.certification.verdicts.values())
    # 2. the revocation and its whole chain: the reader remembers the head it verified
    shutil.rmtree(store / "_ledger" / "chains" / next(b.writer for b in st.snapshot.breaks))
    st = _status(store)
    assert st.latest_good is None and any("rolled back" in b.why for b in st.snapshot.breaks)
    r = CliRunner().invoke(main, ["latest-good", str(store)])
    assert r.exit_code == 1 and "Traceback" not in r.output and "tampered ledger: writer" in r.output
    r = CliRunner().invoke(main, ["status", str(store)])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("tampered: ")]
    assert r.exit_code == 0 and lines and all("rolled back" in ln or "missing" in ln for ln in lines)
    doc = json.loads(CliRunner().invoke(main, ["status", str(store), "--json"]).output)
    assert doc["ledger"]["chained"] and doc["ledger"]["tampered"] == {"*": -1} and doc["ledger"]["breaks"]


def test_flipping_contained_in_a_signed_failure_counts_it_as_a_failure_that_reached_the_weights(attack):
    store = attack("continue")
    before = _status(store)
    assert before.latest_good == "main@20"
    for seg in _segments_with(store, _failed_at(30)):
        seg.write_text(seg.read_text().replace('"contained":false', '"contained":true'))
    st = _status(store)
    assert st.latest_good == "main@20" and st.latest_good != "main@30"
    assert any("changed after it was sealed" in b.why for b in st.snapshot.breaks)
    det = [d for d in st.certification.detections if d.step == 30]
    assert det and not any(d.contained for d in det)  # read pessimistically: never contained


def test_splicing_another_runs_signed_records_in_never_moves_latest_good(attack, signed_runs):
    victim, clean = attack("victim"), Path(signed_runs["clean"])
    for seg in _segments_with(victim, _failed_at(30)):
        seg.unlink()
    # the clean run's signed events, chains and later commit records and files, copied in
    for sub in ("events", "checkpoints"):
        for p in (clean / "_ledger" / sub).iterdir():
            if not (victim / "_ledger" / sub / p.name).exists():
                shutil.copy(p, victim / "_ledger" / sub / p.name)
    for d in (clean / "_ledger" / "chains").iterdir():
        shutil.copytree(d, victim / "_ledger" / "chains" / d.name)
    shutil.copy(clean / "step000030.safetensors", victim / "step000030.safetensors")
    status, chosen = find_latest_good(str(victim), write_certificates=False)
    assert chosen not in ("main@25", "main@30")
    assert any("belongs to store" in b.why for b in status.snapshot.breaks)
    assert any("is missing (deleted)" in b.why for b in status.snapshot.breaks)
    assert not status.certification.verdicts["main@25"].trusted
    assert "main@30" not in status.certification.verdicts or not status.certification.verdicts["main@30"].trusted


def test_reordering_truncating_and_replaying_chain_entries_are_each_a_break(attack, signed_runs):
    # reorder: swap a writer's entries 2 and 3
    store = attack("victim")
    writer = max((store / "_ledger" / "chains").iterdir(), key=lambda d: len(list(d.iterdir())))
    a, b = writer / "000000000002.json", writer / "000000000003.json"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    st = _status(store)
    assert st.latest_good is None or st.latest_good < "main@20"
    assert any(x.writer == writer.name and x.seq == 2 for x in st.snapshot.breaks)
    # truncate: the branch writer's last entry and what it sealed, gone (another writer's entry sealed
    # that head, and this reader remembers it too)
    store = attack("victim")
    _status(store)
    writer = max((store / "_ledger" / "chains").iterdir(), key=lambda d: len(list(d.iterdir())))
    last = sorted(writer.iterdir())[-1]
    for kind, name, _ in json.loads(last.read_text())["records"]:
        (store / "_ledger" / kind / name).unlink(missing_ok=True)
    last.unlink()
    st = _status(store)
    assert any(x.writer == writer.name and ("rolled back" in x.why or "truncated" in x.why) for x in st.snapshot.breaks)
    assert st.latest_good != "main@25"
    # replay: an entry of the clean run's store in place of the victim's
    store = attack("victim")
    clean_writer = next((Path(signed_runs["clean"]) / "_ledger" / "chains").iterdir())
    writer = next((store / "_ledger" / "chains").iterdir())
    shutil.copy(clean_writer / "000000000001.json", writer / "000000000001.json")
    st = _status(store)
    assert any("not this one (replayed from elsewhere)" in x.why or "stored as" in x.why for x in st.snapshot.breaks)
    assert st.latest_good is None


@pytest.mark.parametrize(
    "bad", [{"suspect_ranks": 5}, {"details": "x"}, {"contained": "yes"}, {"kind": 7}], ids=lambda d: next(iter(d))
)
def test_malformed_unsigned_failures_count_as_failures_without_a_traceback(attack, bad):
    store = attack("clean")
    ev = {"run": "clean", "branch": "main", "step": 12, "kind": "replay", "outcome": "fail", "contained": True}
    (store / "_ledger" / "events" / "zz-forged.jsonl").write_text(json.dumps({**ev, **bad}) + "\n")
    st = _status(store)
    assert st.latest_good == "main@10"  # the failure at 12 counts, never contained
    for cmd in (["status", str(store)], ["latest-good", str(store)]):
        r = CliRunner().invoke(main, cmd)
        # an uncaught error would be r.exception itself; the commands end in a documented exit only
        assert r.exit_code in (0, 1) and (r.exception is None or isinstance(r.exception, SystemExit)), r.output


def test_unsigned_revocations_never_drive_a_prune(attack, tmp_path, signed_runs):
    store = attack("clean")
    vault = tmp_path / "vault"
    env = {"CERTCKPT_SIGNING_KEY": signed_runs["priv"]}
    r = CliRunner().invoke(main, ["vault", "promote", str(store), str(vault)], env=env)
    assert r.exit_code == 0, r.output
    held = sorted(p.name for p in vault.glob("*.safetensors"))
    assert len(held) == 6
    # a hand-written, unsigned revocation of the run's first checkpoint, mirrored into the vault
    (store / "_ledger" / "revocations").mkdir(exist_ok=True)
    (store / "_ledger" / "revocations" / "main@5--1.json").write_text(
        json.dumps({"ckpt_id": "main@5", "reason": "forged", "by": "mallory", "at": 1.0})
    )
    r = CliRunner().invoke(main, ["vault", "promote", str(store), str(vault)], env=env)
    assert r.exit_code == 0, r.output
    assert not _status(vault).certification.verdicts["main@30"].trusted  # it still demotes
    r = CliRunner().invoke(main, ["vault", "prune", str(vault), "--keep-last", "2", "--apply"], env=env)
    assert "Traceback" not in r.output
    left = sorted(p.name for p in vault.glob("*.safetensors"))
    assert {"main@30.safetensors", "main@25.safetensors"} <= set(left), r.output
    assert len(left) >= 2 and len(held) - len(left) <= 4


def test_unsigned_revocations_never_drive_a_prune_on_s3_without_object_lock(attack, s3_bucket, signed_runs):
    from certckpt.vault import promote, prune
    from certckpt.vault.retention import KeepLatest

    store = attack("clean")
    vault = f"{s3_bucket}/vault"
    os.environ["CERTCKPT_SIGNING_KEY"] = signed_runs["priv"]
    try:
        held = [p.ckpt_id for p in promote(str(store), vault, lock_mode="none")]
        assert len(held) == 6
        (store / "_ledger" / "revocations").mkdir(exist_ok=True)
        (store / "_ledger" / "revocations" / "main@5--1.json").write_text(
            json.dumps({"ckpt_id": "main@5", "reason": "forged", "by": "mallory", "at": 1.0})
        )
        promote(str(store), vault, lock_mode="none")  # brings the forged revocation across
        st = certify_store(vault, write_certificates=False)
        assert st.snapshot.chained and st.snapshot.breaks == []
        assert all(not v.trusted for v in st.certification.verdicts.values())  # it demotes everything
        result = prune(vault, KeepLatest(2), apply=True)
    finally:
        os.environ.pop("CERTCKPT_SIGNING_KEY", None)
    # the plan acts on authenticated evidence only: the two newest trusted copies stay, and what it
    # let go is what KeepLatest(2) would have let go without the forgery
    assert sorted(result.deleted) == ["main@10", "main@15", "main@20", "main@5"]
    assert sorted(result.plan.keep) == ["main@25", "main@30"]
