"""Runs without the auditor (issue 18, part 4): ``certckpt.save(..., ledger=STORE)`` commits a
checkpoint that can reach ``verified``, never ``trusted``; latest-good and vault promote take it
only with ``--accept verified``; status shows the level."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

import certckpt
from certckpt_cli.main import main


def _run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def plain_run(tmp_path):
    """A run store with three checkpoints saved and committed without the auditor."""
    store = tmp_path / "run"
    store.mkdir()
    for step in (10, 20, 30):
        certckpt.save(
            {"w": torch.full((4,), float(step))}, store / f"s{step}.safetensors", ledger=str(store), run="r1", step=step
        )
    return str(store)


def test_save_with_a_ledger_commits_a_verified_checkpoint(plain_run):
    r = _run("status", plain_run)
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[3] for line in r.output.splitlines() if line.startswith("main@")}
    assert rows == {"main@10": "verified", "main@20": "verified", "main@30": "verified"}
    assert "newest verified (no audit evidence): main@30" in r.output
    doc = json.loads(_run("status", plain_run, "--json").output)
    assert [c["verdict"] for c in doc["checkpoints"]] == ["verified"] * 3 and doc["latest_good"] is None


def test_latest_good_takes_verified_only_when_asked(plain_run):
    r = _run("latest-good", plain_run)
    assert r.exit_code == 1
    assert "none of 3 committed checkpoints is trusted" in r.output and "--accept verified" in r.output
    r = _run("latest-good", plain_run, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(plain_run, "s30.safetensors")
    doc = json.loads(_run("latest-good", plain_run, "--accept", "verified", "--json").output)
    assert (doc["ckpt_id"], doc["verdict"], doc["verified"]) == ("main@30", "verified", True)


def test_verified_falls_back_when_bytes_fail_or_two_records_name_one_file(plain_run):
    # flip a byte in the newest file: latest-good --accept verified skips it and says why
    path = os.path.join(plain_run, "s30.safetensors")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    with open(path, "wb") as f:
        f.write(bytes(data))
    r = _run("latest-good", plain_run, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip().endswith("s20.safetensors")
    assert "skipping main@30" in r.output and "digest mismatch" in r.output
    # a forged commit record naming main@20's file: no chain seals it, so it is no checkpoint at all
    with open(os.path.join(plain_run, "_ledger", "checkpoints", "main@20.json")) as f:
        rec = json.load(f)
    rec.update(ckpt_id="main@25", step=25)
    with open(os.path.join(plain_run, "_ledger", "checkpoints", "main@25.json"), "w") as f:
        json.dump(rec, f)
    r = _run("latest-good", plain_run, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip().endswith("s20.safetensors"), r.output
    doc = json.loads(_run("status", plain_run, "--json").output)
    assert "main@25" not in {c["ckpt_id"] for c in doc["checkpoints"]}


def test_revoked_is_suspect_and_never_accepted(plain_run):
    assert _run("revoke", plain_run, "main@20", "--reason", "bad shard").exit_code == 0
    doc = json.loads(_run("status", plain_run, "--json").output)
    assert {c["ckpt_id"]: c["verdict"] for c in doc["checkpoints"]} == {
        "main@10": "verified",
        "main@20": "suspect",
        "main@30": "suspect",
    }
    assert _run("latest-good", plain_run, "--accept", "verified").output.strip().endswith("s10.safetensors")


def test_save_with_a_ledger_is_create_only_and_checks_its_options(plain_run, tmp_path):
    with pytest.raises(certckpt.CheckpointExistsError, match="main@30 has a commit record already, of another"):
        certckpt.save({"w": torch.ones(1)}, os.path.join(plain_run, "other.safetensors"), ledger=plain_run, step=30)
    with pytest.raises(certckpt.CheckpointExistsError):  # the file name is taken: never replaced
        certckpt.save({"w": torch.ones(1)}, os.path.join(plain_run, "s10.safetensors"), ledger=plain_run, step=11)
    with pytest.raises(certckpt.ConfigurationError, match="needs step=N"):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "x.safetensors", ledger=plain_run)
    with pytest.raises(certckpt.ConfigurationError, match="write-once"):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "x.safetensors", ledger=plain_run, step=1, overwrite=True)
    with pytest.raises(certckpt.ConfigurationError, match="pass ledger=STORE"):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "x.safetensors", branch="b2")
    with pytest.raises(TypeError):
        certckpt.save({"w": torch.ones(1)}, tmp_path / "x.safetensors", None, 2, True, True, plain_run)


def test_a_branch_forked_from_a_verified_checkpoint_is_verified(plain_run):
    certckpt.save(
        {"w": torch.ones(2)},
        os.path.join(plain_run, "b2-40.safetensors"),
        ledger=plain_run,
        step=40,
        branch="b2",
        parent="main@20",
    )
    doc = json.loads(_run("status", plain_run, "--json").output)
    b2 = next(c for c in doc["checkpoints"] if c["ckpt_id"] == "b2@40")
    assert (b2["verdict"], b2["parent"]) == ("verified", "main@20")


def test_vault_promote_takes_verified_only_when_asked(plain_run, tmp_path):
    vault = str(tmp_path / "vault")
    r = _run("vault", "promote", plain_run, vault)
    assert r.exit_code == 0 and "no checkpoint of" in r.output and "is trusted yet" in r.output
    r = _run("vault", "promote", plain_run, vault, "--ckpt", "main@20")
    assert r.exit_code == 1 and "main@20 is verified" in r.output and "--accept verified" in r.output
    r = _run("vault", "promote", plain_run, vault, "--accept", "verified")
    assert r.exit_code == 0, r.output
    doc = json.loads(_run("vault", "ls", vault, "--json").output)
    assert {c["ckpt_id"]: c["verdict"] for c in doc["checkpoints"]} == dict.fromkeys(
        ("main@10", "main@20", "main@30"), "verified"
    )
    r = _run("latest-good", vault, "--accept", "verified")
    assert r.exit_code == 0 and r.output.strip() == os.path.join(vault, "main@30.safetensors")
    # restoring from that vault: a verified copy needs --accept verified, like everything else
    dest = str(tmp_path / "node") + "/"
    r = _run("vault", "restore", vault, "latest-good", dest)
    assert r.exit_code == 2 and "--accept verified" in r.output
    r = _run("vault", "restore", vault, "main@20", dest)
    assert r.exit_code == 1 and "main@20 is verified, not trusted" in r.output
    r = _run("vault", "restore", vault, "latest-good", dest, "--accept", "verified")
    assert r.exit_code == 0 and "main@30" in r.output, r.output
    assert os.path.exists(os.path.join(dest, "main@30.safetensors"))


def test_report_draws_verified_checkpoints_distinctly(plain_run, tmp_path):
    from certckpt.ops.timeline import timeline
    from certckpt.ops.timeline_svg import svg as render_svg
    from certckpt.trust.runstore import certify_store

    tl = timeline(certify_store(plain_run, write_certificates=False))
    assert {c.verdict for c in tl.checkpoints} == {"verified"}
    svg = render_svg(tl)
    assert svg.count('class="checkpoint verified') == 3 and "verified (intact; no audit evidence yet)" in svg


def test_prune_counts_verified_copies_in_a_vault_without_trusted_ones(plain_run, tmp_path):
    vault = str(tmp_path / "vault")
    assert _run("vault", "promote", plain_run, vault, "--accept", "verified").exit_code == 0
    doc = json.loads(_run("vault", "prune", vault, "--keep-last", "2", "--json").output)
    assert sorted(doc["keep"]) == ["main@20", "main@30"] and doc["delete"] == ["main@10"]


def test_verify_ledger_reports_the_verified_level(plain_run):
    r = _run("verify", os.path.join(plain_run, "s20.safetensors"), "--ledger", plain_run)
    assert r.exit_code == 0 and "verdict: verified (main@20)" in r.output, r.output
    doc = json.loads(_run("verify", os.path.join(plain_run, "s20.safetensors"), "--ledger", plain_run, "--json").output)
    assert doc["verdict"]["verdict"] == "verified" and not doc["verdict"]["trusted"]
