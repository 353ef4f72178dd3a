"""The fleet registry: convictions that outlive a run, refusal at the start, retroactive judgement,
appeals and clearances under two keys, rates; and what someone who can write the registry but holds
no key can do to it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from certckpt.errors import ConfigurationError, FleetError
from certckpt.format.signing import SigningKey, generate_key
from certckpt.trust.certify import CheckpointEntry, certify
from certckpt.trust.devices import (
    Placement,
    convicted_ranges,
    device_of,
    fleet_standing,
    rates,
    unaudited_overlap,
)
from certckpt.trust.fleet import Fleet
from certckpt.trust.fleetscan import fleet_rates, impact
from certckpt.trust.ledger import Ledger
from certckpt.trust.records import parse_record
from certckpt.trust.runstore import certify_store
from certckpt_cli.main import main
from tests.support import fleet_cases

EVIDENCE = {"store": "s", "run": "A", "branch": "main", "step": 10, "check": "replay", "rank": 1, "incident_id": "i"}


@pytest.fixture
def keys(tmp_path, monkeypatch):
    """Three people's keys (the writer on the training nodes, alice, bob), all trusted."""
    out = {}
    for who in ("writer", "alice", "bob"):
        priv, pub = generate_key(tmp_path / "keys" / who)
        out[who], out[who + ".pub"] = priv, pub
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", ",".join(out[w + ".pub"] for w in ("writer", "alice", "bob")))
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    return out


def _fleet(path, key=None):
    return Fleet(str(path), signing_key=SigningKey.load(key) if key else None)


def _convicted_fleet(tmp_path, keys):
    root = tmp_path / "fleet"
    root.mkdir()
    _fleet(root, keys["writer"]).create()  # an operator creates the registry once; runs never do
    _fleet(root, keys["writer"]).convict(device="gpu-x", inventory={"host": "node-x"}, evidence=EVIDENCE)
    return root


# --- the pure rules ---------------------------------------------------------------------------------


def test_device_identity_prefers_the_override_then_the_uuid_and_refuses_path_like_names():
    assert device_of({"device_id": "gpu-7", "device_uuid": "GPU-1", "host": "h"}) == "gpu-7"
    assert device_of({"device_uuid": "GPU-1", "host": "h", "device": "cpu"}) == "GPU-1"
    assert device_of({"host": "h", "device": "cpu"}) == "h/cpu"
    assert device_of({"device_id": "../../etc", "host": "h", "device": "cpu"}) == "h/cpu"
    assert device_of({}) == ""


def _parsed(kind, doc):
    # the rules take records as the reader parses them (``records.parse_record``)
    rid = doc[{"convictions": "conviction_id", "appeals": "appeal_id", "clearances": "clearance_id"}[kind]]
    rec = parse_record(kind, f"{rid}.json", doc)
    assert not isinstance(rec, str), rec
    return rec


def test_a_clearance_counts_only_by_another_person_with_another_key():
    conv = [_parsed("convictions", {"conviction_id": "c1", "device": "d", "at": 1.0, "evidence": {}})]
    appeal = _parsed(
        "appeals",
        {
            "appeal_id": "a1",
            "device": "d",
            "convictions": ["c1"],
            "by": "alice",
            "reason": "r",
            "at": 2.0,
            "sig": {"key": "K1"},
        },
    )

    def standing(**clear):
        doc = {"clearance_id": "x", "device": "d", "approves": "a1", "by": "bob", "reason": "r", "at": 3.0, **clear}
        return fleet_standing(conv, [appeal], [_parsed("clearances", doc)])["d"]

    assert not standing().convicted
    assert standing(by="Alice ").convicted  # the appellant clearing her own appeal
    assert standing(sig={"key": "K1"}).convicted  # another name, the appellant's key
    assert standing(device="e").convicted  # a clearance of another device
    assert standing(approves="a2").convicted
    # a later conviction is not covered by an earlier appeal
    later = fleet_standing(
        [*conv, _parsed("convictions", {"conviction_id": "c2", "device": "d", "at": 4.0, "evidence": {}})], [appeal], []
    )
    assert [c["conviction_id"] for c in later["d"].open_convictions] == ["c1", "c2"]


