"""Issue 45, item 2: ``certckpt verify checkpoint-N/`` says what it verified: every file of the
directory (the certified ones whole, the plain ones by their digests), their tensors and bytes, in
one summary line, and each of them with ``--json``."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import certckpt
from certckpt.format.companions import plain_entry
from certckpt_cli.main import main


def _checkpoint(store, step):
    d = store / f"checkpoint-{step}"
    d.mkdir(parents=True)
    w = certckpt.save({"a": torch.ones(4), "b": torch.zeros(2, 3)}, d / "model.safetensors")
    r = certckpt.save({"python": torch.ones(1)}, d / "rng_state.safetensors")
    (d / "config.json").write_text(json.dumps({"n": step}))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    files = {
        "model.safetensors": {"bytes": (d / "model.safetensors").stat().st_size, "header_digest": w.header_digest},
        "rng_state.safetensors": {
            "bytes": (d / "rng_state.safetensors").stat().st_size,
            "header_digest": r.header_digest,
        },
        "config.json": plain_entry(str(d / "config.json")),
        "trainer_state.json": plain_entry(str(d / "trainer_state.json")),
    }
    meta = {"layout": "test-bundle/1", "files": json.dumps(files, sort_keys=True, separators=(",", ":"))}
    certckpt.save({"optim": torch.ones(3)}, d / "trainer.safetensors", ledger=str(store), step=step, metadata=meta)
    return d


def test_verify_checkpoint_directory_lists_what_was_verified(tmp_path):
    d = _checkpoint(tmp_path / "out", 5)
    nbytes = sum(p.stat().st_size for p in d.iterdir())
    runner = CliRunner()
    r = runner.invoke(main, ["verify", str(d)])
    assert r.exit_code == 0, r.output
    (line,) = r.output.splitlines()  # one summary line
    assert line.startswith(f"OK  {d / 'trainer.safetensors'}  5 files, 4 tensors, ")
    assert "trainer.safetensors (1 tensors)" in line
    assert "model.safetensors, rng_state.safetensors (3 tensors)" in line
    assert "config.json, trainer_state.json (digests)" in line
    doc = json.loads(runner.invoke(main, ["verify", str(d), "--json"]).output)
    assert doc["ok"] and doc["total"] == {"files": 5, "tensors": 4, "bytes": nbytes}
    by_name = {c["name"]: c for c in doc["companions"]}
    assert set(by_name) == {"model.safetensors", "rng_state.safetensors", "config.json", "trainer_state.json"}
    assert by_name["model.safetensors"] == {
        "name": "model.safetensors",
        "kind": "certified",
        "bytes": (d / "model.safetensors").stat().st_size,
        "tensors": 2,
    }
    assert by_name["config.json"]["kind"] == "plain" and by_name["config.json"]["tensors"] == 0
    # a single file keeps its short line
    r = runner.invoke(main, ["verify", str(d / "model.safetensors")])
    assert r.output.startswith(f"OK  {d / 'model.safetensors'}  2 tensors, "), r.output
