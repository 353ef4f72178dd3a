#!/usr/bin/env python
"""Benchmark certckpt's Megatron-Core strategies against Megatron's own ``torch_dist`` format.

Run from the repository root:

    python benchmarks/bench_megatron.py               # 24 layers of a GPT block's weights, 5 trials
    python benchmarks/bench_megatron.py --trials 9 --dir /dev/shm
    python benchmarks/bench_megatron.py --threads 2   # torch's intra-op threads (default 1)
    python benchmarks/bench_megatron.py --device cuda # the tensors on the GPU, against Megatron's own strategy

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): toy sizes, one trial, figures meaningless.

One process (a gloo group of one), one sharded state dict built with Megatron's ``ShardedTensor``
(per layer: qkv, proj, fc1, fc2 weights in bfloat16 and their fp32 copies, as a mixed-precision
optimizer holds them), through ``dist_checkpointing.save`` / ``load`` on the same disk, contenders
alternating every trial (one untimed warm-up round; medians, [min-max] beside them). torch runs with one
intra-op thread, as under torchrun (its default ``OMP_NUM_THREADS=1``, how Megatron is launched) and
as in ``bench_dcp.py``; ``--threads N`` changes that. Beside the wall times, the process's CPU seconds
(every thread): on a shared machine they move much less than wall time.

1. save: ``sharded_strategy=CertifiedSaveStrategy(ledger=..., step=...)`` (certified shards, common state
   and manifest, fsync'd, committed to a ledger) vs Megatron's ``torch_dist``. On a CUDA machine that is
   Megatron's own strategy; without CUDA it cannot run (its save path calls ``torch.cuda.synchronize()``),
   and the baseline is the same format written by the same pieces: Megatron's ShardedTensor translation
   and planner, DCP's ``FileSystemWriter`` (fsync on), ``common.pt`` and ``metadata.json``. The table says
   which ran.
2. load, warm page cache, into the same preallocated tensors: ``CertifiedLoadStrategy()`` (every chunk's
   digest checked, and the loaded state's fingerprints against the saved ones) vs Megatron's
   ``torch_dist`` load strategy (this one runs on the CPU); a third line without the fingerprint check.
   The fingerprint check runs on a second thread beside the reads (``certckpt/dcp/loadfp.py``).

``--device cuda``: the ShardedTensors live on the GPU (saved from it, loaded back into it), the group
is NCCL for CUDA tensors and gloo for the rest, and the save baseline is Megatron's own strategy.

Target: both ratios <= 1.10x. Every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinymode import announce

TARGET = 1.10


def _state(layers: int, hidden: int, *, zeros: bool, device: str = "cpu"):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    g = torch.Generator().manual_seed(0)
    shapes = {
        "qkv": (3 * hidden, hidden),
        "proj": (hidden, hidden),
        "fc1": (4 * hidden, hidden),
        "fc2": (hidden, 4 * hidden),
    }
    model, optim = {}, {}
    for i in range(layers):
        for name, shape in shapes.items():
            key = f"decoder.layers.{i}.{name}.weight"
            w = (torch.zeros(shape) if zeros else torch.randn(shape, generator=g)).to(device)
            model[f"{i}.{name}"] = ShardedTensor.from_rank_offsets(key, w.to(torch.bfloat16))
            optim[f"{i}.{name}"] = ShardedTensor.from_rank_offsets(f"optimizer.fp32.{key}", w.clone())
    return {"model": model, "optimizer": optim, "iteration": 100, "args": {"hidden": hidden, "layers": layers}}


def _plain_torch_dist_save(sd, directory: str) -> None:
    """Megatron's torch_dist format written by its own pieces (the CPU stand-in for its strategy)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict

    TorchCommonSaveStrategy("torch", 1).save_common({k: sd[k] for k in ("iteration", "args")}, directory)
    grouped: dict = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            grouped.setdefault(sh.key, []).append(sh)
    dcp.save(
        mcore_to_pyt_state_dict(grouped, False),
        storage_writer=dcp.FileSystemWriter(directory),
        planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
    )
    save_config(CheckpointingConfig("torch_dist", 1), directory)


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.3f}   [{min(xs):.3f}-{max(xs):.3f}]"


