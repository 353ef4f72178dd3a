"""Issue 45, item 5 (docs/integrations.md, "What happens to your disk"): after a resume, the
checkpoint resumed from is released by the rotation of the new branch, through the deletion gate
(``rotation_keeps``): it stays while the gate keeps it (latest-good), and goes at the first rotation
after that, in the Hugging Face Trainer (``checkpoint-N/`` under ``save_total_limit``) and in
Lightning (``epoch=0-step=N.ckpt`` under ``save_top_k``, which Lightning itself never deletes once
it resumed from it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _retired(store) -> list[str]:
    d = os.path.join(store, "_ledger", "retired")
    return sorted(n.removesuffix(".json") for n in os.listdir(d)) if os.path.isdir(d) else []


# --- the Hugging Face Trainer ---------------------------------------------------------------------


@pytest.mark.parametrize("kept_while_latest_good", [False, True], ids=["released", "gate-keeps-then-releases"])
def test_resume_releases_the_resumed_from_checkpoint_trainer(tmp_path, monkeypatch, kept_while_latest_good):
    pytest.importorskip("transformers")
    import certckpt.integrations.transformers.trainer as trainer_module
    from tests.support.hf_cases import certified_trainer

    out = str(tmp_path / "out")
    certified_trainer(out, save_steps=2, save_total_limit=1, max_steps=8, stop=4).train()
    assert sorted(os.listdir(out)) == ["_ledger", "checkpoint-4"]
    if kept_while_latest_good:
        gate = trainer_module.rotation_keeps
        asked = []

        def keeps_main4_until_step_8(cid, **kw):  # as if main@4 were latest-good until main-r1@8 is trusted
            asked.append(cid)
            newest = max(int(c.split("@")[1]) for c in kw["snap"].records)
            return "it is the run's latest-good" if cid == "main@4" and newest < 8 else gate(cid, **kw)

        monkeypatch.setattr(trainer_module, "rotation_keeps", keeps_main4_until_step_8)
    resumed = certified_trainer(out, save_steps=2, save_total_limit=1, max_steps=8)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.certckpt.branch == "main-r1"
    # the resumed-from checkpoint-4 counted as the run's oldest: released, and retired in the ledger
    assert sorted(os.listdir(out)) == ["_ledger", "main-r1"]
    assert os.listdir(os.path.join(out, "main-r1")) == ["checkpoint-8"]
    assert "main@4" in _retired(out)
    if kept_while_latest_good:
        assert asked.count("main@4") >= 2  # kept at main-r1@6, released at main-r1@8


# --- Lightning ------------------------------------------------------------------------------------


def _lightning_run(tmp_path, *, max_steps, ckpt_path=None, save_top_k=1):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from certckpt.integrations.lightning import CertifiedCheckpointIO

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    x = torch.randn(80, 4)
    io = CertifiedCheckpointIO()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=max_steps,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=save_top_k)],
    )
    trainer.fit(Lit(), DataLoader(TensorDataset(x, x[:, :2]), batch_size=4), ckpt_path=ckpt_path)
    return io


def _files(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.startswith("_"))


@pytest.mark.parametrize("kept_while_latest_good", [False, True], ids=["released", "gate-keeps-then-releases"])
def test_resume_releases_the_resumed_from_checkpoint_lightning(tmp_path, monkeypatch, kept_while_latest_good):
    import warnings

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _lightning_run(tmp_path, max_steps=10)
    assert _files(ckpt) == ["epoch=0-step=10.ckpt"]
    if kept_while_latest_good:
        import certckpt.integrations.lightning.checkpoint_io as io_module

        gate = io_module.rotation_keeps

        def keeps_main10_until_step_25(cid, **kw):  # as if main@10 were latest-good until main-r1@25 is trusted
            newest = max(int(c.split("@")[1]) for c in kw["snap"].records)
            return "it is the run's latest-good" if cid == "main@10" and newest < 25 else gate(cid, **kw)

        monkeypatch.setattr(io_module, "rotation_keeps", keeps_main10_until_step_25)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io = _lightning_run(tmp_path, max_steps=30, ckpt_path=str(ckpt / "epoch=0-step=10.ckpt"))
    assert io.resume_point is not None and io.branch == "main-r1"
    # Lightning alone would leave epoch=0-step=10.ckpt on disk for good (it never deletes its ckpt_path)
    assert _files(ckpt) == ["epoch=1-step=30.ckpt"], _files(ckpt)
    assert "main@10" in _retired(str(ckpt))
    with open(os.path.join(ckpt, "_ledger", "retired", "main@10.json")) as f:
        assert json.load(f)["policy"] == "lightning"
    kept = [str(w.message) for w in caught if "kept" in str(w.message) and "main@10" in str(w.message)]
    assert bool(kept) == kept_while_latest_good, kept  # kept (with its warning) while the gate said so


def test_resume_keeps_the_resumed_from_checkpoint_when_save_top_k_keeps_everything(tmp_path):
    import warnings

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _lightning_run(tmp_path, max_steps=10, save_top_k=-1)
        _lightning_run(tmp_path, max_steps=20, ckpt_path=str(ckpt / "epoch=0-step=10.ckpt"), save_top_k=-1)
    assert "epoch=0-step=10.ckpt" in _files(ckpt) and "main@10" not in _retired(str(ckpt))
