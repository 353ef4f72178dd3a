"""Per-rank functions for the multi-process detection tests (run through certckpt.detect.launch)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import certckpt
from certckpt.detect import Auditor, AuditSetupError, Fault, FaultDetectedError, MemorySink


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(dist.get_rank() * 1000 + step)
    x = torch.randn(4, 8, generator=g)
    return x, x[:, :4].cos()


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


class _Jittery(torch.nn.Module):
    """A forward that is not a function of weights, batch and RNG state: a call counter leaks in."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1 + 1e-3 * self.calls)


def setup_errors(args):
    rank = dist.get_rank()
    out = {}
    try:
        Auditor(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), loss_fn=_loss)
    except AuditSetupError as e:
        out["not_ddp"] = str(e)
    m = _model()
    try:
        Auditor(DDP(m), torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=_loss, audit_every=10 if rank == 0 else 20)
    except AuditSetupError as e:
        out["mismatch"] = str(e)
    j = _Jittery()
    aud = Auditor(DDP(j), torch.optim.SGD(j.parameters(), lr=0.1), loss_fn=lambda mdl, b: mdl(b[0]).square().mean())
    try:
        aud.train_step(_batch(1))
    except AuditSetupError as e:
        out["nondeterministic"] = str(e)
    m = _model()
    aud = Auditor(DDP(m), torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=lambda mdl, b: _loss(mdl, b["xy"]))
    try:
        aud.train_step({"xy": _batch(1), "sampler": object()})
    except certckpt.UnsupportedObjectError as e:
        out["unshippable"] = str(e)
    return out


def checkpoint_lineage(args):
    import certckpt.format.writer as writer

    counted = []  # tensors the writer fingerprints: on their devices, and on the host in shared slices
    real = writer.fingerprint_many

    def counting(tensors):
        tensors = list(tensors)
        counted.append(len(tensors))
        return real(tensors)

    class CountingShared(writer.SharedFingerprints):
        def __init__(self, tensors):
            tensors = list(tensors)
            counted.append(len(tensors))
            super().__init__(tensors)

    writer.fingerprint_many = counting
    writer.SharedFingerprints = CountingShared
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    aud = Auditor(DDP(m), opt, loss_fn=_loss, run="lin", audit_every=5, sink=MemorySink())
    for s in range(1, 11):
        aud.train_step(_batch(s))
    path = os.path.join(args["dir"], "step10.safetensors")
    res = aud.save({"model": m.state_dict(), "optim": opt.state_dict()}, path)
    return {
        "fingerprinted": counted,
        "params": len(list(m.parameters())),
        "saved": res is not None,
        "events": [(e.step, e.kind, e.outcome) for e in aud.sink.events],
        "consensus": aud.consensus_fingerprints(),
    }


def skip_policy(args):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    aud = Auditor(
        DDP(m),
        opt,
        loss_fn=_loss,
        audit_every=4,
        on_nonfinite="skip",
        sink=MemorySink(),
        injector_faults=[Fault(kind="non-finite", rank=2, step=3)],
    )
    applied = []
    for s in range(1, 9):
        aud.train_step(_batch(s))
        applied.append(aud.last.applied)
    ok = aud.weight_consensus(aud.step)
    finite = all(torch.isfinite(p).all().item() for p in m.parameters())
    return {
        "applied": applied,
        "consensus": ok,
        "finite": finite,
        "events": [(e.step, e.kind, e.outcome, e.suspect_ranks, e.contained) for e in aud.sink.events if e.failed],
    }


def raise_detected(args):
    """A persistent backward fault with the default policy: the error carries the event."""
    m = _model()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        audit_every=5,
        injector_faults=[Fault(kind="backward", rank=0, step=2, persistent=True)],
    )
    before = None
    for s in range(1, 11):
        try:
            if s == 5:
                before = [p.detach().clone() for p in m.parameters()]
            aud.train_step(_batch(s))
        except FaultDetectedError as e:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
            return {
                "step": e.event.step,
                "kind": e.event.kind,
                "suspects": e.event.suspect_ranks,
                "message": str(e),
                "update_dropped": unchanged,
                "inventory_ranks": sorted(e.event.inventory),
            }
    return None