def main() -> int:
    tiny = announce("bench_megatron")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--layers", type=int, default=2 if tiny else 24)
    p.add_argument("--hidden", type=int, default=64 if tiny else 512)
    p.add_argument("--trials", type=int, default=1 if tiny else 5)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, torchrun's default)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    try:
        from megatron.core import dist_checkpointing
    except ImportError:
        print("bench_megatron: megatron-core is not installed (pip install 'certckpt[megatron]')", file=sys.stderr)
        return 2
    import resource

    import torch
    import torch.distributed as dist

    from certckpt.detect.launch import free_port
    from certckpt.integrations.megatron import CertifiedLoadStrategy, CertifiedSaveStrategy

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
        return r.ru_utime + r.ru_stime

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_megatron: --device cuda, but torch sees no CUDA device", file=sys.stderr)
            return 2
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    cuda = torch.cuda.is_available()
    sd = _state(args.layers, args.hidden, zeros=False, device=args.device)
    template = _state(args.layers, args.hidden, zeros=True, device=args.device)
    nbytes = sum(sh.data.numel() * sh.data.element_size() for d in (sd["model"], sd["optimizer"]) for sh in d.values())
    root = tempfile.mkdtemp(prefix="bench-megatron-", dir=args.dir)
    names = (
        "save certified",
        "save torch_dist",
        "load certified",
        "load certified, no fp check",
        "load torch_dist",
    )
    times: dict[str, list[float]] = {k: [] for k in names}
    cpus: dict[str, list[float]] = {k: [] for k in names}

    def plain_save(d: str) -> None:
        if cuda:
            dist_checkpointing.save(sd, d)  # Megatron's own torch_dist strategy
        else:
            _plain_torch_dist_save(sd, d)

    try:
        for trial in range(args.trials + 1):
            store = os.path.join(root, f"run{trial}")
            dirs = {"certified": os.path.join(store, "iter_100"), "plain": os.path.join(root, f"plain{trial}")}
            for d in dirs.values():
                os.makedirs(d)
            saves = [
                (
                    "save certified",
                    lambda: dist_checkpointing.save(
                        sd, dirs["certified"], sharded_strategy=CertifiedSaveStrategy(ledger=store, step=100)
                    ),
                ),
                ("save torch_dist", lambda: plain_save(dirs["plain"])),
            ]
            loads = [
                (
                    "load certified",
                    lambda: dist_checkpointing.load(
                        template, dirs["certified"], sharded_strategy=CertifiedLoadStrategy()
                    ),
                ),
                (
                    "load certified, no fp check",
                    lambda: dist_checkpointing.load(
                        template, dirs["certified"], sharded_strategy=CertifiedLoadStrategy(check_fingerprints=False)
                    ),
                ),
                ("load torch_dist", lambda: dist_checkpointing.load(template, dirs["plain"])),
            ]
            for group in (saves, loads):
                order = group if trial % 2 == 0 else list(reversed(group))
                for name, fn in order:
                    os.sync()
                    t0, c0 = time.perf_counter(), cpu()
                    fn()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    dt, dc = time.perf_counter() - t0, cpu() - c0
                    if trial:  # round 0 warms up
                        times[name].append(dt)
                        cpus[name].append(dc)
            shutil.rmtree(store)
            shutil.rmtree(dirs["plain"])
            os.sync()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()

    baseline = (
        "Megatron's torch_dist strategy"
        if cuda
        else "torch_dist format via Megatron's translation + DCP FileSystemWriter (its strategy needs CUDA)"
    )
    on = torch.cuda.get_device_name(0) if args.device == "cuda" else "the CPU"
    print(
        f"# bench_megatron: {args.layers} layers, hidden {args.hidden}, {nbytes / 2**20:.0f} MiB of tensors;"
        f" {args.trials} trials; {os.cpu_count()} cpus, {torch.get_num_threads()} torch thread(s); load average"
        f" {os.getloadavg()[0]:.2f}; tensors on {on};"
        f" baseline: {baseline}"
    )
    print("contender                       median s    [min-max]      CPU s (median)")
    for name, xs in times.items():
        print(f"{name:30s}{_fmt(xs)}   {statistics.median(cpus[name]):8.3f}")
    ratio = statistics.median(times["save certified"]) / statistics.median(times["save torch_dist"])
    print(f"ratio save certified / torch_dist:  {ratio:.2f}x  (goal <= {TARGET:.2f}x)")
    ratio = statistics.median(times["load certified"]) / statistics.median(times["load torch_dist"])
    print(f"ratio load certified / torch_dist:  {ratio:.2f}x  (goal <= {TARGET:.2f}x)")
    ratio = statistics.median(times["load certified, no fp check"]) / statistics.median(times["load torch_dist"])
    print(f"ratio load certified (no fp check) / torch_dist:  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
