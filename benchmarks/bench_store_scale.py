"""Run stores with many writers, on a real S3 server: what each checkpoint commit asks of the store.

    python benchmarks/bench_store_scale.py [--writers 64,256,1024] [--steps 10000] [--checkpoints N]
        [--put-price 0.005] [--get-price 0.0004] [--storage-price 0.023] [--json]

Starts a SeaweedFS 4.48 on 127.0.0.1 (``scripts/local-s3.sh``, through ``tests/support/seaweed.py``)
and, for each number of writers W, writes one run store through the real ``Ledger`` API: W simulated
ranks (8 per node), one ``Ledger`` object each (one chain per writer and scope, as W processes would
have), driven by a pool of threads in this process. Over ``--steps`` steps with a full audit every
100, at each of the ``--checkpoints`` checkpoints every rank appends its event segment for the
interval (sealed in its chain), and rank 0 then commits the checkpoint record; at the start every
node's first rank records its placement. Every S3 request is counted by kind at the client (botocore's
``before-call`` event on s3fs's client), with the bytes sent and received.

Printed per W: requests per checkpoint commit by kind, per writer (the first checkpoint and the last:
equal when the cost does not grow with what was written before), the wall time of one round
(every writer's segment and the commit), and ``latest-good`` (in this process, ``--no-verify``: the
ledger's reading and the certifier, not the files' bytes) cold (a reader with no memory) and warm
(the same reader again: its memory of the chains and folded segments). The goals of issue 47:
requests per commit O(1) in the entries already written, at most one LIST per writer per commit,
latest-good warm at most 1 s at 1,024 writers.

Then what it costs: the requests of one run of this shape turned into a monthly S3 bill at the
prices given (defaults: AWS's public price list for S3 Standard in us-east-1, as read in 2026-06:
PUT/COPY/POST/LIST $0.005 per 1,000, GET and other requests $0.0004 per 1,000, storage $0.023 per
GB-month); change them with the options for another region, class or provider.

``CERTCKPT_BENCH_TINY=1`` (``benchmarks/tinymode.py``): 4 and 8 writers, 400 steps, 2 checkpoints:
every code path in seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests.support.seaweed: the suite's own way to start SeaweedFS

from tinymode import announce  # noqa: E402

KINDS = ("PUT", "GET", "HEAD", "LIST", "DELETE", "OTHER")
_KIND_OF = {
    "PutObject": "PUT",
    "CreateMultipartUpload": "PUT",
    "UploadPart": "PUT",
    "CompleteMultipartUpload": "PUT",
    "CopyObject": "PUT",
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "HeadBucket": "HEAD",
    "ListObjectsV2": "LIST",
    "ListObjects": "LIST",
    "ListObjectVersions": "LIST",
    "DeleteObject": "DELETE",
    "DeleteObjects": "DELETE",
}
AUDIT_EVERY = 100
RANKS_PER_NODE = 8


@dataclass
class Requests:
    """S3 requests counted at the client, by kind, with the bytes of their bodies."""

    kinds: Counter = field(default_factory=Counter)
    sent: int = 0
    received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> tuple[Counter, int, int]:
        with self.lock:
            return Counter(self.kinds), self.sent, self.received


def count_requests(fs: object) -> Requests:
    """Count every request s3fs's client makes from now on (botocore's ``before-call`` and
    ``after-call`` events: the operation's name and the body lengths, whatever called it)."""
    req = Requests()

    def before(*, model: object, params: dict, **_: object) -> None:
        body = params.get("body")
        size = len(body) if isinstance(body, (bytes, bytearray)) else 0
        if size == 0 and hasattr(body, "seek") and hasattr(body, "tell"):
            pos = body.tell()
            size = body.seek(0, 2) - pos
            body.seek(pos)
        with req.lock:
            req.kinds[_KIND_OF.get(getattr(model, "name", ""), "OTHER")] += 1
            req.sent += size

    def after(*, http_response: object, **_: object) -> None:
        headers = getattr(http_response, "headers", {}) or {}
        with req.lock:
            req.received += int(headers.get("content-length") or 0)

    client = fs.s3  # type: ignore[attr-defined]
    client.meta.events.register("before-call.s3", before)
    client.meta.events.register("after-call.s3", after)
    return req


