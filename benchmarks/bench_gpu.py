"""The GPU checks of issue 15, as one script for a session lent a GPU (CI never has one).

Measures, side by side in one run, and writes a text report and JSON under ``--out`` (default
``$OUT`` when set, else the working directory):

1. agreement: certckpt fingerprints of the same tensors on the CPU and on the GPU (dtypes x shapes x
   non-contiguous views), every case must agree bit for bit;
2. fingerprint and audit-digest throughput on the GPU, the fused Triton kernels
   (``certckpt/format/fused.py``, what ``certckpt.fingerprint`` uses on CUDA once its first-use check
   passed) and the eager torch path, against a plain ``sum`` reading the same tensor (64 MiB and
   ``--fp-gib``), and ``fingerprint_state`` over many 32 MiB bf16 tensors; targets (issue 15): fused
   >= 50 % of the read bandwidth from 64 MiB up, ``fingerprint_state`` >= 25 %;
3. saving a CUDA state: ``certckpt.save`` vs ``torch.save`` vs ``safetensors.torch.save_file``
   (all fsync'd), ratios;
4. loading to the GPU: ``certckpt.load(map_location="cuda")`` (plain and ``mmap=True``) vs
   ``torch.load(map_location="cuda", weights_only=True)`` vs ``safetensors.torch.load_file(device=
   "cuda")``, ratios (target: plain <= 1.3x safetensors);
5. the fault drill on CUDA: ``certckpt drill faults --device cuda`` (12 cases, 3 gloo ranks sharing
   the GPU), how many behaved as designed, then ``certckpt status --verify-bytes`` of one case's run
   store and ``verify --deep`` of its checkpoints (fingerprints computed on the GPU);
6. the per-step checks on CUDA: ``certckpt envelope --quick --backend nccl --device cuda --ranks 1``
   (plain DDP against the auditor, premium per K beside the replay floor), its table as printed.

Usage on the device machine (one call, a timeout that leaves room for a rerun)::

    python benchmarks/bench_gpu.py --state-gib 3 --fp-gib 4 --out "$OUT"

``--quick`` shrinks everything (a smoke run, also possible on a CPU-only machine with ``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import certckpt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, trials: int) -> list[float]:
    fn()  # warm-up
    _sync(device)
    out = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def agreement(device: torch.device) -> dict:
    from certckpt.detect.digest import digest

    cases = ok = 0
    bad = []
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool):
        for shape in ((0,), (1,), (7,), (3, 5), (1000, 33), (65536 * 2 + 3,)):
            base = torch.randn(shape, generator=g) * 10
            t = base.to(dtype) if dtype is not torch.bool else base > 0
            views = [t] + ([t.t()] if t.dim() == 2 else []) + ([t[::2]] if t.numel() > 1 else [])
            for v in views:
                cases += 2
                a, b = certckpt.fingerprint(v), certckpt.fingerprint(v.to(device))
                da, db = int(digest(v)), int(digest(v.to(device)))
                ok += (a == b) + (da == db)
                if a != b:
                    bad.append(f"fingerprint {dtype} {tuple(v.shape)} stride {v.stride()}")
                if da != db:
                    bad.append(f"digest {dtype} {tuple(v.shape)} stride {v.stride()}")
    return {"cases": cases, "agree": ok, "disagree": bad[:10]}


def _speeds(t: torch.Tensor, device: torch.device, trials: int) -> dict:
    from certckpt.detect.digest import digest, digest_words_eager
    from certckpt.format.fingerprinting import as_words, raw_sum_eager

    nbytes = t.numel() * t.element_size()
    words = as_words(t)
    timings = {
        "sum": _timed(lambda: t.sum(), device, trials),
        "fingerprint": _timed(lambda: certckpt.fingerprint(t), device, trials),  # fused where ready
        "fingerprint_eager": _timed(lambda: int(raw_sum_eager(words)), device, trials),
        "digest": _timed(lambda: int(digest(t)), device, trials),
        "digest_eager": _timed(lambda: int(digest_words_eager(words)), device, trials),
    }
    gbps = {k: nbytes / _med(v) / 1e9 for k, v in timings.items()}
    return {"bytes": nbytes, "GBps": gbps, "fraction_of_sum": {k: v / gbps["sum"] for k, v in gbps.items()}}


def fingerprint_speed(device: torch.device, gib: float, trials: int) -> dict:
    from certckpt.format import fused

    out = {"fused_active": fused.ready(device), "digest_fused_active": None}
    sizes = sorted({64 << 20, int(gib * (1 << 30))})
    out["sizes"] = [_speeds(torch.randn(n // 4, device=device), device, trials) for n in sizes]
    many = [torch.randn(16 << 20, device=device, dtype=torch.bfloat16) for _ in range(max(4, int(gib * 24)))]
    nbytes_many = sum(x.numel() * x.element_size() for x in many)
    st = _timed(lambda: certckpt.fingerprint_state({str(i): x for i, x in enumerate(many)}), device, trials)
    sm = _timed(lambda: [x.sum() for x in many], device, trials)
    out["fingerprint_state_GBps"] = nbytes_many / _med(st) / 1e9
    out["fingerprint_state_fraction_of_sum"] = _med(sm) / _med(st)
    out["fingerprint_state_tensors"] = len(many)
    from certckpt.detect.digest import digest_words_eager

    out["digest_fused_active"] = fused.digest_ready(device, digest_words_eager)
    return out


def _state(device: torch.device, gib: float) -> dict[str, torch.Tensor]:
    each = 64 << 20  # 64 MiB bf16 tensors, as a large model's layers
    count = max(2, int(gib * (1 << 30) // each))
    return {f"layer{i}.weight": torch.randn(each // 2, device=device, dtype=torch.bfloat16) for i in range(count)}


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_and_load(device: torch.device, gib: float, trials: int, directory: str) -> dict:
    from safetensors.torch import load_file, save_file

    state = _state(device, gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    paths = {k: os.path.join(directory, f"bench.{k}") for k in ("certckpt", "torch", "safetensors")}

    def save_certckpt():
        certckpt.save(state, paths["certckpt"])

    def save_torch():
        torch.save(state, paths["torch"])
        _fsync(paths["torch"])

    def save_st():
        save_file(state, paths["safetensors"])
        _fsync(paths["safetensors"])

    saves = {
        name: _timed(fn, device, trials)
        for name, fn in (("certckpt", save_certckpt), ("torch", save_torch), ("safetensors", save_st))
    }
    where = str(device)
    loads = {
        "certckpt": _timed(lambda: certckpt.load(paths["certckpt"], map_location=where), device, trials),
        "certckpt_mmap": _timed(
            lambda: certckpt.load(paths["certckpt"], map_location=where, mmap=True), device, trials
        ),
        "torch": _timed(lambda: torch.load(paths["torch"], map_location=where, weights_only=True), device, trials),
        "safetensors": _timed(lambda: load_file(paths["safetensors"], device=where), device, trials),
    }
    back = certckpt.load(paths["certckpt"], map_location=where)
    equal = all(torch.equal(back[k], v) for k, v in state.items())
    return {
        "bytes": nbytes,
        "save_s": {k: _med(v) for k, v in saves.items()},
        "load_s": {k: _med(v) for k, v in loads.items()},
        "save_ratio_vs_torch": _med(saves["certckpt"]) / _med(saves["torch"]),
        "save_ratio_vs_safetensors": _med(saves["certckpt"]) / _med(saves["safetensors"]),
        "load_ratio_vs_safetensors": _med(loads["certckpt"]) / _med(loads["safetensors"]),
        "load_mmap_ratio_vs_safetensors": _med(loads["certckpt_mmap"]) / _med(loads["safetensors"]),
        "load_ratio_vs_torch": _med(loads["certckpt"]) / _med(loads["torch"]),
        "verify_after_gpu_save": certckpt.verify(paths["certckpt"], deep=True).ok,
        "round_trip_equal": equal,
    }


def gpu_drill(directory: str) -> dict:
    import subprocess

    from certckpt.detect.drill import run_matrix

    t0 = time.perf_counter()
    m = run_matrix(ranks=3, audit_every=10, ckpt_every=5, directory=directory, device="cuda")
    elapsed = time.perf_counter() - t0
    designed = [
        (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
        and (c["caught_by"] is None or c["suspect_ranks"] == [c["rank"]])
        for c in m["cases"]
    ]
    rows = [
        f"{c['fault']}/{c['timing']}: caught by {c['caught_by'] or 'ESCAPED'} at {c['detected_step']}"
        f" naming {c['suspect_ranks']} ({'as designed' if ok else 'NOT as designed'})"
        for c, ok in zip(m["cases"], designed)
    ]
    store = os.path.join(directory, "post-optimizer-persistent")
    status = subprocess.run(
        [sys.executable, "-m", "certckpt_cli.main", "status", store, "--verify-bytes"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    files = sorted(f for f in os.listdir(store) if f.endswith(".safetensors"))
    deep = {f: certckpt.verify(os.path.join(store, f), deep=True).ok for f in files}
    return {
        "seconds": elapsed,
        "cases": len(designed),
        "as_designed": sum(designed),
        "rows": rows,
        "status_exit": status.returncode,
        "status": status.stdout[-3000:],
        "verify_deep": deep,
    }


def envelope_nccl(timeout: int) -> dict:
    import subprocess

    cmd = ["certckpt", "envelope", "--quick", "--backend", "nccl", "--device", "cuda", "--ranks", "1"]
    t0 = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "certckpt_cli.main", *cmd[1:]], capture_output=True, text=True, timeout=timeout
    )
    return {
        "command": " ".join(cmd),
        "exit": run.returncode,
        "seconds": time.perf_counter() - t0,
        "table": run.stdout[-4000:],
        "stderr_tail": run.stderr[-1500:],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--state-gib", type=float, default=3.0, help="size of the saved/loaded bf16 state")
    ap.add_argument("--fp-gib", type=float, default=4.0, help="size of the fingerprint throughput tensor")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB everywhere, 3 trials")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default=None, help="where the files go (a local disk)")
    ap.add_argument("--skip-drill", action="store_true", help="leave out the fault drill on CUDA (section 5)")
    ap.add_argument("--skip-envelope", action="store_true", help="leave out the per-step checks (section 6)")
    ap.add_argument("--envelope-timeout", type=int, default=240)
    args = ap.parse_args(argv)
    if args.quick:
        args.state_gib = args.fp_gib = 0.25
        args.trials = 3
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke run", file=sys.stderr)
        return 2
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "certckpt": certckpt.__version__,
    }
    report["agreement"] = agreement(device)
    report["fingerprint"] = fingerprint_speed(device, args.fp_gib, args.trials)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        report["save_load"] = save_and_load(device, args.state_gib, args.trials, d)
    cuda = device.type == "cuda"
    if cuda and not args.skip_drill:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            report["drill"] = gpu_drill(os.path.join(d, "drill"))
    if cuda and not args.skip_envelope:
        report["envelope"] = envelope_nccl(args.envelope_timeout)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=2)
    a, f, s = report["agreement"], report["fingerprint"], report["save_load"]
    fp_lines = [f"fused kernels active: fingerprint {f['fused_active']}, digest {f['digest_fused_active']}"]
    for size in f["sizes"]:
        g, fr = size["GBps"], size["fraction_of_sum"]
        fp_lines.append(
            f"{size['bytes'] / 2**20:.0f} MiB fp32: sum {g['sum']:.1f} GB/s; "
            + ", ".join(f"{k} {g[k]:.1f} GB/s ({100 * fr[k]:.1f} %)" for k in g if k != "sum")
            + f"  [target fused >= 50 %: {'met' if fr['fingerprint'] >= 0.5 and fr['digest'] >= 0.5 else 'MISSED'}]"
        )
    fp_lines.append(
        f"fingerprint_state of {f['fingerprint_state_tensors']} bf16 32 MiB tensors: {f['fingerprint_state_GBps']:.1f}"
        f" GB/s ({100 * f['fingerprint_state_fraction_of_sum']:.1f} % of their sums' bandwidth)"
        f"  [target >= 25 %: {'met' if f['fingerprint_state_fraction_of_sum'] >= 0.25 else 'MISSED'}]"
    )
    fp_line = "\n".join(fp_lines)
    save_line = (
        f"save {s['bytes'] / 1e9:.2f} GB: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in s["save_s"].items())
        + f"; ratio /torch.save {s['save_ratio_vs_torch']:.2f}x, /safetensors {s['save_ratio_vs_safetensors']:.2f}x"
    )
    load_line = (
        "load to device: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in s["load_s"].items())
        + f"; ratio /safetensors {s['load_ratio_vs_safetensors']:.2f}x"
        + f" (mmap {s['load_mmap_ratio_vs_safetensors']:.2f}x), /torch.load {s['load_ratio_vs_torch']:.2f}x"
    )
    lines = [
        f"bench_gpu on {report['device']} (torch {report['torch']}, certckpt {report['certckpt']})",
        f"agreement CPU/GPU fingerprints and digests: {a['agree']} of {a['cases']}"
        + (f"  DISAGREE: {a['disagree']}" if a["disagree"] else ""),
        fp_line,
        save_line,
        load_line,
        f"verify --deep of the GPU-fingerprinted file: {s['verify_after_gpu_save']}; "
        f"round trip equal: {s['round_trip_equal']}",
    ]
    if "drill" in report:
        dr = report["drill"]
        lines.append(
            f"drill on CUDA (3 gloo ranks): {dr['as_designed']} of {dr['cases']} cases as designed"
            f" in {dr['seconds']:.0f} s; status --verify-bytes exit {dr['status_exit']};"
            f" verify --deep {sum(dr['verify_deep'].values())} of {len(dr['verify_deep'])} checkpoints"
        )
        lines += ["  " + r for r in dr["rows"]]
    if "envelope" in report:
        ev = report["envelope"]
        lines.append(f"{ev['command']}: exit {ev['exit']} in {ev['seconds']:.0f} s")
        lines += ["  " + r for r in ev["table"].splitlines()]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "bench_gpu.txt"), "w") as fh:
        fh.write(text + "\n")
    return 0 if not a["disagree"] and s["round_trip_equal"] and s["verify_after_gpu_save"] else 1


if __name__ == "__main__":
    sys.exit(main())