def test_unaudited_interval_and_the_ranges_a_device_computed():
    # a checkpoint at 20 whose last clean audit was 10 holds steps 11..20
    assert unaudited_overlap([(15, None)], last_clean=10, step=20)
    assert not unaudited_overlap([(20, None)], last_clean=10, step=20)
    assert not unaudited_overlap([(0, 10)], last_clean=10, step=20)  # audited at 10 before it left
    assert unaudited_overlap([(0, 11)], last_clean=10, step=20)
    p = [
        Placement(branch="m", start=0, devices={"0": "x"}, hosts={}),
        Placement(branch="m", start=10, devices={"0": "y"}, hosts={}),
        Placement(branch="m", start=20, devices={"0": "z"}, hosts={}, counts=False),  # forged: adds, never cuts
    ]
    assert convicted_ranges(p, {"x"}) == {"m": [(0, 10)]}
    assert convicted_ranges(p, {"y"}) == {"m": [(10, None)]}
    assert convicted_ranges(p, {"z"}) == {"m": [(20, None)]}


def test_the_certifier_convicts_only_checkpoints_whose_unaudited_steps_ran_on_the_device():
    events = []
    for s in (5, 10, 15, 20):
        for kind in ("replay", "nonfinite", "consensus"):
            details = {"fp": f"fp{s}"} if kind == "consensus" else {}
            events.append(
                {
                    "run": "r",
                    "branch": "main",
                    "step": s,
                    "kind": kind,
                    "outcome": "pass",
                    "ranks": [0, 1, 2],
                    "details": details,
                }  # fmt: skip
            )
    ckpts = [CheckpointEntry(ckpt_id=f"main@{s}", branch="main", step=s, consensus_fp=f"fp{s}") for s in (5, 10, 15)]
    fork = CheckpointEntry(ckpt_id="b2@20", branch="b2", step=20, parent="main@15", consensus_fp="fp20")
    plain = certify([*ckpts, fork], events)
    assert [plain.verdicts[c.ckpt_id].trusted for c in ckpts] == [True, True, True]
    cert = certify([*ckpts, fork], events, convicted={"main": [(10, None)]})
    got = {cid: list(v.reasons) for cid, v in cert.verdicts.items()}
    assert got["main@5"] == [] and got["main@10"] == []
    assert got["main@15"] == ["device-convicted"]
    assert got["b2@20"][-1] == "tainted-parent"  # descends from a convicted checkpoint


def test_rates_per_device_and_host():
    out = rates({"x": 2, "y": 0}, {"x": 1_000_000, "y": 500_000, "z": 0}, {"x": "h1", "y": "h1", "z": "h2"})
    assert [(r["device"], r["per_million"]) for r in out["devices"]] == [("x", 2.0), ("y", 0.0), ("z", None)]
    h1 = next(r for r in out["hosts"] if r["host"] == "h1")
    assert (h1["detections"], h1["device_steps"]) == (2, 1_500_000)


def test_the_inventory_override_is_per_rank_and_refused_when_malformed(monkeypatch):
    from certckpt.detect.events import rank_inventory

    monkeypatch.setenv("CERTCKPT_INVENTORY", json.dumps({"*": {"host": "n7"}, "1": {"device_id": "gpu-bad"}}))
    assert rank_inventory(rank=1)["device_id"] == "gpu-bad" and rank_inventory(rank=1)["host"] == "n7"
    assert "device_id" not in rank_inventory(rank=0)
    monkeypatch.setenv("CERTCKPT_INVENTORY", '{"one": {"device_id": "x"}}')
    with pytest.raises(ConfigurationError, match="CERTCKPT_INVENTORY"):
        rank_inventory(rank=0)


# --- the registry against someone who can write it but holds no key -------------------------------------


def test_a_signed_appeal_and_clearance_by_two_keys_clear_a_device(tmp_path, keys):
    root = _convicted_fleet(tmp_path, keys)
    assert Fleet(str(root)).read().start_problem({"0": "gpu-a", "1": "gpu-x"}).startswith("rank 1 runs on device gpu-x")
    appeal = _fleet(root, keys["alice"]).appeal("gpu-x", by="alice", reason="reseated")
    with pytest.raises(FleetError, match="someone else"):
        _fleet(root, keys["alice"]).clear("gpu-x", approves=appeal["appeal_id"], by="bob", reason="ok")
    with pytest.raises(FleetError, match="someone else"):
        _fleet(root, keys["bob"]).clear("gpu-x", approves=appeal["appeal_id"], by="alice", reason="ok")
    _fleet(root, keys["bob"]).clear("gpu-x", approves=appeal["appeal_id"], by="bob", reason="ok")
    view = Fleet(str(root)).read()
    assert view.start_problem({"1": "gpu-x"}) is None and view.devices["gpu-x"].status == "cleared"


