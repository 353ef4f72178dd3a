#!/usr/bin/env python
"""Hugging Face Accelerate: ``CertifiedAccelerator.save_state`` against plain ``Accelerator.save_state``,
and ``AcceleratorAudit`` every 10 / 100 steps against the plain loop, in one run, side by side.

Run from the repository root:

    python benchmarks/bench_accelerate.py            # ~400 MiB checkpoints, 5 trials; 3 gloo ranks
    python benchmarks/bench_accelerate.py --json     # also every figure as JSON
    python benchmarks/bench_accelerate.py --only save    # the save_state table alone (~30 s)

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): toy sizes, one trial, a few steps: every code
path in seconds, figures meaningless.

1. save_state, one process, the same prepared model and AdamW state (about 3x the weights), the same
   disk (``--dir``, default a temporary directory here): the certified save (every file fingerprinted,
   digested, fsync'd; manifest; ledger commit) vs plain ``Accelerator.save_state`` (safetensors weights,
   pickled optimizer and RNG states, no fsync) vs plain + fsync of every file, and the certified save
   with ``async_save=True`` (a second accelerator over an equal model and optimizer): the time
   ``save_state`` held the caller (the snapshot and the small files) and, untimed in the ratio, the
   time until the commit was done (``certckpt_wait``), waited for before the next contender runs. One
   untimed warm-up round, then ``--trials`` rounds whose order rotates; each save into a fresh
   directory, deleted and synced untimed. Goal: certified / plain <= 1.10x. The CPU seconds of this
   process (its threads, user + system; not the kernel's writeback threads) vary less than wall time on
   a busy machine (the async row's CPU counts only what ran until save_state returned).
2. the audits, 3 gloo ranks (``--ranks``; ``certckpt.detect.launch``): the user's loop (``accelerator.accumulate``
   over 2 micro-batches, ``clip_grad_norm_`` on the synchronised step, AdamW) with no audit, with
   ``AcceleratorAudit(audit_every=10)`` and ``(audit_every=100)``, interleaved in rounds of
   ``--round-steps`` steps; ms per step is the median over rounds of rank 0's mean. The replay floor
   is the replay's own forward + backward of one step's micro-batches, / K, over the plain step: no
   implementation of a full replay goes below it. Goal: premium within 2 points (K=10) / 1 point
   (K=100) of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinymode import announce

# The integrations turn certckpt's log lines on in the main process; a benchmark prints its table only.
os.environ.setdefault("CERTCKPT_LOG", "off")

MiB = 1 << 20
ACCUMULATION = 2


def _model(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _fsync_tree(d: str) -> None:
    for root, _, files in os.walk(d):
        for n in files:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def bench_save(args: argparse.Namespace, top: str) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    from certckpt.integrations.accelerate import CertifiedAccelerator

    _reset_accelerate()

    def prepared(acc: CertifiedAccelerator) -> Any:
        model = _model(args.width, args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        torch.manual_seed(1)
        x = torch.randn(8, args.width)
        acc.backward(model(x).square().mean())
        opt.step()  # AdamW's two moments exist: the checkpoint holds what a training run's does
        return model

    acc = CertifiedAccelerator(cpu=True, ledger=os.path.join(top, "store"))
    model = prepared(acc)
    later = CertifiedAccelerator(cpu=True, ledger=os.path.join(top, "store"), branch="async", async_save=True)
    prepared(later)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    n = [0]
    committed: list[float] = []

    def certified(i: int) -> None:
        acc.certckpt.steps += 1  # one commit per step: every trial is committed
        acc.save_state(os.path.join(top, "store", f"c{i}"))

    def certified_async(i: int) -> None:
        later.certckpt.steps += 1
        later.save_state(os.path.join(top, "store", f"a{i}"))

    def plain(i: int) -> None:
        Accelerator.save_state(acc, os.path.join(top, f"p{i}"))

    def plain_fsync(i: int) -> None:
        d = os.path.join(top, f"f{i}")
        Accelerator.save_state(acc, d)
        _fsync_tree(d)

    contenders = [
        ("certified", certified),
        ("plain", plain),
        ("plain+fsync", plain_fsync),
        ("certified async", certified_async),
    ]
    times: dict[str, list[float]] = {k: [] for k, _ in contenders}
    cpu: dict[str, list[float]] = {k: [] for k, _ in contenders}
    sizes: dict[str, int] = {}
    for r in range(args.trials + 1):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for name, fn in order:
            n[0] += 1
            c0, t0 = time.process_time(), time.perf_counter()
            fn(n[0])
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            later.certckpt_wait()  # the async save is done before anything else is timed
            if r:
                times[name].append(dt)
                cpu[name].append(dc)
                if name == "certified async":
                    committed.append(time.perf_counter() - t0)
            d = [e for e in os.scandir(top) if e.is_dir() and e.name != "store"] + [
                e for e in os.scandir(os.path.join(top, "store")) if e.is_dir() and e.name != "_ledger"
            ]
            for e in d:
                sizes[name] = sum(f.stat().st_size for f in os.scandir(e.path))
                shutil.rmtree(e.path)
            os.sync()
    med = {k: statistics.median(v) for k, v in times.items()}
    later.end_training()
    return {
        "weights_bytes": weights,
        "sizes": sizes,
        "times": times,
        "median_s": med,
        "cpu_s": cpu,
        "async_committed_s": committed,
        "async_staging_bytes": later.certckpt.pipeline.staging_bytes if later.certckpt.pipeline else 0,
    }


# --- the audits: gloo ranks --------------------------------------------------------------------


def ranks(a: dict[str, Any]) -> dict[str, Any]:
    """One rank: the plain loop and the audited ones, interleaved in rounds."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    r, w = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(w))
    from certckpt.detect import Triggers
    from certckpt.integrations.accelerate import AcceleratorAudit, CertifiedAccelerator

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    g = torch.Generator().manual_seed(r)
    setups = {}
    for name, k in (("plain", None), ("audit/10", 10), ("audit/100", 100)):
        acc = CertifiedAccelerator(
            cpu=True, gradient_accumulation_steps=ACCUMULATION, ledger=os.path.join(a["top"], name.replace("/", "-"))
        )
        model = _model(a["width"], a["layers"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        triggers = {} if a["sentinels"] else {"triggers": Triggers(enabled=False)}
        audit = AcceleratorAudit(acc, model, opt, loss_fn=loss_fn, audit_every=k, **triggers) if k else None
        setups[name] = (acc, model, opt, audit)

    def step(name: str) -> None:
        acc, model, opt, audit = setups[name]
        for _ in range(ACCUMULATION):
            x = torch.randn(a["batch"], a["width"], generator=g)
            batch = [x, x.sin()]
            with acc.accumulate(model):
                loss = audit.loss(batch) if audit is not None else loss_fn(model, batch)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

    ms: dict[str, list[float]] = {n: [] for n in setups}
    cpu: dict[str, list[float]] = {n: [] for n in setups}  # this process's CPU ms per step (its threads too)
    names = list(setups)
    for rnd in range(a["rounds"] + 1):
        for name in names[rnd % 3 :] + names[: rnd % 3]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(a["round_steps"]):
                step(name)
            c1 = time.process_time()
            dist.barrier()
            if rnd:
                ms[name].append((time.perf_counter() - t0) * 1000 / a["round_steps"])
                cpu[name].append((c1 - c0) * 1000 / a["round_steps"])
    # the replay floor: one step's micro-batches forward + backward on the bare module (what a replay computes)
    bare = setups["plain"][1].module
    reps, reps_cpu = [], []
    for _ in range(a["floor_reps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(ACCUMULATION):
            x = torch.randn(a["batch"], a["width"], generator=g)
            grads = torch.autograd.grad(loss_fn(bare, [x, x.sin()]) / ACCUMULATION, list(bare.parameters()))
            del grads
        reps.append((time.perf_counter() - t0) * 1000)
        reps_cpu.append((time.process_time() - c0) * 1000)
    for _, _, _, audit in setups.values():
        if audit is not None:
            audit.close()
    return {"ms": ms, "cpu_ms": cpu, "replay_ms": statistics.median(reps), "replay_cpu_ms": statistics.median(reps_cpu)}


def bench_audits(args: argparse.Namespace, top: str) -> dict[str, Any]:
    from certckpt.detect.launch import run_ranks

    a = {
        "top": top,
        "width": args.audit_width,
        "layers": args.audit_layers,
        "batch": args.batch,
        "rounds": args.rounds,
        "round_steps": args.round_steps,
        "floor_reps": 5 if args.tiny else 20,
        "sentinels": not args.no_sentinels,
    }
    here = os.path.dirname(os.path.abspath(__file__))
    out = run_ranks("bench_accelerate:ranks", args.ranks, a, timeout=3600, extra_path=here)
    r0 = out[0]
    med = {k: statistics.median(v) for k, v in r0["ms"].items()}
    # CPU: every rank's, summed per round (the work the loop adds, less sensitive than wall time to how
    # the ranks share the cores), median over rounds
    cpu = {
        k: statistics.median(sum(r["cpu_ms"][k][i] for r in out) for i in range(len(v)))
        for k, v in r0["cpu_ms"].items()
    }
    return {
        "per_rank": out,
        "median_ms": med,
        "replay_ms": r0["replay_ms"],
        "cpu_ms": cpu,
        "replay_cpu_ms": sum(r["replay_cpu_ms"] for r in out),
    }


def main() -> int:
    tiny = announce("bench_accelerate")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--width", type=int, default=64 if tiny else 2048)
    p.add_argument("--layers", type=int, default=2 if tiny else 8)
    p.add_argument("--trials", type=int, default=1 if tiny else 5)
    p.add_argument("--audit-width", type=int, default=32 if tiny else 1024)
    p.add_argument("--audit-layers", type=int, default=2 if tiny else 8)
    p.add_argument("--batch", type=int, default=4 if tiny else 32)
    p.add_argument("--rounds", type=int, default=1 if tiny else 5)
    p.add_argument("--round-steps", type=int, default=10 if tiny else 100)
    p.add_argument(
        "--ranks",
        type=int,
        default=3,
        help="gloo ranks of the audits table (3 names a faulty rank; as many as cores keeps them from sharing one)",
    )
    p.add_argument(
        "--no-sentinels",
        action="store_true",
        help="audits without the per-step sentinels (Triggers(enabled=False)): the interval audits alone",
    )
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory here)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", choices=("save", "audits"), default=None, help="run one of the two tables")
    args = p.parse_args()
    args.tiny = tiny
    top = tempfile.mkdtemp(prefix="bench-accelerate-", dir=args.dir or os.getcwd())
    try:
        save = bench_save(args, top) if args.only != "audits" else None
        audits = bench_audits(args, os.path.join(top, "audits")) if args.only != "save" else None
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if save is not None:
        print_save(args, save)
    if audits is not None:
        print_audits(args, audits, newline=save is not None)
    if args.json:
        print(json.dumps({"save": save, "audits": audits}, indent=2, default=str))
    return 0


def print_save(args: argparse.Namespace, save: dict[str, Any]) -> None:
    m = save["median_s"]
    ckpt = save["sizes"].get("certified", 0)
    print(
        f"# bench_accelerate: {args.layers} x {args.width}^2 MLP, checkpoint {ckpt / MiB:.0f} MiB "
        f"(plain {save['sizes'].get('plain', 0) / MiB:.0f} MiB); {args.trials} trials; {platform.machine()},"
        f" {os.cpu_count()} cpus"
    )
    print("save_state          median s    [min-max]       cpu s (this process, median)")
    for k in ("certified", "plain", "plain+fsync", "certified async"):
        v = save["times"][k]
        print(f"{k:<18} {m[k]:8.3f}   [{min(v):.3f}-{max(v):.3f}]   {statistics.median(save['cpu_s'][k]):8.3f}")
    done = save["async_committed_s"]
    print(
        f"  async: committed after {statistics.median(done):.3f} s [{min(done):.3f}-{max(done):.3f}]; staging"
        f" memory kept {save['async_staging_bytes'] / MiB:.0f} MiB"
    )
    print(f"ratio certified / plain:        {m['certified'] / m['plain']:.2f}x  (goal <= 1.10x)")
    held = m["certified async"] / m["plain"]
    print(f"ratio certified async / plain:  {held:.2f}x  (the time save_state held the caller)")
    print(f"ratio certified / plain+fsync:  {m['certified'] / m['plain+fsync']:.2f}x")


def print_audits(args: argparse.Namespace, audits: dict[str, Any], *, newline: bool) -> None:
    a = audits["median_ms"]
    base = a["plain"]
    if newline:
        print()
    print(
        f"# audits, {args.ranks} gloo ranks: {args.audit_layers} x {args.audit_width}^2 MLP, 2 micro-batches of"
        f" {args.batch}, clipping; {args.rounds} rounds of {args.round_steps} steps"
        + ("; sentinels off" if args.no_sentinels else "")
    )
    print("loop                ms/step   premium   replay floor   premium - floor   goal")
    for name, k, goal in (("plain", None, None), ("audit/10", 10, 2.0), ("audit/100", 100, 1.0)):
        prem = (a[name] / base - 1) * 100
        if k is None:
            print(f"{name:<18} {a[name]:8.2f}")
            continue
        floor = audits["replay_ms"] / k / base * 100
        verdict = "PASS" if prem - floor <= goal else "MISS"
        print(
            f"{name:<18} {a[name]:8.2f}   {prem:+6.1f}%   {floor:10.2f}%   {prem - floor:+13.2f} pts"
            f"   <= {goal:.0f} pts {verdict}"
        )
    c = audits["cpu_ms"]
    print("CPU, all ranks      ms/step   premium   replay floor   premium - floor")
    for name, k in (("plain", None), ("audit/10", 10), ("audit/100", 100)):
        if k is None:
            print(f"{name:<18} {c[name]:8.2f}")
            continue
        prem = (c[name] / c["plain"] - 1) * 100
        floor = audits["replay_cpu_ms"] / k / c["plain"] * 100
        print(f"{name:<18} {c[name]:8.2f}   {prem:+6.1f}%   {floor:10.2f}%   {prem - floor:+13.2f} pts")


if __name__ == "__main__":
    sys.exit(main())
