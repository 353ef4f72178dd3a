"""Chained ledgers, in-process: the pure chain check on hand-made chains, concurrent writers, crash
windows, the reader's memory, and incremental certification agreeing with a cold read."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from certckpt.trust.chain import check_chains, digest, entry_doc
from certckpt.trust.ledger import Ledger
from certckpt.trust.memory import STATE_ENV
from certckpt.trust.runstore import certify_snapshot, certify_store, read_remembering
from tests.support.helpers import event_dict

GENESIS = b'{"created_at":1.0,"format":"certckpt-ledger/2","store_id":"' + b"a" * 32 + b'"}\n'
STORE = "a" * 32


def _chain(writer: str, records: list[list[tuple[str, str, str]]], *, store=STORE, seen=None) -> dict[int, bytes]:
    out, prev = {}, digest(GENESIS)
    for i, recs in enumerate(records, 1):
        doc = entry_doc(
            store=store, writer=writer, seq=i, prev=prev, scope="branch:main", records=recs,
            seen=(seen or {}).get(i, {}), now=float(i),
        )  # fmt: skip
        out[i] = json.dumps(doc, sort_keys=True).encode()
        prev = digest(out[i])
    return out


def _recs(n: int) -> tuple[list[list[tuple[str, str, str]]], dict[tuple[str, str], str]]:
    files = {("events", f"s{i}.jsonl"): digest(f"segment {i}".encode()) for i in range(n)}
    return [[("events", name, sha)] for (_, name), sha in files.items()], files


def _check(entries, files, **kw):
    return check_chains(
        entries,
        stores={STORE: digest(GENESIS)},
        record_digest=lambda store, kind, name: files.get((kind, name)),
        trusted_keys=None,
        **kw,
    )


W1, W2 = "w" + "1" * 16, "w" + "2" * 16


def test_an_intact_chain_seals_every_record_it_lists():
    recs, files = _recs(3)
    check = _check({W1: _chain(W1, recs)}, files)
    assert check.breaks == {} and check.heads[W1][0] == 3
    assert all(check.counts(kind, name) for kind, name in files)


@pytest.mark.parametrize(
    "attack, why",
    [
        ("gap", "entry 2 is missing"),
        ("swap", "stored as w1111111111111111/2"),  # an entry names its own place in the chain
        ("foreign", "not this one (replayed from elsewhere)"),
        ("edit", "changed after it was sealed"),
        ("delete", "is missing (deleted)"),
    ],
)
def test_each_way_of_breaking_a_chain_is_named_and_later_records_count_only_against(attack, why):
    recs, files = _recs(4)
    chain = _chain(W1, recs)
    if attack == "gap":
        del chain[2]
    elif attack == "swap":
        chain[2], chain[3] = chain[3], chain[2]
    elif attack == "foreign":
        chain[2] = _chain(W1, recs, store="b" * 32)[2]
    elif attack == "edit":
        files["events", "s1.jsonl"] = digest(b"edited")
    elif attack == "delete":
        del files["events", "s1.jsonl"]
    check = _check({W1: chain}, files)
    (brk,) = check.breaks.values()
    assert why in brk.why and brk.seq == 2 and brk.scope == "branch:main"
    assert check.counts("events", "s0.jsonl") and not check.counts("events", "s3.jsonl")


def test_a_truncated_tail_is_caught_by_another_writers_seal_and_by_the_readers_memory():
    recs, files = _recs(3)
    w1 = _chain(W1, recs)
    w2 = _chain(W2, [[]], seen={1: {W1: 3}})
    truncated = {1: w1[1], 2: w1[2]}
    check = _check({W1: truncated, W2: w2}, files)
    assert "sealed by writer" in check.breaks[W1].why and check.breaks[W1].seq == 3
    check = _check({W1: truncated}, files, remembered={W1: (3, digest(w1[3]))})
    assert "rolled back" in check.breaks[W1].why


def _audit(led: Ledger, step: int, branch: str = "main") -> None:
    led.append_events(
        [event_dict(branch, step, k) for k in ("replay", "nonfinite")]
        + [event_dict(branch, step, "consensus", fp=f"fp{step}")]
    )
    led.commit_checkpoint(
        branch=branch, step=step, location=f"/nowhere/{branch}-{step}.safetensors", consensus_fp=f"fp{step}"
    )


def test_concurrent_writers_seal_each_other_and_nothing_breaks(tmp_path):
    a, b = Ledger(str(tmp_path)), Ledger(str(tmp_path))
    for step in (10, 20, 30):
        _audit(a, step)
        _audit(b, step, branch="side")
    a.revoke("side@10", reason="test")
    st = certify_store(str(tmp_path), write_certificates=False)
    assert st.snapshot.chained and st.snapshot.breaks == [] and st.snapshot.invalid == []
    assert st.latest_good == "main@30" and "revoked" in st.certification.verdicts["side@10"].reasons
    chains = {w.name: sorted(w.iterdir()) for w in (tmp_path / "_ledger" / "chains").iterdir()}
    assert len(chains) == 3  # a's branch chain, b's, a's store chain (the revocation)
    last = json.loads(
        max((p for ps in chains.values() for p in ps), key=lambda p: json.loads(p.read_text())["at"]).read_text()
    )
    assert len(last["seen"]) == 2  # the last entry sealed both other writers' heads


def test_a_record_written_before_a_crash_that_nothing_sealed_counts_for_nothing_and_breaks_nothing(tmp_path):
    led = Ledger(str(tmp_path))
    _audit(led, 10)
    # what a writer killed between the record and its chain entry leaves behind
    rec = json.loads((tmp_path / "_ledger" / "checkpoints" / "main@10.json").read_text())
    rec.update(ckpt_id="main@20", step=20)
    (tmp_path / "_ledger" / "checkpoints" / "main@20.json").write_text(json.dumps(rec))
    st = certify_store(str(tmp_path), write_certificates=False)
    assert st.snapshot.breaks == [] and "main@20" not in st.certification.verdicts
    assert "sealed by no chain entry" in dict(st.snapshot.invalid)["checkpoints/main@20.json"]


def test_a_warm_read_parses_only_new_segments_and_agrees_with_a_cold_one(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    store = tmp_path / "run"
    led = Ledger(str(store))
    for step in (10, 20):
        _audit(led, step)
    first = certify_store(str(store), write_certificates=False)
    assert first.snapshot.facts_cache is not None and not first.snapshot.facts_cache.unchanged
    led.append_events([event_dict("main", 30, "replay", "fail", suspects=[1])])
    _audit(led, 40)
    warm = certify_store(str(store), write_certificates=False)
    cold = certify_snapshot(read_remembering(Ledger(str(store)), use_cache=False))
    assert warm.certification.verdicts == cold.verdicts
    assert [d.step for d in warm.certification.detections] == [30] and warm.latest_good == "main@20"
    assert set(warm.snapshot.facts_cache.segments) == {p.name for p in (store / "_ledger" / "events").iterdir()}
    again = certify_store(str(store), write_certificates=False)
    assert again.snapshot.facts_cache.unchanged and again.certification.verdicts == cold.verdicts


def test_a_damaged_cache_is_ignored_and_a_rewritten_segment_is_seen_by_a_full_read(tmp_path, monkeypatch):
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "state"))
    store = tmp_path / "run"
    led = Ledger(str(store))
    _audit(led, 10)
    certify_store(str(store), write_certificates=False)
    for p in (tmp_path / "state").iterdir():
        if p.name.endswith(".facts.json"):
            p.write_text('{"version": 2, "branches": 5}')
    assert certify_store(str(store), write_certificates=False).latest_good == "main@10"
    seg = next((store / "_ledger" / "events").iterdir())
    seg.write_text(seg.read_text().replace('"pass"', '"fail"', 1))
    # a warm read re-hashes a segment whose size, times or inode moved since it was folded
    warm = read_remembering(Ledger(str(store)))
    assert certify_snapshot(warm).latest_good is None and "changed after it was sealed" in warm.breaks[0].why
    full = read_remembering(Ledger(str(store)), use_cache=False)  # what `status --verify-bytes` reads
    assert "changed after it was sealed" in full.breaks[0].why


def test_a_ledger_written_before_chains_existed_is_read_as_before_and_says_so(tmp_path):
    (tmp_path / "_ledger" / "checkpoints").mkdir(parents=True)
    led = Ledger(str(tmp_path))
    _audit(led, 10)
    st = certify_store(str(tmp_path), write_certificates=False)
    assert not st.snapshot.chained and st.latest_good == "main@10"
    assert any("unchained ledger" in n and "new run store" in n for n in st.snapshot.notes)
    assert not os.path.exists(tmp_path / "_ledger" / "genesis.json")


def test_a_store_copied_whole_keeps_its_identity_and_verdicts(tmp_path):
    led = Ledger(str(tmp_path / "a"))
    _audit(led, 10)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a = certify_store(str(tmp_path / "a"), write_certificates=False)
    b = certify_store(str(tmp_path / "b"), write_certificates=False)
    assert a.snapshot.store_id == b.snapshot.store_id and b.latest_good == "main@10" and b.snapshot.breaks == []


def test_fifos_devices_and_links_in_a_ledger_are_refused_unopened_within_a_second(tmp_path):
    import time

    led = Ledger(str(tmp_path))
    _audit(led, 10)
    events = tmp_path / "_ledger" / "events"
    os.mkfifo(events / "00000000000000000001-fifo.jsonl")  # opening it would block until a writer came
    os.symlink("/dev/zero", events / "00000000000000000002-zero.jsonl")  # reading it would never end
    os.mkfifo(tmp_path / "_ledger" / "checkpoints" / "main@45.json")
    t = time.monotonic()
    st = certify_store(str(tmp_path), write_certificates=False)
    assert time.monotonic() - t < 1 and st.latest_good == "main@10" and st.snapshot.breaks == []
    why = dict(st.snapshot.invalid)
    assert "a FIFO" in why["events/00000000000000000001-fifo.jsonl"]
    assert "a symbolic link" in why["events/00000000000000000002-zero.jsonl"]
    assert "a FIFO" in why["checkpoints/main@45.json"]


def test_reading_while_writers_append_never_sees_a_false_break(tmp_path):
    import threading

    store = str(tmp_path / "run")
    Ledger(store).commit_checkpoint(branch="main", step=1, location=f"{store}/main@1.safetensors")
    stop = threading.Event()

    def write(branch: str) -> None:
        led, step = Ledger(store), 0
        while not stop.is_set() and step < 400:
            step += 10
            _audit(led, step, branch=branch)

    writers = [threading.Thread(target=write, args=(b,)) for b in ("a", "b")]
    for w in writers:
        w.start()
    reads = 0
    try:
        while any(w.is_alive() for w in writers) and reads < 60:
            snap = Ledger(store).snapshot()  # no reader memory: each read stands alone
            assert snap.breaks == [] and not snap.tampered, snap.breaks
            reads += 1
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert reads > 5


def test_a_deleted_genesis_record_is_tampering_not_an_unchained_store(tmp_path):
    led = Ledger(str(tmp_path))
    _audit(led, 10)
    (tmp_path / "_ledger" / "genesis.json").unlink()
    st = certify_store(str(tmp_path), write_certificates=False)
    assert st.snapshot.chained and st.latest_good is None
    assert st.snapshot.breaks[0].why == "genesis record missing (deleted)"
    # nothing can be authenticated without the identity every entry links to: no record counts for trust
    assert "main@10" not in st.certification.verdicts
    assert dict(st.snapshot.invalid)["checkpoints/main@10.json"] == "the store's chains cannot be verified"


def test_a_fifo_named_like_the_genesis_record_is_refused_by_a_writer(tmp_path):
    from certckpt.errors import StorageError

    (tmp_path / "_ledger").mkdir()
    os.mkfifo(tmp_path / "_ledger" / "genesis.json")
    with pytest.raises(StorageError, match="is a FIFO, not a file"):
        _audit(Ledger(str(tmp_path)), 10)


def test_events_of_a_branch_that_cannot_name_a_chain_are_refused_before_anything_is_written(tmp_path):
    from certckpt.errors import ConfigurationError

    led = Ledger(str(tmp_path))
    _audit(led, 10)
    before = sorted(p.name for p in (tmp_path / "_ledger" / "events").iterdir())
    with pytest.raises(ConfigurationError, match="branch"):
        led.append_events([event_dict("main", 20, "replay"), event_dict("../x", 20, "replay")])
    assert sorted(p.name for p in (tmp_path / "_ledger" / "events").iterdir()) == before
