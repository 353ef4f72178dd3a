"""A store someone edited: ids, names and URLs read from records are validated like user input, a
malformed record is evidence of nothing, and nothing read from a store escapes its directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from certckpt import TrustConfig
from certckpt.errors import CertckptError, ConfigurationError, StorageError
from certckpt.trust.ledger import Ledger, is_ckpt_id
from certckpt.trust.runstore import certify_store, find_latest_good
from tests.support.helpers import console_script, event_dict

_ev = event_dict


def _store(root) -> Ledger:
    """main@10 trusted (full audit passed at 10 with its consensus), main@15 awaiting its audit."""
    led = Ledger(str(root))
    for s in (10, 15):
        led.commit_checkpoint(
            branch="main", step=s, location=str(root / f"main-{s}.safetensors"), run="r", consensus_fp=f"fp{s}"
        )
    led.append_events(
        [_ev("main", 10, k) for k in ("nonfinite-pre", "nonfinite-post", "replay")]
        + [_ev("main", 10, "consensus", fp="fp10"), _ev("main", 15, "consensus", fp="fp15")]
    )
    return led


def _write_record(root, kind, name, doc):
    d = root / "_ledger" / kind
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(doc))


def test_checkpoint_ids_are_branch_at_step_and_never_a_path():
    assert is_ckpt_id("main@10") and is_ckpt_id("b2.resume_1@0")
    for bad in ("../../ESCAPED@60", "main@-1", "main@", "@5", "..@5", "main@5/x", "main", 5, None, "a/b@1", "m@1e3"):
        assert not is_ckpt_id(bad), bad


@pytest.mark.parametrize(
    ("name", "doc", "why"),
    [
        (
            "ESCAPED@60.json",
            {"ckpt_id": "../../ESCAPED@60", "branch": "../..", "step": 60, "url": "x"},
            "is not branch@step",
        ),
        (
            "main@20b.json",
            {"ckpt_id": "main@20", "branch": "main", "step": 20, "url": "main-15.safetensors"},
            "stored as main@20b.json",
        ),
        (
            "main@20.json",
            {"ckpt_id": "main@20", "branch": "main", "step": "20", "url": "main-15.safetensors"},
            "do not make its id",
        ),
        ("main@30.json", {"ckpt_id": "main@30", "branch": "main", "step": 30}, "no file location"),
        ("main@40.json", ["not", "an", "object"], "not a JSON object"),
    ],
)
def test_a_forged_commit_record_is_ignored_and_named(tmp_path, name, doc, why):
    led = _store(tmp_path)
    _write_record(tmp_path, "checkpoints", name, doc)
    snap = led.snapshot()
    assert sorted(snap.records) == ["main@10", "main@15"]
    assert len(snap.invalid) == 1 and snap.invalid[0][0] == f"checkpoints/{name}" and why in snap.invalid[0][1]
    status, good = find_latest_good(str(tmp_path), verify_bytes=False, write_certificates=True)
    assert good == "main@10"
    # certificates were written for real checkpoints only, inside the certificates folder
    written = sorted(os.listdir(tmp_path / "_ledger" / "certificates"))
    assert written and all(n.startswith(("main@10--", "main@15--")) for n in written)
    assert not (tmp_path.parent / "ESCAPED@60.json").exists()


def test_records_of_every_kind_are_checked(tmp_path):
    led = _store(tmp_path)
    _write_record(
        tmp_path,
        "holdings",
        "main@10.json",
        {"ckpt_id": "main@10", "branch": "main", "step": 10, "url": "../elsewhere/main@10.safetensors"},
    )
    _write_record(tmp_path, "incidents", "x.json", {"incident_id": "../../x", "record": "opened"})
    _write_record(tmp_path, "branches", "b2.json", {"branch": "b2/../..", "parent": "main@10"})
    _write_record(tmp_path, "revocations", "r.json", {"ckpt_id": "main@10/..", "reason": "x"})
    snap = led.snapshot()
    kinds = sorted(k.split("/")[0] for k, _ in snap.invalid)
    assert kinds == ["branches", "holdings", "incidents", "revocations"]
    assert snap.holdings == {} and snap.incident_records == [] and snap.branch_parents == {}
    assert snap.revocations == []


def test_an_unreadable_event_stops_certification_with_one_line_naming_it(tmp_path):
    _store(tmp_path)
    seg = tmp_path / "_ledger" / "events" / "zz-forged.jsonl"
    seg.write_text(json.dumps(_ev("main", 20, "replay")) + '\n{"branch": "main", "step": "20"}\n')
    with pytest.raises(CertckptError, match="segment zz-forged.jsonl, line 2, is not a readable audit event"):
        certify_store(str(tmp_path), write_certificates=False)
    r = subprocess.run(
        [console_script("certckpt"), "latest-good", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "zz-forged.jsonl" in r.stderr
    assert "Traceback" not in r.stderr


def test_writers_refuse_names_that_are_not_plain(tmp_path):
    led = Ledger(str(tmp_path))
    for kind, name in (
        ("incidents", "../../x.json"),
        ("incidents", "a/b.json"),
        ("incidents", ".hidden.json"),
        ("nope", "a.json"),
    ):
        with pytest.raises(ConfigurationError):
            led.put_raw(kind, name, b"{}")
    with pytest.raises(ConfigurationError):
        led.commit_checkpoint(branch="..", step=1, location=str(tmp_path / "x.safetensors"))
    with pytest.raises(ConfigurationError):
        led.record_holding({"ckpt_id": "../x@1", "url": "x"})
    assert not (tmp_path.parent / "x.json").exists()


def _flip_byte(path: str, offset_from_end: int = 100) -> None:
    os.chmod(path, 0o644)  # vault copies are read-only; an attacker with write access changes that
    with open(path, "r+b") as fh:
        fh.seek(-offset_from_end, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-offset_from_end, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.mark.slow
def test_prune_never_deletes_good_copies_while_keeping_a_damaged_one(copy_run, tmp_path):
    from certckpt.errors import CorruptCheckpointError
    from certckpt.vault import KeepLatest, promote, prune

    run, vault = copy_run("clean"), str(tmp_path / "vault")
    promote(run, vault)
    before = sorted(n for n in os.listdir(vault) if n.endswith(".safetensors"))
    _flip_byte(os.path.join(vault, "main@30.safetensors"))  # the newest copy: latest-good until re-read
    dry = prune(vault, KeepLatest(1))
    # the damaged copy is not good: the plan keeps the newest copy that verifies instead
    assert set(dry.damaged) == {"main@30"} and "digest mismatch" in dry.damaged["main@30"]
    assert "main@25" in dry.plan.keep and "main@25" not in dry.plan.delete
    with pytest.raises(
        CorruptCheckpointError, match=r"nothing pruned: 1 copy retention relies on is damaged \(main@30"
    ):
        prune(vault, KeepLatest(1), apply=True)
    assert sorted(n for n in os.listdir(vault) if n.endswith(".safetensors")) == before
    r = subprocess.run(
        [console_script("certckpt"), "vault", "prune", vault, "--keep-last", "1", "--apply"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "main@30" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "--repair" in r.stderr
    assert sorted(n for n in os.listdir(vault) if n.endswith(".safetensors")) == before


def _cli(*args):
    return subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_vault_ls_verify_names_damaged_and_missing_copies_and_promote_repair_restores_them(copy_run, tmp_path):
    from certckpt.vault import promote

    run, vault = copy_run("clean"), str(tmp_path / "vault")
    promote(run, vault)
    clean = _cli("vault", "ls", "--verify", vault)
    assert clean.returncode == 0 and "copy" in clean.stdout and "damaged" not in clean.stdout, clean.stderr
    _flip_byte(os.path.join(vault, "main@30.safetensors"))
    os.unlink(os.path.join(vault, "main@20.safetensors"))
    plain = _cli("vault", "ls", vault)  # without --verify nothing is read: the holdings still say held
    assert plain.returncode == 0
    checked = _cli("vault", "ls", "--verify", "--json", vault)
    assert checked.returncode == 1
    rows = {r["ckpt_id"]: r for r in json.loads(checked.stdout)["checkpoints"]}
    assert "digest mismatch" in rows["main@30"]["copy"] and "not found" in rows["main@20"]["copy"].lower()
    assert rows["main@25"]["copy"] == "ok"
    table = _cli("vault", "ls", "--verify", vault)
    assert table.returncode == 1 and "2 held copies are not as promoted" in table.stderr and "--repair" in table.stderr
    # a plain promote has nothing new to copy and does not look; --repair re-reads and replaces
    assert "already in" in _cli("vault", "promote", run, vault).stdout
    fixed = _cli("vault", "promote", "--repair", "--json", run, vault)
    assert fixed.returncode == 0, fixed.stderr
    repaired = {p["ckpt_id"]: p["repaired"] for p in json.loads(fixed.stdout)["promoted"]}
    assert set(repaired) == {"main@20", "main@30"} and all(repaired.values())
    assert _cli("vault", "ls", "--verify", vault).returncode == 0
    assert not os.access(os.path.join(vault, "main@30.safetensors"), os.W_OK) or os.geteuid() == 0
    assert oct(os.stat(os.path.join(vault, "main@30.safetensors")).st_mode & 0o777) == "0o444"


@pytest.mark.slow
def test_a_commit_record_rewritten_to_name_another_file_is_caught_by_its_embedded_record(copy_run, tmp_path):
    run = copy_run("faulty")  # main@5, main@10 trusted; main@15 suspect (after the fault)
    ckpts = os.path.join(run, "_ledger", "checkpoints")
    with open(os.path.join(ckpts, "main@15.json")) as fh:
        suspect = json.load(fh)
    # main@10's record, rewritten to name main@15's file (with that file's header digest): every
    # field that could be checked without the file now agrees with the bytes
    path = os.path.join(ckpts, "main@10.json")
    with open(path) as fh:
        doc = json.load(fh)
    doc.update(url=suspect["url"], header_digest=suspect["header_digest"], state_fp=suspect["state_fp"])
    os.chmod(path, 0o644)
    with open(path, "w") as fh:
        json.dump(doc, fh)
    os.unlink(os.path.join(ckpts, "main@15.json"))  # and the suspect checkpoint's own record is gone
    # a chained store: both edits break the chain that sealed those records
    status, good = find_latest_good(run, write_certificates=False)
    assert "main@10" not in status.certification.verdicts
    assert any("checkpoints/main@10.json, changed after it was sealed" in b.why for b in status.snapshot.breaks)
    # the writer broke right after main@5, before any clean audit point it proves: what it lost could
    # have been a failure whose suspect interval covers main@5 too, so nothing is latest-good
    assert good is None and status.certification.verdicts["main@5"].reasons == ("tampered",)
    # the same store without its chains (as a ledger written before them is read): the file's own
    # record still gives the rewritten commit record away
    shutil.rmtree(os.path.join(run, "_ledger", "chains"))
    os.unlink(os.path.join(run, "_ledger", "genesis.json"))
    # (a reader that read the chained store above remembers its genesis: for it, this is a break; a
    # reader that never read it before sees an unchained ledger)
    assert find_latest_good(run, write_certificates=False)[0].snapshot.breaks
    fresh = TrustConfig(state_dir=str(tmp_path / "fresh-reader"))
    status, good = find_latest_good(run, write_certificates=False, trust=fresh)
    assert good == "main@5" and not status.snapshot.chained
    assert "the file's own record says step 15, its commit record 10" in status.problems["main@10"]


def _second_record_for_main_10(root) -> None:
    """A commit record written by hand, naming main@10's file as main@12's."""
    _write_record(
        root,
        "checkpoints",
        "main@12.json",
        {"ckpt_id": "main@12", "branch": "main", "step": 12, "url": "main-10.safetensors", "consensus_fp": "fp10"},
    )


def test_two_commit_records_for_one_file_trust_neither(tmp_path):
    (tmp_path / "_ledger" / "checkpoints").mkdir(parents=True)  # a ledger written before chains existed
    _store(tmp_path)
    _second_record_for_main_10(tmp_path)
    status = certify_store(str(tmp_path), write_certificates=False)
    assert {"main@10", "main@12"} <= set(status.problems) and "named by 2 commit records" in status.problems["main@10"]
    assert not status.certification.verdicts["main@10"].trusted and not status.snapshot.chained


def test_a_commit_record_no_chain_seals_is_no_checkpoint(tmp_path):
    _store(tmp_path)
    _second_record_for_main_10(tmp_path)
    status = certify_store(str(tmp_path), write_certificates=False)
    assert status.snapshot.chained and "main@12" not in status.certification.verdicts
    assert ("checkpoints/main@12.json", status.snapshot.invalid[0][1]) in status.snapshot.invalid
    assert "sealed by no chain entry" in dict(status.snapshot.invalid)["checkpoints/main@12.json"]
    assert status.certification.verdicts["main@10"].trusted


@pytest.fixture
def read_only(tmp_path):
    """``read_only(path)`` → the same directory mounted read-only (root and mount(8) needed)."""
    mounts = []

    def make(src) -> str:
        dst = tmp_path / f"ro-{len(mounts)}"
        dst.mkdir()
        for cmd in (["mount", "--bind", str(src), str(dst)], ["mount", "-o", "remount,ro,bind", str(dst)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                if mounts or cmd[1] != "--bind":
                    subprocess.run(["umount", str(dst)], capture_output=True)
                pytest.skip(f"cannot make a read-only mount here: {r.stderr.strip()}")
        mounts.append(dst)
        return str(dst)

    yield make
    for m in mounts:
        subprocess.run(["umount", str(m)], capture_output=True)


def test_status_and_latest_good_answer_on_a_read_only_store(tmp_path, read_only):
    src = tmp_path / "run"
    src.mkdir()
    _store(src)
    ro = read_only(src)
    for args, want in ((["latest-good", "--no-verify", ro], "main-10.safetensors"), (["status", ro], "main@10")):
        r = subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and want in r.stdout and r.stderr == "", (args, r.stderr)
    assert not (src / "_ledger" / "certificates").exists()  # nothing could be cached, nothing was


def test_gc_lists_and_removes_only_stale_temp_files_of_killed_writers(tmp_path):
    _store(tmp_path)
    old = [
        tmp_path / ".main-20.safetensors.certckpt-tmp-4242-deadbeef",
        tmp_path / "_ledger" / "checkpoints" / ".main@20.json.certckpt-tmp-4242-cafebabe",
    ]
    young = tmp_path / ".main-25.safetensors.certckpt-tmp-4343-0badf00d"
    for p in (*old, young):
        p.write_bytes(b"x" * 1000)
    for p in old:
        os.utime(p, (0, 0))
    lookalike = tmp_path / ".notes"  # hidden, but not ours
    lookalike.write_text("keep")
    records = sorted(os.listdir(tmp_path / "_ledger" / "checkpoints"))
    cli = console_script("certckpt")
    r = subprocess.run([cli, "gc", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "dry run: pass --apply to remove 2 temp file(s), 2.0 kB" in r.stdout
    assert all(p.exists() for p in old)
    r = subprocess.run([cli, "gc", str(tmp_path), "--apply", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and sorted(json.loads(r.stdout)["removed"]) == sorted(map(str, old))
    assert not any(p.exists() for p in old) and young.exists() and lookalike.exists()
    assert sorted(os.listdir(tmp_path / "_ledger" / "checkpoints")) == [n for n in records if not n.startswith(".")]
    r = subprocess.run([cli, "gc", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no such run store" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.slow  # builds a million-entry header (several seconds)
def test_a_header_listing_too_many_tensors_is_refused_before_it_is_parsed(tmp_path):
    import struct
    import time

    from certckpt.errors import UnsupportedObjectError
    from certckpt.format.header import MAX_TENSORS, encode_header

    n = 1_000_000
    doc = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
    body = json.dumps(doc).encode()
    body += b" " * (-len(body) % 8)
    path = tmp_path / "wide.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * n)
    t0 = time.perf_counter()
    r = subprocess.run([console_script("certckpt"), "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"more than {MAX_TENSORS:,} tensors" in r.stdout + r.stderr
    assert time.perf_counter() - t0 < 10  # a scan, not a 20-second parse
    with pytest.raises(UnsupportedObjectError, match="save large states in shards"):
        encode_header({k: doc[k] for k in list(doc)[: MAX_TENSORS + 1]})


@pytest.mark.parametrize("make", ["fifo", "dev-zero-link"])
def test_fifos_and_devices_named_like_checkpoints_are_refused_unopened(tmp_path, make):
    import time

    import torch

    import certckpt

    certckpt.save({"w": torch.ones(3)}, str(tmp_path / "main@5.safetensors"), ledger=str(tmp_path), step=5)
    certckpt.save({"w": torch.ones(3)}, str(tmp_path / "main@10.safetensors"), ledger=str(tmp_path), step=10)
    victim = tmp_path / "main@10.safetensors"
    victim.unlink()
    os.mkfifo(victim) if make == "fifo" else os.symlink("/dev/zero", victim)
    what = "a FIFO" if make == "fifo" else "a device"
    t = time.monotonic()
    r = subprocess.run([console_script("certckpt"), "verify", str(victim)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and f"is {what}, not a file; refused unopened" in r.stderr
    assert r.stderr.count("\n") == 1
    r = subprocess.run(
        [console_script("certckpt"), "latest-good", str(tmp_path), "--accept", "verified"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("main@5.safetensors")
    # (a link to /dev/zero is refused twice over: it leaves the store, and it is a device)
    refused = "a link that leaves the store (to /dev/zero)" if make == "dev-zero-link" else f"is {what}"
    assert f"skipping main@10: {victim}: {refused}" in r.stderr
    with pytest.raises(StorageError, match="refused unopened"):
        certckpt.load(str(victim))
    assert time.monotonic() - t < 5


def test_a_checkpoint_linked_to_a_file_outside_the_store_is_refused(tmp_path):
    import torch

    import certckpt

    store, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.mkdir()
    for step in (5, 10):
        certckpt.save({"w": torch.ones(3)}, str(store / f"main@{step}.safetensors"), ledger=str(store), step=step)
    # the very bytes, moved out of the store and linked back: the store no longer holds what it vouches for
    shutil.move(store / "main@10.safetensors", elsewhere / "x.safetensors")
    os.symlink(elsewhere / "x.safetensors", store / "main@10.safetensors")
    status, good = find_latest_good(str(store), accept="verified", write_certificates=False)
    assert good == "main@5"
    assert "a link that leaves the store" in dict(status.fallbacks)["main@10"]
