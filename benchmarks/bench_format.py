#!/usr/bin/env python
"""Benchmark certckpt's file format against torch.save, safetensors and sha256sum.

Run from the repository root:

    python benchmarks/bench_format.py            # two ~1 GiB states, 7 trials (~3 min on 2 cores)
    python benchmarks/bench_format.py --quick    # two 128 MiB states, 5 trials (smoke run)
    python benchmarks/bench_format.py --json     # also print every figure and sample as JSON

States (random values, seeded):
    A  ~1 GiB in 28 large tensors: 12 float32 4096x4096 + 16 bfloat16 2048x4096
    B  ~1 GiB in 500 float32 tensors of 2 MiB (512x1024)

Measurements (medians of interleaved trials; contenders rotate their order every round so that
they share the machine's noise; files live in a temp dir on local disk and are deleted, then
``os.sync()``'d untimed, after every trial; one untimed warm-up round comes first):

1. save, fsync included: ``certckpt.save`` (fsyncs internally) vs ``torch.save`` + flush + fsync
   vs ``safetensors.torch.save_file`` + open + fsync.
2. verify as whole processes, warm page cache: ``certckpt verify FILE`` (the installed console
   script) vs ``sha256sum FILE``; ``certckpt verify --deep`` for information; ``certckpt --help``;
   a subprocess check that the verify code path never imports torch.
3. fingerprint throughput on one core (``torch.set_num_threads(1)``, in a fresh subprocess):
   eager ``certckpt.fingerprint`` vs ``xxhash.xxh3_64_digest`` over the same bytes, then the
   compiled kernel after ``certckpt.enable_compile()`` (its compiling first calls excluded).
4. peak extra memory, one fresh subprocess per case: build the state (or import what is needed),
   read VmRSS, reset VmHWM (``echo 5 > /proc/self/clear_refs``), run the operation, read VmHWM;
   extra = VmHWM - VmRSS before.

Nothing here is hard-coded: every figure printed is measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
GB = 1e9  # throughput is reported in decimal GB/s

TARGETS = {
    "save_vs_torch": ("<=", 1.0),
    "save_vs_safetensors": ("<=", 1.15),
    "verify_speedup": (">=", 10.0),
    "help_s": ("<", 0.3),
    "fp_compiled_gbps": (">=", 12.0),
    "fp_eager_gbps": (">=", 5.0),
    "mem_mib": ("<=", 64.0),
}

# --------------------------------------------------------------------------------------------------
# states


def state_layout(kind: str, size: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) for each tensor of state A or B; size "quick" divides the total by 8, "tiny"
    (CERTCKPT_BENCH_TINY=1) keeps the tensor counts of A and a few KiB of everything."""
    if kind == "A":
        div = {"full": 1, "quick": 8, "tiny": 256}[size]
        f32 = [(f"layers.{i}.mlp.weight", "float32", (4096 // div, 4096)) for i in range(12)]
        bf16 = [(f"layers.{i}.attn.weight", "bfloat16", (2048 // div, 4096)) for i in range(16)]
        return f32 + bf16
    if kind == "B":
        n, rows = {"full": (500, 512), "quick": (64, 512), "tiny": (8, 8)}[size]
        return [(f"params.{i:03d}", "float32", (rows, 1024)) for i in range(n)]
    raise ValueError(kind)


def describe_state(kind: str, size: str) -> str:
    layout = state_layout(kind, size)
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    for _, dt, shape in layout:
        groups[(dt, shape)] = groups.get((dt, shape), 0) + 1
    total = sum(_nbytes(dt, shape) for _, dt, shape in layout)
    parts = ", ".join(f"{n}x {dt} {'x'.join(map(str, s))}" for (dt, s), n in groups.items())
    return f"{len(layout)} tensors ({parts}), {total / MiB:.0f} MiB"


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * {"float32": 4, "bfloat16": 2}[dtype]


def build_state(kind: str, size: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(20261130 + ord(kind))
    return {
        name: torch.randn(shape, generator=g, dtype=getattr(torch, dt)) for name, dt, shape in state_layout(kind, size)
    }


# --------------------------------------------------------------------------------------------------
# helpers


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def judge(key: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    op, target = TARGETS[key]
    ok = {"<=": value <= target, "<": value < target, ">=": value >= target}[op]
    return "PASS" if ok else "MISS"


def target_str(key: str) -> str:
    op, target = TARGETS[key]
    sym = {"<=": "≤", "<": "<", ">=": "≥"}[op]
    return f"{sym} {target:g}"


def interleaved(
    contenders: list[tuple[str, Callable[[], Any]]], trials: int, after: Callable[[], None] | None = None
) -> dict:
    """One untimed warm-up round, then ``trials`` rounds; the order rotates every round."""
    samples: dict[str, list[float]] = {name: [] for name, _ in contenders}
    warmup: dict[str, float] = {}
    for r in range(trials + 1):
        k = r % len(contenders)
        for name, fn in contenders[k:] + contenders[:k]:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r == 0:
                warmup[name] = dt
            else:
                samples[name].append(dt)
            if after:
                after()
    return {"samples": samples, "warmup": warmup, "median": {n: median(s) for n, s in samples.items()}}


def console_script(name: str) -> str:
    """The console script pip installed next to this interpreter (not a pyenv/asdf shim)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    found = shutil.which(name)
    if not found:
        sys.exit(f"bench_format: `{name}` is not installed; run `pip install -e .` first")
    return found


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def cpu_busy_seconds() -> float | None:
    """CPU seconds all processes (and the kernel) spent busy since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its finished child processes."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def others_busy_cores(seconds: float = 1.0) -> float | None:
    """How many cores other processes kept busy over a short sample (this one sleeps)."""
    b0 = cpu_busy_seconds()
    time.sleep(seconds)
    b1 = cpu_busy_seconds()
    return None if b0 is None or b1 is None else (b1 - b0) / seconds


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, f"{parts[2]} on {parts[0]}"
    except OSError:
        pass
    return kind


def run_worker(argv: list[str], timeout: float = 600) -> dict:
    env = dict(os.environ)
    env.pop("CERTCKPT_COMPILE", None)
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"worker {argv} exited {p.returncode}: {(p.stderr or p.stdout).strip()[-2000:]}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------------
# 1. save


def bench_save(state: dict, d: str, trials: int) -> dict:
    import safetensors.torch
    import torch

    import certckpt

    path = os.path.join(d, "save-trial.safetensors")

    def c_save():
        certckpt.save(state, path)

    def t_save():
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def s_save():
        safetensors.torch.save_file(state, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def cleanup():
        os.unlink(path)
        gc.collect()
        os.sync()  # untimed: let the unlink's journal/discard work finish before the next contender

    res = interleaved([("certckpt", c_save), ("torch.save", t_save), ("safetensors", s_save)], trials, cleanup)
    m = res["median"]
    res["ratio_vs_torch"] = m["certckpt"] / m["torch.save"]
    res["ratio_vs_safetensors"] = m["certckpt"] / m["safetensors"]
    return res


def bench_components(state: dict, trials: int) -> dict:
    """Where certckpt.save's CPU time goes: the two hashes it computes, without any I/O."""
    import torch
    import xxhash

    import certckpt

    tensors = list(state.values())
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]

    def fps():
        certckpt.fingerprint_many(tensors)

    def digests():
        for v in views:
            xxhash.xxh3_128_hexdigest(v)

    res = interleaved([("fingerprint_many", fps), ("xxh3_128", digests)], max(3, trials // 2))
    return res


# --------------------------------------------------------------------------------------------------
# 2. verify


def bench_verify(path: str, trials: int, exe: str, deep: bool) -> dict:
    with open(path, "rb") as f:  # warm the page cache
        while f.read(64 * MiB):
            pass

    def run(cmd: list[str]) -> Callable[[], None]:
        def go():
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.decode()[-500:]}")

        return go

    contenders = [("certckpt verify", run([exe, "verify", path])), ("sha256sum", run(["sha256sum", path]))]
    if deep:  # information only (no target); skipped by --quick, where torch's import dominates
        contenders.append(("certckpt verify --deep", run([exe, "verify", "--deep", path])))
    res = interleaved(contenders, trials)
    m = res["median"]
    res["speedup"] = m["sha256sum"] / m["certckpt verify"]
    res["nbytes"] = os.path.getsize(path)
    return res


def bench_help(exe: str, trials: int) -> dict:
    samples = []
    for _ in range(trials + 1):
        t0 = time.perf_counter()
        p = subprocess.run([exe, "--help"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise RuntimeError(f"{exe} --help exited {p.returncode}")
    return {"samples": samples[1:], "warmup": samples[0], "median": median(samples[1:])}


NO_TORCH_CHECK = r"""
import json, sys
from certckpt_cli.main import main
try:
    main(["verify", sys.argv[1]], standalone_mode=False)
    rc = 0
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "torch_imported": "torch" in sys.modules,
                  "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:5]}))
"""


def check_no_torch(path: str) -> dict:
    p = subprocess.run([sys.executable, "-c", NO_TORCH_CHECK, path], capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"ok": False, "error": (p.stderr or p.stdout)[-1000:]}
    out = json.loads(lines[-1])
    out["ok"] = out["rc"] in (0, None) and not out["torch_imported"]
    return out


# --------------------------------------------------------------------------------------------------
# 3. fingerprint throughput (worker subprocess)


def worker_fp(mib: int, trials: int, compile_too: bool = True) -> dict:
    import warnings

    import torch
    import xxhash

    import certckpt

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    t = torch.randn(mib * MiB // 4, generator=g, dtype=torch.float32)
    buf = t.numpy()  # shares t's memory: the same bytes
    nbytes = t.numel() * t.element_size()
    eager_fp = certckpt.fingerprint(t)

    cpu = {"eager": 0.0, "compiled": 0.0}
    wall = {"eager": 0.0, "compiled": 0.0}

    def timed(label: str) -> Callable[[], None]:
        def go():
            c0, w0 = time.process_time(), time.perf_counter()
            certckpt.fingerprint(t)
            cpu[label] += time.process_time() - c0
            wall[label] += time.perf_counter() - w0

        return go

    def xxh():
        xxhash.xxh3_64_digest(buf)

    eager = interleaved([("eager", timed("eager")), ("xxh3_64", xxh)], trials)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        # tiny mode skips compiling (inductor takes ~20 s with a cold cache): the row says so
        active = certckpt.enable_compile() if compile_too else False
        compile_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "nbytes": nbytes,
        "threads": torch.get_num_threads(),
        "eager": eager,
        "compile_active": active,
        "compile_skipped": not compile_too,
        "compile_seconds": compile_s,
        "compile_warnings": [str(w.message) for w in caught],
    }
    if active:
        t0 = time.perf_counter()
        first = certckpt.fingerprint(t)  # first real call: may still trace/compile; excluded
        out["compiled_first_call_seconds"] = time.perf_counter() - t0
        out["compiled_matches_eager"] = first == eager_fp
        out["compiled"] = interleaved([("compiled", timed("compiled")), ("xxh3_64", xxh)], trials)
    # CPU seconds / wall seconds over the timed calls: ~1.0 means one core was used.
    out["cores_used"] = {k: (cpu[k] / wall[k] if wall[k] else None) for k in cpu}
    return out


# --------------------------------------------------------------------------------------------------
# 4. peak extra memory (worker subprocess, one per case)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker_mem(op: str, kind: str, size: str, path: str) -> dict:
    state = None
    if op in ("save", "torch.save", "safetensors"):
        import safetensors.torch
        import torch

        import certckpt

        certckpt.save  # noqa: B018 - resolve the lazy import (certckpt's writer module) before measuring
        state = build_state(kind, size)
    elif op == "verify":
        import certckpt
    elif op == "verify-deep":
        # Import the libraries deep verification uses, so their code pages count as baseline
        # (through certckpt's public lazy names, not its private module names).
        import torch

        import certckpt

        certckpt.fingerprint_many, certckpt.save  # noqa: B018
    else:
        raise ValueError(op)
    gc.collect()

    rss0 = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hwm_reset = _status_kib("VmHWM")

    ok = True
    if op == "save":
        certckpt.save(state, path)
    elif op == "torch.save":
        import torch

        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    elif op == "safetensors":
        import safetensors.torch

        safetensors.torch.save_file(state, path)
    elif op == "verify":
        ok = certckpt.verify(path).ok
    elif op == "verify-deep":
        ok = certckpt.verify(path, deep=True).ok

    hwm = _status_kib("VmHWM")
    rss1 = _status_kib("VmRSS")
    if op in ("save", "torch.save", "safetensors"):
        os.unlink(path)
    return {
        "op": op,
        "ok": ok,
        "rss_before_mib": rss0 / 1024,
        "hwm_after_reset_mib": hwm_reset / 1024,
        "hwm_reset_worked": hwm_reset <= rss0 + 1024,  # within 1 MiB of the RSS just read
        "hwm_mib": hwm / 1024,
        "rss_after_mib": rss1 / 1024,
        "extra_mib": (hwm - rss0) / 1024,
        "torch_imported": "torch" in sys.modules,
    }


# --------------------------------------------------------------------------------------------------
# report


def fmt_s(res: dict, name: str) -> str:
    s = res["samples"][name]
    return f"{median(s):.3f} s [{min(s):.3f}-{max(s):.3f}]"


def print_report(R: dict) -> None:
    A, B = R["states"]["A"], R["states"]["B"]
    rows: list[tuple[str, str, str, str]] = []  # label, target, A, B

    def both(label: str, target: str, cell: Callable[[dict], str]) -> None:
        rows.append((label, target, cell(A), cell(B)))

    def judged(key: str, value: float | None, f: str) -> str:
        return "n/a" if value is None else f"{format(value, f)}  {judge(key, value)}"

    rows.append(("1. SAVE (fsync included), median [min-max]", "", "", ""))
    for name in ("certckpt", "torch.save", "safetensors"):
        both(f"   {name}", "", lambda s, n=name: fmt_s(s["save"], n))
    both(
        "   ratio certckpt / torch.save",
        target_str("save_vs_torch"),
        lambda s: judged("save_vs_torch", s["save"]["ratio_vs_torch"], ".3f"),
    )
    both(
        "   ratio certckpt / safetensors",
        target_str("save_vs_safetensors"),
        lambda s: judged("save_vs_safetensors", s["save"]["ratio_vs_safetensors"], ".3f"),
    )
    both(
        "   info: fastest-run ratios (/torch, /st)",
        "",
        lambda s: "{:.3f} / {:.3f}".format(
            *(
                min(s["save"]["samples"]["certckpt"]) / min(s["save"]["samples"][n])
                for n in ("torch.save", "safetensors")
            )
        ),
    )
    both("   info: fingerprint_many, no I/O", "", lambda s: f"{s['components']['median']['fingerprint_many']:.3f} s")
    both("   info: xxh3_128 digests, no I/O", "", lambda s: f"{s['components']['median']['xxh3_128']:.3f} s")
    rows.append(("2. VERIFY, whole process, warm cache", "", "", ""))
    both("   certckpt verify", "", lambda s: fmt_s(s["verify"], "certckpt verify"))
    both("   sha256sum", "", lambda s: fmt_s(s["verify"], "sha256sum"))
    both(
        "   speedup sha256sum / certckpt",
        target_str("verify_speedup"),
        lambda s: judged("verify_speedup", s["verify"]["speedup"], ".1f").replace(" ", "x ", 1),
    )
    both(
        "   info: certckpt verify --deep",
        "",
        lambda s: (
            fmt_s(s["verify"], "certckpt verify --deep")
            if "certckpt verify --deep" in s["verify"]["samples"]
            else "skipped (quick/tiny)"
        ),
    )
    rows.append(("4. PEAK EXTRA MEMORY (VmHWM - VmRSS)", "", "", ""))

    def mem_cell(s: dict, op: str, targeted: bool) -> str:
        m = s["memory"].get(op)
        if m is None:
            return "skipped"
        if "error" in m:
            return "ERROR"
        flag = "" if m["hwm_reset_worked"] and m["ok"] else " (!)"
        v = m["extra_mib"]
        return f"{v:.1f} MiB" + (f"  {judge('mem_mib', v)}" if targeted else "") + flag

    for op, label, targeted in (
        ("save", "certckpt.save", True),
        ("verify", "certckpt.format.verify", True),
        ("verify-deep", "certckpt.format.verify deep=True", True),
        ("torch.save", "info: torch.save", False),
        ("safetensors", "info: safetensors save_file", False),
    ):
        both(
            f"   {label}",
            target_str("mem_mib") + " MiB" if targeted else "",
            lambda s, o=op, t=targeted: mem_cell(s, o, t),
        )

    head = ("", "target", f"A ({A['label']})", f"B ({B['label']})")
    w = [max(len(r[i]) for r in [*rows, head]) for i in range(4)]
    print()
    print(
        f"certckpt format benchmark ({R['config']['size']}): {R['config']['trials']} trials, "
        f"median [min-max]; dir {R['config']['dir']} ({R['config']['fs']})"
    )
    c = R["config"]
    print(
        f"torch {c['torch']}, {c['cpus']} CPUs, {c['torch_threads']} torch threads; "
        f"load average {c['loadavg_start']} at start, {c['loadavg_end']} at end (1/5/15 min)"
    )
    ob, oc = c.get("others_busy_cores_before"), c.get("others_cpu_s_during_run")
    if ob is not None and oc is not None:
        print(
            f"CPU used outside this benchmark: {ob:.2f} cores just before it; {oc:.1f} CPU-s during its "
            f"{R['elapsed_s']:.0f} s (includes kernel writeback it caused)"
        )
    print(f"A = {A['desc']}")
    print(f"B = {B['desc']}")
    print()
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("  ".join("-" * x for x in w))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())

    G = R["global"]
    print()
    print("2. CLI (state-independent)")
    h = G["help"]
    print(
        f"   certckpt --help: {h['median']:.3f} s [{min(h['samples']):.3f}-{max(h['samples']):.3f}]"
        f"   target {target_str('help_s')} s   {judge('help_s', h['median'])}   ({G['exe']})"
    )
    nt = G["no_torch"]
    detail = (
        "verify exited " + str(nt.get("rc")) + ", torch imported: " + str(nt.get("torch_imported"))
        if "error" not in nt
        else nt["error"]
    )
    print(f"   verify code path imports no torch: {'PASS' if nt['ok'] else 'MISS'}   ({detail})")

    print()
    fp = G["fp"]
    if "error" in fp:
        print(f"3. FINGERPRINT: worker failed: {fp['error']}")
    else:
        e = fp["eager"]["median"]
        gbps = lambda t: fp["nbytes"] / GB / t  # noqa: E731
        print(
            f"3. FINGERPRINT THROUGHPUT, one core (torch threads = {fp['threads']}), "
            f"one {fp['nbytes'] / MiB:.0f} MiB float32 tensor"
        )
        cu = fp["cores_used"]
        print(f"   xxhash.xxh3_64_digest          {gbps(e['xxh3_64']):6.2f} GB/s   (reference)")
        print(
            f"   certckpt.fingerprint, eager    {gbps(e['eager']):6.2f} GB/s   "
            f"target {target_str('fp_eager_gbps')} GB/s   "
            f"{judge('fp_eager_gbps', gbps(e['eager']))}   (cpu/wall {cu['eager']:.2f})"
        )
        if fp.get("compile_skipped"):
            print(
                "   certckpt.fingerprint, compiled   skipped (tiny mode)   "
                f"target {target_str('fp_compiled_gbps')} GB/s"
            )
        elif fp["compile_active"]:
            c = fp["compiled"]["median"]
            print(
                f"   certckpt.fingerprint, compiled {gbps(c['compiled']):6.2f} GB/s   "
                f"target {target_str('fp_compiled_gbps')} GB/s   "
                f"{judge('fp_compiled_gbps', gbps(c['compiled']))}   (cpu/wall {cu['compiled']:.2f}; "
                f"same value as eager: {fp['compiled_matches_eager']}; "
                f"xxh3_64 in those rounds {gbps(c['xxh3_64']):.2f} GB/s)"
            )
            print(
                f"   info: enable_compile() took {fp['compile_seconds']:.1f} s, first compiled call "
                f"{fp['compiled_first_call_seconds']:.2f} s (both excluded)"
            )
        else:
            print(
                f"   certckpt.fingerprint, compiled   n/a   target {target_str('fp_compiled_gbps')} GB/s   MISS   "
                f"(enable_compile() returned False: {'; '.join(fp['compile_warnings']) or 'no warning'})"
            )

    misses = R["misses"]
    print()
    print(
        f"{len(misses)} target(s) missed"
        + (": " + ", ".join(misses) if misses else "")
        + f"; total {R['elapsed_s']:.0f} s"
    )


def collect_misses(R: dict) -> list[str]:
    out = []
    for k in ("A", "B"):
        s = R["states"][k]
        for key, v, label in (
            ("save_vs_torch", s["save"]["ratio_vs_torch"], "save/torch.save"),
            ("save_vs_safetensors", s["save"]["ratio_vs_safetensors"], "save/safetensors"),
            ("verify_speedup", s["verify"]["speedup"], "verify speedup"),
        ):
            if judge(key, v) != "PASS":
                out.append(f"{label} ({k})")
        for op in ("save", "verify", "verify-deep"):
            m = s["memory"].get(op, {})
            if judge("mem_mib", m.get("extra_mib")) != "PASS":
                out.append(f"memory {op} ({k})")
    G = R["global"]
    if judge("help_s", G["help"]["median"]) != "PASS":
        out.append("--help time")
    if not G["no_torch"]["ok"]:
        out.append("no-torch verify")
    fp = G["fp"]
    if "error" in fp:
        out.append("fingerprint (worker failed)")
    else:
        if judge("fp_eager_gbps", fp["nbytes"] / GB / fp["eager"]["median"]["eager"]) != "PASS":
            out.append("eager fingerprint GB/s")
        if (
            not fp["compile_active"]
            or judge("fp_compiled_gbps", fp["nbytes"] / GB / fp["compiled"]["median"]["compiled"]) != "PASS"
        ):
            out.append("compiled fingerprint GB/s")
    return out


# --------------------------------------------------------------------------------------------------
# main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 MiB states, 5 trials: a smoke run")
    ap.add_argument("--json", action="store_true", help="also print all results as JSON")
    ap.add_argument("--trials", type=int, default=None, help="timed rounds per measurement (default 7, quick 5)")
    ap.add_argument("--dir", default=None, help="parent directory for the temp dir (default: the system temp dir)")
    ap.add_argument(
        "--fp-mib", type=int, default=None, help="size of the fingerprint throughput tensor (default 256, tiny 4)"
    )
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        w = args.worker
        if w[0] == "fp":
            print(json.dumps(worker_fp(int(w[1]), int(w[2]), compile_too=w[3:] != ["nocompile"])))
        elif w[0] == "mem":
            print(json.dumps(worker_mem(w[1], w[2], w[3], w[4])))
        else:
            sys.exit(f"unknown worker {w}")
        return

    from tinymode import announce

    tiny = announce("bench_format")
    size = "tiny" if tiny else "quick" if args.quick else "full"
    os.environ.pop("CERTCKPT_COMPILE", None)  # the main process measures the default (eager) save
    trials = args.trials or (1 if tiny else 5 if args.quick else 7)
    fp_mib = args.fp_mib or (4 if tiny else 256)
    if trials < 5 and not tiny:
        print(f"note: {trials} trials (fewer than 5)", file=sys.stderr)
    busy = others_busy_cores(0.1 if tiny else 1.0)
    if busy is not None and busy > 0.25:
        print(
            f"warning: other processes keep {busy:.2f} cores busy; figures will be noisy "
            "(torch's thread pool suffers most)",
            file=sys.stderr,
        )
    busy0, own0 = cpu_busy_seconds(), own_cpu_seconds()
    t_start = time.perf_counter()
    exe = console_script("certckpt")
    d = tempfile.mkdtemp(prefix="certckpt-bench-", dir=args.dir)
    log = lambda msg: print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa: E731

    import torch

    import certckpt

    R: dict[str, Any] = {
        "config": {
            "quick": args.quick,
            "size": size,
            "trials": trials,
            "dir": d,
            "fs": fs_type(d),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "certckpt": certckpt.__version__,
            "exe": exe,
            "loadavg_start": loadavg(),
            "others_busy_cores_before": busy,
        },
        "states": {},
        "global": {},
    }
    try:
        vpaths = {}
        for kind in ("A", "B"):
            log(f"state {kind}: building {describe_state(kind, size)}")
            state = build_state(kind, size)
            S = R["states"][kind] = {
                "label": (
                    f"{sum(_nbytes(dt, sh) for _, dt, sh in state_layout(kind, size)) / MiB:.0f} MiB, "
                    f"{len(state)} tensors"
                ),
                "desc": describe_state(kind, size),
            }
            log(f"state {kind}: save x{trials + 1} rounds")
            S["save"] = bench_save(state, d, trials)
            log(f"state {kind}: hashing components")
            S["components"] = bench_components(state, trials)
            vpaths[kind] = os.path.join(d, f"verify-{kind}.safetensors")
            certckpt.save(state, vpaths[kind])
            del state
            gc.collect()
            log(f"state {kind}: verify x{trials + 1} rounds")
            S["verify"] = bench_verify(vpaths[kind], trials, exe, deep=not (args.quick or tiny))

        G = R["global"]
        G["exe"] = exe
        log("CLI: --help, no-torch check")
        G["help"] = bench_help(exe, trials)
        G["no_torch"] = check_no_torch(vpaths["A"])
        log("fingerprint throughput worker (compiles for a while)")
        G["fp"] = run_worker(["--worker", "fp", str(fp_mib), str(trials)] + (["nocompile"] if tiny else []))

        for kind in ("A", "B"):
            mem = R["states"][kind]["memory"] = {}
            # torch.save / safetensors rows are information only; --quick skips them. Tiny mode runs
            # every case once, on state A only (each case is a process that imports torch).
            if tiny and kind == "B":
                continue
            for op in ("save", "verify", "verify-deep") + (() if args.quick else ("torch.save", "safetensors")):
                log(f"state {kind}: memory {op}")
                path = vpaths[kind] if op.startswith("verify") else os.path.join(d, f"mem-{kind}.bin")
                mem[op] = run_worker(["--worker", "mem", op, kind, size, path])
    finally:
        shutil.rmtree(d, ignore_errors=True)

    R["elapsed_s"] = time.perf_counter() - t_start
    R["config"]["loadavg_end"] = loadavg()
    busy1 = cpu_busy_seconds()
    if busy0 is not None and busy1 is not None:
        # All busy CPU time on the machine minus this benchmark's own processes; kernel work it
        # caused (page-cache writeback, journaling) lands here too, so a few seconds is normal.
        R["config"]["others_cpu_s_during_run"] = max(0.0, (busy1 - busy0) - (own_cpu_seconds() - own0))
    R["misses"] = collect_misses(R)
    print_report(R)
    if args.json:
        print()
        print(json.dumps(R, indent=2))


if __name__ == "__main__":
    main()
