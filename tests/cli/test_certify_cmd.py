"""`certckpt certify`: existing checkpoints into certified files, never through pickle."""

from __future__ import annotations

import json
import os
import subprocess

import torch
from safetensors.torch import save_file

import certckpt
from tests.support.helpers import console_script


def cli(*args):
    return subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=120)


class NotAllowed:  # a class torch's weights_only loader refuses
    pass


def test_a_torch_save_file_becomes_a_certified_checkpoint_with_the_same_values(tmp_path):
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(4)}, "step": 7, "lr": [0.1, 0.01]}
    torch.save(state, tmp_path / "old.pt")
    r = cli("certify", str(tmp_path / "old.pt"), str(tmp_path / "new.safetensors"))
    assert r.returncode == 0 and "certified" in r.stdout, r.stderr
    assert certckpt.verify(str(tmp_path / "new.safetensors")).ok
    back = certckpt.load(str(tmp_path / "new.safetensors"))
    assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 7 and back["lr"] == [0.1, 0.01]


def test_a_file_that_needs_pickle_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    torch.save({"w": torch.ones(2), "obj": NotAllowed()}, tmp_path / "evil.pt")
    r = cli("certify", str(tmp_path / "evil.pt"), str(tmp_path / "out.safetensors"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "never unpickles" in r.stderr, r.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_a_plain_safetensors_file_keeps_its_names_and_metadata_and_commits_as_verified(tmp_path):
    save_file(
        {"a": torch.arange(6.0), "b": torch.ones(2, 2)}, str(tmp_path / "plain.safetensors"), metadata={"format": "pt"}
    )
    store = tmp_path / "run"
    store.mkdir()
    dest = str(store / "step10.safetensors")
    r = cli("certify", str(tmp_path / "plain.safetensors"), dest, "--ledger", str(store), "--run", "r", "--step", "10")
    assert r.returncode == 0, r.stderr
    info = certckpt.inspect(dest)
    assert {e.name for e in info.header.entries} == {"a", "b"} and info.record.user == {"format": "pt"}
    r = cli("latest-good", str(store), "--accept", "verified")
    assert r.returncode == 0 and r.stdout.strip() == dest, r.stderr
    r = cli("certify", dest, str(tmp_path / "again.safetensors"))
    assert r.returncode == 2 and "already a certckpt checkpoint" in r.stderr


def test_a_model_directory_is_certified_file_by_file_and_pickled_weights_are_refused(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    save_file({"w": torch.ones(3)}, str(src / "model-00001-of-00002.safetensors"))
    save_file({"v": torch.zeros(3)}, str(src / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text("{}")
    r = cli("certify", str(src), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    assert all(certckpt.verify(str(out / n)).ok for n in os.listdir(out) if n.endswith(".safetensors"))
    assert json.loads((out / "model.safetensors.index.json").read_text()) == index
    torch.save({"w": torch.ones(1)}, src / "pytorch_model.bin")
    r = cli("certify", str(src), str(tmp_path / "out2"))
    assert r.returncode == 2 and "pytorch_model.bin" in r.stderr and not (tmp_path / "out2").exists()
