"""A reader's cache of chain entries and small records (issue 47): a warm read fetches only what was
written since its last read, and never says less than a cold one: after any entry or record is
deleted or rewritten, the warm read gives the same breaks, marks and verdicts as a read without the
cache. And a chain that looks behind is listed again on its own, not the whole ledger."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from certckpt.format.trustconfig import TrustConfig
from certckpt.storage import LocalStorage
from certckpt.trust.chain import CHAINS_DIR
from certckpt.trust.ledger import Ledger
from certckpt.trust.memory import recall_chains
from certckpt.trust.runstore import certify_snapshot, read_remembering
from certckpt.trust.snapshot import read_snapshot
from tests.support.helpers import event_dict


def _audit(led: Ledger, step: int, branch: str) -> None:
    led.append_events(
        [event_dict(branch, step, k) for k in ("replay", "nonfinite")]
        + [event_dict(branch, step, "consensus", fp=f"fp{step}")]
    )
    led.commit_checkpoint(
        branch=branch, step=step, location=f"/nowhere/{branch}-{step}.safetensors", consensus_fp=f"fp{step}"
    )


def _chains(store: str) -> dict[str, list[str]]:
    """Each writer's entry files, in order, keyed by the branch its chain seals."""
    root = os.path.join(store, "_ledger", CHAINS_DIR)
    out = {}
    for w in os.listdir(root):
        names = sorted(os.listdir(os.path.join(root, w)))
        with open(os.path.join(root, w, names[0])) as f:
            scope = json.load(f)["scope"]
        out[scope.removeprefix("branch:")] = [os.path.join(root, w, n) for n in names]
    return out


def _read(store: str, state: str, *, use_cache: bool):
    snap = read_remembering(Ledger(store, trust=TrustConfig(state_dir=state)), use_cache=use_cache)
    return snap, certify_snapshot(snap)


def _rewrite(path: str, change) -> None:
    with open(path) as f:
        doc = json.load(f)
    change(doc)
    with open(path, "w") as f:
        f.write(json.dumps(doc, sort_keys=True))


def _same_bytes(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data)


TAMPER = {
    "a middle entry deleted": lambda s, c: os.unlink(c["main"][1]),
    "an entry rewritten": lambda s, c: _rewrite(c["main"][0], lambda d: d.update(at=d["at"] + 1)),
    "an entry rewritten with its own bytes": lambda s, c: _same_bytes(c["main"][2]),
    "the tail entry deleted": lambda s, c: os.unlink(c["main"][-1]),
    "a whole chain deleted": lambda s, c: shutil.rmtree(os.path.dirname(c["main"][0])),
    "a sealed commit record rewritten": lambda s, c: _rewrite(
        os.path.join(s, "_ledger", "checkpoints", "main@10.json"), lambda d: d.update(consensus_fp="forged")
    ),
    "a sealed commit record deleted": lambda s, c: os.unlink(os.path.join(s, "_ledger", "checkpoints", "side@10.json")),
    "a sealed segment deleted": lambda s, c: os.unlink(
        os.path.join(s, "_ledger", "events", sorted(os.listdir(os.path.join(s, "_ledger", "events")))[0])
    ),
}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_a_warm_read_after_a_deletion_or_rewrite_says_exactly_what_a_cold_read_says(tmp_path, tamper):
    store, state = str(tmp_path / "run"), str(tmp_path / "state")
    a, b = Ledger(store), Ledger(store)
    for step in (10, 20):
        _audit(a, step, "main")
        _audit(b, step, "side")  # b's entries see a's head: a's tail is witnessed
    _read(store, state, use_cache=True)
    _audit(a, 30, "main")  # written after the first read: the second one fetches only this
    _read(store, state, use_cache=True)
    unchanged, _ = _read(store, state, use_cache=True)
    assert unchanged.chain_cache is not None and unchanged.chain_cache.unchanged  # the cache holds everything
    assert unchanged.breaks == [] and recall_chains(store, base=state) is not None
    TAMPER[tamper](store, _chains(store))
    cold_state = str(tmp_path / "cold-state")
    shutil.copytree(state, cold_state)  # the same memory of heads and identity, without using the caches
    warm, warm_cert = _read(store, state, use_cache=True)
    cold, cold_cert = _read(store, cold_state, use_cache=False)
    assert warm.breaks == cold.breaks and warm.tampered == cold.tampered
    assert sorted(warm.invalid) == sorted(cold.invalid)
    assert warm_cert.verdicts == cold_cert.verdicts and warm_cert.latest_good == cold_cert.latest_good
    if tamper != "an entry rewritten with its own bytes":
        assert warm.breaks, "every deletion and rewrite here is a break"
    else:
        assert warm.breaks == [] and warm_cert.latest_good == "main@30"


