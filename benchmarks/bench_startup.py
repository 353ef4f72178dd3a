"""Whole-process start-up, side by side: what a person waits for when they type the command.

- ``certckpt --help`` against ``python -c "import click"`` (the floor of any click CLI); target
  within 2x.
- ``certckpt verify FILE`` against ``sha256sum FILE`` on a 0.5 GB checkpoint, page cache warm, both
  whole processes; target at least 10x faster.
- per command, the time its process spends importing (``python -X importtime``, min of the runs):
  the whole import, what certckpt's own modules take of it, and the three heaviest top-level imports
  (a command should import what it needs to answer and nothing else).

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


def _store(top: str) -> tuple[str, str]:
    """A tiny run store (a placement under a fleet registry, audits, three checkpoints) and its fleet,
    written with the ledger alone: every command below has something to answer."""
    from certckpt.trust.fleet import Fleet
    from certckpt.trust.ledger import Ledger

    store, fleet = os.path.join(top, "run"), os.path.join(top, "fleet")
    os.makedirs(store)
    os.makedirs(fleet)
    Fleet(fleet, signing_key=None).create()
    Fleet(fleet, signing_key=None).register_store(store)
    led = Ledger(store, signing_key=None)
    led.record_placement(branch="main", start_step=0, devices={"0": "gpu-a", "1": "gpu-b"}, fleet=fleet)
    events = [
        {"run": "r", "branch": "main", "step": s, "kind": k, "outcome": "pass", "ranks": [0, 1]}
        | {"details": {"fp": f"fp{s}"} if k == "consensus" else {}}
        for s in (10, 20, 30)
        for k in ("replay", "nonfinite", "consensus")
    ]
    led.append_events(events)
    for s in (10, 20, 30):
        led.commit_checkpoint(branch="main", step=s, location=os.path.join(store, f"m{s}.safetensors"))
    return store, fleet


def commands(cli: list[str], *, store: str, fleet: str, ckpt: str, out: str) -> dict[str, list[str]]:
    """The commands whose import time is measured, each with arguments it can answer."""
    return {
        "--help": [*cli, "--help"],
        "verify": [*cli, "verify", ckpt],
        "latest-good": [*cli, "latest-good", store, "--no-verify"],
        "status": [*cli, "status", store],
        "incident ls": [*cli, "incident", "ls", store],
        "fleet ls": [*cli, "fleet", "ls", "--fleet", fleet],
        "plan": [*cli, "plan", "--audit-every", "100", "--ckpt-every", "100", "--keep", "2"],
        "report": [*cli, "report", store, "--out", out, "--force"],
    }


def importtime_ms(stderr: str) -> tuple[float, float, list[tuple[str, float]]]:
    """(all imports, certckpt's own, top-level imports by cumulative time) in ms from ``-X importtime``."""
    total = own = 0.0
    top: list[tuple[str, float]] = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        try:
            _, cum, name = line[len("import time:") :].split("|")
            cum_us = int(cum)
        except ValueError:
            continue  # the header line
        if name.startswith(" ") and not name.startswith("  "):  # a top-level import (one space after |)
            total += cum_us / 1000
            top.append((name.strip(), cum_us / 1000))
            if name.strip().startswith("certckpt"):
                own += cum_us / 1000
    return total, own, sorted(top, key=lambda kv: -kv[1])


def import_times(cmds: dict[str, list[str]], runs: int) -> dict[str, dict[str, object]]:
    """Per command, its process's import time (min of ``runs``, interleaved) and its heaviest imports."""
    best: dict[str, dict[str, object]] = {}
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    for _ in range(runs):
        for name, argv in cmds.items():
            out = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
            total, own, top = importtime_ms(out.stderr)
            if name not in best or total < float(best[name]["import_ms"]):  # type: ignore[arg-type]
                best[name] = {"import_ms": total, "certckpt_ms": own, "top": top[:3], "exit": out.returncode}
    return best


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
        store, fleet = _store(os.path.join(d, "stores"))
        out = os.path.join(d, "timeline.svg")
        imports = import_times(commands(cli, store=store, fleet=fleet, ckpt=path, out=out), args.runs)
    result = {
        "runs": args.runs,
        "checkpoint_bytes": nbytes,
        "seconds": {**help_t, **verify_t},
        "help_over_import_click": help_t["certckpt --help"] / help_t["import click"],
        "sha256sum_over_verify": verify_t["sha256sum"] / verify_t["certckpt verify"],
        "verify_gb_per_s": nbytes / verify_t["certckpt verify"] / 1e9,
        "imports": imports,
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
    print(f"import time per command (python -X importtime, whole process, min of {args.runs} runs)")
    print(f"  {'command':<13} {'imports':>9} {'certckpt':>9}   heaviest top-level imports")
    for name, r in imports.items():
        top = ", ".join(f"{m} {ms:.0f}" for m, ms in r["top"])  # type: ignore[attr-defined]
        print(f"  {name:<13} {r['import_ms']:7.1f}ms {r['certckpt_ms']:7.1f}ms   {top}")


if __name__ == "__main__":
    main()
