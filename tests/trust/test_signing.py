"""Signed ledgers: with trusted keys, no edit, addition or deletion of records short of the private
key makes a suspect checkpoint latest-good; without keys everything works as before."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.support.helpers import console_script

pytest.importorskip("cryptography")

from certckpt.errors import ConfigurationError, IncidentError
from certckpt.format.signing import SigningKey, TrustedKeys, generate_key
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store


def _ev(branch, step, kind, outcome="pass", **details):
    return {
        "run": "r",
        "branch": branch,
        "step": step,
        "kind": kind,
        "outcome": outcome,
        "ranks": [0, 1, 2],
        "suspect_ranks": [1] if outcome == "fail" else [],
        "contained": False,
        "details": details,
        "inventory": {},
    }


def _audit(step, *, replay="pass"):
    return [_ev("main", step, k) for k in ("nonfinite-pre", "nonfinite-post")] + [
        _ev("main", step, "replay", replay),
        _ev("main", step, "consensus", fp=f"fp{step}"),
    ]


@pytest.fixture
def keys(tmp_path):
    (tmp_path / "keys").mkdir()
    priv, pub = generate_key(tmp_path / "keys" / "k")
    return {"priv": priv, "pub": pub, "signing": SigningKey.load(priv), "trusted": TrustedKeys.load([pub])}


def _signed_run(root, keys) -> None:
    """main@10 and main@20 trusted (audits pass at 10 and 20); main@30 fails its audit at 30."""
    led = Ledger(str(root), signing_key=keys["signing"], trusted_keys=None)
    for s in (10, 20, 30):
        led.commit_checkpoint(
            branch="main", step=s, location=str(root / f"s{s}.safetensors"), run="r", consensus_fp=f"fp{s}"
        )
    led.append_events(_audit(10) + _audit(20) + _audit(30, replay="fail"))


def _verdicts(root, monkeypatch, pub=None):
    if pub:
        monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", str(pub))
    else:
        monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS", raising=False)
    st = certify_store(str(root), write_certificates=False)
    return st.latest_good, {c: v.label for c, v in st.certification.verdicts.items()}, st.snapshot.invalid


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_replaces_one(tmp_path):
    priv, pub = generate_key(tmp_path / "k")
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600 and Path(pub).read_text().startswith("-----BEGIN PUBLIC KEY")
    with pytest.raises(ConfigurationError, match="never replaced"):
        generate_key(tmp_path / "k")
    with pytest.raises(ConfigurationError, match="not a readable Ed25519 private key"):
        SigningKey.load(pub)


def test_a_signed_run_certifies_the_same_with_and_without_trusted_keys(tmp_path, keys, monkeypatch):
    _signed_run(tmp_path, keys)
    plain = _verdicts(tmp_path, monkeypatch)
    checked = _verdicts(tmp_path, monkeypatch, keys["pub"])
    assert plain[:2] == checked[:2] and checked[0] == "main@20" and checked[2] == []


def _edit(path, **changes):
    doc = json.loads(Path(path).read_text())
    doc.update(changes)
    Path(path).write_text(json.dumps(doc))


def _forge(tmp_path) -> None:
    ckpts = tmp_path / "_ledger" / "checkpoints"
    # 1. edit main@30's record to look like a step that passed its audit (the signature breaks)
    _edit(ckpts / "main@30.json", step=20, ckpt_id="main@20")
    os.rename(ckpts / "main@30.json", ckpts / "main@20x.json")
    # 2. add a new unsigned record pointing at main@30's file
    (ckpts / "main@25.json").write_text(
        json.dumps(
            {"ckpt_id": "main@25", "branch": "main", "step": 25, "url": "s30.safetensors", "consensus_fp": "fp20"}
        )
    )
    # 3. flip the failing replay at 30 into a pass, in place (bad signature) and 4. append unsigned passes
    seg = next((tmp_path / "_ledger" / "events").iterdir())
    seg.write_text(seg.read_text().replace('"outcome":"fail"', '"outcome":"pass"'))
    (tmp_path / "_ledger" / "events" / "zz.jsonl").write_text(
        "\n".join(json.dumps(e) for e in _audit(30) + [_ev("main", 25, "consensus", fp="fp20")]) + "\n"
    )


def test_an_unchained_ledger_under_trusted_keys_is_a_break_and_forged_records_move_nothing(tmp_path, keys, monkeypatch):
    (tmp_path / "_ledger" / "checkpoints").mkdir(parents=True)  # a ledger written before chains existed
    _signed_run(tmp_path, keys)
    assert _verdicts(tmp_path, monkeypatch, keys["pub"])[0] is None  # no downgrade: unchained proves nothing
    _forge(tmp_path)
    st = certify_store(str(tmp_path), write_certificates=False)
    assert st.latest_good is None and "main@25" not in st.certification.verdicts
    assert all(v.reasons[-1] == "tampered" for v in st.certification.verdicts.values())
    assert "unchained ledger proves nothing under trusted keys" in st.snapshot.breaks[0].why
    # without keys the same edits do fool an unchained ledger: which is what the README warns about
    assert _verdicts(tmp_path, monkeypatch)[0] == "main@25"


@pytest.mark.parametrize("with_keys", [True, False])
def test_forged_records_in_a_chained_store_break_its_chain_with_or_without_keys(tmp_path, keys, monkeypatch, with_keys):
    _signed_run(tmp_path, keys)
    _forge(tmp_path)
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", str(keys["pub"])) if with_keys else monkeypatch.delenv(
        "CERTCKPT_TRUSTED_KEYS", raising=False
    )
    st = certify_store(str(tmp_path), write_certificates=False)
    # the segment edited in place no longer matches what its chain sealed: its passes count for nothing
    # and the branch is tampered from the edit on; the added records are sealed by nothing
    assert st.snapshot.chained and st.latest_good is None
    assert set(st.certification.verdicts) == {"main@10", "main@20"}
    (brk,) = st.snapshot.breaks  # the first broken link: main@30's commit record, renamed away
    assert brk.scope == "branch:main" and "checkpoints/main@30.json, is missing" in brk.why
    whys = dict(st.snapshot.invalid)
    assert "sealed by no chain entry" in whys["checkpoints/main@25.json"]
    assert any(k.startswith("events/zz.jsonl") for k in whys)


def test_an_unsigned_failure_still_counts(tmp_path, keys, monkeypatch):
    _signed_run(tmp_path, keys)
    (tmp_path / "_ledger" / "events" / "zz.jsonl").write_text(json.dumps(_ev("main", 20, "replay", "fail")) + "\n")
    good, verdicts, _ = _verdicts(tmp_path, monkeypatch, keys["pub"])
    assert verdicts["main@20"] == "suspect" and good == "main@10"


def test_another_key_is_not_trusted(tmp_path, keys, monkeypatch):
    _signed_run(tmp_path, keys)
    _, other = generate_key(tmp_path / "other")
    good, verdicts, invalid = _verdicts(tmp_path, monkeypatch, other)
    assert good is None and verdicts == {}
    st = certify_store(str(tmp_path), write_certificates=False)
    assert "genesis record: not signed by a trusted key" in st.snapshot.breaks[0].why  # its identity is unproven


def test_the_cli_honours_trusted_keys_from_the_environment(tmp_path, keys):
    _signed_run(tmp_path, keys)
    (tmp_path / "_ledger" / "checkpoints" / "main@25.json").write_text(
        json.dumps(
            {"ckpt_id": "main@25", "branch": "main", "step": 25, "url": "s30.safetensors", "consensus_fp": "fp25"}
        )
    )
    env = dict(os.environ, CERTCKPT_TRUSTED_KEYS=str(keys["pub"]))
    r = subprocess.run(
        [console_script("certckpt"), "latest-good", "--no-verify", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("s20.safetensors"), r.stderr


def test_keygen_command(tmp_path):
    r = subprocess.run(
        [console_script("certckpt"), "keygen", str(tmp_path / "w")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and (tmp_path / "w.pub").exists() and "CERTCKPT_TRUSTED_KEYS=" in r.stdout
    r = subprocess.run(
        [console_script("certckpt"), "keygen", str(tmp_path / "w")], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "never replaced" in r.stderr and r.stderr.count("\n") == 1


def _incident_store(root, keys):
    """A store with one opened incident (an opening counts unsigned: it only adds caution)."""
    Ledger(str(root), signing_key=SigningKey.load(keys["priv"]), trusted_keys=None).create()  # a signed genesis
    led = Ledger(str(root), signing_key=None, trusted_keys=None)
    led.commit_checkpoint(branch="main", step=10, location=str(root / "s10.safetensors"), run="r")
    led.write_record(
        "incidents",
        "inc-main-20-replay--opened.json",
        {"incident_id": "inc-main-20-replay", "record": "opened", "opened_at": 1.0, "suspect_nodes": ["n7"]},
    )
    return "inc-main-20-replay"


def test_incident_decisions_count_only_signed_with_trusted_keys(tmp_path, keys, monkeypatch):
    from certckpt.trust.runstore import decide, get_incident

    iid = _incident_store(tmp_path, keys)
    second = tmp_path / "keys2"
    second.mkdir()
    bob_priv, bob_pub = generate_key(second / "bob")
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", str(keys["priv"]))
    proposal = decide(str(tmp_path), iid, action="return-to-service", by="alice", reason="swapped the GPU")
    # An approval signed with the proposer's own key is refused, whatever name it gives
    with pytest.raises(IncidentError, match="with their own key"):
        decide(str(tmp_path), iid, action="approve", by="bob", reason="ok", approves=proposal["decision_id"])
    # An unsigned approval written straight into the store (no key at all) counts for nothing
    forged = {**proposal, "action": "approve", "by": "mallory", "approves": proposal["decision_id"], "at": 9e9}
    forged["decision_id"] = f"{iid}--99999999999999999999-approve"
    forged.pop("sig", None)
    Ledger(str(tmp_path), signing_key=None, trusted_keys=None).write_record(
        "incidents", f"{forged['decision_id']}.json", forged
    )
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", f"{keys['pub']},{bob_pub}")
    inc = get_incident(str(tmp_path), iid)
    assert [d["decision_id"] for d in inc.pending_approvals()] == [proposal["decision_id"]]
    monkeypatch.delenv("CERTCKPT_TRUSTED_KEYS")
    assert get_incident(str(tmp_path), iid).pending_approvals() == []  # without keys the forgery counts
    # Bob, with his own key, approves: that counts with trusted keys
    monkeypatch.setenv("CERTCKPT_TRUSTED_KEYS", f"{keys['pub']},{bob_pub}")
    monkeypatch.setenv("CERTCKPT_SIGNING_KEY", str(bob_priv))
    decide(str(tmp_path), iid, action="approve", by="bob", reason="checked", approves=proposal["decision_id"])
    assert get_incident(str(tmp_path), iid).pending_approvals() == []


@pytest.mark.parametrize("how", ["option-comma", "option-empty", "env-blank"])
def test_a_trusted_keys_value_with_no_key_is_an_error_never_no_checks(tmp_path, keys, how):
    _signed_run(tmp_path, keys)
    env = dict(os.environ, CERTCKPT_TRUSTED_KEYS=str(keys["pub"]))
    args = [console_script("certckpt"), "latest-good", "--no-verify", str(tmp_path)]
    if how == "option-comma":
        args.append("--trusted-keys=,")
    elif how == "option-empty":
        args.append("--trusted-keys=")
    else:
        env["CERTCKPT_TRUSTED_KEYS"] = " , "
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "no public key file" in r.stderr and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_ledger_refuses_a_key_given_as_a_string(tmp_path, monkeypatch):
    """A path or a key's text passed where a key object goes used to fail at the first signature
    with an AttributeError; it is refused at once, saying what to pass."""
    monkeypatch.delenv("CERTCKPT_SIGNING_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="signing_key 'k.pem': pass a key object, None or 'from-env'"):
        Ledger(str(tmp_path), signing_key="k.pem")
    with pytest.raises(ConfigurationError, match="trusted_keys 'pub.pem': pass a key object"):
        Ledger(str(tmp_path), trusted_keys="pub.pem")
    assert Ledger(str(tmp_path), signing_key="from-env").signing_key is None  # nothing in the environment
