"""Asynchronous certified saves, side by side with what users would do instead (issue 30's targets).

In one run, on the CPU:

1. **Blocking time** on a 1 GiB state (32 fp32 tensors of 32 MiB): how long ``AsyncSaver.save``
   holds the caller (staging memory reused, as in a training loop) against a plain ``clone()`` of
   every tensor, the floor of any snapshot (target <= 1.2x), against the synchronous certified save
   (target <= 0.15x), and against ``dcp.async_save`` with a ``FileSystemWriter``.
2. **Training throughput**: a loop (an MLP and Adam, ~0.2 s a step on 2 cores) that saves its model and
   optimizer every N steps, timed with no saving, ``certckpt.async_save``, ``certckpt.save``,
   ``torch.save`` and ``dcp.async_save``; each mode's loss of throughput against no saving
   (target for certckpt.async_save: <= 5%). Every mode writes the same state at the same steps,
   half an interval off the loop's end (steps N/2, 3N/2, ...), and the timed window ends when the
   last save is durable: each save has the same steps after it, so the figure is the steady-state
   loss, not one final write left to finish after the last step (that tail would count for
   ``certckpt.save`` and ``torch.save`` in full either way).

    python benchmarks/bench_async.py [--trials 5] [--steps 100] [--every 25] [--json]

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a 256 KiB state, a small MLP, 4 steps, one
trial: every code path in seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from tinymode import announce

import certckpt

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _median_time(fn, trials: int) -> float:
    out = []
    for i in range(trials):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def blocking(d: str, trials: int, *, device: str = "cpu", gib: int = 1, tiny: bool = False) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    count, numel = (4, 16 << 10) if tiny else (32 * gib, 8 << 20)  # 32 MiB each (tiny: 64 KiB)
    state = {f"layer{i}": torch.randn(numel, device=device) for i in range(count)}
    res: dict[str, float] = {"state_bytes": sum(t.numel() * t.element_size() for t in state.values())}

    def clone(i: int) -> None:
        [t.clone() for t in state.values()]
        _sync(device)

    res["clone_s"] = _median_time(clone, trials)
    if device == "cuda":  # the floor of a snapshot off the device: one pinned copy of the same bytes
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in state.values()]

        def to_host(i: int) -> None:
            for p, t in zip(pinned, state.values()):
                p.copy_(t, non_blocking=True)
            torch.cuda.synchronize()

        to_host(0)
        res["pinned_copy_s"] = _median_time(to_host, trials)
        del pinned

    saver = certckpt.AsyncSaver()
    pending: list = []

    def async_save(i: int) -> None:
        pending.append(saver.save(state, os.path.join(d, f"a{i}.safetensors"), step=i))

    def settle() -> None:  # outside the timed part: the write finishes, the disk keeps one copy
        for f in pending:
            os.remove(f.result().location)
        pending.clear()

    saver.save(state, os.path.join(d, "warm.safetensors")).result()  # staging memory allocated once
    os.remove(os.path.join(d, "warm.safetensors"))
    times = []
    for i in range(trials):
        t = time.perf_counter()
        async_save(i)
        times.append(time.perf_counter() - t)
        settle()
    res["async_block_s"] = statistics.median(times)
    res["staging_bytes"] = saver.staging_bytes
    saver.close()

    def sync_save(i: int) -> None:
        path = os.path.join(d, f"s{i}.safetensors")
        certckpt.save(state, path, step=i)
        os.remove(path)

    res["sync_save_s"] = _median_time(sync_save, trials)

    times = []
    for i in range(trials):
        where = os.path.join(d, f"dcp{i}")
        t = time.perf_counter()
        f = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(where))
        times.append(time.perf_counter() - t)
        f.result()
        shutil.rmtree(where)
    res["dcp_async_block_s"] = statistics.median(times)
    return res


class _Model(torch.nn.Module):
    def __init__(self, io: int = 1024, hidden: int = 4096) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(io, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, io),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _loop(mode: str, d: str, steps: int, every: int, tiny: bool = False) -> tuple[float, int]:
    """Seconds for ``steps`` training steps saving every ``every`` (the last save waited for)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    io, hidden = (64, 128) if tiny else (1024, 4096)
    model = _Model(io, hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, io), torch.randn(64, io)
    saver = certckpt.AsyncSaver()
    futures: list = []
    nbytes = 0

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(3):  # warm-up: Adam's state exists, the allocator is settled
        step()
    t = time.perf_counter()
    for s in range(1, steps + 1):
        step()
        if (s - every // 2) % every or mode == "none":
            continue
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        where = os.path.join(d, f"{mode}-{s}")
        if mode == "certckpt.async_save":
            if futures:
                futures.pop().result()  # what the saver does anyway: one save in flight
            futures.append(saver.save(state, where + ".safetensors", step=s))
        elif mode == "certckpt.save":
            nbytes = certckpt.save(state, where + ".safetensors", step=s).nbytes
        elif mode == "torch.save":
            torch.save(state, where + ".pt")
        elif mode == "dcp.async_save":
            if futures:
                futures.pop().result()
            futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(where)))
    for f in futures:
        f.result()
    seconds = time.perf_counter() - t
    saver.close()
    return seconds, nbytes


