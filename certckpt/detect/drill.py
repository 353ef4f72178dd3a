"""``certckpt drill faults``: the fault-injection matrix on a small model, 3 gloo ranks (CPU, or CUDA).

One case per fault kind x {persistent, one time on an audit step, one time between audits}; each case
trains from scratch with the auditor, checkpointing as it goes, and records which check caught the
fault, at which step, and which rank it named. Escapes are listed as escapes: a small one-time finite
fault between audits is averaged into every replica and no later check can see it. The kinds a
replay catches get one more case, a *large* one-time fault between audits (``LARGE_SCALE``), which
the sentinels flag, so that the replay runs at its step (``docs/detection.md``, "Triggered replays").
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from certckpt.errors import ConfigurationError, DeviceUnavailableError

from .inject import FAULT_KINDS

__all__ = [
    "run_matrix",
    "matrix_cases",
    "expected_catch",
    "make_model",
    "evaluate",
    "drill_model",
    "drill_batch",
    "drill_loss",
    "rank_device",
    "TIMINGS",
    "OUTPUT_LAYER",
]

TIMINGS = ("persistent", "one-time-audit-step", "one-time-between-audits")
LARGE_SCALE = 1e3  # a large fault: the largest element scaled by about 1e3 (the drill's default is 0.05)
# The drill model's output layer: a large forward fault there reaches the loss and the gradients
# whole. The default forward target, the first Linear, feeds a Tanh, which saturates: the same
# fault there changes the gradients too little for the sentinels (the matrix keeps that escape).
OUTPUT_LAYER = "3"
_CAUGHT_BY = {  # event kind -> the matrix's "caught_by"
    "nonfinite-pre": "nonfinite-pre",
    "nonfinite-post": "nonfinite-post",
    "replay": "replay",
    "consensus": "consensus",
}


def matrix_cases(*, audit_every: int, ckpt_every: int, rank: int = 1) -> list[dict[str, Any]]:
    """The cases: the fault lands at step 1.3 K (between audits) or at step 2 K (an audit step)."""
    between = audit_every + max(1, audit_every * 3 // 10)
    if between % ckpt_every == 0:
        between += 1
    on_audit = 2 * audit_every
    cases = []
    for kind in (k for k, row in FAULT_KINDS.items() if row.drilled):
        for timing in TIMINGS:
            step = on_audit if timing == "one-time-audit-step" else between
            cases.append({"fault": kind, "timing": timing, "rank": rank, "injected_step": step})
        if FAULT_KINDS[kind].caught_by == "replay":
            large = {"fault": kind, "timing": TIMINGS[2], "rank": rank, "injected_step": between}
            large |= {"magnitude": "large", "scale": LARGE_SCALE, "name": f"{kind}-one-time-between-audits-large"}
            if kind == "forward":
                cases.append({**large, "target": OUTPUT_LAYER})
                cases.append({**large, "saturated": True, "name": f"{large['name']}-saturated"})
            else:
                cases.append(large)
    return cases


def expected_catch(case: dict[str, Any], *, audit_every: int, ckpt_every: int) -> tuple[str | None, int | None]:
    """What the checks are designed to do with a case: ``(caught_by, detected_step)``."""
    s, timing = case["injected_step"], case["timing"]
    check = FAULT_KINDS[case["fault"]].caught_by
    next_audit = -(-s // audit_every) * audit_every
    if check.startswith("nonfinite"):
        return check, s  # read at the step itself
    if check == "consensus":
        # consensus runs after the update at audit steps and checkpoint steps
        consensus_steps = [t for t in range(s, next_audit + 1) if t % audit_every == 0 or t % ckpt_every == 0]
        return check, consensus_steps[0]
    if timing == "one-time-between-audits":
        if case.get("magnitude") == "large" and not case.get("saturated"):
            return check, s  # the sentinels flag the step and the replay runs there, before its update
        return None, None  # the documented escape: no replay recomputes that step
    return check, next_audit


# --- the per-rank case runner (called through certckpt.detect.launch) ------------------------------


def drill_model(seed: int):
    """The drill's model (also the sweep's, ``certckpt.detect.sweep_run``): Linear, Tanh, Dropout, Linear."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 8))


def make_model():
    """The drill's model, freshly built (``certckpt drill restore --model certckpt.detect.drill:make_model``)."""
    return drill_model(0)


def evaluate(model) -> dict[str, float]:
    """Loss on a fixed held-out batch (``--eval certckpt.detect.drill:evaluate``)."""
    import torch

    model.eval()
    with torch.no_grad():
        return {"eval_loss": float(drill_loss(model, drill_batch(10_000, 0)))}


def drill_batch(rank: int, step: int, device=None):
    """The batch of ``rank`` at ``step``: 8 seeded rows of 16 features, a smooth target of 8."""
    import torch

    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(8, 16, generator=g)
    y = x[:, :8].sin() * 2
    return (x, y) if device is None else (x.to(device), y.to(device))


def rank_device(kind: str, rank: int):
    """This rank's device: the CPU, or a CUDA device (ranks share the GPUs round-robin, gloo between them)."""
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def drill_loss(model, batch):
    """Mean squared error of the model on a batch."""
    import torch.nn.functional as F

    x, y = batch
    return F.mse_loss(model(x), y)