def events_for(rank: int, world: int, start: int, end: int) -> list[dict]:
    """One rank's audit events for steps ``(start, end]``: rank 0 the collective outcomes of every full
    audit (replay, non-finite, consensus), every other rank its own non-finite summaries."""
    out = []
    for s in range(start + AUDIT_EVERY, end + 1, AUDIT_EVERY):
        base = {"run": "scale", "branch": "main", "step": s, "outcome": "pass", "suspect_ranks": []}
        base |= {"contained": False, "inventory": {}}
        if rank == 0:
            everyone = list(range(world))
            out += [
                base | {"kind": "replay", "ranks": everyone, "details": {"comparisons": world}},
                base | {"kind": "consensus", "ranks": everyone, "details": {"fp": f"{s:016x}", "params": 300}},
                base | {"kind": "nonfinite", "ranks": everyone, "details": {"steps_checked": AUDIT_EVERY}},
            ]
        else:
            out.append(base | {"kind": "nonfinite", "ranks": [rank], "details": {"steps_checked": AUDIT_EVERY}})
    return out


@dataclass
class Row:
    """One checkpoint round: requests by kind, per writer, and its wall times."""

    checkpoint: int
    per_writer: dict[str, float]
    sent: int
    received: int
    round_s: float
    commit_s: float


def delta(req: Requests, before: tuple[Counter, int, int]) -> tuple[Counter, int, int]:
    kinds, sent, received = req.snapshot()
    return kinds - before[0], sent - before[1], received - before[2]


