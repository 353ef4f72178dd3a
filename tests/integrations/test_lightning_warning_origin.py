"""Issue 45, item 3: the Lightning plugin's "kept latest-good" warning names the user's call (or
certckpt's own line on a saver thread), never a file of Lightning's (``plugins/io/wrapper.py`` under
``AsyncCheckpointIO``)."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from pytorch_lightning.plugins.io import AsyncCheckpointIO

import certckpt.integrations.lightning.checkpoint_io as checkpoint_io
from certckpt.integrations.lightning import CertifiedCheckpointIO


def _io_holding_latest_good(tmp_path):
    io = CertifiedCheckpointIO()
    path = str(tmp_path / "ckpt" / "epoch=0-step=5.ckpt")
    state = {"state_dict": {"w": torch.ones(2)}, "epoch": 0, "global_step": 5}
    io.save_checkpoint(state, path)
    io._keep_reason = lambda store, cid: "it is the run's latest-good"  # what the gate says of a trusted one
    return io, path


def test_lightning_kept_latest_good_warning_points_at_the_users_call(tmp_path):
    io, path = _io_holding_latest_good(tmp_path)
    wrapped = AsyncCheckpointIO(io)
    with pytest.warns(UserWarning, match="kept .* it is the run's latest-good") as caught:
        wrapped.remove_checkpoint(path)  # Lightning's wrapper.py between this line and certckpt
    (w,) = [w for w in caught if "kept" in str(w.message)]
    assert w.filename == __file__, w.filename
    assert os.path.exists(path)


def test_lightning_kept_latest_good_warning_on_a_saver_thread_points_at_certckpt(tmp_path):
    io, path = _io_holding_latest_good(tmp_path)
    wrapped = AsyncCheckpointIO(io)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=wrapped.remove_checkpoint, args=(path,))
        t.start()
        t.join()
    (w,) = [w for w in caught if "kept" in str(w.message)]
    assert w.filename == checkpoint_io.__file__, w.filename  # no user frame: certckpt's line, not Lightning's
