#!/usr/bin/env python
"""Checkpoint time under PyTorch Lightning: CertifiedCheckpointIO against Lightning's own TorchCheckpointIO.

Run from the repository root:

    python benchmarks/bench_lightning.py            # ~600 MiB checkpoints, 5 trials (~1 min on 2 cores)
    python benchmarks/bench_lightning.py --quick    # ~50 MiB checkpoints, 3 trials (smoke run)
    python benchmarks/bench_lightning.py --json     # also print every figure and sample as JSON

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): 2 layers of 64, one trial: every code path in
seconds, figures meaningless.

The model: an MLP of ``--layers`` square float32 ``Linear`` layers of width ``--width`` (default 12 x
2048: 201 MiB of weights), trained one step with AdamW under a real ``Trainer`` so that the
checkpoint holds what a training run's does: weights, the optimizer's two moments, the scheduler,
callbacks' and loops' state, hyper-parameters (about 3x the weights).

Measurements, in one process, on the same checkpoint dict (Lightning's own, built once by
``trainer._checkpoint_connector.dump_checkpoint()``), interleaved: one untimed warm-up round, then
``--trials`` rounds whose contenders rotate their order; each save goes to a fresh directory on local
disk, deleted and ``os.sync()``'d untimed after the trial:

1. save: ``CertifiedCheckpointIO().save_checkpoint`` (certified file, fsync'd, committed to the
   directory's ledger) vs ``TorchCheckpointIO().save_checkpoint`` as Lightning ships it (``torch.save``
   to memory, then one write; no fsync) vs the same + ``os.fsync`` of the file (the like-for-like
   durability). Ratios of medians against both.
2. load (the resume path, warm page cache): ``CertifiedCheckpointIO().load_checkpoint`` (every digest
   checked) vs ``TorchCheckpointIO().load_checkpoint`` (``torch.load``).

Not measured here: ``AuditCallback``'s consensus at a checkpoint (a collective over the ranks'
weight fingerprints, needs DDP; ``bench_detect.py`` measures the auditor's costs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

MiB = 1 << 20


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def interleaved(
    contenders: list[tuple[str, Callable[[int], Any]]], trials: int, after: Callable[[], None] | None = None
) -> dict:
    """One untimed warm-up round, then ``trials`` rounds; the order rotates every round."""
    samples: dict[str, list[float]] = {name: [] for name, _ in contenders}
    warmup: dict[str, float] = {}
    n = 0
    for r in range(trials + 1):
        k = r % len(contenders)
        for name, fn in contenders[k:] + contenders[:k]:
            n += 1
            t0 = time.perf_counter()
            fn(n)
            dt = time.perf_counter() - t0
            if r == 0:
                warmup[name] = dt
            else:
                samples[name].append(dt)
            if after:
                after()
        print(f"  round {r}/{trials} done", file=sys.stderr, flush=True)
    return {"samples": samples, "warmup": warmup, "median": {n: median(s) for n, s in samples.items()}}


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def fmt(res: dict, name: str) -> str:
    s = res["samples"][name]
    return f"{median(s):.3f} s [{min(s):.3f}-{max(s):.3f}]"


def build_checkpoint(layers: int, width: int) -> tuple[dict, int]:
    """Lightning's checkpoint dict after one AdamW step of the benchmark MLP, and the weights' bytes."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class MLP(pl.LightningModule):
        def __init__(self, layers: int, width: int, lr: float = 1e-3):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}

    torch.manual_seed(0)
    model = MLP(layers, width)
    data = DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return checkpoint, weights


