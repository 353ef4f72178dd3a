"""One committed file certifying its directory: the files its record lists (size and digest) are
checked wherever its bytes are (latest-good, status --verify-bytes), so a damaged, replaced or
missing companion makes the checkpoint fail like a damaged file."""

from __future__ import annotations

import json

import torch

import certckpt
from certckpt.format.companions import companion_problems
from certckpt.trust.runstore import find_latest_good


def _checkpoint(store, step):
    d = store / f"checkpoint-{step}"
    d.mkdir(parents=True)
    w = certckpt.save({"w": torch.full((4,), float(step))}, d / "model.safetensors")
    (d / "state.json").write_text(json.dumps({"step": step}))
    files = {
        "model.safetensors": {"bytes": (d / "model.safetensors").stat().st_size, "header_digest": w.header_digest},
        "state.json": {"bytes": (d / "state.json").stat().st_size, "xxh3": _xxh3(d / "state.json")},
    }
    meta = {"layout": "test-bundle/1", "files": json.dumps(files, sort_keys=True, separators=(",", ":"))}
    certckpt.save({"optim": torch.ones(2)}, d / "manifest.safetensors", ledger=str(store), step=step, metadata=meta)
    return d


def _xxh3(path):
    import xxhash

    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def test_a_damaged_or_missing_companion_fails_the_checkpoint(tmp_path):
    store = tmp_path / "out"
    _checkpoint(store, 5)
    d10 = _checkpoint(store, 10)
    _, good = find_latest_good(str(store), accept="verified", write_certificates=False)
    assert good == "main@10"
    (d10 / "state.json").write_text(json.dumps({"step": 11}))  # same size, other bytes
    status, good = find_latest_good(str(store), accept="verified", write_certificates=False)
    assert good == "main@5" and "xxh3 digest differs" in status.problems["main@10"]
    (d10 / "model.safetensors").unlink()
    rec = certckpt.inspect(d10 / "manifest.safetensors").record
    problems = companion_problems(str(d10 / "manifest.safetensors"), rec)
    assert any("model.safetensors: missing" in p for p in problems) and len(problems) == 2


def test_a_companion_that_is_a_symbolic_link_is_refused_even_to_a_file_with_its_bytes(tmp_path):
    import shutil

    d = _checkpoint(tmp_path / "out", 5)
    elsewhere = tmp_path / "elsewhere.json"
    shutil.copyfile(d / "state.json", elsewhere)  # the very bytes the listing binds
    (d / "state.json").unlink()
    (d / "state.json").symlink_to(elsewhere)
    rec = certckpt.inspect(d / "manifest.safetensors").record
    (problem,) = companion_problems(str(d / "manifest.safetensors"), rec)
    assert "state.json: a symbolic link where a file of the checkpoint should be" in problem


