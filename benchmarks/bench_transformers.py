#!/usr/bin/env python
"""Checkpoint time of the Hugging Face Trainer: its own ``_save_checkpoint`` against the certified one.

Run from the repository root:

    python benchmarks/bench_transformers.py            # GPT2 124M (0.5 GB weights, 1 GB AdamW state), 5 trials
    python benchmarks/bench_transformers.py --quick    # a 2-layer GPT2 with hidden 256: a smoke run
    python benchmarks/bench_transformers.py --json     # also print every sample as JSON

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a 1-layer GPT2 with hidden 32, one trial: every
code path in seconds, figures meaningless.

One model, one AdamW state (after one real training step), and three contenders, each saving
``checkpoint-1/`` into a fresh output directory:

    plain          transformers.Trainer._save_checkpoint: model.safetensors (safetensors, no fsync),
                   optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin (torch.save), JSON
    plain+fsync    the same, then an fsync of every file it wrote and of the directory (what a
                   checkpoint must cost to survive a crash; certckpt always pays it)
    certified      CertifiedTrainer._save_checkpoint: certified model.safetensors, RNG file and
                   manifest (optimizer, scheduler: fsync'd, create-only), and the ledger commit

Every timing: one untimed warm-up round, then ``--trials`` rounds, the contenders' order rotating
every round; the directory is deleted and ``os.sync()`` called, untimed, after each save. Medians,
[min-max], and the ratios certified/plain and certified/plain+fsync, of the medians and of the
fastest runs (on a shared machine the disk's writeback stalls dominate the spread: read both).
Nothing is hard-coded: every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MB = 1e6


def build(quick: bool, tiny: bool = False):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if tiny:
        cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32)
    elif quick:
        cfg = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=64)
    else:  # GPT2 "small": 124M parameters
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return GPT2LMHeadModel(cfg)


class Tokens:
    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        import torch

        ids = torch.randint(0, self.vocab, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer_pair(model, root: str):
    """A plain and a certified Trainer sharing one model, both after the same single training step."""
    from transformers import Trainer, TrainingArguments

    from certckpt.integrations.transformers import CertifiedTrainer

    def args(out: str) -> TrainingArguments:
        return TrainingArguments(
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=2,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            logging_strategy="no",
        )

    data = Tokens(model.config.vocab_size)
    plain = Trainer(model=model, args=args(os.path.join(root, "warm")), train_dataset=data)
    with contextlib.redirect_stdout(sys.stderr):  # the Trainer prints its metrics; the report owns stdout
        plain.train()  # one step: AdamW's moments exist
    cert = CertifiedTrainer(model=model, args=args(os.path.join(root, "cert-warm")), train_dataset=data)
    # The certified one saves the very same state: the optimizer, scheduler and step of the plain one.
    cert.optimizer, cert.lr_scheduler, cert.state = plain.optimizer, plain.lr_scheduler, plain.state
    cert.certckpt.branch = "main"
    return plain, cert


def fsync_tree(path: str) -> None:
    for d, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def interleaved(contenders: list[tuple[str, Callable[[], Any]]], trials: int, after: Callable[[], None]) -> dict:
    samples: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for r in range(trials + 1):
        k = r % len(contenders)
        for name, fn in contenders[k:] + contenders[:k]:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r:
                samples[name].append(dt)
            after()
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small GPT2: a smoke run")
    ap.add_argument("--trials", type=int, default=None, help="timed rounds (default 5, quick 3)")
    ap.add_argument("--dir", default=None, help="parent of the temp dir (default: the system temp dir)")
    ap.add_argument("--json", action="store_true", help="also print every sample as JSON")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tinymode import announce

    tiny = announce("bench_transformers")
    trials = args.trials or (1 if tiny else 3 if args.quick else 5)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    import torch
    import transformers

    import certckpt

    root = tempfile.mkdtemp(prefix="certckpt-bench-hf-", dir=args.dir)
    try:
        log("building the model and taking one training step")
        model = build(args.quick, tiny)
        params = sum(p.numel() for p in model.parameters())
        plain, cert = trainer_pair(model, root)
        counter = {"n": 0}
        sizes: dict[str, int] = {}
        files: dict[str, list[str]] = {}

        def fresh(kind: str) -> str:
            counter["n"] += 1
            out = os.path.join(root, f"{kind}-{counter['n']}")
            for t in (plain, cert):
                t.args.output_dir = out
            if kind == "certified":
                cert.certckpt.ledger = type(cert.certckpt.ledger)(out)  # a fresh store: main@1 is free
            return out

        def measure(kind: str, out: str) -> None:
            ckpt = os.path.join(out, "checkpoint-1")
            sizes[kind] = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
            files[kind] = sorted(os.listdir(ckpt))

        def run_plain() -> None:
            out = fresh("plain")
            plain._save_checkpoint(plain.model, None)
            measure("plain", out)

        def run_plain_fsync() -> None:
            out = fresh("plain+fsync")
            plain._save_checkpoint(plain.model, None)
            fsync_tree(out)
            measure("plain+fsync", out)

        def run_certified() -> None:
            out = fresh("certified")
            cert._save_checkpoint(cert.model, None)
            measure("certified", out)

        def cleanup() -> None:
            for name in os.listdir(root):
                if name.startswith(("plain", "certified")):
                    shutil.rmtree(os.path.join(root, name))
            os.sync()

        log(f"{trials} interleaved trials of three saves")
        samples = interleaved(
            [("plain", run_plain), ("plain+fsync", run_plain_fsync), ("certified", run_certified)], trials, cleanup
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    print(
        f"# bench_transformers: GPT2 {params / 1e6:.1f}M parameters, checkpoint {sizes['certified'] / MB:.0f} MB "
        f"(plain {sizes['plain'] / MB:.0f} MB); {trials} trials; python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, certckpt {certckpt.__version__}, "
        f"{os.cpu_count()} cpus"
    )
    print(f"{'checkpoint save':<14} {'median s':>9} {'[min-max]':>17} {'MB/s':>7}")
    for k in ("plain", "plain+fsync", "certified"):
        lo, hi = min(samples[k]), max(samples[k])
        print(f"{k:<14} {med[k]:>9.3f} {f'[{lo:.3f}-{hi:.3f}]':>17} {sizes[k] / MB / med[k]:>7.0f}")
    fast = {k: min(v) for k, v in samples.items()}
    print(
        f"ratio certified / plain:        {med['certified'] / med['plain']:.2f}x  (fastest runs: "
        f"{fast['certified'] / fast['plain']:.2f}x)"
    )
    print(
        f"ratio certified / plain+fsync:  {med['certified'] / med['plain+fsync']:.2f}x  (fastest runs: "
        f"{fast['certified'] / fast['plain+fsync']:.2f}x)"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cpus)")
    print(f"plain files:     {', '.join(files['plain'])}")
    print(f"certified files: {', '.join(files['certified'])}")
    if args.json:
        print(json.dumps({"params": params, "sizes": sizes, "samples": samples, "median": med}, indent=1))


if __name__ == "__main__":
    main()
