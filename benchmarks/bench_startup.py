"""Whole-process start-up, side by side: what a person waits for when they type the command.

- ``certckpt --help`` against ``python -c "import click"`` (the floor of any click CLI); target
  within 2x.
- ``certckpt verify FILE`` against ``sha256sum FILE`` on a 0.5 GB checkpoint, page cache warm, both
  whole processes; target at least 10x faster.

Each command runs ``--runs`` times, interleaved, and the minimum is reported (start-up noise is
one-sided: nothing makes a process start faster than its floor).

    python benchmarks/bench_startup.py [--runs 10] [--size-mb 512] [--json]

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): one run of each, a 1 MiB checkpoint: every code
path in seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def certckpt_exe() -> list[str]:
    exe = shutil.which("certckpt")
    return [exe] if exe else [sys.executable, "-m", "certckpt_cli.main"]


def make_checkpoint(path: str, size_mb: int) -> int:
    """A realistic state: 64 bf16 and fp32 tensors totalling ``size_mb`` MiB, saved by certckpt."""
    import torch

    import certckpt

    g = torch.Generator().manual_seed(0)
    per = (size_mb << 20) // 64
    state = {}
    for i in range(64):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        n = per // (2 if dtype == torch.bfloat16 else 4)
        state[f"layers.{i}.weight"] = torch.randn(n, generator=g).to(dtype)
    certckpt.save(state, path, step=1000, run="bench")
    return os.path.getsize(path)


def best_of(commands: dict[str, list[str]], runs: int) -> dict[str, float]:
    """Minimum wall time per command, runs interleaved so drift hits each alike."""
    times: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            t0 = time.perf_counter()
            out = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            times[name].append(time.perf_counter() - t0)
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.decode()[-500:]}")
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=None, help="default 10 (tiny 1)")
    ap.add_argument("--size-mb", type=int, default=None, help="default 512 (tiny 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tinymode import announce

    tiny = announce("bench_startup")
    args.runs = args.runs or (1 if tiny else 10)
    args.size_mb = args.size_mb or (1 if tiny else 512)

    cli = certckpt_exe()
    help_t = best_of(
        {"import click": [sys.executable, "-c", "import click"], "certckpt --help": [*cli, "--help"]}, args.runs
    )
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.safetensors")
        nbytes = make_checkpoint(path, args.size_mb)
        subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)  # warm the page cache for both
        verify_t = best_of({"sha256sum": ["sha256sum", path], "certckpt verify": [*cli, "verify", path]}, args.runs)
    result = {
        "runs": args.runs,
        "checkpoint_bytes": nbytes,
        "seconds": {**help_t, **verify_t},
        "help_over_import_click": help_t["certckpt --help"] / help_t["import click"],
        "sha256sum_over_verify": verify_t["sha256sum"] / verify_t["certckpt verify"],
        "verify_gb_per_s": nbytes / verify_t["certckpt verify"] / 1e9,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    s = result["seconds"]
    print(f"start-up, whole process, min of {args.runs} runs")
    print(f"  python -c 'import click'  {s['import click'] * 1000:7.1f} ms")
    print(
        f"  certckpt --help           {s['certckpt --help'] * 1000:7.1f} ms   "
        f"{result['help_over_import_click']:.2f}x import click (target <= 2x)"
    )
    print(f"verify a {nbytes / 1e9:.2f} GB checkpoint, page cache warm, min of {args.runs} runs")
    print(f"  sha256sum                 {s['sha256sum'] * 1000:7.1f} ms")
    print(
        f"  certckpt verify           {s['certckpt verify'] * 1000:7.1f} ms   "
        f"{result['sha256sum_over_verify']:.1f}x faster than sha256sum (target >= 10x), "
        f"{result['verify_gb_per_s']:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
