"""Coverage of the demo's checkpoints from the events its run wrote, and releases of them that the
real OpenSSF model_signing verifies (the demo runs once per session: conftest's ``demo_run``)."""

import base64
import json
import shutil
import subprocess
from fractions import Fraction

import pytest
import torch
from click.testing import CliRunner

import certckpt
from certckpt.errors import ConfigurationError, ReleaseVerificationError, UntrustedCheckpointError
from certckpt.ops.release import make_release, verify_release
from certckpt.ops.release_cert import CERTIFICATE_NAME, PREDICATE_TYPE, SIGNATURE_NAME, generate_release_key
from certckpt.ops.timeline import timeline
from certckpt.tools.demo import SCHEDULE
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store
from certckpt_cli.main import main as cli
from tests.support.helpers import console_script

pytest.importorskip("model_signing")
pytestmark = pytest.mark.slow  # the demo's launch (shared with test_demo)


@pytest.fixture(scope="module")
def demo(demo_run):
    d, r = demo_run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return d


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    k = tmp_path_factory.mktemp("keys")
    mine = generate_release_key(str(k / "release"))
    other = generate_release_key(str(k / "other"))
    return {"key": mine[0], "pub": mine[1], "other_pub": other[1]}


@pytest.fixture(scope="module")
def released(demo, keys, tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "latest-good"
    r = CliRunner().invoke(cli, ["release", str(demo / "run"), "--key", keys["key"], "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _expected_from_events(events, branch, start, end):
    """Replay steps of ``(start, end]`` on ``branch`` read straight from the stored events."""
    return sorted(
        {
            e["step"]
            for e in events
            if e["branch"] == branch
            and e["kind"] == "replay"
            and start < e["step"] <= end
            and not e["details"].get("found_by")
        }
    )


def test_demo_coverage_matches_the_events_it_wrote(demo):
    store = str(demo / "run")
    status = certify_store(store, write_certificates=False)
    events = Ledger(store).snapshot().events
    cov = status.coverage()
    K, world = SCHEDULE["audit_every"], 3
    replay_events = [e for e in events if e["kind"] == "replay"]
    assert replay_events and all(len(e["ranks"]) == world for e in replay_events)
    assert all(e["details"]["replayed_micro_batches"] == e["details"]["micro_batches"] for e in replay_events)
    for c in status.snapshot.checkpoints:
        x = cov[c.ckpt_id]
        want = _expected_from_events(events, c.branch, x.window.start, c.step)
        assert sorted(x.window.replay_steps) == want, c.ckpt_id
        assert x.one_time_replayed == Fraction(len(want), x.window.steps)
        assert x.window.steps == SCHEDULE["ckpt_every"]
        assert x.rank_named and x.world == world  # 3 ranks: the replay names the rank
        assert x.persistent_within == (K if c.step % K else SCHEDULE["ckpt_every"])
        if c.step % K == 0:  # a whole lineage of audits every K: exactly 1/K of its steps replayed
            assert x.lineage_replayed == Fraction(1, K) and x.lineage_steps == c.step
    assert cov["b2@60"].parent == "b2@55" and cov["b2@25"].parent == "main@20"
    assert cov["b2@60"].lineage == 12  # main@5..main@20, b2@25..b2@60


def test_coverage_in_status_inspect_and_the_timeline(demo):
    store = str(demo / "run")
    runner = CliRunner()
    r = runner.invoke(cli, ["status", store, "--coverage"])
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.startswith("b2@60 ") and "1/5" in line)
    assert "1/10 over 60 steps" in row and "rank named" in row
    doc = json.loads(runner.invoke(cli, ["status", store, "--json", "--coverage"]).output)
    b60 = next(c for c in doc["checkpoints"] if c["ckpt_id"] == "b2@60")["coverage"]
    assert b60["bound"]["one_time_replayed"] == "1/5" and b60["lineage"]["one_time_replayed"] == "1/10"
    url = next(c["url"] for c in doc["checkpoints"] if c["ckpt_id"] == "b2@60")
    r = runner.invoke(cli, ["inspect", url, "--ledger", store, "--json"])
    assert json.loads(r.output)["ledger"]["coverage"]["replay"]["steps"] == [60]
    tl = timeline(certify_store(store, write_certificates=False))
    mark = next(m for m in tl.lane("b2").checkpoints if m.ckpt_id == "b2@60")
    assert mark.coverage["bound"]["persistent_within"] == 5 and "1/10 of 60 steps" in mark.coverage_text


def test_release_of_latest_good_verifies_with_model_signing_and_certckpt(released, keys, demo):
    files = sorted(p.name for p in released.iterdir())
    assert files == sorted([CERTIFICATE_NAME, SIGNATURE_NAME, "model.safetensors"])
    # the real OpenSSF tool, offline, key-based
    ms = subprocess.run(
        [console_script("model_signing"), "verify", "key", str(released), "--signature",
         str(released / SIGNATURE_NAME), "--public_key", keys["pub"]],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ms.returncode == 0 and "Verification succeeded" in ms.stdout, ms.stdout + ms.stderr
    r = CliRunner().invoke(cli, ["verify-release", str(released), "--public-key", keys["pub"]])
    assert r.exit_code == 0 and "release of b2@60 verified: trusted" in r.output, r.output
    # the model loads without certckpt, and is the checkpoint's model
    from safetensors.torch import load_file

    from certckpt.tools.demo import make_model

    plain = load_file(str(released / "model.safetensors"))
    state = certckpt.load(str(demo / "run" / "b2-step000060.safetensors"))
    assert plain.keys() == state["model"].keys() and all(torch.equal(plain[k], state["model"][k]) for k in plain)
    make_model().load_state_dict(plain, strict=True)
    # the certificate's statement: subjects = the files, own predicate type, what it binds
    env = json.loads((released / CERTIFICATE_NAME).read_text())
    doc = json.loads(base64.b64decode(env["payload"]))
    assert doc["predicateType"] == PREDICATE_TYPE and [s["name"] for s in doc["subject"]] == ["model.safetensors"]
    p = doc["predicate"]
    assert p["verdict"]["level"] == "trusted" and p["verdict"]["audited"] is True
    assert [x["ckpt_id"] for x in p["lineage"]["parents"]][-1] == "main@5" and p["lineage"]["run"] == "demo"
    assert p["coverage"]["lineage"]["one_time_replayed"] == "1/10"
    assert p["consensus_fp"] == p["checkpoint"]["consensus_fp"] and p["consensus_fp"]
    assert p["ledger"]["store_id"] and p["ledger"]["heads"] and p["ledger"]["events"] > 0


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


@pytest.mark.parametrize(
    "tamper, words",
    [
        (lambda d: (d / "model.safetensors").open("ab").write(b"x"), "model.safetensors changed since it was signed"),
        (lambda d: (d / "notes.txt").write_text("hi"), "files not signed: notes.txt"),
        (lambda d: (d / "model.safetensors").unlink(), "signed files missing: model.safetensors"),
    ],
)
def test_a_tampered_file_fails_both_verifiers(released, keys, tmp_path, tamper, words):
    d = _copy(released, tmp_path)
    tamper(d)
    with pytest.raises(ReleaseVerificationError, match=words):
        verify_release(str(d), public_key=keys["pub"])
    r = CliRunner().invoke(cli, ["verify-release", str(d), "--public-key", keys["pub"]])
    assert r.exit_code == 1 and words in r.output and r.output.count("\n") == 1
    ms = subprocess.run(
        [console_script("model_signing"), "verify", "key", str(d), "--signature", str(d / SIGNATURE_NAME),
         "--public_key", keys["pub"]],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Verification succeeded" not in ms.stdout


@pytest.mark.parametrize("digest_bytes", [b"no quote", b"it's"], ids=["plain-repr", "escaped-repr"])
def test_the_verifiers_complaint_names_the_file_whatever_quotes_its_digest_bytes_took(digest_bytes):
    """model_signing reports a list's repr: when a digest's bytes hold a quote, the names' quotes in
    that entry come out escaped (which happened at random in CI, with real digests)."""
    from model_signing._hashing.hashing import Digest

    from certckpt.ops.release import _said

    expected, actual = Digest("sha256", digest_bytes), Digest("sha256", b"x")
    diffs = [
        "Extra files found in model 'copy': notes.txt",
        "Missing files in model 'copy': tokenizer.json",
        f"Hash mismatch for 'model.safetensors': Expected '{expected}', Actual '{actual}'",
    ]
    said = _said(ValueError(f"Signature mismatch: {diffs}"))
    assert said == (
        "model.safetensors changed since it was signed; files not signed: notes.txt; "
        "signed files missing: tokenizer.json"
    )
    assert ("\\'" in str(diffs)) == (digest_bytes == b"it's")  # the case is the one named


def test_an_untrusted_key_fails(released, keys):
    r = CliRunner().invoke(cli, ["verify-release", str(released), "--public-key", keys["other_pub"]])
    assert r.exit_code == 1 and "Key mismatch" in r.output and r.output.count("\n") == 1


def test_a_certificate_edited_or_from_another_release_fails(released, keys, demo, tmp_path):
    # the same model released again: another model.sig, so the first certificate does not fit it
    again = tmp_path / "again"
    make_release(str(demo / "run"), key=keys["key"], out=str(again))
    d = _copy(released, tmp_path)
    shutil.copyfile(again / CERTIFICATE_NAME, d / CERTIFICATE_NAME)
    with pytest.raises(ReleaseVerificationError, match="another model signature"):
        verify_release(str(d), public_key=keys["pub"])
    # another checkpoint's release: other files
    other = tmp_path / "other"
    make_release(str(demo / "run" / "b2-step000050.safetensors"), key=keys["key"], out=str(other))
    shutil.copyfile(other / CERTIFICATE_NAME, d / CERTIFICATE_NAME)
    with pytest.raises(ReleaseVerificationError, match="files differ from this release's"):
        verify_release(str(d), public_key=keys["pub"])
    # an edited certificate: its signature no longer holds
    env = json.loads((released / CERTIFICATE_NAME).read_text())
    doc = json.loads(base64.b64decode(env["payload"]))
    doc["predicate"]["verdict"]["level"] = "trusted"
    doc["predicate"]["coverage"]["bound"]["one_time_replayed"] = "1"
    env["payload"] = base64.b64encode(json.dumps(doc).encode()).decode()
    (d / CERTIFICATE_NAME).write_text(json.dumps(env))
    with pytest.raises(ReleaseVerificationError, match="not signed by the trusted key"):
        verify_release(str(d), public_key=keys["pub"])


def test_a_suspect_checkpoint_is_not_released(demo, keys, tmp_path):
    with pytest.raises(UntrustedCheckpointError, match=r"main@25: suspect \(after-fault\)"):
        make_release(str(demo / "run" / "main-step000025.safetensors"), key=keys["key"], out=str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_a_ledger_key_is_refused_with_the_fix(demo, tmp_path):
    from certckpt.format.signing import generate_key

    ed, _ = generate_key(str(tmp_path / "ledger-key"))
    with pytest.raises(ConfigurationError, match="certckpt keygen --release"):
        make_release(str(demo / "run"), key=ed, out=str(tmp_path / "r"))


def test_a_verified_run_says_so_and_is_refused_by_default(keys, tmp_path):
    store = tmp_path / "r1"
    store.mkdir()
    model = torch.nn.Linear(4, 2)
    certckpt.save({"model": model.state_dict()}, str(store / "step100.safetensors"), ledger=str(store), step=100)
    with pytest.raises(UntrustedCheckpointError, match="--accept verified"):
        make_release(str(store), key=keys["key"], out=str(tmp_path / "no"))
    out = tmp_path / "rel"
    r = make_release(str(store), key=keys["key"], out=str(out), accept="verified")
    assert r.level == "verified"
    env = json.loads((out / CERTIFICATE_NAME).read_text())
    p = json.loads(base64.b64decode(env["payload"]))["predicate"]
    assert p["verdict"]["level"] == "verified" and p["verdict"]["audited"] is False
    assert "no audit evidence" in p["verdict"]["note"] and p["coverage"]["replay"]["steps"] == []
    cli_r = CliRunner().invoke(cli, ["verify-release", str(out), "--public-key", keys["pub"]])
    assert cli_r.exit_code == 1 and "'verified'" in cli_r.output and "--accept verified" in cli_r.output
    assert verify_release(str(out), public_key=keys["pub"], accept="verified").level == "verified"


def test_a_hostile_certificate_is_one_line(released, keys, tmp_path):
    d = _copy(released, tmp_path)
    (d / CERTIFICATE_NAME).write_text("[" * 100_000 + "]" * 100_000)  # nested past any parser's stack
    r = CliRunner().invoke(cli, ["verify-release", str(d), "--public-key", keys["pub"]])
    assert r.exit_code == 1 and "not a certificate" in r.output and r.output.count("\n") == 1, r.output
    (d / CERTIFICATE_NAME).write_text('{"payloadType": "x"}' + " " * (17 << 20))  # past the size bound
    with pytest.raises(ReleaseVerificationError, match="not a certificate"):
        verify_release(str(d), public_key=keys["pub"])


def test_the_released_weights_are_the_ones_checked_even_if_the_store_file_is_swapped_after(keys, tmp_path, monkeypatch):
    """Someone who can write the store swaps the checkpoint file right after its bytes are checked:
    the release must hold the checked weights (it reads the file once, into a private copy)."""
    import certckpt.ops.release as release

    store = tmp_path / "r1"
    store.mkdir()
    torch.manual_seed(0)
    good = {"w": torch.randn(4, 3)}
    path = store / "step100.safetensors"
    certckpt.save({"model": good}, str(path), ledger=str(store), step=100)
    checked = release.check_file

    def check_then_swap(*args, **kwargs):
        problem = checked(*args, **kwargs)
        evil = tmp_path / "evil.safetensors"
        certckpt.save({"model": {"w": torch.zeros(4, 3)}}, str(evil), step=100)
        path.chmod(0o644)
        evil.replace(path)  # the store's file now holds other weights
        return problem

    monkeypatch.setattr(release, "check_file", check_then_swap)
    out = tmp_path / "rel"
    make_release(str(store), key=keys["key"], out=str(out), accept="verified")
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], good["w"])
    assert torch.equal(certckpt.load(str(path))["model"]["w"], torch.zeros(4, 3))  # the swap did happen
    assert not list(tmp_path.glob(".certckpt-release-*"))  # the private copy beside the release is gone
