"""Vault copies side by side: certckpt's write-once, verified copy against the plain copy a user
would otherwise run, in one process, interleaved, medians.

    python benchmarks/bench_vault.py [--mib 512] [--trials 3]

Measures, for one checkpoint of --mib MiB:
  local vault   shutil.copyfile + fsync              vs  copy_once (temp, fsync, verify, os.link, read-only)
  S3 promote    s3fs put_file                        vs  copy_once (create-only PUT, read back, verify)
  S3 restore    s3fs get_file                        vs  copy_once from S3 to a local file (verify before publish)
The S3 figures use moto's standalone server on 127.0.0.1 (started here): they compare the two clients
on one server, not a real network. certckpt's copies verify every digest, so they read the bytes twice.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): a 1 MiB checkpoint, one trial: every code path in
seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def start_moto() -> tuple[subprocess.Popen, str]:
    from certckpt.detect.launch import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
            return proc, endpoint
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=None, help="default 512 (tiny 1)")
    ap.add_argument("--trials", type=int, default=None, help="default 3 (tiny 1)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tinymode import announce

    tiny = announce("bench_vault")
    a.mib = a.mib or (1 if tiny else 512)
    a.trials = a.trials or (1 if tiny else 3)

    import torch

    import certckpt
    from certckpt.vault import copy_once

    proc, endpoint = start_moto()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.call_s3("create_bucket", Bucket=bucket, ObjectLockEnabledForBucket=True)
    rows: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="certckpt-bench-vault-") as d:
            src = os.path.join(d, "ckpt.safetensors")
            n = a.mib << 18  # float32 elements
            res = certckpt.save({"w": torch.randn(n // 4, 4)}, src)
            size = os.path.getsize(src)
            for t in range(a.trials):
                dst_plain = os.path.join(d, f"plain-{t}.safetensors")

                def plain_local():
                    shutil.copyfile(src, dst_plain)
                    with open(dst_plain, "rb+") as f:
                        os.fsync(f.fileno())

                rows.setdefault("local: copyfile + fsync", []).append(timed(plain_local))
                rows.setdefault("local: certckpt copy_once", []).append(
                    timed(
                        lambda: copy_once(
                            src, os.path.join(d, "vault", f"c-{t}.safetensors"), header_digest=res.header_digest
                        )
                    )
                )
                os.unlink(dst_plain)
                key = f"{bucket}/plain-{t}.safetensors"
                rows.setdefault("S3 promote: s3fs put_file", []).append(timed(lambda: fs.put_file(src, key)))
                url = f"s3://{bucket}/vault/c-{t}.safetensors"
                rows.setdefault("S3 promote: certckpt copy_once (+ read-back verify)", []).append(
                    timed(lambda: copy_once(src, url, header_digest=res.header_digest))
                )
                got = os.path.join(d, f"got-{t}.safetensors")
                rows.setdefault("S3 restore: s3fs get_file", []).append(timed(lambda: fs.get_file(key, got)))
                back = os.path.join(d, f"back-{t}.safetensors")
                rows.setdefault("S3 restore: certckpt copy_once (verify before publish)", []).append(
                    timed(lambda: copy_once(url, back, header_digest=res.header_digest, read_only=False))
                )
                for p in (got, back):
                    os.unlink(p)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    print(
        f"certckpt vault copies: one {size / 2**20:.0f} MiB checkpoint, {a.trials} interleaved trials, medians; "
        "S3 = moto on 127.0.0.1"
    )
    med = {k: statistics.median(v) for k, v in rows.items()}
    width = max(map(len, med))
    for k, v in med.items():
        print(f"  {k:<{width}}  {v:7.3f} s  {size / v / 1e6:8.1f} MB/s")
    for label, base, ours in (
        ("local vault", "local: copyfile + fsync", "local: certckpt copy_once"),
        ("S3 promote", "S3 promote: s3fs put_file", "S3 promote: certckpt copy_once (+ read-back verify)"),
        ("S3 restore", "S3 restore: s3fs get_file", "S3 restore: certckpt copy_once (verify before publish)"),
    ):
        print(f"ratio {label}: certckpt / plain = {med[ours] / med[base]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