def test_forged_clearances_are_ignored_where_keys_are_trusted(tmp_path, keys):
    root = _convicted_fleet(tmp_path, keys)
    conv = [c["conviction_id"] for c in Fleet(str(root)).read().devices["gpu-x"].convictions]
    forger = _fleet(root)  # unsigned chain entries: a writer without a key
    base = {"device": "gpu-x", "reason": "r"}
    appeal_doc = {**base, "appeal_id": "appeal-f", "convictions": conv, "by": "m"}
    forger.ledger.write_record("appeals", "appeal-f.json", appeal_doc)
    clearance = {**base, "clearance_id": "clear-f", "approves": "appeal-f", "by": "e"}
    forger.ledger.write_record("clearances", "clear-f.json", clearance)
    # a raw file written beside the chains, sealed by nothing
    raw = root / "_ledger" / "clearances" / "clear-raw.json"
    raw.write_text(json.dumps({**clearance, "clearance_id": "clear-raw"}))
    view = Fleet(str(root)).read()
    assert view.devices["gpu-x"].convicted and view.start_problem({"1": "gpu-x"}) is not None
    ignored = {k for k, _ in view.invalid}
    assert {"appeals/appeal-f.json", "clearances/clear-f.json", "clearances/clear-raw.json"} <= ignored
    # a clearance signed with the appellant's key (one person with two names) counts for nothing either
    appeal = _fleet(root, keys["alice"]).appeal("gpu-x", by="alice", reason="r")
    _fleet(root, keys["alice"]).ledger.write_record(
        "clearances",
        "clear-self.json",
        {
            "clearance_id": "clear-self",
            "device": "gpu-x",
            "approves": appeal["appeal_id"],
            "by": "carol",
            "reason": "r",
        },
    )
    assert Fleet(str(root)).read().devices["gpu-x"].convicted


def test_without_keys_an_unsigned_clearance_by_another_name_counts(tmp_path, monkeypatch):
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    root = tmp_path / "fleet"
    root.mkdir()
    f = Fleet(str(root))
    f.create()
    f.convict(device="gpu-x", inventory={}, evidence=EVIDENCE)
    appeal = f.appeal("gpu-x", by="alice", reason="r")
    f.clear("gpu-x", approves=appeal["appeal_id"], by="bob", reason="r")  # documented: nothing tells them apart
    assert not Fleet(str(root)).read().devices["gpu-x"].convicted


def test_deleting_or_editing_a_conviction_breaks_the_registry_and_refuses_every_start(tmp_path, keys):
    root = _convicted_fleet(tmp_path, keys)
    assert Fleet(str(root)).read().start_problem({"0": "gpu-ok"}) is None  # read once: this reader remembers
    (conv,) = (root / "_ledger" / "convictions").iterdir()
    doc = json.loads(conv.read_text())
    doc["device"] = "gpu-other"  # move the conviction onto another device
    conv.chmod(0o644)
    conv.write_text(json.dumps(doc))
    problem = Fleet(str(root)).read().start_problem({"0": "gpu-ok"})
    assert problem is not None and "tampered" in problem
    conv.unlink()
    assert "tampered" in Fleet(str(root)).read().start_problem({"0": "gpu-ok"})
    # rolled back whole (the conviction and everything after it gone): this reader saw it
    shutil.rmtree(root / "_ledger" / "chains")
    assert "tampered" in Fleet(str(root)).read().start_problem({"0": "gpu-ok"})


