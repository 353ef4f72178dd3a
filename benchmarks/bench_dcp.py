#!/usr/bin/env python
"""Benchmark certckpt.dcp against torch.distributed.checkpoint's own file system storage.

Run from the repository root:

    python benchmarks/bench_dcp.py            # ~1 GiB state, 1 process and 2 gloo ranks, 7 trials
    python benchmarks/bench_dcp.py --quick    # 128 MiB state, 5 trials (smoke run)
    python benchmarks/bench_dcp.py --json     # also print every sample as JSON

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): the same 28 tensors at 1/512 of their rows,
one trial: every code path in seconds, figures meaningless.

State (seeded random values): 12 float32 4096x4096 + 16 bfloat16 2048x4096 (1 GiB; --quick: 1/8 of
the rows). With one process the tensors are plain (``dcp.save(no_dist=True)``); with R ranks each is
a DTensor sharded along dim 0 over a 1-D CPU mesh (FSDP's layout), so every rank writes 1/R of it.

Measured, side by side in one run (contenders alternate every trial, their order rotating; one
untimed warm-up round; medians of the timed trials, [min-max] beside them):

Every process runs torch with one intra-op thread (torchrun's default, ``OMP_NUM_THREADS=1``). Beside
the wall times, the CPU seconds of rank 0's process (all its threads) are shown: on a shared machine
they move much less than wall time.

1. ``dcp.save`` with ``CertifiedWriter`` vs ``FileSystemWriter`` (its defaults: one file per rank,
   fsync on). Each trial writes a fresh directory; directories are deleted and ``os.sync()``'d
   untimed after each trial. certckpt's figure includes everything it does beyond DCP's writer:
   xxh3 digests and device fingerprints of every chunk, each chunk's contribution to the
   sharding-independent fingerprints, the certified manifest.
2. ``dcp.load`` into the same (preallocated) state with ``CertifiedReader`` vs
   ``FileSystemReader``, warm page cache. certckpt checks every chunk's xxh3 digest; a third line
   shows ``CertifiedReader(check_fingerprints=True)`` (also recomputes the loaded state's
   fingerprints and compares them with the manifest), for information.

Target: both ratios <= 1.10x. Every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = 1.10


def _layout(size: str) -> list[tuple[str, str, tuple[int, int]]]:
    div = {"full": 1, "quick": 8, "tiny": 512}[size]
    f32 = [(f"layers.{i}.mlp.weight", "float32", (4096 // div, 4096)) for i in range(12)]
    bf16 = [(f"layers.{i}.attn.weight", "bfloat16", (2048 // div, 4096)) for i in range(16)]
    return f32 + bf16


def _state(size: str, seed: int):
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, dtype, shape in _layout(size):
        tensors[name] = torch.randn(shape, generator=g).to(getattr(torch, dtype))
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {"model": tensors}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"model": {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in tensors.items()}}


def _contenders(kind: str):
    import torch.distributed.checkpoint as dcp

    from certckpt.dcp import CertifiedReader, CertifiedWriter

    if kind == "save":
        return {
            "certckpt": lambda d: CertifiedWriter(d),
            "dcp": lambda d: dcp.FileSystemWriter(d),
        }
    return {
        "certckpt": lambda d: CertifiedReader(d),
        "dcp": lambda d: dcp.FileSystemReader(d),
        "certckpt+fp": lambda d: CertifiedReader(d, check_fingerprints=True),
    }


def measure(args: dict) -> dict:
    """Run every trial in this process (on every rank when distributed); rank 0's timings are returned."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dist_on = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist_on else 0
    no_dist = not dist_on
    root = args["root"]
    state = _state(args["size"], 0)
    target = _state(args["size"], 1)  # loads overwrite a second state of the same shapes

    def barrier():
        if dist_on:
            dist.barrier()

    def cleanup(d):
        barrier()
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
            os.sync()
        barrier()

    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
        return r.ru_utime + r.ru_stime

    samples: dict[str, list[float]] = {}
    saves, loads = _contenders("save"), _contenders("load")
    trials = args["trials"]
    for t in range(trials + 1):  # round 0: warm-up, untimed
        order = list(saves)
        order = order[t % len(order) :] + order[: t % len(order)]
        for name in order:
            d = os.path.join(root, f"{name}-{t}")
            barrier()
            t0, c0 = time.perf_counter(), cpu()
            dcp.save(state, storage_writer=saves[name](d), no_dist=no_dist)
            c1 = cpu()
            barrier()
            if t:
                samples.setdefault(f"save:{name}", []).append(time.perf_counter() - t0)
                samples.setdefault(f"save-cpu:{name}", []).append(c1 - c0)
            for reader in ["certckpt", "certckpt+fp"] if name == "certckpt" else ["dcp"]:
                barrier()
                t0, c0 = time.perf_counter(), cpu()
                dcp.load(target, storage_reader=loads[reader](d), no_dist=no_dist)
                c1 = cpu()
                barrier()
                if t:
                    samples.setdefault(f"load:{reader}", []).append(time.perf_counter() - t0)
                    samples.setdefault(f"load-cpu:{reader}", []).append(c1 - c0)
            cleanup(d)
    ok = all(
        torch.equal(a.to_local() if hasattr(a, "to_local") else a, b.to_local() if hasattr(b, "to_local") else b)
        for a, b in zip(state["model"].values(), target["model"].values())
    )
    return {"rank": rank, "samples": samples, "loaded_equal": ok}