def throughput(d: str, trials: int, steps: int, every: int, tiny: bool = False) -> dict[str, float]:
    modes = ["none", "certckpt.async_save", "certckpt.save", "torch.save", "dcp.async_save"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    nbytes = 0
    for i in range(trials):
        for m in modes[i % len(modes) :] + modes[: i % len(modes)]:  # each mode leads in turn
            where = os.path.join(d, f"loop{i}")
            os.makedirs(where)
            seconds, n = _loop(m, where, steps, every, tiny)
            nbytes = max(nbytes, n)
            times[m].append(seconds)
            shutil.rmtree(where)
    res: dict[str, float] = {"checkpoint_bytes": nbytes}
    base = statistics.median(times["none"])
    for m in modes:
        res[f"loop_{m}_s"] = statistics.median(times[m])
        if m != "none":
            res[f"loss_{m}"] = 1 - base / statistics.median(times[m])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=None, help="default 5 (tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="default 100 (tiny 4)")
    ap.add_argument("--every", type=int, default=None, help="default 25 (tiny 2)")
    ap.add_argument("--device", default="cpu", help="cuda: the blocking part only, on a GPU state")
    ap.add_argument("--state-gib", type=int, default=None, help="default 1 on the CPU, 4 on a GPU")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tiny = announce("bench_async")
    a.trials = a.trials or (1 if tiny else 5)
    a.steps = a.steps or (4 if tiny else 100)
    a.every = a.every or (2 if tiny else 25)
    gib = a.state_gib or (4 if a.device == "cuda" else 1)
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-async-") as d:
        res = blocking(d, a.trials, device=a.device, gib=gib, tiny=tiny)
        if a.device == "cpu":
            res.update(throughput(d, 1 if tiny else max(3, a.trials // 2), a.steps, a.every, tiny))
    res["device"], res["state_gib"] = a.device, gib
    if a.json:
        print(json.dumps(res, indent=2))
        return
    if a.device == "cuda":
        floor = res["pinned_copy_s"]
        size = res["state_bytes"] / 2**30
        print(f"{size:.3g} GiB CUDA state: pinned copy {floor:.3f} s, async save blocks {res['async_block_s']:.3f} s,"
              f" dcp.async_save blocks {res['dcp_async_block_s']:.3f} s")  # fmt: skip
        for name, ratio, limit in (
            ("async save blocking / pinned device-to-host copy", res["async_block_s"] / floor, 1.2),
            ("async save blocking / dcp.async_save blocking", res["async_block_s"] / res["dcp_async_block_s"], 1.0),
        ):
            print(f"  {name:<52} {ratio:6.3f}x  <= {limit:.2f}{'  met' if ratio <= limit else '  NOT met'}")
        return
    ratios = [
        ("async save blocking / clone() of every tensor", res["async_block_s"] / res["clone_s"], "<= 1.20", 1.2),
        (
            "async save blocking / synchronous certified save",
            res["async_block_s"] / res["sync_save_s"],
            "<= 0.15",
            0.15,
        ),
        ("async save blocking / dcp.async_save blocking", res["async_block_s"] / res["dcp_async_block_s"], "", None),
    ]
    size = res["state_bytes"] / 2**30
    print(f"{size:.3g} GiB state: clone {res['clone_s']:.3f} s, async save blocks {res['async_block_s']:.3f} s "
          f"(staging {res['staging_bytes'] / 2**30:.2f} GiB kept), synchronous save {res['sync_save_s']:.3f} s, "
          f"dcp.async_save blocks {res['dcp_async_block_s']:.3f} s")  # fmt: skip
    for name, ratio, target, limit in ratios:
        verdict = "" if limit is None else ("  met" if ratio <= limit else "  NOT met")
        print(f"  {name:<52} {ratio:6.3f}x  {target}{verdict}")
    mb = res["checkpoint_bytes"] / 2**20
    print(f"training loop, {a.steps} steps, a {mb:.0f} MiB checkpoint every {a.every}:"
          f" no saving {res['loop_none_s']:.2f} s")  # fmt: skip
    for m in ["certckpt.async_save", "certckpt.save", "torch.save", "dcp.async_save"]:
        loss = res[f"loss_{m}"]
        target = ("  <= 5%" + ("  met" if loss <= 0.05 else "  NOT met")) if m == "certckpt.async_save" else ""
        print(f"  {m:<22} {res[f'loop_{m}_s']:7.2f} s   throughput lost {100 * loss:5.1f}%{target}")


if __name__ == "__main__":
    main()