class _Tee:
    """Hands every event to several sinks."""

    def __init__(self, *sinks):
        self.sinks = sinks

    def emit(self, event) -> None:
        for s in self.sinks:
            s.emit(event)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        self.flush()
        for s in self.sinks:
            if hasattr(s, "close"):
                s.close()


def run_cases_on_rank(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Every case of ``args["cases"]`` in turn on this rank; rank 0 keeps each case's run store."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.trust.ledger import Ledger, LedgerSink

    from .auditor import Auditor, FaultDetectedError
    from .events import JsonlSink, MemorySink
    from .inject import Fault

    rank = dist.get_rank()
    device = rank_device(args.get("device", "cpu"), rank)
    results = []
    for case in args["cases"]:
        store = os.path.join(args["dir"], case["name"])
        if rank == 0:
            os.makedirs(store, exist_ok=True)
        model = drill_model(0).to(device)
        torch.manual_seed(1000 + rank)  # each rank its own dropout stream, as in real training
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        fault = Fault(
            kind=case["fault"],
            rank=case["rank"],
            step=case["injected_step"],
            persistent=case["timing"] == "persistent",
            scale=case.get("scale", args.get("scale", 0.05)),
            target=case.get("target"),
        )
        # rank 0 keeps the events twice: in the ledger (for status / latest-good) and as plain JSON lines
        sink = (
            _Tee(LedgerSink(Ledger(store)), JsonlSink(os.path.join(store, "events.jsonl")))
            if rank == 0
            else MemorySink()
        )
        auditor = Auditor(
            ddp,
            opt,
            loss_fn=drill_loss,
            run=case["name"],
            audit_every=args["audit_every"],
            mode=args.get("mode", "deterministic"),
            sink=sink,
            ledger=Ledger(store),
            injector_faults=[fault],
            on_fault=case.get("on_fault", "raise"),
        )
        detected = None
        for step in range(1, args["steps"] + 1):
            try:
                auditor.train_step(drill_batch(rank, step, device))
            except FaultDetectedError as e:
                detected = e.event
                break
            if step % args["ckpt_every"] == 0:
                try:
                    auditor.save(
                        {"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
                        os.path.join(store, f"step{step:06d}.safetensors"),
                    )
                except FaultDetectedError as e:
                    detected = e.event
                    break
        auditor.close()
        if isinstance(sink, _Tee):
            sink.close()
        results.append(
            {
                **case,
                "caught_by": _CAUGHT_BY.get(detected.kind) if detected else None,
                "triggered": bool(detected and detected.details.get("trigger")),  # a sentinel asked for the replay
                "detected_step": detected.step if detected else None,
                "suspect_ranks": detected.suspect_ranks if detected else [],
                "notes": detected.details.get("notes", []) if detected else [],
                "store": f"file://{os.path.abspath(store)}" if args.get("keep") else None,
                "fired": len(auditor.injector.fired) if auditor.injector else 0,
            }
        )
        dist.barrier()
    return results


def run_matrix(
    *,
    ranks: int = 3,
    audit_every: int = 10,
    ckpt_every: int = 5,
    directory: str | None = None,
    cases: list[dict[str, Any]] | None = None,
    mode: str = "deterministic",
    timeout: float = 600,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the fault matrix; returns ``{"ranks", "audit_every", "ckpt_every", "device", "cases": [...]}``.

    ``device="cuda"``: every rank trains on a GPU (round-robin over the visible ones, so 3 ranks may
    share one), still talking gloo.

    Raises:
        DeviceUnavailableError: ``device="cuda"`` without a CUDA device.
    """
    from .launch import run_ranks

    if device not in ("cpu", "cuda"):
        raise ConfigurationError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailableError("the drill was asked to run on CUDA, but no CUDA device is available here")

    cases = cases if cases is not None else matrix_cases(audit_every=audit_every, ckpt_every=ckpt_every, rank=1 % ranks)
    for c in cases:
        c.setdefault("name", f"{c['fault']}-{c['timing']}")
    steps = 3 * audit_every + 1
    with tempfile.TemporaryDirectory(prefix="certckpt-drill-") as scratch:
        root = os.path.abspath(directory) if directory else scratch
        os.makedirs(root, exist_ok=True)
        taken = [c["name"] for c in cases if os.path.exists(os.path.join(root, c["name"]))]
        if taken:
            raise FileExistsError(
                f"{root} already holds drill results ({', '.join(taken[:3])}); choose an empty directory"
            )
        args = {
            "cases": cases,
            "audit_every": audit_every,
            "ckpt_every": ckpt_every,
            "steps": steps,
            "dir": root,
            "keep": directory is not None,
            "mode": mode,
            "device": device,
        }
        per_rank = run_ranks("certckpt.detect.drill:run_cases_on_rank", ranks, args, timeout=timeout)
    out = []
    for i, res in enumerate(per_rank[0]):
        res["fired"] = per_rank[max(res["rank"], 0)][i]["fired"]  # the faulty rank knows what it injected
        exp_by, exp_step = expected_catch(res, audit_every=audit_every, ckpt_every=ckpt_every)
        res["updates_before_detection"] = (
            res["detected_step"] - res["injected_step"] if res["detected_step"] is not None else None
        )
        res["expected"] = {"caught_by": exp_by, "detected_step": exp_step}
        out.append(res)
    return {
        "ranks": ranks,
        "audit_every": audit_every,
        "ckpt_every": ckpt_every,
        "mode": mode,
        "device": device,
        "cases": out,
    }
