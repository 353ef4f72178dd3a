"""Per-rank functions for the sentinel and triggered-replay tests (run through certckpt.detect.launch).

``triggers_world`` runs every scenario in one launched world of ranks, one after another, so that
the tests pay for one start of torch.distributed: a clean run, one-time large faults between audits
(backward and forward), a rate-limited run whose every step is flagged, and the same forced triggers
through the hook points of a user's loop (``AuditSession``) and with gradient accumulation; and where
no local gradient survives the all-reduce (no hand-over), the same with the buckets' sums of squares.
"""

from __future__ import annotations

import importlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, AuditSession, Fault, FaultDetectedError, Triggers
from certckpt.detect.events import MemorySink

# Every step flagged: any spread is an outlier on both tests, at once (no warm-up to wait for).
EAGER = Triggers(mad_threshold=1e-9, band=1e-9, floor=1e-9, warmup_steps=1, min_interval=4)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


class _WithSpare(torch.nn.Module):
    """The test model with a layer the forward never uses (its bucket part stays zeros)."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.spare = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.net(x)


def _batch(step: int):
    g = torch.Generator().manual_seed(dist.get_rank() * 1000 + step)
    x = torch.randn(4, 8, generator=g)
    return x, x[:, :4].cos()


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _auditor(*, ddp: dict | None = None, spare: bool = False, **options):
    m = _WithSpare() if spare else _model()
    model = DDP(m, **(ddp or {}))
    return Auditor(model, torch.optim.SGD(m.parameters(), lr=0.05), loss_fn=_loss, sink=MemorySink(), **options)


def _kinds(aud, kind):
    return [e.step for e in aud.sink.events if e.kind == kind] if dist.get_rank() == 0 else None


def _clean(steps: int) -> dict:
    aud = _auditor(audit_every=10)
    per_step, tables = [], []
    for s in range(1, steps + 1):
        aud.train_step(_batch(s))
        per_step.append([s, list(aud.last.flagged), aud.last.triggered])
        tables.append(aud.nonfinite.table)
    aud.close()
    return {
        "decisions": per_step,
        "triggered": _kinds(aud, "triggered-replay"),
        "failures": [e.kind for e in aud.sink.events if e.failed] if dist.get_rank() == 0 else None,
        "names": list(aud.sentinels.names),
        "tables": tables if dist.get_rank() == 0 else None,
        "off": aud.sentinels.off,
    }


def _one_time_fault(kind: str, step: int, scale: float, **options) -> dict:
    aud = _auditor(audit_every=10, injector_faults=[Fault(kind=kind, rank=1, step=step, scale=scale)], **options)
    out: dict = {"caught": None}
    for s in range(1, step + 3):
        try:
            aud.train_step(_batch(s))
        except FaultDetectedError as e:
            ev = e.event
            out["caught"] = {
                "kind": ev.kind,
                "step": ev.step,
                "suspects": ev.suspect_ranks,
                "trigger": ev.details.get("trigger"),
                "contained": ev.contained,
                "incident": e.incident_id,
                "compared": ev.details.get("compared"),
                "mismatched": ev.details.get("mismatched"),
            }
            break
    aud.close()
    return out


def _rate_limited(steps: int) -> dict:
    aud = _auditor(audit_every=100, triggers=EAGER)
    for s in range(1, steps + 1):
        aud.train_step(_batch(s))
    aud.close()
    return {
        "triggered": _kinds(aud, "triggered-replay"),
        "replayed": aud.state.triggered_replays,
        "suppressed": aud.state.triggers_suppressed,
        "failures": [e.kind for e in aud.sink.events if e.failed] if dist.get_rank() == 0 else None,
    }


def _accumulated(steps: int) -> dict:
    aud = _auditor(audit_every=100, triggers=EAGER)
    for s in range(1, steps + 1):
        aud.train_step(micro_batches=[_batch(3 * s + k) for k in range(3)])
    aud.close()
    return {"triggered": _kinds(aud, "triggered-replay")}


def _session_loop(steps: int) -> dict:
    m = _model()
    ddp = DDP(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    session = AuditSession(ddp, opt, loss_fn=_loss, sink=MemorySink(), audit_every=100, triggers=EAGER)
    for s in range(1, steps + 1):
        batch = _batch(s)
        session.begin_micro_batch(batch)
        opt.zero_grad(set_to_none=True)
        _loss(ddp, batch).backward()
        if session.before_update():
            opt.step()
        session.after_update()
    session.close()
    return {
        "triggered": [e.step for e in session.sink.events if e.kind == "triggered-replay"]
        if dist.get_rank() == 0
        else None,
        "names": list(session.sentinels.names),
    }


def _off_where_no_replay_can_run() -> dict:
    m = _model()
    deferred = Auditor(DDP(m), torch.optim.SGD(m.parameters(), lr=0.05), loss_fn=_loss, nonfinite_read="deferred")
    for s in range(1, 4):
        deferred.train_step(_batch(s))
    deferred.close()
    return {"deferred": deferred.sentinels.off, "table": deferred.nonfinite.table}


def _no_hand_over() -> dict:
    """No local gradient survives the all-reduce: the triggered replays compare the buckets' sums of
    squares. A large one-time backward fault is caught at its step; forced triggers on clean steps
    pass, through gradient copies (``hand_over_grads=False``), bucket views with accumulation (the
    sums taken at the sync micro-batch over the accumulated gradient), several buckets rebuilt after
    the first step, tolerance mode, an unused parameter (``find_unused_parameters``) and a static
    graph."""
    out: dict = {"caught": _one_time_fault("backward", 13, 1e3, hand_over_grads=False)["caught"]}
    setups = {
        "copies": ({}, {"hand_over_grads": False}, False),
        "views-accumulated": ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0002}, {}, True),
        "tolerance": ({"gradient_as_bucket_view": True}, {"mode": "tolerance"}, False),
        "unused": ({"find_unused_parameters": True}, {"spare": True}, False),
        "static": ({"static_graph": True}, {}, False),
    }
    for name, (ddp, options, micro) in setups.items():
        aud = _auditor(ddp=ddp, audit_every=100, triggers=EAGER, **options)
        for s in range(1, 6):
            if micro:
                aud.train_step(micro_batches=[_batch(3 * s + k) for k in range(3)])
            else:
                aud.train_step(_batch(s))
        aud.close()
        out[name] = {
            "off": aud.sentinels.off,
            "hand_over": aud.ctx.hook.hand_over,
            "buckets": len(aud.ctx.hook.sumsq),
            "triggered": _kinds(aud, "triggered-replay"),
            "compared": [e.details.get("compared") for e in aud.sink.events if e.kind == "triggered-replay"]
            if dist.get_rank() == 0
            else None,
            "failures": [e.kind for e in aud.sink.events if e.failed] if dist.get_rank() == 0 else None,
        }
    return out


def triggers_world(args: dict) -> dict:
    """Each scenario of ``args["scenarios"]`` in turn on this rank; its seconds too."""
    out: dict = {}
    for name in args["scenarios"]:
        t0 = time.perf_counter()
        if name == "clean":
            out[name] = _clean(args.get("clean_steps", 60))
        elif name == "backward":
            out[name] = _one_time_fault("backward", 13, 1e3)
        elif name == "forward":
            # the last Linear's output: before the Tanh, a large activation would only saturate it
            out[name] = _one_time_fault_target("forward", 13, 1e3, "2")
        elif name == "huge-element":
            out[name] = _one_time_fault("backward", 14, 1e30)
        elif name == "rate":
            out[name] = _rate_limited(20)
        elif name == "accumulated":
            out[name] = _accumulated(6)
        elif name == "session":
            out[name] = _session_loop(10)
        elif name == "off":
            out[name] = _off_where_no_replay_can_run()
        elif name == "no-hand-over":
            out[name] = _no_hand_over()
        out[name + "_seconds"] = time.perf_counter() - t0
        dist.barrier()
    return out


def outcome(session, error) -> dict:
    """What an integration's session did: the detection raised (None: none), the triggered replays
    that ran (and passed: a failed one raises), and whether the sentinels ran without hand-over."""
    caught = None
    if error is not None:
        ev = error.event
        trigger = ev.details.get("trigger") or {}
        caught = {
            "kind": ev.kind,
            "step": ev.step,
            "suspects": list(ev.suspect_ranks),
            "flagged": trigger.get("flagged"),
            "compared": ev.details.get("compared"),
        }
    return {
        "caught": caught,
        "triggered": session.state.triggered_replays,
        "off": session.sentinels.off,
        "hand_over": session.ctx.hook.hand_over,
    }


FAMILIES = {"accelerate": "accelerate_cases", "lightning": "lightning_cases", "transformers": "hf_cases"}


def integrations_world(args: dict) -> dict:
    """The triggered replays of the Accelerate, Lightning and Trainer integrations (their DDP runs
    hand no gradient over), in one launched world: per family, a one-time backward fault of 1e3 on
    rank 1 at step 13 with the default triggers, then a clean run whose every step is flagged."""
    from accelerate.state import AcceleratorState, GradientState

    fault = {"kind": "backward", "rank": 1, "step": 13, "scale": 1e3}
    forced = {"mad_threshold": 1e-9, "band": 1e-9, "floor": 1e-9, "warmup_steps": 1, "min_interval": 4}
    out: dict = {}
    for family in args["families"]:
        module = importlib.import_module(f"tests.support.{FAMILIES[family]}")
        where = f"{args['dir']}/{family}"
        t0 = time.perf_counter()
        out[family] = {
            "fault": module.triggered(
                {"project": where + "-fault", "dir": where + "-fault", "out": where + "-fault", "faults": [fault]}
                | {"max_steps": 13}
            ),
            "clean": module.triggered(
                {"project": where + "-clean", "dir": where + "-clean", "out": where + "-clean", "triggers": forced}
                | {"max_steps": 5}
            ),
        }
        out[family + "_seconds"] = time.perf_counter() - t0
        AcceleratorState._reset_state(True)  # the Trainer runs on Accelerate's process-wide singletons too
        GradientState._reset_state()
        dist.barrier()
    return out


def _one_time_fault_target(kind: str, step: int, scale: float, target: str) -> dict:
    aud = _auditor(audit_every=10, injector_faults=[Fault(kind=kind, rank=1, step=step, scale=scale, target=target)])
    out: dict = {"caught": None}
    for s in range(1, step + 3):
        try:
            aud.train_step(_batch(s))
        except FaultDetectedError as e:
            ev = e.event
            out["caught"] = {
                "kind": ev.kind,
                "step": ev.step,
                "suspects": ev.suspect_ranks,
                "trigger": ev.details.get("trigger"),
            }
            break
    aud.close()
    return out