def rollback(args):
    """Train on `main` until a persistent fault is caught, roll back to latest-good, go on as branch b2."""
    import logging

    from certckpt.trust.runstore import find_latest_good

    store = args["store"]
    rank = dist.get_rank()
    lines: list[str] = []  # what certckpt's log says on this rank (INFO, as the integrations turn it on)
    catcher = logging.Handler(logging.INFO)
    catcher.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("certckpt").addHandler(catcher)
    logging.getLogger("certckpt").setLevel(logging.INFO)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    aud = Auditor(
        DDP(m),
        opt,
        loss_fn=_loss,
        run="rb",
        audit_every=10,
        ledger=store,
        sink=None if rank == 0 else MemorySink(),
        injector_faults=[Fault(kind="backward", rank=1, step=13, persistent=True)],
    )
    caught = None
    for s in range(1, 31):
        try:
            aud.train_step(_batch(s))
        except FaultDetectedError as e:
            caught = e.event.step
            break
        if s % 5 == 0:
            aud.save({"model": m.state_dict(), "optim": opt.state_dict()}, f"{store}/main-{s:04d}.safetensors")
    aud.close()
    _, good = find_latest_good(store, write_certificates=rank == 0)
    dist.barrier()
    state = certckpt.load(f"{store}/main-{int(good.split('@')[1]):04d}.safetensors")
    m2 = _model()
    m2.load_state_dict(state["model"])
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(state["optim"])
    start = int(good.split("@")[1])
    aud2 = Auditor(
        DDP(m2),
        opt2,
        loss_fn=_loss,
        run="rb",
        branch="b2",
        parent=good,
        start_step=start,
        audit_every=10,
        ledger=store,
        sink=None if rank == 0 else MemorySink(),
    )
    for s in range(start + 1, 31):
        aud2.train_step(_batch(s))
        if s % 5 == 0:
            aud2.save({"model": m2.state_dict(), "optim": opt2.state_dict()}, f"{store}/b2-{s:04d}.safetensors")
    aud2.close()
    return {"caught": caught, "good": good, "log": lines}


def _conv_model():
    """A small conv net in channels_last, whose weights' gradients are not row-major in DDP's buckets."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.Tanh(),
        torch.nn.Conv2d(8, 4, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 4),
    )
    return net.to(memory_format=torch.channels_last)


def _conv_batch(step: int):
    g = torch.Generator().manual_seed(dist.get_rank() * 1000 + step)
    x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
    return x, x[:, 0, :2, :2].reshape(4, 4).cos()


def trains_like_plain_ddp(args):
    """The auditor's hook (averaging folded into the loss) gives DDP's averaged gradients and weights."""
    conv = args.get("model") == "conv-channels-last"
    make, batch = (_conv_model, _conv_batch) if conv else (_model, _batch)
    plain_m, aud_m = make(), make()
    plain = DDP(plain_m, gradient_as_bucket_view=args["view"])
    plain_opt = torch.optim.SGD(plain_m.parameters(), lr=0.05, momentum=0.9)
    aud_opt = torch.optim.SGD(aud_m.parameters(), lr=0.05, momentum=0.9)
    aud = Auditor(
        DDP(aud_m, gradient_as_bucket_view=args["view"]), aud_opt, loss_fn=_loss, audit_every=3, sink=MemorySink()
    )
    grad_diffs, losses = [], []
    for s in range(1, 8):
        b = batch(s)
        plain_opt.zero_grad(set_to_none=True)
        plain_loss = _loss(plain, b)
        plain_loss.backward()
        grads = [p.grad.clone() for p in plain_m.parameters()]
        plain_opt.step()
        losses.append([float(plain_loss), float(aud.train_step(b))])
        grad_diffs.append(max(float((a - p.grad).abs().max()) for a, p in zip(grads, aud_m.parameters())))
    weight_diff = max(float((a - b).abs().max()) for a, b in zip(plain_m.parameters(), aud_m.parameters()))
    return {
        "grad_diffs": grad_diffs,
        "weight_diff": weight_diff,
        "losses": losses,
        "eager_pre": aud._hook.eager_pre,
        "hand_over": aud._hook.hand_over,
        "grad_is_bucket_view": [p.grad._base is not None for p in aud_m.parameters()],
        "channels_last_grads": [
            p.grad.is_contiguous(memory_format=torch.channels_last) for p in aud_m.parameters() if p.dim() == 4
        ],
        "outcomes": sorted({(k, o) for _, k, o in aud.state.lineage}),
        "audits": sum(k == "replay" for _, k, _ in aud.state.lineage),
    }


def nonfinite_attribution(args):
    """A NaN in one rank's local gradients is attributed to that rank, with eager or lazy pre-checks."""
    m = _model()
    aud = Auditor(
        DDP(m, gradient_as_bucket_view=args["view"]),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        audit_every=4,
        on_nonfinite="skip",
        sink=MemorySink(),
        injector_faults=[
            Fault(kind="non-finite", rank=1, step=2, value="inf"),
            Fault(kind="reduction", rank=-1, step=5),
        ],
    )
    for s in range(1, 7):
        aud.train_step(_batch(s))
    return {
        "eager_pre": aud._hook.eager_pre,
        "events": [(e.step, e.kind, e.suspect_ranks, e.details["pre_ranks"]) for e in aud.sink.events if e.failed],
    }


