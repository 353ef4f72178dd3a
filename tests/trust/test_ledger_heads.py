"""What a seal costs and what its ``seen`` may claim: one page of the chains directory per seal (one
S3 LIST, however long the run), heads that are never more than what was written, every writer seen
again within one round of the directory, and a truncated tail still caught (issue 47)."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from certckpt.trust import ledger as ledger_module
from certckpt.trust.commit import commit_saved
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from tests.support.helpers import event_dict


def _entries(root: str) -> dict[str, list[dict]]:
    chains = os.path.join(root, "_ledger", "chains")
    return {
        w: [json.loads(open(os.path.join(chains, w, n)).read()) for n in sorted(os.listdir(os.path.join(chains, w)))]
        for w in os.listdir(chains)
    }


def test_seen_goes_round_a_page_at_a_time_never_claims_more_and_still_catches_a_truncation(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "HEADS_PAGE", 2)  # a page of two names: the round takes several seals
    store = str(tmp_path)
    writers = [Ledger(store) for _ in range(3)]
    for i in range(4):
        for n, led in enumerate(writers):
            led.append_events([event_dict(f"b{n}", 10 * (i + 1), "nonfinite")])
    witness = Ledger(store)
    for i in range(16):  # one round: the others' 12 entries and its own 16, two names a page
        witness.append_events([event_dict("w", 10 * (i + 1), "nonfinite")])
    chains = _entries(store)
    heads = {w: len(es) for w, es in chains.items()}
    mine = next(w for w, es in chains.items() if es[0]["scope"] == "branch:w")
    for entry in chains[mine]:
        # what a seal claims of another writer is an entry that was there, never beyond its head
        assert all(seq <= heads[w] for w, seq in entry["seen"].items())
    # the seals have been once round the directory, wherever the random writer ids sort; each names
    # only the heads that moved since the one before it
    named: dict[str, int] = {}
    for entry in chains[mine]:
        assert all(seq > named.get(w, 0) for w, seq in entry["seen"].items())
        named.update(entry["seen"])
    assert named == {w: n for w, n in heads.items() if w != mine}
    assert certify_store(store, write_certificates=False).snapshot.breaks == []
    # another writer's tail deleted after the witness sealed it: a break, as with a full listing
    victim = next(w for w in heads if w != mine)
    os.unlink(os.path.join(store, "_ledger", "chains", victim, f"{heads[victim]:012d}.json"))
    breaks = certify_store(store, write_certificates=False).snapshot.breaks
    assert [b.writer for b in breaks] == [victim] and "truncated or deleted" in breaks[0].why


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
def test_a_commit_lists_once_whatever_the_run_wrote_before(s3_bucket, tmp_path):
    """On a real S3 server: a commit through ``commit_saved`` (events, branch, record: three entries)
    makes one LIST request, as many the tenth time as the first, with 24 writers' chains there."""
    import s3fs

    from certckpt.format.record import RecordFields
    from certckpt.format.writer import SaveResult

    store = f"{s3_bucket}/run"
    others = [Ledger(store) for _ in range(24)]
    for n, led in enumerate(others):
        led.append_events([event_dict(f"r{n}", 1, "nonfinite")])
    led = Ledger(store)
    kinds: Counter = Counter()
    client = s3fs.S3FileSystem().s3
    count = lambda model, **_: kinds.update([model.name])  # noqa: E731 - botocore passes keywords
    client.meta.events.register("before-call.s3", count)
    try:
        per_commit = []
        for step in range(10, 110, 10):
            kinds.clear()
            result = SaveResult(
                location=f"{store}/main@{step}.safetensors", nbytes=1, state_fp="1" * 16, tensors=1, seconds=0.0
            )
            commit_saved(
                led,
                result,
                RecordFields(step=step, run="r", branch="main2", parent="main@0" if step == 10 else None),
                flush=lambda step=step: led.append_events([event_dict("main2", step, "nonfinite")]),
            )
            per_commit.append(dict(kinds))
    finally:
        client.meta.events.unregister("before-call.s3", count)
    assert all(c.get("ListObjectsV2", 0) == 1 for c in per_commit), per_commit
    assert per_commit[-1] == per_commit[1], per_commit  # the tenth costs what the second did
    assert certify_store(store, write_certificates=False).snapshot.breaks == []


@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_hidden_names_planted_in_the_chains_never_end_a_round_early(s3_bucket, monkeypatch):
    """A page is one LIST of at most HEADS_PAGE keys; a short page ends the round. Hidden keys that
    sort first (anyone with write access can plant them) must count toward the page, or the round
    would end on them every time and no seal would ever witness the writers listed after them."""
    import s3fs

    monkeypatch.setattr(ledger_module, "HEADS_PAGE", 2)
    store = f"{s3_bucket}/run"
    writers = [Ledger(store) for _ in range(2)]
    for n, led in enumerate(writers):
        led.append_events([event_dict(f"b{n}", 10, "nonfinite")])
    fs = s3fs.S3FileSystem()
    for name in (".a", ".b", ".c"):
        fs.pipe(f"{store}/_ledger/chains/{name}", b"planted")
    fs.invalidate_cache()
    witness = Ledger(store)
    for i in range(8):
        witness.append_events([event_dict("w", 10 * (i + 1), "nonfinite")])
    assert certify_store(store, write_certificates=False).snapshot.breaks == []
    chains: dict[str, list[dict]] = {}
    for path in sorted(fs.find(f"{store}/_ledger/chains")):
        writer, name = path.split("/")[-2:]
        if writer != "chains" and not name.startswith("."):
            chains.setdefault(writer, []).append(json.loads(fs.cat(path)))
    mine = next(w for w, es in chains.items() if es[0]["scope"] == "branch:w")
    # the witness's seals saw both other writers' heads, the planted names notwithstanding
    named = {w: n for entry in chains[mine] for w, n in entry["seen"].items()}
    assert named == {w: len(es) for w, es in chains.items() if w != mine}
