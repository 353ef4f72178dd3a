"""Saves made durable together (``durable_together``): every file fsync'd before its name appears, the
directory fsync'd once after the names, nothing published when the block fails."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import certckpt
from certckpt.format.durable import DurableBatch, durable_together, joining
from certckpt.format.writer import save_certified


@pytest.fixture
def disk_calls(monkeypatch):
    """The real fsync, link and replace, each recorded (with the inode it acted on) once it returned."""
    events: list[tuple[str, int]] = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        real_fsync(fd)
        events.append(("dir-fsync" if stat.S_ISDIR(st.st_mode) else "fsync", st.st_ino))

    def link(src, dst, *args, **kwargs):
        real_link(src, dst, *args, **kwargs)
        events.append(("name", os.stat(dst).st_ino))

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        events.append(("name", os.stat(dst).st_ino))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _temps(d) -> list[str]:
    return [n for n in os.listdir(d) if n.startswith(".")]


def test_files_appear_durable_at_the_end_of_the_block_and_the_directory_is_synced_once(tmp_path, disk_calls):
    old = tmp_path / "replaced.safetensors"
    certckpt.save({"w": torch.zeros(4)}, old, step=0)
    disk_calls.clear()
    hook = tmp_path / "hook.json"
    with durable_together() as batch:
        for i in range(3):
            path = tmp_path / f"f{i}.safetensors"
            save_certified({"w": torch.full((50_000,), float(i))}, path, step=i)  # create-only: a hard link
            assert not path.exists()  # under a temp name until the block ends
        with durable_together():  # an inner block joins the outer one
            certckpt.save({"w": torch.ones(4)}, old, step=9)  # replaces: os.replace
        assert certckpt.load(old)["w"].sum() == 0  # the previous file is untouched until the end
        hook.write_text("{}")  # a file someone else wrote without an fsync
        batch.add_existing(str(hook))
    assert _temps(tmp_path) == []
    for i in range(3):
        assert torch.equal(certckpt.load(tmp_path / f"f{i}.safetensors")["w"], torch.full((50_000,), float(i)))
    assert certckpt.verify(old).ok and certckpt.load(old)["w"].sum() == 4
    at = {e: k for k, e in enumerate(disk_calls)}  # each event's position
    names = [k for k, (what, _) in enumerate(disk_calls) if what == "name"]
    assert len(names) == 4
    for f in [*(tmp_path / f"f{i}.safetensors" for i in range(3)), old, hook]:
        ino = os.stat(f).st_ino
        assert ("fsync", ino) in at, f"{f.name} was never fsync'd"
        if ("name", ino) in at:
            assert at[("fsync", ino)] < at[("name", ino)], f"{f.name} got its name before its bytes were durable"
    dir_syncs = [k for k, e in enumerate(disk_calls) if e == ("dir-fsync", os.stat(tmp_path).st_ino)]
    assert len(dir_syncs) == 1 and dir_syncs[0] > max(names), disk_calls  # once, after every name
    assert dir_syncs[0] == len(disk_calls) - 1  # and the block returned only then


def test_a_failure_in_the_block_publishes_nothing(tmp_path):
    old = tmp_path / "kept.safetensors"
    certckpt.save({"w": torch.zeros(4)}, old, step=0)
    with pytest.raises(RuntimeError, match="the training loop broke"), durable_together():
        save_certified({"w": torch.ones(8)}, tmp_path / "new.safetensors", step=1)
        certckpt.save({"w": torch.ones(4)}, old, step=1)
        raise RuntimeError("the training loop broke")
    assert sorted(os.listdir(tmp_path)) == ["kept.safetensors"]  # no new name, no temp file left
    assert certckpt.load(old)["w"].sum() == 0


def test_a_name_taken_meanwhile_is_refused_at_the_end_and_left_alone(tmp_path):
    taken = tmp_path / "b.safetensors"
    with pytest.raises(certckpt.CheckpointExistsError, match="b.safetensors"), durable_together():
        save_certified({"w": torch.ones(8)}, tmp_path / "a.safetensors", step=1)
        save_certified({"w": torch.ones(8)}, taken, step=1)
        taken.write_bytes(b"another writer's")
    assert taken.read_bytes() == b"another writer's"
    assert _temps(tmp_path) == []
    assert certckpt.verify(tmp_path / "a.safetensors").ok  # durable before the one refused: published


def test_saves_joining_a_batch_are_published_by_its_owner_and_a_discard_leaves_nothing(tmp_path, disk_calls):
    # DeepSpeed's checkpoint engine: one file per call, the batch published at its commit.
    batch = DurableBatch()
    for i in range(2):
        with joining(batch):
            save_certified({"w": torch.full((1000,), float(i))}, tmp_path / f"f{i}.safetensors", step=i)
        assert not (tmp_path / f"f{i}.safetensors").exists()  # the block's end publishes nothing
    certckpt.save({"w": torch.ones(4)}, tmp_path / "alone.safetensors", step=5)  # outside: published at once
    assert (tmp_path / "alone.safetensors").exists()
    before = len(disk_calls)
    batch.publish()
    assert [certckpt.load(tmp_path / f"f{i}.safetensors")["w"][0].item() for i in range(2)] == [0.0, 1.0]
    at = {e: k for k, e in enumerate(disk_calls)}
    for i in range(2):  # each file fsync'd before its name appeared
        ino = os.stat(tmp_path / f"f{i}.safetensors").st_ino
        assert at[("fsync", ino)] < at[("name", ino)]
    published = [what for what, _ in disk_calls[before:] if what != "fsync"]
    assert published == ["name", "name", "dir-fsync"]  # the names, then the directory once
    # a save that never reached its commit: its batch discarded, no name and no temp file left
    left = DurableBatch()
    with joining(left):
        save_certified({"w": torch.ones(8)}, tmp_path / "never.safetensors", step=9)
    left.discard()
    assert sorted(os.listdir(tmp_path)) == ["alone.safetensors", "f0.safetensors", "f1.safetensors"]
