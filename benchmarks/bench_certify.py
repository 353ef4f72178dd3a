"""Ledger scale: a 1,000,000-step run, a full audit every 100 steps, a checkpoint every 1,000.

Writes the ledger through the real Ledger API into a temp dir on local disk (events batched into one
segment per checkpoint, as the auditor's LedgerSink does), then measures, side by side:
- the ledger's size on disk (target < 100 MB);
- certifying it: read every record + the pure certifier (target < 2 s), in-process and as the whole
  `certckpt status --json` / `certckpt latest-good --no-verify` processes.

    python benchmarks/bench_certify.py [--steps 1000000] [--audit-every 100] [--ckpt-every 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import certify_store


def build(store: str, steps: int, audit_every: int, ckpt_every: int) -> tuple[int, float]:
    led = Ledger(store)
    inv = {str(r): {"host": f"node-{r // 8}", "device": "NVIDIA H100 80GB HBM3"} for r in range(3)}
    buf: list[dict] = []
    n_events = 0
    t0 = time.perf_counter()
    for s in range(audit_every, steps + 1, audit_every):
        fp = f"{s:016x}"
        buf += [
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "replay",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"comparisons": 3, "mode": "deterministic"},
                "inventory": {},
            },
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "nonfinite",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"steps_checked": audit_every, "first": s - audit_every + 1},
                "inventory": {},
            },
            {
                "run": "big",
                "branch": "main",
                "step": s,
                "kind": "consensus",
                "outcome": "pass",
                "ranks": [0, 1, 2],
                "suspect_ranks": [],
                "contained": False,
                "details": {"fp": fp, "params": 300},
                "inventory": {},
            },
        ]
        if s == steps // 2:  # one detection, for realism
            buf.append(
                {
                    "run": "big",
                    "branch": "main",
                    "step": s + 7,
                    "kind": "replay",
                    "outcome": "fail",
                    "ranks": [0, 1, 2],
                    "suspect_ranks": [1],
                    "contained": False,
                    "details": {"failed": [{"origin": 1, "replayer": 2}]},
                    "inventory": inv,
                }
            )
        if s % ckpt_every == 0:
            n_events += len(buf)
            led.append_events(buf)
            buf = []
            led.commit_checkpoint(
                branch="main",
                step=s,
                location=f"{store}/step{s:09d}.safetensors",
                run="big",
                consensus_fp=fp,
                state_fp="1" * 16,
                header_digest="2" * 32,
                step_range=[s - ckpt_every + 1, s],
                nbytes=10**9,
            )
    led.append_events(buf)
    n_events += len(buf)
    return n_events, time.perf_counter() - t0


def du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
    return total


def timed(fn, trials: int) -> list[float]:
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--audit-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    exe = os.path.join(os.path.dirname(sys.executable), "certckpt")
    with tempfile.TemporaryDirectory(prefix="certckpt-bench-ledger-") as store:
        n_events, build_s = build(store, a.steps, a.audit_every, a.ckpt_every)
        size = du(os.path.join(store, "_ledger"))
        inproc = timed(lambda: certify_store(store, write_certificates=False), a.trials)
        st = certify_store(store, write_certificates=False)
        status_proc = timed(
            lambda: subprocess.run([exe, "status", store, "--json"], capture_output=True, check=True), a.trials
        )
        lg_proc = timed(
            lambda: subprocess.run([exe, "latest-good", store, "--no-verify"], capture_output=True, check=True),
            a.trials,
        )
        first_cert = timed(lambda: certify_store(store, write_certificates=True), 1)[0]
    res = {
        "steps": a.steps,
        "audit_every": a.audit_every,
        "ckpt_every": a.ckpt_every,
        "checkpoints": len(st.snapshot.checkpoints),
        "events": n_events,
        "segments": st.snapshot.segments,
        "ledger_bytes": size,
        "build_seconds": build_s,
        "certify_in_process_s": statistics.median(inproc),
        "status_process_s": statistics.median(status_proc),
        "latest_good_process_s": statistics.median(lg_proc),
        "first_certificates_s": first_cert,
        "latest_good": st.certification.latest_good,
        "suspect": sum(not v.trusted for v in st.certification.verdicts.values()),
    }
    print(
        f"ledger scale: {a.steps:,} steps, full audit every {a.audit_every}, checkpoint every {a.ckpt_every} "
        f"({res['checkpoints']} checkpoints, {n_events:,} events in {res['segments']} segments; "
        f"built in {build_s:.1f} s)"
    )
    print(
        f"  ledger size                        {size / 1e6:8.1f} MB   target < 100 MB   "
        f"{'PASS' if size < 100e6 else 'MISS'}"
    )
    print(
        f"  certify (read + verdicts), in-proc {res['certify_in_process_s']:8.3f} s    target < 2 s      "
        f"{'PASS' if res['certify_in_process_s'] < 2 else 'MISS'}"
    )
    print(
        f"  certckpt status --json (process)   {res['status_process_s']:8.3f} s    target < 2 s      "
        f"{'PASS' if res['status_process_s'] < 2 else 'MISS'}"
    )
    print(f"  certckpt latest-good --no-verify   {res['latest_good_process_s']:8.3f} s")
    print(
        f"  first certify writing {res['checkpoints']} certificates {first_cert:.2f} s "
        "(once; later runs write only changes)"
    )
    print(f"  verdicts: latest-good {res['latest_good']}, {res['suspect']} suspect (one injected detection)")
    if a.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