def bench(checkpoint: dict, d: str, trials: int) -> dict:
    from lightning_fabric.plugins import TorchCheckpointIO

    from certckpt.integrations.lightning import CertifiedCheckpointIO

    certified, plain = CertifiedCheckpointIO(), TorchCheckpointIO()

    def path(n: int) -> str:
        return os.path.join(d, f"trial{n}", "epoch=0-step=1.ckpt")

    def c_save(n: int) -> None:
        certified.save_checkpoint(checkpoint, path(n))

    def t_save(n: int) -> None:
        plain.save_checkpoint(checkpoint, path(n))

    def t_save_fsync(n: int) -> None:
        plain.save_checkpoint(checkpoint, path(n))
        fd = os.open(path(n), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def cleanup() -> None:
        for name in os.listdir(d):
            shutil.rmtree(os.path.join(d, name))
        gc.collect()
        os.sync()

    out: dict[str, Any] = {}
    print("save:", file=sys.stderr)
    out["save"] = interleaved(
        [
            ("CertifiedCheckpointIO", c_save),
            ("TorchCheckpointIO", t_save),
            ("TorchCheckpointIO + fsync", t_save_fsync),
        ],
        trials,
        cleanup,
    )
    m = out["save"]["median"]
    out["save"]["ratio_vs_torch"] = m["CertifiedCheckpointIO"] / m["TorchCheckpointIO"]
    out["save"]["ratio_vs_torch_fsync"] = m["CertifiedCheckpointIO"] / m["TorchCheckpointIO + fsync"]

    # load: one file of each kind, read back repeatedly (warm page cache, as a resume right after a save)
    certified.save_checkpoint(checkpoint, path(-1))
    plain.save_checkpoint(checkpoint, path(-2))
    out["bytes"] = {"certified": os.path.getsize(path(-1)), "torch": os.path.getsize(path(-2))}
    print("load:", file=sys.stderr)
    out["load"] = interleaved(
        [
            ("CertifiedCheckpointIO", lambda n: CertifiedCheckpointIO().load_checkpoint(path(-1))),
            ("TorchCheckpointIO", lambda n: plain.load_checkpoint(path(-2))),
        ],
        trials,
        gc.collect,
    )
    m = out["load"]["median"]
    out["load"]["ratio_vs_torch"] = m["CertifiedCheckpointIO"] / m["TorchCheckpointIO"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers of 1024: ~50 MiB checkpoints, 3 trials")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the temp dir goes (local disk, not tmpfs)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tinymode import announce

    tiny = announce("bench_lightning")
    layers = args.layers or (2 if tiny else 4 if args.quick else 12)
    width = args.width or (64 if tiny else 1024 if args.quick else 2048)
    trials = args.trials or (1 if tiny else 3 if args.quick else 5)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    import pytorch_lightning as pl
    import torch

    checkpoint, weights = build_checkpoint(layers, width)
    with tempfile.TemporaryDirectory(prefix="bench-lightning-", dir=args.dir) as d:
        R = bench(checkpoint, d, trials)
    R["config"] = {"layers": layers, "width": width, "trials": trials, "weights_mib": weights / MiB}

    s, ld = R["save"], R["load"]
    print(
        f"bench_lightning: {platform.node()}, {os.cpu_count()} CPUs (load average {loadavg()} at the end),"
        f" torch {torch.__version__},"
        f" pytorch_lightning {pl.__version__}; MLP {layers} x {width}x{width} fp32 + AdamW:"
        f" {weights / MiB:.0f} MiB of weights, checkpoint {R['bytes']['certified'] / MiB:.0f} MiB certified /"
        f" {R['bytes']['torch'] / MiB:.0f} MiB torch.save; medians of {trials} interleaved trials [min-max]"
    )
    rows = [
        ("save, CertifiedCheckpointIO (fsync'd, committed)", fmt(s, "CertifiedCheckpointIO")),
        ("save, TorchCheckpointIO (Lightning's default, no fsync)", fmt(s, "TorchCheckpointIO")),
        ("save, TorchCheckpointIO + fsync", fmt(s, "TorchCheckpointIO + fsync")),
        ("ratio certified / TorchCheckpointIO", f"{s['ratio_vs_torch']:.3f}x"),
        ("ratio certified / TorchCheckpointIO + fsync", f"{s['ratio_vs_torch_fsync']:.3f}x"),
        ("load, CertifiedCheckpointIO (digests checked)", fmt(ld, "CertifiedCheckpointIO")),
        ("load, TorchCheckpointIO (torch.load)", fmt(ld, "TorchCheckpointIO")),
        ("ratio certified / TorchCheckpointIO", f"{ld['ratio_vs_torch']:.3f}x"),
    ]
    width_col = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"  {label:<{width_col}}  {value}")
    if args.json:
        print(json.dumps(R, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