def test_a_warm_read_fetches_only_what_was_written_since_the_last_one(tmp_path, monkeypatch):
    store, state = str(tmp_path / "run"), str(tmp_path / "state")
    writers = [Ledger(store) for _ in range(3)]
    for step in (10, 20):
        for n, led in enumerate(writers):
            _audit(led, step, f"b{n}")
    _read(store, state, use_cache=True)
    fetched: list[str] = []
    real = LocalStorage.get_many

    def spy(self, names):
        names = list(names)
        fetched.extend(names)
        return real(self, names)

    monkeypatch.setattr(LocalStorage, "get_many", spy)
    root = os.path.join(store, "_ledger")
    before = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    _audit(writers[1], 30, "b1")
    after = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    snap, cert = _read(store, state, use_cache=True)
    assert sorted(fetched) == sorted(after - before)  # two entries, a segment, a commit record: nothing else
    assert snap.breaks == [] and cert.verdicts["b1@30"].trusted
    cold, cold_cert = _read(store, str(tmp_path / "fresh"), use_cache=False)
    assert cold_cert.verdicts == cert.verdicts and cold.heads == snap.heads


class _Racing(LocalStorage):
    """A local ledger listed one chain after another, with writers at work in between: right after
    the first chain is listed, its writer appends and another writer seals the new head; after the
    rest is listed, the first writer appends again (a segment no listing of this read has seen)."""

    def __init__(self, root: str, *, first: Ledger, second: Ledger):
        super().__init__(root)
        self.first, self.second = first, second
        self.listed: list[str] = []
        self.raced = False

    def walk(self, prefix: str = "", **kw):
        out = super().walk(prefix, **kw)
        self.listed.append(prefix)
        if prefix.startswith(f"{CHAINS_DIR}/") and not self.raced:
            self.raced = True
            mine = self.first if self._is(prefix, self.first) else self.second
            other = self.second if mine is self.first else self.first
            self.first, self.second = mine, other
            _audit(mine, 30, self._branch(mine))
            other.append_events([event_dict(self._branch(other), 30, "nonfinite")])
        elif prefix == "" and kw.get("skip"):
            _audit(self.first, 40, self._branch(self.first))
        return out

    def _is(self, prefix: str, led: Ledger) -> bool:
        return any(ch.writer == prefix.split("/")[1] for ch in led._chains.values())

    @staticmethod
    def _branch(led: Ledger) -> str:
        return next(iter(led._chains)).removeprefix("branch:")


def test_a_chain_that_looks_behind_is_listed_again_on_its_own(tmp_path):
    store = str(tmp_path / "run")
    a, b = Ledger(store), Ledger(store)
    _audit(a, 10, "main")
    _audit(b, 10, "side")
    storage = _Racing(os.path.join(store, "_ledger"), first=a, second=b)
    led = Ledger(store)
    snap = read_snapshot(store=store, storage=storage, trusted_keys=None, url_of=led.url_of)
    assert storage.raced and snap.breaks == []
    first = next(ch.writer for ch in storage.first._chains.values())
    assert snap.heads[first][0] == 6  # both appends the race made, the second found by the relisting
    assert storage.listed.count("") == 1  # the ledger was listed once...
    assert storage.listed.count(f"{CHAINS_DIR}/{first}") == 2  # ...and the chain that looked behind twice


