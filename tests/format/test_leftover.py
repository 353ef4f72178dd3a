"""``leftover_problem``: a checkpoint directory may be removed before a save takes its name again
only when it is provably what an uncommitted save of the same run at the same step left. Every
other shape is refused with the reason (doubt frees no space)."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

import certckpt
from certckpt.integrations.transformers.checkpoint import MANIFEST_NAME, leftover_problem


def _left(tmp_path, *, run="r", step=3):
    """What a save of ``run`` at ``step`` leaves when it dies before its manifest."""
    d = tmp_path / "checkpoint-3"
    d.mkdir()
    certckpt.save({"w": torch.ones(2)}, str(d / "model.safetensors"), run=run, step=step)
    certckpt.save({"cpu": torch.zeros(1)}, str(d / "rng_state.safetensors"), run=run, step=step)
    (d / "config.json").write_text("{}")
    (d / ".model.safetensors.tmp").write_bytes(b"half")  # a writer's temp file
    return d


def test_an_uncommitted_save_of_this_run_and_step_is_a_leftover(tmp_path):
    assert leftover_problem(str(_left(tmp_path)), run="r", step=3) is None


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: None, "written by run 'r' at step 3 (not 'other' at 3)"),
        (lambda d: certckpt.save({"o": torch.ones(1)}, str(d / MANIFEST_NAME), run="r", step=3), "a manifest"),
        (lambda d: torch.save({"o": 1}, d / "optimizer.pt"), "optimizer.pt, a pickle"),
        (
            lambda d: safetensors.torch.save_file({"x": torch.ones(1)}, str(d / "extra.safetensors")),
            "a file certckpt did not write",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x08" + bytes(7)), "does not read whole"),
        (lambda d: (d / "sub").mkdir(), "'sub', which is not a plain file"),
        (lambda d: os.symlink(d / "config.json", d / "link.json"), "'link.json', which is not a plain file"),
        (lambda d: [os.remove(d / n) for n in ("model.safetensors", "rng_state.safetensors")], "no certified file"),
    ],
    ids=["another-run", "manifest", "pickle", "uncertified", "truncated", "subdirectory", "link", "nothing-certified"],
)
def test_anything_else_is_not_a_leftover_and_says_why(tmp_path, change, words):
    d = _left(tmp_path)
    change(d)
    problem = leftover_problem(str(d), run="other" if words.startswith("written by") else "r", step=3)
    assert problem is not None and words in problem


def test_another_step_or_a_linked_directory_is_not_a_leftover(tmp_path):
    d = _left(tmp_path)
    assert "at step 3 (not 'r' at 6)" in leftover_problem(str(d), run="r", step=6)
    os.symlink(d, tmp_path / "checkpoint-6")
    assert leftover_problem(str(tmp_path / "checkpoint-6"), run="r", step=3) == "it is a symbolic link"