def rank_main(args: dict) -> dict:
    return measure(args)


def _run(ranks: int, args: dict) -> dict:
    if ranks == 1:
        import torch

        torch.set_num_threads(1)  # as every rank below (and torchrun's default OMP_NUM_THREADS=1)
        return measure(args)
    sys.path.insert(0, HERE)
    from certckpt.detect.launch import run_ranks

    return run_ranks("bench_dcp:rank_main", ranks, args, timeout=3600, extra_path=HERE)[0]


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} s [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="128 MiB state, 5 trials")
    p.add_argument("--trials", type=int, default=None, help="timed trials (default 7, --quick 5)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="process counts to run (default 1 2)")
    p.add_argument("--dir", default=None, help="where the temp dir goes (a local disk)")
    p.add_argument("--json", action="store_true", help="also print every sample as JSON")
    a = p.parse_args()
    sys.path.insert(0, HERE)
    from tinymode import announce

    tiny = announce("bench_dcp")
    scale = "tiny" if tiny else "quick" if a.quick else "full"
    trials = a.trials or (1 if tiny else 5 if a.quick else 7)
    size = sum((4 if dt == "float32" else 2) * shape[0] * shape[1] for _, dt, shape in _layout(scale))
    print(
        f"state: {size / (1 << 20):.2f} MiB in {len(_layout(scale))} tensors; {trials} timed trials; "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}"
    )
    results = {}
    misses = []
    for ranks in a.ranks:
        root = tempfile.mkdtemp(prefix="certckpt-bench-dcp-", dir=a.dir)
        try:
            print(f"[{ranks} rank(s)] running...", file=sys.stderr, flush=True)
            out = _run(ranks, {"root": root, "size": scale, "trials": trials})
        finally:
            shutil.rmtree(root, ignore_errors=True)
        s = out["samples"]
        results[ranks] = out
        print(f"\n{ranks} {'process' if ranks == 1 else 'gloo ranks (DTensor Shard(0) on a CPU mesh)'}:")
        for op, base in (("save", "dcp"), ("load", "dcp")):
            mine = statistics.median(s[f"{op}:certckpt"])
            theirs = statistics.median(s[f"{op}:{base}"])
            ratio = mine / theirs
            verdict = "met" if ratio <= TARGET else "MISSED"
            if ratio > TARGET:
                misses.append(f"{op} at {ranks} rank(s)")
            print(
                f"  dcp.{op}  certckpt {_fmt(s[f'{op}:certckpt'])}   DCP {_fmt(s[f'{op}:{base}'])}"
                f"   ratio {ratio:.3f}x (target <= {TARGET:.2f}x: {verdict})"
            )
            mine_cpu = statistics.median(s[f"{op}-cpu:certckpt"])
            theirs_cpu = statistics.median(s[f"{op}-cpu:{base}"])
            print(
                f"            CPU seconds of rank 0's process: certckpt {mine_cpu:.3f}, DCP {theirs_cpu:.3f},"
                f" ratio {mine_cpu / theirs_cpu:.3f}x"
            )
        fp = s["load:certckpt+fp"]
        print(
            f"  dcp.load with check_fingerprints=True: {_fmt(fp)}  ratio to DCP"
            f" {statistics.median(fp) / statistics.median(s['load:dcp']):.3f}x (information)"
        )
        print(f"  loaded state equals the saved one: {out['loaded_equal']}")
    if a.json:
        print(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    if misses:
        print(f"\ntarget missed: {', '.join(misses)}", file=sys.stderr)


if __name__ == "__main__":
    main()
