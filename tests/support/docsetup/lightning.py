# What the Lightning snippets take for granted: a LightningModule, a datamodule, no checkpoint to
# resume from, and a short run (20 steps) so that the doc test stays quick.
import argparse
import functools

import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: F401  (the snippets' names)
from torch.utils.data import DataLoader, TensorDataset


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        x = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :4].cos()), batch_size=4)


torch.manual_seed(0)
model, datamodule, ckpt_path = LitModel(), Data(), None
args = argparse.Namespace(ckpt_path=None)
L.Trainer = functools.partial(L.Trainer, max_steps=20, logger=False, enable_progress_bar=False)