def _s3_entries(fs, store: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in sorted(fs.find(f"{store}/_ledger/chains")):
        writer = path.split("/")[-2]
        out.setdefault(writer, []).append(path)
    return out


@pytest.mark.parametrize("s3_server", ["seaweedfs"], indirect=True)
@pytest.mark.parametrize("tamper", ["entry deleted", "record rewritten, same size"])
def test_on_s3_a_warm_read_gets_nothing_and_still_sees_a_deletion_or_a_same_size_rewrite(s3_bucket, tmp_path, tamper):
    """On a real S3 server an object's stamp is its size, ETag and write time: a warm read of an
    unchanged store makes no GET at all, and a deleted entry or a record rewritten to the same size
    gives the breaks a read without the cache gives."""
    import s3fs

    store, state = f"{s3_bucket}/run", str(tmp_path / "state")
    a, b = Ledger(store), Ledger(store)
    for step in (10, 20):
        _audit(a, step, "main")
        _audit(b, step, "side")
    _read(store, state, use_cache=True)
    fs = s3fs.S3FileSystem()
    kinds: list[str] = []
    count = lambda model, **_: kinds.append(model.name)  # noqa: E731 - botocore passes keywords
    fs.s3.meta.events.register("before-call.s3", count)
    try:
        again, _ = _read(store, state, use_cache=True)
    finally:
        fs.s3.meta.events.unregister("before-call.s3", count)
    assert again.breaks == [] and "GetObject" not in kinds and again.chain_cache.unchanged, kinds
    if tamper == "entry deleted":
        victim = next(iter(_s3_entries(fs, store).values()))[1]
        fs.rm(victim)
    else:
        path = f"{store}/_ledger/checkpoints/main@10.json"
        data = fs.cat(path)
        fs.pipe(path, data.replace(b'"fp10"', b'"fp99"'))  # same size, other bytes: another ETag
    fs.invalidate_cache()
    cold_state = str(tmp_path / "cold-state")
    shutil.copytree(state, cold_state)
    warm, warm_cert = _read(store, state, use_cache=True)
    cold, cold_cert = _read(store, cold_state, use_cache=False)
    assert warm.breaks and warm.breaks == cold.breaks and warm.tampered == cold.tampered
    assert warm_cert.verdicts == cold_cert.verdicts


def test_with_trusted_keys_the_cache_keeps_each_chain_standing_and_is_not_used_under_other_keys(tmp_path):
    """A signed writer and an unsigned one under trusted keys: a warm read gives the cold read's
    unauthenticated writers and verdicts, a forged signed entry breaks as it does cold, and a cache
    proved without keys is never used with them (it would have counted the unsigned chain)."""
    from certckpt.format.signing import SigningKey, TrustedKeys, generate_key

    priv, pub = generate_key(tmp_path / "keys" / "k")
    trusted = TrustedKeys.load([pub])
    store, state = str(tmp_path / "run"), str(tmp_path / "state")
    signed = Ledger(store, signing_key=SigningKey.load(priv), trusted_keys=None)
    unsigned = Ledger(store, signing_key=None, trusted_keys=None)
    for step in (10, 20):
        _audit(signed, step, "main")
        _audit(unsigned, step, "side")

    def read(state: str, *, keys: TrustedKeys | None, use_cache: bool = True):
        snap = read_remembering(
            Ledger(store, trust=TrustConfig(trusted_keys=keys, state_dir=state)), use_cache=use_cache
        )
        return snap, certify_snapshot(snap)

    read(state, keys=None)  # a cache proved without keys: both chains count there
    keyed_state = str(tmp_path / "keyed")
    shutil.copytree(state, keyed_state)
    warm, warm_cert = read(keyed_state, keys=trusted)
    cold, cold_cert = read(str(tmp_path / "cold"), keys=trusted, use_cache=False)
    assert warm.invalid and sorted(warm.invalid) == sorted(cold.invalid)  # the unsigned chain counts only against
    assert warm_cert.verdicts == cold_cert.verdicts and warm_cert.latest_good == "main@20"
    assert "side@10" not in warm_cert.verdicts  # an unsigned commit is no checkpoint under trusted keys
    again, _ = read(keyed_state, keys=trusted)
    assert again.chain_cache is not None and again.chain_cache.unchanged  # proved under these keys, used
    _rewrite(_chains(store)["main"][1], lambda d: d.update(at=d["at"] + 1))  # its signature no longer holds
    shutil.copytree(keyed_state, str(tmp_path / "cold2"))
    warm, warm_cert = read(keyed_state, keys=trusted)
    cold, cold_cert = read(str(tmp_path / "cold2"), keys=trusted, use_cache=False)
    assert warm.breaks and warm.breaks == cold.breaks and warm_cert.verdicts == cold_cert.verdicts