def test_cli_refuses_a_self_clearance_in_one_line_and_shows_the_device(tmp_path, keys, monkeypatch):
    root = _convicted_fleet(tmp_path, keys)
    runner = CliRunner()
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", keys["alice"])
    r = runner.invoke(
        main, ["fleet", "appeal", "gpu-x", "--fleet", str(root), "--by", "alice", "--reason", "r", "--json"]
    )
    assert r.exit_code == 0, r.output
    aid = json.loads(r.output)["appeal_id"]
    r = runner.invoke(
        main, ["fleet", "clear", "gpu-x", "--fleet", str(root), "--approves", aid, "--by", "zed", "--reason", "r"]
    )
    assert r.exit_code == 1 and "refused" in r.output and "own key" in r.output and "Traceback" not in r.output
    r = runner.invoke(main, ["fleet", "ls", "--fleet", str(root)])
    assert r.exit_code == 0 and "gpu-x" in r.output and "convicted" in r.output and aid in r.output
    r = runner.invoke(main, ["fleet", "show", "gpu-x", "--fleet", str(root)])
    assert "replay at step 10 of run A" in r.output
    r = runner.invoke(main, ["fleet", "show", "gpu-none", "--fleet", str(root)])
    assert r.exit_code == 2 and "no record names device" in r.output
    r = runner.invoke(main, ["fleet", "ls"])
    assert r.exit_code == 2 and "--fleet URL" in r.output


def test_impact_and_rates_read_the_registered_stores(tmp_path, keys):
    root = _convicted_fleet(tmp_path, keys)
    store = tmp_path / "run"
    store.mkdir()
    led = Ledger(str(store), signing_key=SigningKey.load(keys["writer"]))
    assert _fleet(root, keys["writer"]).register_store(str(store))  # as a run does before its placement
    led.record_placement(branch="main", start_step=0, devices={"0": "gpu-y", "1": "gpu-z"}, fleet=str(root))
    led.record_placement(branch="b", start_step=0, devices={"0": "gpu-x"}, hosts={"0": "node-x"}, fleet=str(root))
    for s in (10, 20):
        led.commit_checkpoint(branch="main", step=s, location=str(store / f"m{s}.safetensors"))
    led.commit_checkpoint(branch="b", step=10, location=str(store / "b10.safetensors"))
    assert certify_store(str(store), write_certificates=False).certification.verdicts["b@10"].reasons[-1] == (
        "device-convicted"
    )
    assert not _fleet(root, keys["writer"]).register_store(str(store))  # once
    out = impact(str(root), "gpu-y")
    assert [c["ckpt_id"] for c in out.changes] == ["main@10", "main@20"] and not out.already_convicted
    assert [c["ckpt_id"] for c in impact(str(root), "gpu-x").changes] == ["b@10"]  # what its conviction made suspect
    doc = fleet_rates(str(root))
    x = next(r for r in doc["devices"] if r["device"] == "gpu-x")
    assert (x["detections"], x["device_steps"], x["per_million"], x["host"]) == (1, 10, 100_000.0, "node-x")
    y = next(r for r in doc["devices"] if r["device"] == "gpu-y")
    assert (y["detections"], y["device_steps"], y["per_million"]) == (0, 20, 0.0)
    r = CliRunner().invoke(main, ["fleet", "rates", "--fleet", str(root), "--out", str(tmp_path / "r.svg")])
    assert r.exit_code == 0 and "100000.0" in r.output
    svg = (tmp_path / "r.svg").read_text()
    assert svg.startswith("<svg") and "gpu-x" in svg and "node-x" in svg


def test_deleting_the_fleet_a_run_was_placed_under_does_not_clear_its_devices(tmp_path, keys):
    root = _convicted_fleet(tmp_path, keys)
    store = tmp_path / "run"
    store.mkdir()
    led = Ledger(str(store), signing_key=SigningKey.load(keys["writer"]))
    _fleet(root, keys["writer"]).register_store(str(store))
    led.record_placement(branch="b", start_step=4, devices={"0": "gpu-x"}, fleet=str(root))
    for s in (4, 10):
        led.commit_checkpoint(branch="b", step=s, location=str(store / f"b{s}.safetensors"))
    assert certify_store(str(store), write_certificates=False).certification.verdicts["b@10"].reasons[-1] == (
        "device-convicted"
    )
    saved = tmp_path / "fleet-copy"
    shutil.copytree(root, saved)
    # what someone who can write the fleet's storage but holds no key may try, each time afresh:
    # delete the registry, empty it, or delete only the conviction
    for attack, words in (
        (lambda: shutil.rmtree(root), "is tampered (writer genesis entry 0: the ledger is gone (deleted)"),
        (lambda: [p.unlink() for p in root.rglob("*") if p.is_file()], "genesis record missing"),
        (lambda: [p.unlink() for p in (root / "_ledger" / "convictions").iterdir()], "tampered"),
    ):
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(saved, root)
        attack()
        status = certify_store(str(store), write_certificates=False)
        assert status.certification.verdicts["b@10"].reasons[-1] == "tampered", words  # unproven, never cleared
        assert "tampered" not in status.certification.verdicts["b@4"].reasons  # steps before the placement
        assert any("fleet registry" in n and words in n for n in status.snapshot.notes), status.snapshot.notes


