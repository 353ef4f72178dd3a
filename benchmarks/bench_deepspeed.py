"""Certified DeepSpeed checkpoints against DeepSpeed's own ``engine.save_checkpoint`` (one run, side by side).

One process (a 1-rank gloo group, DeepSpeed's CPU accelerator), a ZeRO engine around an MLP with
AdamW: each trial takes one optimizer step (untimed), then saves the same engine state three ways,
in turn: DeepSpeed's own ``TorchCheckpointEngine`` (``torch.save``, no fsync), the same followed by
an fsync of every file it wrote, and ``certify_engine``'s certified engine (certified files, fsync,
the tag's manifest, the ledger commit). Medians over the trials and the ratios are printed.

    python benchmarks/bench_deepspeed.py [--stage 2] [--layers 8 --width 2048] [--trials 5] [--dir D]

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): 2 layers of 64, one trial.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

# The integrations turn certckpt's log lines on in the main process; a benchmark prints its table only.
os.environ.setdefault("CERTCKPT_LOG", "off")

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(path) for n in fs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the temp dir goes (local disk, not tmpfs)")
    args = p.parse_args(argv)
    from tinymode import announce

    tiny = announce("bench_deepspeed")
    layers = args.layers or (2 if tiny else 8)
    width = args.width or (64 if tiny else 2048)
    trials = args.trials or (1 if tiny else 5)

    try:
        import deepspeed
    except ImportError:
        print("bench_deepspeed: deepspeed is not installed (bash scripts/install.sh deepspeed)", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from certckpt.detect.launch import free_port
    from certckpt.integrations.deepspeed import certify_engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build at first use (1 rank)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    plain_engine = TorchCheckpointEngine(None)
    certified = certify_engine(engine, run="bench")
    nparams = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())  # ZeRO-3: placeholders
    times: dict[str, list[float]] = {"plain": [], "plain+fsync": [], "certified": []}
    root = tempfile.mkdtemp(prefix="bench-ds-", dir=args.dir)
    sizes: dict[str, int] = {}
    try:
        for t in range(trials + 1):  # the first round warms caches and allocators: not counted
            x = torch.randn(4, width)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            for name in ("plain", "plain+fsync", "certified"):
                out = os.path.join(root, name)
                tag = f"t{t}"
                engine.checkpoint_engine = certified if name == "certified" else plain_engine
                t0 = time.perf_counter()
                engine.save_checkpoint(out, tag=tag)
                if name == "plain+fsync":
                    _fsync_tree(os.path.join(out, tag))
                dt = time.perf_counter() - t0
                if t:
                    times[name].append(dt)
                sizes[name] = _size(os.path.join(out, tag))
                if name != "certified":
                    shutil.rmtree(os.path.join(out, tag))  # the disk holds one plain checkpoint at a time
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    mb = sizes["certified"] / 1e6
    print(
        f"# bench_deepspeed: ZeRO-{args.stage}, {nparams / 1e6:.1f}M parameters, checkpoint {mb:.0f} MB "
        f"(plain {sizes['plain'] / 1e6:.0f} MB); {trials} trials; {os.cpu_count()} cpus"
    )
    print("checkpoint save  median s         [min-max]    MB/s")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:<14} {med[k]:8.3f}     [{min(v):.3f}-{max(v):.3f}]  {mb / med[k]:7.0f}")
    print(f"ratio certified / plain:        {med['certified'] / med['plain']:.2f}x")
    print(f"ratio certified / plain+fsync:  {med['certified'] / med['plain+fsync']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