def _payload(rank: int):
    g = torch.Generator().manual_seed(rank)
    return {
        "x": torch.randn(3, 5, generator=g),
        "mask": torch.rand(7, generator=g) > 0.5,
        "ids": torch.randint(0, 1000, (2, 3), generator=g),
        "half": torch.randn(1, generator=g).half(),
        "raw": torch.randint(0, 255, (5,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).view(3, 4).t(),
        "meta": {"rank": rank, "name": f"r{rank}", "scale": 0.5},
        "rng": torch.Generator().manual_seed(100 + rank).get_state(),
    }


def ring_shift_payloads(args):
    """The overlapped ring shift delivers the previous rank's object intact (dtypes, alignment, structure)."""
    from certckpt.detect.exchange import RingShift

    rank, world = dist.get_rank(), dist.get_world_size()
    shift = RingShift(
        _payload(rank), group=dist.group.WORLD, wire_device=torch.device("cpu"), out_device=torch.device("cpu")
    )
    busy = torch.randn(256, 256) @ torch.randn(256, 256)  # work the payload may overlap
    shift.advance()
    got = shift.finish()
    want = _payload((rank - 1) % world)
    same = {
        k: (torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype)
        if isinstance(want[k], torch.Tensor)
        else got[k] == want[k]
        for k in want
    }
    torch.set_rng_state(got["rng"])  # a received RNG state is usable as is
    return {"same": same, "busy": float(busy.sum()) != 0.0}


class _TiedWithSpare(torch.nn.Module):
    """A weight used twice in one forward, and a parameter the forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(torch.tanh(self.inp(x)))))


def replay_tied_and_unused(args):
    m = _TiedWithSpare()
    aud = Auditor(
        DDP(m, find_unused_parameters=True),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        audit_every=2,
        sink=MemorySink(),
        injector_faults=[Fault(kind="backward", rank=2, step=5, persistent=True, target="inp.weight")],
    )
    caught = None
    for s in range(1, 9):
        try:
            aud.train_step(_batch(s))
        except FaultDetectedError as e:
            caught = (e.event.step, e.event.kind, e.event.suspect_ranks, e.event.details["mismatched"])
            break
    return {"outcomes": sorted({(k, o) for _, k, o in aud.state.lineage}), "caught": caught}


def one_rank_reduction_fault(args):
    """A reduction that delivers NaN to rank 1 only, with the per-step flag exchange: all ranks skip."""
    m = _model()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        audit_every=4,
        on_nonfinite="skip",
        exchange_flags="every-step",
        sink=MemorySink(),
        injector_faults=[Fault(kind="reduction", rank=1, step=2)],
    )
    applied = []
    for s in range(1, 7):
        aud.train_step(_batch(s))
        applied.append(aud.last.applied)
    return {
        "applied": applied,
        "consensus": aud.weight_consensus(aud.step),
        "events": [(e.step, e.kind, e.suspect_ranks, e.details["post_ranks"]) for e in aud.sink.events if e.failed],
    }


def hand_over_conditions(args):
    """Where the callback hands .grad the reduced bucket, and where DDP is left to copy it."""

    def auditor(*, ddp_kwargs=None, opt_params=None, **kw):
        m = _model()
        opt = torch.optim.SGD(opt_params(m) if opt_params else m.parameters(), lr=0.05)
        return m, Auditor(DDP(m, **(ddp_kwargs or {})), opt, loss_fn=_loss, audit_every=2, sink=MemorySink(), **kw)

    cases = {
        "default": auditor(),
        "opted_out": auditor(hand_over_grads=False),
        "find_unused": auditor(ddp_kwargs={"find_unused_parameters": True}),
        "optimizer_owns_part": auditor(opt_params=lambda m: m[0].parameters()),
    }
    out = {}
    for name, (m, aud) in cases.items():
        for s in range(1, 3):
            aud.train_step(_batch(s))
        out[name] = {
            "hand_over": aud._hook.hand_over,
            "views": [p.grad is not None and p.grad._base is not None for p in m.parameters()],
            "outcomes": sorted({(k, o) for _, k, o in aud.state.lineage}),
        }
    # the guard against a DDP that would not leave the handed-over gradients alone
    m, aud = cases["default"]
    intact_after_step = aud._hook.handed_over_intact()
    for p in m.parameters():  # as if DDP had reset the gradients after the callbacks
        p.grad = None
    out["guard"] = {"intact_after_step": intact_after_step, "intact_after_reset": aud._hook.handed_over_intact()}
    return out


def deferred_read(args):
    """``nonfinite_read="deferred"``: clean steps train bit-equal to immediate reads; a NaN is detected one
    step late, naming the rank; a checkpoint over an unread step is refused before anything is written."""
    view = args["view"]

    def auditor(m, **kw):
        return Auditor(
            DDP(m, gradient_as_bucket_view=view),
            torch.optim.SGD(m.parameters(), lr=0.05),
            loss_fn=_loss,
            audit_every=4,
            sink=MemorySink(),
            **kw,
        )

    out = {}
    ms = [_model(), _model()]
    clean = [auditor(m, nonfinite_read=r) for m, r in zip(ms, ("immediate", "deferred"))]
    for s in range(1, 10):
        for a in clean:
            a.train_step(_batch(s))
    for a in clean:
        a.close()
    out["equal"] = all(torch.equal(a, b) for a, b in zip(ms[0].parameters(), ms[1].parameters()))
    out["checked"] = [
        [(e.step, e.details.get("steps_checked")) for e in a.sink.events if e.kind == "nonfinite"] for a in clean
    ]

    m = _model()
    late = auditor(m, nonfinite_read="deferred", injector_faults=[Fault(kind="non-finite", rank=1, step=6)])
    for s in range(1, 7):
        late.train_step(_batch(s))
    out["step6_applied"] = late.last.applied
    out["weights_finite_after_6"] = all(bool(torch.isfinite(p).all()) for p in m.parameters())
    try:
        late.train_step(_batch(7))
        out["raised"] = None
    except FaultDetectedError as e:
        d = e.event.details
        out["raised"] = [e.event.step, e.event.kind, e.event.suspect_ranks, d.get("read"), d.get("detected_at"), str(e)]
        out["contained"] = e.event.contained
    out["step7_applied"] = late.last.applied

    # a consensus step (every 3) reads its own flags at once: the NaN of step 6 is caught before its update
    m = _model()
    nan6 = [Fault(kind="non-finite", rank=1, step=6)]
    due = auditor(m, nonfinite_read="deferred", consensus_every=3, injector_faults=nan6)
    try:
        for s in range(1, 7):
            due.train_step(_batch(s))
        out["on_consensus_step"] = None
    except FaultDetectedError as e:
        out["on_consensus_step"] = [s, e.event.step, e.event.contained, e.event.details.get("read")]
    out["finite_after_consensus_step"] = all(bool(torch.isfinite(p).all()) for p in m.parameters())

    m = _model()
    ckpt = auditor(m, nonfinite_read="deferred", injector_faults=[Fault(kind="non-finite", rank=2, step=6)])
    for s in range(1, 7):
        ckpt.train_step(_batch(s))
    path = os.path.join(args["dir"], f"view{int(view)}-step6.safetensors")
    try:
        ckpt.save(m.state_dict(), path)
        out["save"] = "written"
    except FaultDetectedError as e:
        out["save"] = [e.event.step, e.event.suspect_ranks]
    out["file_exists"] = os.path.exists(path)

    # close() right after an unread non-finite step: no collective, no raise (it runs in exception handlers)
    m = _model()
    closing = auditor(m, nonfinite_read="deferred", injector_faults=[Fault(kind="non-finite", rank=0, step=6)])
    for s in range(1, 7):
        closing.train_step(_batch(s))
    closing.close()  # were it to read the pending NaN, it would raise here (or hang in a collective)
    out["closed_quietly"] = [e.kind for e in closing.sink.events if e.failed] == []

    refusals = []
    for kw in (
        {"on_nonfinite": "skip"},
        {"grad_scaler": torch.amp.GradScaler("cpu")},
        {"exchange_flags": "every-step"},
        {"nonfinite_read": "later"},
    ):
        try:
            auditor(_model(), **{"nonfinite_read": "deferred", **kw})
            refusals.append(None)
        except Exception as e:
            refusals.append(f"{type(e).__name__}: {e}")
    out["refusals"] = refusals
    return out


def deferred_hook_points(args):
    """A user's own loop (``AuditSession`` hook points) with ``nonfinite_read="deferred"``: trains bit-equal
    to plain DDP; a NaN on rank 2 at step 6 is applied, then ``before_update`` of step 7 raises naming it."""
    from certckpt.detect import AuditSession

    def run(session_kw, faults=None, steps=10):
        m = _model()
        ddp, opt = DDP(m), torch.optim.AdamW(m.parameters(), lr=1e-2)
        session = None
        if session_kw is not None:
            session = AuditSession(
                ddp, opt, loss_fn=_loss, audit_every=5, sink=MemorySink(), injector_faults=faults, **session_kw
            )
        raised = None
        try:
            for s in range(1, steps + 1):
                b = _batch(s)
                if session is not None:
                    session.begin_micro_batch(b)
                opt.zero_grad(set_to_none=True)
                _loss(ddp, b).backward()
                if session is None or session.before_update():
                    opt.step()
                if session is not None:
                    session.after_update()
        except FaultDetectedError as e:
            d = e.event.details
            raised = [s, e.event.step, e.event.kind, e.event.suspect_ranks, d.get("read"), d.get("detected_at")]
        if session is not None:
            session.close()
        return m, raised

    plain, _ = run(None)
    deferred, _ = run({"nonfinite_read": "deferred"})
    _, raised = run({"nonfinite_read": "deferred"}, faults=[Fault(kind="non-finite", rank=2, step=6)])
    return {
        "bit_equal": all(torch.equal(a, b) for a, b in zip(plain.parameters(), deferred.parameters())),
        "raised": raised,
    }


def async_checkpoints(args):
    """Auditor.async_save on every rank: a failed background write at step 5 is raised on every rank
    at the next save (step 10); the saves at 15 and 20 are written while training goes on."""
    from certckpt import CertckptError

    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    store = args["dir"]
    aud = Auditor(DDP(m), opt, loss_fn=_loss, run="as", audit_every=5, ledger=store)
    out: dict = {"raised": [], "locations": []}
    pending = []

    def state():
        return {"model": m.state_dict(), "optim": opt.state_dict()}

    for s in range(1, 21):
        aud.train_step(_batch(s))
        if s == 5:
            aud.async_save(state(), os.path.join(store, "missing-dir", "x.safetensors"))
        elif s == 10:
            try:
                aud.async_save(state(), os.path.join(store, "main@10.safetensors"))
            except CertckptError as e:
                out["raised"].append(f"{type(e).__name__}: {e}")
        elif s in (15, 20):
            pending.append(aud.async_save(state(), os.path.join(store, f"main@{s}.safetensors")))
            out[f"consensus{s}"] = aud.consensus_fingerprints()
            out[f"weights{s}"] = {k: v.clone() for k, v in m.state_dict().items()}
    if dist.get_rank() == 0:
        out["locations"] = [f.result().location for f in pending]
    aud.close()
    out["weights15"] = {k: v.tolist() for k, v in out["weights15"].items()}
    out["weights20"] = {k: v.tolist() for k, v in out["weights20"].items()}
    return out