def test_a_vault_copy_is_rejudged_when_the_device_it_ran_on_is_convicted_later(tmp_path, keys, monkeypatch):
    import torch

    import certckpt
    from certckpt.vault.promotion import promote

    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", keys["writer"])  # the vault's own records are signed too
    root = tmp_path / "fleet"
    root.mkdir()
    store, vault = tmp_path / "run", tmp_path / "vault"
    store.mkdir()
    led = Ledger(str(store), signing_key=SigningKey.load(keys["writer"]))
    fleet_id = _fleet(root, keys["writer"]).create()
    _fleet(root, keys["writer"]).register_store(str(store))
    led.record_placement(branch="main", start_step=0, devices={"0": "gpu-x"}, fleet=str(root), fleet_id=fleet_id)
    for s in (5, 10):
        certckpt.save({"w": torch.full((4,), float(s))}, str(store / f"s{s}.safetensors"), ledger=led, step=s)
    assert [p.ckpt_id for p in promote(str(store), str(vault), accept="verified")] == ["main@5", "main@10"]
    assert certify_store(str(vault), write_certificates=False).certification.verdicts["main@10"].label == "verified"
    # later, another run convicts gpu-x: the vault's copies computed on it are re-judged too
    _fleet(root, keys["writer"]).convict(device="gpu-x", inventory={}, evidence=EVIDENCE)
    verdicts = certify_store(str(vault), write_certificates=False).certification.verdicts
    assert [verdicts[c].reasons[-1] for c in ("main@5", "main@10")] == ["device-convicted"] * 2


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process (the collectives run for real), torn down after."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield {"group": dist.group.WORLD, "wire_device": torch.device("cpu")}
    finally:
        dist.destroy_process_group()


def _start(fleet_root, store, policy, pg, device="gpu-x"):
    from certckpt.detect.fleet_check import check_fleet_at_start

    check_fleet_at_start(
        Fleet(str(fleet_root)),
        policy=policy,
        inventory={"0": {"host": "node-x", "device_id": device}},
        rank=0,
        ledger=Ledger(str(store)),
        run="r",
        branch="main",
        start_step=0,
        **pg,
    )


def test_warn_policy_trains_on_a_convicted_device_and_records_where(tmp_path, keys, one_rank):
    from certckpt.errors import DeviceConvictedError

    root = _convicted_fleet(tmp_path, keys)
    store = tmp_path / "run"
    store.mkdir()
    with pytest.raises(DeviceConvictedError, match="gpu-x"):
        _start(root, store, "refuse", one_rank)
    assert not (store / "_ledger").exists()  # a refused start writes nothing
    with pytest.warns(RuntimeWarning, match="gpu-x.*fleet_policy='warn': training anyway"):
        _start(root, store, "warn", one_rank)
    placed = os.listdir(store / "_ledger" / "placements")
    assert len(placed) == 1  # so that its checkpoints are judged against the conviction


def test_a_run_whose_placement_cannot_be_recorded_does_not_start(tmp_path, keys, one_rank):
    from certckpt.errors import DeviceConvictedError

    root = tmp_path / "fleet"
    root.mkdir()
    _fleet(root, keys["writer"]).create()
    store = tmp_path / "run"
    store.mkdir()
    (store / "_ledger").write_text("not a directory")  # the run store's ledger cannot be written
    with pytest.raises(DeviceConvictedError, match="cannot be recorded .* does not start"):
        _start(root, store, "warn", one_rank, device="gpu-ok")  # whatever the policy


# --- three stores, three gloo ranks each, in one launch ----------------------------------------------------