def test_a_hostile_files_table_is_a_problem_not_a_path(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    meta = {"layout": "x", "files": json.dumps({"../../etc/passwd": {"bytes": 1, "xxh3": "0" * 32}})}
    certckpt.save({"a": torch.ones(1)}, d / "m.safetensors", metadata=meta)
    rec = certckpt.inspect(d / "m.safetensors").record
    (problem,) = companion_problems(str(d / "m.safetensors"), rec)
    assert "unreadable" in problem


def test_verify_takes_a_directory_shaped_checkpoint_and_any_flipped_byte_in_it(tmp_path):
    from click.testing import CliRunner

    from certckpt_cli.main import main

    d = _checkpoint(tmp_path / "out", 5)
    runner = CliRunner()
    r = runner.invoke(main, ["verify", str(d)])
    assert r.exit_code == 0 and r.output.startswith(f"OK  {d / 'manifest.safetensors'}"), r.output
    model = d / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0x01
    model.chmod(0o644)
    model.write_bytes(bytes(data))
    for target in (d, d / "manifest.safetensors"):  # the directory, or its certified file alone
        r = runner.invoke(main, ["verify", str(target)])
        assert r.exit_code == 1 and "FAILED" in r.output and "model.safetensors" in r.output, r.output


def test_latest_good_dir_prints_the_directory_from_pretrained_takes(tmp_path):
    from click.testing import CliRunner

    from certckpt_cli.main import main

    store = tmp_path / "out"
    d = _checkpoint(store, 5)
    r = CliRunner().invoke(main, ["latest-good", str(store), "--accept", "verified", "--dir"])
    assert r.exit_code == 0 and r.output.strip() == str(d), r.output
    r = CliRunner().invoke(main, ["latest-good", str(store), "--accept", "verified"])
    assert r.output.strip() == str(d / "manifest.safetensors")
    doc = json.loads(CliRunner().invoke(main, ["latest-good", str(store), "--accept", "verified", "--json"]).output)
    assert doc["directory"] == str(d)


def test_inspect_and_status_take_a_checkpoint_directory(tmp_path):
    from click.testing import CliRunner

    from certckpt_cli.main import main

    store = tmp_path / "out"
    _checkpoint(store, 5)
    d = _checkpoint(store, 10)
    runner = CliRunner()
    r = runner.invoke(main, ["inspect", str(d)])
    assert r.exit_code == 0 and r.output.startswith(f"{d / 'manifest.safetensors'}: certckpt schema"), r.output
    assert "model.safetensors" in r.output and "state.json" in r.output and "bytes digested" in r.output
    doc = json.loads(runner.invoke(main, ["inspect", str(d), "--json"]).output)
    assert [c["name"] for c in doc["companions"]] == ["model.safetensors", "state.json"]
    r = runner.invoke(main, ["status", str(d)])
    assert (
        r.exit_code == 0
        and r.output.splitlines()[0] == f"{d}: main@10 in the store {store}: verified (no-consensus, awaiting-audit)"
    )
    doc = json.loads(runner.invoke(main, ["status", str(d), "--json"]).output)
    assert doc["checkpoint"] == "main@10" and doc["store"] == str(store)
    r = runner.invoke(main, ["verify", str(d / "model.safetensors")])  # one member: says it checked that only
    assert r.exit_code == 0 and f"part of the checkpoint {d}; `certckpt verify {d}`" in r.output, r.output
    r = runner.invoke(main, ["verify", str(store)])  # the store itself is not one checkpoint: the command that is
    assert r.exit_code == 2 and f"certckpt status {store} --verify-bytes" in r.output


def _state_json(step):
    # more than one 1,024-byte xxh3 block, as a real trainer_state.json is
    return json.dumps({"global_step": step, "log_history": [{"loss": 1.0 / (i + 1), "step": i} for i in range(60)]})


def test_an_xxh3_forged_companion_keeps_its_xxh3_and_fails_its_cryptographic_digest(tmp_path):
    from certckpt.format.companions import plain_entry
    from tests.support.xxh3_forge import forge

    d = tmp_path / "checkpoint-7"
    d.mkdir()
    (d / "trainer_state.json").write_text(_state_json(7))
    entry = plain_entry(str(d / "trainer_state.json"))
    assert set(entry) == {"bytes", "xxh3", "blake3"}
    meta = {"layout": "test-bundle/1", "files": json.dumps({"trainer_state.json": entry}, separators=(",", ":"))}
    certckpt.save({"optim": torch.ones(2)}, d / "manifest.safetensors", metadata=meta)
    rec = certckpt.inspect(d / "manifest.safetensors").record
    assert companion_problems(str(d / "manifest.safetensors"), rec) == []

    forged = forge((d / "trainer_state.json").read_bytes())
    assert _xxh3_of_bytes(forged) == entry["xxh3"] and forged != (d / "trainer_state.json").read_bytes()
    (d / "trainer_state.json").write_bytes(forged)
    (problem,) = companion_problems(str(d / "manifest.safetensors"), rec)  # no key needed: BLAKE3 is in the entry
    assert "trainer_state.json: BLAKE3 digest differs" in problem


def test_a_keyed_read_refuses_a_companion_bound_by_xxh3_only(tmp_path):
    from certckpt.format.signing import TrustedKeys, generate_key

    _, pub = generate_key(str(tmp_path / "k"))
    store = tmp_path / "out"
    d = _checkpoint(store, 3)  # the entry of state.json has xxh3 only, as listings before BLAKE3 did
    rec = certckpt.inspect(d / "manifest.safetensors").record
    assert not [p for p in companion_problems(str(d / "manifest.safetensors"), rec) if "state.json" in p]
    problems = companion_problems(str(d / "manifest.safetensors"), rec, trusted_keys=TrustedKeys.load([pub]))
    assert any("state.json: its listing binds it by xxh3 only" in p for p in problems), problems


def _xxh3_of_bytes(data):
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)
