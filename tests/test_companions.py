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