@pytest.mark.slow
def test_a_conviction_rejudges_other_runs_and_refuses_the_device_until_cleared(tmp_path, keys, monkeypatch):
    from certckpt.detect.launch import run_ranks

    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", keys["writer"])
    dirs = {k: tmp_path / k for k in ("fleet", "a", "b", "c", "d")}
    for p in dirs.values():
        p.mkdir()
    args = {k: str(p) for k, p in dirs.items()} | {"alice": keys["alice"], "bob": keys["bob"]}
    _fleet(args["fleet"], keys["writer"]).create()
    out = run_ranks(fleet_cases.fleet_story, 3, args, timeout=300)
    r0 = out[0]
    assert [o["a_caught"] for o in out] == [5, 5, 5]
    # before the conviction, impact lists what will change: b2's checkpoints, nothing of main or of C
    assert [(c["store"], c["ckpt_id"]) for c in r0["impact_before"]["changes"]] == [
        (args["b"], "b2@15"),
        (args["b"], "b2@20"),
    ]
    assert all(v == ["trusted", []] for v in r0["b_before"].values()), r0["b_before"]
    # after: B's checkpoints whose unaudited steps ran on gpu-x are suspect, the others keep their verdicts
    b = r0["b_after"]
    assert b["main@5"] == b["main@10"] == ["trusted", []]
    assert b["b2@15"] == b["b2@20"] == ["suspect", ["device-convicted"]]
    assert all(v == ["trusted", []] for v in r0["c_after"].values()) and len(r0["c_after"]) == 2
    # a new run on gpu-x: refused on every rank with the same message, also after a forged clearance
    msgs = {o["d_refused"] for o in out}
    assert len(msgs) == 1 and None not in msgs
    (msg,) = msgs
    assert "rank 1 runs on device gpu-x" in msg and "replay at step 5 of run a" in msg and "every rank" in msg
    assert {o["d_refused_after_forgery"] for o in out} == {msg}
    # a signed appeal and a clearance by another key let it start; B's checkpoints are judged without it
    assert [o["d_refused_after_clearance"] for o in out] == [None, None, None]
    assert all(v == ["trusted", []] for v in r0["b_cleared"].values())
    assert r0["d_placements"] == 1  # only the start that was let in was recorded
    r = CliRunner().invoke(main, ["fleet", "ls", "--all", "--json", "--fleet", args["fleet"]])
    doc = json.loads(r.output)
    assert sorted(doc["stores"]) == sorted(args[k] for k in ("a", "b", "c", "d"))
    (x,) = [d for d in doc["devices"] if d["device"] == "gpu-x"]
    assert x["status"] == "cleared" and x["convictions"][0]["authenticated"] and len(x["clearances"]) == 1
    rates_doc = json.loads(CliRunner().invoke(main, ["fleet", "rates", "--json", "--fleet", args["fleet"]]).output)
    (rx,) = [r for r in rates_doc["devices"] if r["device"] == "gpu-x"]
    assert rx["detections"] == 1 and rx["device_steps"] >= 10


def test_a_registry_on_s3_convicts_clears_and_is_broken_by_a_conviction_edited_in_place(s3_bucket, keys):
    import s3fs

    url, run = f"{s3_bucket}/fleet", f"{s3_bucket}/run"
    _fleet(url, keys["writer"]).create()
    _fleet(url, keys["writer"]).convict(device="gpu-x", inventory={"host": "node-x"}, evidence=EVIDENCE)
    assert _fleet(url, keys["writer"]).register_store(run) and not _fleet(url, keys["writer"]).register_store(run)
    view = Fleet(url).read()
    assert view.stores == [run] and view.start_problem({"1": "gpu-x"}).startswith("rank 1 runs on device gpu-x")
    appeal = _fleet(url, keys["alice"]).appeal("gpu-x", by="alice", reason="reseated")
    _fleet(url, keys["bob"]).clear("gpu-x", approves=appeal["appeal_id"], by="bob", reason="ok")
    view = Fleet(url).read()  # a write since the last read: read again, not taken from this reader's memory
    assert view.start_problem({"1": "gpu-x"}) is None and view.devices["gpu-x"].status == "cleared"
    # someone who can write the bucket moves the conviction onto another device: same name, new bytes
    fs = s3fs.S3FileSystem()
    (conv,) = fs.ls(f"{url}/_ledger/convictions", refresh=True)
    doc = json.loads(fs.cat(conv))
    fs.pipe(conv, json.dumps({**doc, "device": "gpu-other"}).encode())
    problem = Fleet(url).read().start_problem({"0": "gpu-ok"})
    assert problem is not None and "tampered" in problem