def run_store(
    *, store: str, writers: int, steps: int, checkpoints: int, req: Requests, pool: ThreadPoolExecutor
) -> list[Row]:
    from certckpt.trust.ledger import Ledger

    ledgers = [Ledger(store, signing_key=None, trusted_keys=None) for _ in range(writers)]
    every = steps // checkpoints
    list(
        pool.map(
            lambda n: ledgers[n * RANKS_PER_NODE].record_placement(
                branch="main",
                start_step=0,
                devices={str(r): f"GPU-{r:04d}" for r in range(n * 8, min(writers, n * 8 + 8))},
            ),
            range((writers + RANKS_PER_NODE - 1) // RANKS_PER_NODE),
        )
    )
    rows = []
    for c in range(1, checkpoints + 1):
        start, end = (c - 1) * every, c * every
        commit_s: list[float] = []

        def rank(r: int, start: int = start, end: int = end, commit_s: list[float] = commit_s) -> None:
            if r:
                ledgers[r].append_events(events_for(r, writers, start, end))
                return
            # rank 0 commits as commit_saved does: its events first, then the record, one listing for both
            with ledgers[0].one_listing():
                ledgers[0].append_events(events_for(0, writers, start, end))
                t = time.perf_counter()
                ledgers[0].commit_checkpoint(
                    branch="main",
                    step=end,
                    location=f"{store}/main@{end}.safetensors",
                    run="scale",
                    consensus_fp=f"{end:016x}",
                    state_fp="1" * 16,
                    header_digest="2" * 32,
                    step_range=[start + 1, end],
                    nbytes=10**9,
                )
                commit_s.append(time.perf_counter() - t)

        before = req.snapshot()
        t0 = time.perf_counter()
        list(pool.map(rank, range(writers)))
        t2 = time.perf_counter()
        kinds, sent, received = delta(req, before)
        rows.append(
            Row(
                checkpoint=c,
                per_writer={k: kinds[k] / writers for k in KINDS},
                sent=sent,
                received=received,
                round_s=t2 - t0,
                commit_s=commit_s[0],
            )
        )
    return rows


def latest_good(store: str, state_dir: str, req: Requests) -> tuple[float, str | None, Counter]:
    from certckpt.format.trustconfig import TrustConfig
    from certckpt.trust.runstore import find_latest_good

    before = req.snapshot()
    t0 = time.perf_counter()
    _, cid = find_latest_good(
        store, verify_bytes=False, write_certificates=False, trust=TrustConfig(state_dir=state_dir)
    )
    seconds = time.perf_counter() - t0
    return seconds, cid, delta(req, before)[0]


@dataclass(frozen=True, kw_only=True)
class Prices:
    """S3 prices in dollars (the defaults: S3 Standard, us-east-1, AWS's public list read 2026-06)."""

    put_per_1000: float = 0.005  # PUT, COPY, POST, LIST
    get_per_1000: float = 0.0004  # GET, HEAD and every other request
    storage_gb_month: float = 0.023


def monthly_cost(
    *, per_checkpoint: Counter, stored_bytes_per_checkpoint: float, checkpoints_per_month: float, prices: Prices
) -> dict[str, float]:
    """Dollars a month for a run that commits ``checkpoints_per_month`` checkpoints, each costing
    ``per_checkpoint`` requests (all writers together) and adding ``stored_bytes_per_checkpoint`` of
    ledger; the storage is what the month ends with (a ledger only grows)."""
    put_like = (per_checkpoint["PUT"] + per_checkpoint["LIST"]) * checkpoints_per_month
    get_like = (per_checkpoint["GET"] + per_checkpoint["HEAD"] + per_checkpoint["OTHER"]) * checkpoints_per_month
    requests = put_like / 1000 * prices.put_per_1000 + get_like / 1000 * prices.get_per_1000
    storage = stored_bytes_per_checkpoint * checkpoints_per_month / 1e9 * prices.storage_gb_month
    return {"requests_usd": requests, "storage_usd": storage, "put_list": put_like, "get_head": get_like}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", default=None, help="comma-separated (default 64,256,1024; tiny 4,8)")
    ap.add_argument("--steps", type=int, default=None, help="default 10,000 (tiny 400)")
    ap.add_argument("--checkpoints", type=int, default=None, help="default 5 (tiny 2)")
    ap.add_argument("--threads", type=int, default=32, help="writer threads (default 32)")
    ap.add_argument("--put-price", type=float, default=Prices.put_per_1000, help="$ per 1,000 PUT/LIST")
    ap.add_argument("--get-price", type=float, default=Prices.get_per_1000, help="$ per 1,000 GET/HEAD")
    ap.add_argument("--storage-price", type=float, default=Prices.storage_gb_month, help="$ per GB-month")
    ap.add_argument("--ckpt-per-hour", type=float, default=1.0, help="the costed run's checkpoints an hour")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tiny = announce("bench_store_scale")
    writers = [int(w) for w in (a.writers or ("4,8" if tiny else "64,256,1024")).split(",")]
    a.steps = a.steps or (400 if tiny else 10_000)
    a.checkpoints = a.checkpoints or (2 if tiny else 5)
    prices = Prices(put_per_1000=a.put_price, get_per_1000=a.get_price, storage_gb_month=a.storage_price)

    from tests.support.seaweed import start_seaweed

    top = tempfile.mkdtemp(prefix="certckpt-bench-scale-")
    server = start_seaweed(os.path.join(top, "weed"), access_key="bench", secret_key="bench-secret")
    results: dict[int, dict] = {}
    try:
        os.environ.update(server.env, CERTCKPT_LOG="off")
        import s3fs

        fs = s3fs.S3FileSystem()
        bucket = f"scale-{uuid.uuid4().hex[:8]}"
        fs.call_s3("create_bucket", Bucket=bucket)
        req = count_requests(fs)
        with ThreadPoolExecutor(max_workers=a.threads) as pool:
            for w in writers:
                store = f"s3://{bucket}/run-{w}"
                t0 = time.perf_counter()
                rows = run_store(store=store, writers=w, steps=a.steps, checkpoints=a.checkpoints, req=req, pool=pool)
                build_s = time.perf_counter() - t0
                state = os.path.join(top, f"state-{w}")
                cold = latest_good(store, state, req)
                warm = latest_good(store, state, req)
                stored = sum(info["size"] for info in fs.find(f"{bucket}/run-{w}/_ledger", detail=True).values())
                results[w] = {"rows": rows, "build_s": build_s, "cold": cold, "warm": warm, "stored": stored}
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)
    report(results, a=a, prices=prices)
    return 0


def _fmt(per: dict[str, float]) -> str:
    return "  ".join(f"{per[k]:5.2f}" for k in KINDS[:5])


