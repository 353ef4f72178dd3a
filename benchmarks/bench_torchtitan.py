"""Certified TorchTitan checkpoints against TorchTitan's own (one run, side by side, interleaved).

3 gloo ranks on this machine's CPUs, TorchTitan's llama3 debug model fully sharded over them with its
``OptimizersContainer`` (AdamW) after one step (``tests/support/torchtitan_cases.py``: what of TorchTitan
runs on CPU). Each trial saves the same state with TorchTitan's ``CheckpointManager`` (DCP's file-system
writer: pickled ``.metadata``, fsync) and with ``CertifiedCheckpointManager`` (certified shards, fsync,
manifest, ledger commit), in both orders alternately: sync save, async save (blocking time and the
time to the finished save), and a load of the sync checkpoint. Medians and ratios are printed; the
goal is certified <= 1.10x.

    python benchmarks/bench_torchtitan.py [--layers 6] [--trials 5] [--dir D]
    python benchmarks/bench_torchtitan.py --device cuda    # one rank on one GPU (NCCL)

``--device cuda``: one rank, the model and AdamW state on the GPU (NCCL allows one rank per GPU: the
machines this runs on have one), and a third mode, ``async_with_pinned_mem`` (staged into pinned shared
memory, written from another process; it needs an accelerator).

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): one layer, one trial.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

# The integrations turn certckpt's log lines on in the main process; a benchmark prints its table only.
os.environ.setdefault("CERTCKPT_LOG", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tinymode import announce  # noqa: E402


def main() -> int:
    tiny = announce("bench_torchtitan")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=1 if tiny else 6, help="transformer blocks of the debug model")
    ap.add_argument("--trials", type=int, default=1 if tiny else 5)
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one rank on one GPU")
    a = ap.parse_args()
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("bench_torchtitan: torchtitan is not installed (pip install 'certckpt[torchtitan]')", file=sys.stderr)
        return 2
    import torch

    from certckpt.detect.launch import run_ranks

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_torchtitan: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    ranks = 1 if a.device == "cuda" else 3
    with tempfile.TemporaryDirectory(dir=a.dir) as root:
        out = run_ranks(
            "tests.support.torchtitan_cases:bench",
            ranks,
            {"root": root, "layers": a.layers, "trials": a.trials, "device": a.device},
            timeout=1800,
            extra_path=ROOT,
        )
    # a collective operation lasts as long as its slowest rank
    times = {k: [max(r["times"][k][i] for r in out) for i in range(a.trials)] for k in out[0]["times"]}
    mib = sum(r["local_bytes"] for r in out) / 2**20
    where = f"1 rank on {torch.cuda.get_device_name(0)} (NCCL)" if a.device == "cuda" else "3 gloo ranks"
    print(
        f"TorchTitan debug model, {a.layers} layer(s), {where}, {mib:.0f} MiB of model + AdamW state;"
        f" {a.trials} trial(s), interleaved; medians in seconds"
    )
    print(f"{'checkpoint save / load':<36}{'TorchTitan':>12}{'certified':>12}{'ratio certified / plain':>26}")
    rows = [("save, sync", "sync"), ("save, async (blocking)", "async-block")]
    rows += [("save, async (to finished)", "async-total")]
    if a.device == "cuda":
        rows += [("save, pinned mem (blocking)", "pinned-block"), ("save, pinned mem (to finished)", "pinned-total")]
    for what, key in [*rows, ("load", "load")]:
        plain, cert = statistics.median(times[f"titan-{key}"]), statistics.median(times[f"certified-{key}"])
        print(f"{what:<36}{plain:>12.3f}{cert:>12.3f}{cert / plain:>25.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
