"""The rank side and the driver of the magnitude sweep (``certckpt drill faults --sweep``).

Every case of ``sweep.sweep_cases`` runs in turn inside one set of rank processes
(``launch.run_ranks``): the drill's model, its batches and its loss (``drill``), DDP and the
auditor built afresh per case, no checkpoint and no ledger (events stay in memory), rank 0
appending one progress line per case. What is pure is ``sweep`` (the cases) and ``sweep_table``
(the outcomes, the table).
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .launch import ProgressLog, follow, run_ranks
from .sweep import SweepCase, magnitude_label

__all__ = ["run_sweep", "run_sweep_on_rank", "RANK_TARGET"]

RANK_TARGET = "certckpt.detect.sweep_run:run_sweep_on_rank"
_TRIAL_DATA = 1_000  # trial t trains on the drill's batches of steps t * 1000 + 1, ...


def _run_case(case: dict[str, Any], *, rank: int, audit_every: int, device_kind: str) -> dict[str, Any]:
    """One case on this rank: train until its last step or the first detection."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .auditor import Auditor, FaultDetectedError
    from .drill import OUTPUT_LAYER, drill_batch, drill_loss, drill_model, rank_device
    from .events import MemorySink
    from .inject import Fault
    from .sentinel import Triggers

    device = rank_device(device_kind, rank)
    dtype = getattr(torch, case["dtype"])
    model = drill_model(0).to(device=device, dtype=dtype)
    torch.manual_seed(1000 + rank + 7919 * case["trial"])  # each rank its own dropout stream, per trial
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    faults = None
    if case["fault"] is not None:
        fields = dict(case["fault"])
        if fields["kind"] == "forward":
            fields["target"] = OUTPUT_LAYER  # where a forward fault reaches the loss whole
        faults = [Fault(**fields)]
    auditor = Auditor(
        ddp,
        opt,
        loss_fn=drill_loss,
        run=case["name"],
        audit_every=audit_every,
        sink=MemorySink(),
        injector_faults=faults,
        triggers=Triggers() if case["sentinels"] else Triggers(enabled=False),
    )
    detected, steps = None, 0
    t0 = time.perf_counter()
    for step in range(1, case["steps"] + 1):
        x, y = drill_batch(rank, _TRIAL_DATA * case["trial"] + step, device)
        steps = step
        try:
            auditor.train_step((x.to(dtype), y.to(dtype)))
        except FaultDetectedError as e:
            ev = e.event
            detected = {
                "kind": ev.kind,
                "step": ev.step,
                "suspects": list(ev.suspect_ranks),
                "triggered": bool(ev.details.get("trigger")),  # the sentinels asked for this replay
            }
            break
    seconds = time.perf_counter() - t0
    state = auditor.state
    auditor.close()
    return {
        **case,
        "detected": detected,
        "steps_run": steps,
        # the triggered replays that passed (a failing one is the detection itself)
        "triggered_replays": state.triggered_replays - int(bool(detected and detected["triggered"])),
        "suppressed": state.triggers_suppressed,
        "fired": len(auditor.injector.fired) if auditor.injector else 0,
        "effect": _json_pair(auditor.injector.effects[0]) if auditor.injector and auditor.injector.effects else None,
        "seconds": round(seconds, 3),
    }


def _json_pair(pair: tuple[float, float]) -> list[float | str]:
    """Floats as JSON numbers, a non-finite one as its string (``"inf"``, ``"nan"``): strict JSON."""
    return [v if math.isfinite(v) else str(v) for v in pair]


def _progress_line(n: int, total: int, res: dict[str, Any]) -> str:
    det = res["detected"]
    if res["kind"] == "clean":
        what = f"clean {res['dtype']}: {res['triggered_replays']} triggered replay(s) in {res['steps_run']} steps"
        return f"{n}/{total} {what}" + (f", DETECTION {det['kind']} at {det['step']}" if det else "")
    head = f"{n}/{total} {res['kind']} {magnitude_label(res['kind'], res['magnitude'])}"
    head += f" sentinels {'on' if res['sentinels'] else 'off'}, rank {res['rank']} at step {res['injected_step']}"
    if det is None:
        return f"{head}: no detection"
    how = " (triggered)" if det["triggered"] else ""
    return f"{head}: {det['kind']}{how} at {det['step']}, named {det['suspects']}"


def run_sweep_on_rank(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of ``args["cases"]`` in turn on this rank (through ``launch.run_ranks``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    log = ProgressLog(args.get("progress"), rank=rank)
    out = []
    cases = args["cases"]
    try:
        for n, case in enumerate(cases, 1):
            res = _run_case(case, rank=rank, audit_every=args["audit_every"], device_kind=args.get("device", "cpu"))
            out.append(res)
            log(_progress_line(n, len(cases), res))
            dist.barrier()
    finally:
        log.close()
    return out


def run_sweep(
    cases: Sequence[SweepCase],
    *,
    ranks: int = 3,
    audit_every: int = 10,
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
    timeout: float = 6 * 3600,
) -> dict[str, Any]:
    """Run the cases on ``ranks`` local gloo ranks; returns ``{"ranks", "audit_every", "device",
    "seconds", "cases": [...]}``, each case's result with ``fired`` as its faulty rank counted it.

    Args:
        progress: called with each progress line (one per case) as rank 0 writes it.

    Raises:
        certckpt.errors.RanksFailedError: a rank failed (its output tail is in the message).
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="certckpt-sweep-") as d:
        prog = os.path.join(d, "progress.log")
        open(prog, "w").close()
        stop = threading.Event()
        tail = threading.Thread(target=follow, args=(prog, stop, progress), daemon=True) if progress else None
        if tail:
            tail.start()
        try:
            args = {
                "cases": [c.to_dict() for c in cases],
                "audit_every": audit_every,
                "device": device,
                "progress": prog,
            }
            per_rank = run_ranks(RANK_TARGET, ranks, args, timeout=timeout)
        finally:
            stop.set()
            if tail:
                tail.join(timeout=5)
    out = []
    for i, res in enumerate(per_rank[0]):
        if res["rank"] is not None:
            mine = per_rank[res["rank"]][i]  # the faulty rank knows what it injected, and what that did
            res["fired"], res["effect"] = mine["fired"], mine["effect"]
        out.append(res)
    return {
        "ranks": ranks,
        "audit_every": audit_every,
        "device": device,
        "seconds": round(time.perf_counter() - t0, 1),
        "cases": out,
    }