def report(results: dict[int, dict], *, a: argparse.Namespace, prices: Prices) -> None:
    print(
        f"store scale on SeaweedFS 4.48 (127.0.0.1): {a.steps:,} steps, full audit every {AUDIT_EVERY}, "
        f"{a.checkpoints} checkpoints; per checkpoint every rank appends its segment, rank 0 commits"
    )
    print("requests per checkpoint commit, per writer (first checkpoint -> last):")
    head = "  ".join(f"{k:>5s}" for k in KINDS[:5])
    print(f"  {'writers':>7s}  {'ckpt':>4s}  {head}  {'KB out':>7s} {'KB in':>7s}  {'round s':>7s} {'commit s':>8s}")
    for w, res in results.items():
        for row in (res["rows"][0], res["rows"][-1]):
            print(
                f"  {w:7d}  {row.checkpoint:4d}  {_fmt(row.per_writer)}  {row.sent / w / 1e3:7.2f} "
                f"{row.received / w / 1e3:7.2f}  {row.round_s:7.2f} {row.commit_s:8.3f}"
            )
    print("latest-good (in process, --no-verify):")
    print(f"  {'writers':>7s}  {'cold s':>7s}  {'warm s':>7s}  {'cold LIST/GET':>13s}  {'warm LIST/GET':>13s}  answer")
    for w, res in results.items():
        (cs, cid, ck), (ws, _, wk) = res["cold"], res["warm"]
        lists = f"{ck['LIST']:6d}/{ck['GET']:<6d}  {wk['LIST']:6d}/{wk['GET']:<6d}"
        print(f"  {w:7d}  {cs:7.2f}  {ws:7.2f}  {lists}  {cid}")
    print("goals (issue 47):")
    for w, res in results.items():
        first, last = res["rows"][0].per_writer, res["rows"][-1].per_writer
        flat = sum(last.values()) <= sum(first.values()) * 1.10 + 0.05
        lists = max(r.per_writer["LIST"] for r in res["rows"])
        print(
            f"  {w:5d} writers: requests per commit O(1) {'PASS' if flat else 'MISS'} "
            f"({sum(first.values()):.2f} -> {sum(last.values()):.2f}); LIST per writer per commit <= 1 "
            f"{'PASS' if lists <= 1 else 'MISS'} ({lists:.2f})"
            + (f"; latest-good warm <= 1 s {'PASS' if res['warm'][0] <= 1 else 'MISS'}" if w >= 1024 else "")
        )
    cost_report(results, a=a, prices=prices)
    if a.json:
        print(
            json.dumps(
                {
                    str(w): {
                        "rows": [r.__dict__ for r in res["rows"]],
                        "cold_s": res["cold"][0],
                        "warm_s": res["warm"][0],
                        "stored_bytes": res["stored"],
                    }
                    for w, res in results.items()
                },
                indent=2,
            )
        )


def cost_report(results: dict[int, dict], *, a: argparse.Namespace, prices: Prices) -> None:
    per_month = a.ckpt_per_hour * 24 * 30
    print(
        f"what it costs: a run checkpointing {a.ckpt_per_hour:g}x an hour ({per_month:,.0f} checkpoints a month) "
        f"at PUT/LIST ${prices.put_per_1000}/1k, GET/HEAD ${prices.get_per_1000}/1k, "
        f"storage ${prices.storage_gb_month}/GB-month (S3 Standard us-east-1 list prices, 2026-06; see --help)"
    )
    print(
        f"  {'writers':>7s}  {'PUT+LIST/month':>14s}  {'GET+HEAD/month':>14s}  {'requests $':>10s}  "
        f"{'ledger GB':>9s}  {'storage $':>9s}"
    )
    for w, res in results.items():
        last = res["rows"][-1]
        per_ckpt = Counter({k: v * w for k, v in last.per_writer.items()})
        cost = monthly_cost(
            per_checkpoint=per_ckpt,
            stored_bytes_per_checkpoint=res["stored"] / a.checkpoints,
            checkpoints_per_month=per_month,
            prices=prices,
        )
        print(
            f"  {w:7d}  {cost['put_list']:14,.0f}  {cost['get_head']:14,.0f}  {cost['requests_usd']:10.2f}  "
            f"{res['stored'] / a.checkpoints * per_month / 1e9:9.3f}  {cost['storage_usd']:9.4f}"
        )


if __name__ == "__main__":
    sys.exit(main())
