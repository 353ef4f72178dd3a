"""Per-rank functions for the loop-shape tests (accumulation, clipping, set-up refusals, ...).

Run through ``certckpt.detect.launch.run_ranks``; each function runs several cases in sequence in
one launch, because a launch of 3 gloo ranks costs seconds on the 2-core CI machines.
"""

from __future__ import annotations

import contextlib
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect import Auditor, Fault, FaultDetectedError, MemorySink

N_MICRO = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


class _SharedGradient(torch.nn.Module):
    """Two weights summed before use: autograd hands both the very same gradient tensor, which a
    replay's accumulators must not share."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(8, 4) * 0.3)
        self.b = torch.nn.Parameter(torch.randn(8, 4) * 0.3)

    def forward(self, x):
        return torch.tanh(x @ (self.a + self.b))


def _mb(step: int, k: int):
    g = torch.Generator().manual_seed(dist.get_rank() * 100_000 + step * 10 + k)
    x = torch.randn(4, 8, generator=g)
    return x, x[:, :4].cos()


def _micro(step: int) -> list:
    return [_mb(step, k) for k in range(N_MICRO)]


def _loss(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def _plain_accumulated_step(model, opt, mbs, *, clip=None, transform=None) -> None:
    """What a plain DDP user writes: no_sync on all but the last micro-batch, loss / n each."""
    opt.zero_grad(set_to_none=True)
    n = len(mbs)
    ddp = getattr(model, "_orig_mod", model)  # torch.compile(DDP(m)): no_sync lives on the DDP
    for k, mb in enumerate(mbs):
        with ddp.no_sync() if k < n - 1 else contextlib.nullcontext():
            (_loss(model, mb) / n).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
    if transform is not None:
        transform(ddp.module, opt)
    opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def _failures(aud) -> list:
    """Failed checks as (step, kind), as every rank records them (rank 0 alone emits the events)."""
    return [(s, k) for s, k, o in aud.state.lineage if o == "fail"]


def _suspects(aud) -> list:
    """Failed events with their suspects (rank 0's sink)."""
    return [(e.step, e.kind, e.suspect_ranks) for e in aud.sink.events if e.failed]


def _clip_values(module, _opt):
    torch.nn.utils.clip_grad_value_(module.parameters(), 0.02)


def accumulation_and_clipping(args):
    out = {}
    # 1. accumulation: bit-equal weights to plain DDP with no_sync, gradient copies and bucket views
    for view in (False, True):
        pm, am = _model(), _model()
        plain = DDP(pm, gradient_as_bucket_view=view)
        popt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
        aopt = torch.optim.SGD(am.parameters(), lr=0.05, momentum=0.9)
        aud = Auditor(DDP(am, gradient_as_bucket_view=view), aopt, loss_fn=_loss, audit_every=5, sink=MemorySink())
        losses = []
        for s in range(1, 16):
            _plain_accumulated_step(plain, popt, _micro(s))
            losses.append(float(aud.train_step(micro_batches=_micro(s))))
        want = sum(float(_loss(am, mb)) for mb in _micro(16)) / N_MICRO  # the mean of the micro-batches'
        got = float(aud.train_step(micro_batches=_micro(16)))
        _plain_accumulated_step(plain, popt, _micro(16))
        out[f"accumulate_view={view}"] = {
            "bit_equal": _same(pm, am),
            "replays": sorted({(k, o) for _, k, o in aud.state.lineage if k == "replay"}),
            "failures": _failures(aud),
            "loss_is_mean": abs(got - want) < 1e-6,
        }
    # 1b. a gradient tensor shared by two parameters, accumulated: the replay's accumulators stay apart
    pm, am = _SharedGradient(), _SharedGradient()
    plain, popt = DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.05)
    aud = Auditor(DDP(am), torch.optim.SGD(am.parameters(), lr=0.05), loss_fn=_loss, audit_every=2, sink=MemorySink())
    for s in range(1, 5):
        _plain_accumulated_step(plain, popt, _micro(s))
        aud.train_step(micro_batches=_micro(s))
    out["shared_gradient"] = {
        "bit_equal": _same(pm, am),
        "replays": sorted({(k, o) for _, k, o in aud.state.lineage if k == "replay"}),
        "failures": _failures(aud),
    }
    # 2. clipping and a gradient transform: bit-equal to plain DDP + clip_grad_norm_ (one
    # micro-batch per step: the accumulation path averages as DDP does); clipping really clips
    for name, kw in {
        "clip": {"clip_grad_norm": 0.05},
        "clip+transform": {"clip_grad_norm": 0.05, "before_optimizer_step": _clip_values},
    }.items():
        pm, am = _model(), _model()
        plain = DDP(pm)
        popt = torch.optim.SGD(pm.parameters(), lr=0.05)
        aopt = torch.optim.SGD(am.parameters(), lr=0.05)
        aud = Auditor(DDP(am), aopt, loss_fn=_loss, audit_every=5, sink=MemorySink(), **kw)
        norms = []
        for s in range(1, 11):
            _plain_accumulated_step(
                plain, popt, [_mb(s, 0)], clip=kw["clip_grad_norm"], transform=kw.get("before_optimizer_step")
            )
            aud.train_step(micro_batches=[_mb(s, 0)])
            norms.append(float(aud.last.grad_norm))
        unclipped_m = _model()
        unclipped = DDP(unclipped_m)
        uopt = torch.optim.SGD(unclipped_m.parameters(), lr=0.05)
        for s in range(1, 11):
            _plain_accumulated_step(unclipped, uopt, [_mb(s, 0)])
        out[name] = {
            "bit_equal": _same(pm, am),
            "clipped": not _same(unclipped_m, am) and max(norms) > 0.05,
            "failures": _failures(aud),
        }
    # 3. one batch per step with clipping: equal to plain DDP + clip within rounding (the
    # averaging is folded into the loss there)
    pm, am = _model(), _model()
    plain, popt = DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.05)
    aud = Auditor(DDP(am), torch.optim.SGD(am.parameters(), lr=0.05), loss_fn=_loss, clip_grad_norm=0.05)
    for s in range(1, 11):
        _plain_accumulated_step(plain, popt, [_mb(s, 0)], clip=0.05)
        aud.train_step(_mb(s, 0))
    out["clip_one_batch_max_diff"] = max(float((a - b).abs().max()) for a, b in zip(pm.parameters(), am.parameters()))
    # 4. 100 clean accumulated, clipped steps: no false alarm; then a planted persistent fault
    m = _model()
    aud = Auditor(
        DDP(m), torch.optim.SGD(m.parameters(), lr=0.05), loss_fn=_loss, clip_grad_norm=1.0, sink=MemorySink()
    )
    for s in range(1, 101):
        aud.train_step(micro_batches=_micro(s))
    out["clean_100"] = {
        "failures": _failures(aud),
        "replay_passes": sum(1 for _, k, o in aud.state.lineage if k == "replay" and o == "pass"),
        "last_clean_audit": aud.last_clean_audit,
    }
    m = _model()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        clip_grad_norm=1.0,
        sink=MemorySink(),
        injector_faults=[Fault(kind="backward", rank=1, step=13, persistent=True)],
    )
    caught = None
    for s in range(1, 31):
        try:
            aud.train_step(micro_batches=_micro(s))
        except FaultDetectedError as e:
            caught = (e.event.step, e.event.kind, e.event.suspect_ranks, e.event.details["micro_batches"])
            break
    out["fault"] = caught
    # 4b. a sampled audit (one micro-batch of three per audit): training untouched, no false alarm
    # over three audits (each sampling another block), a persistent fault caught and named
    pm, am = _model(), _model()
    plain, popt = DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.05)
    aud = Auditor(
        DDP(am), torch.optim.SGD(am.parameters(), lr=0.05), loss_fn=_loss, replay_micro_batches=1, sink=MemorySink()
    )
    for s in range(1, 31):
        _plain_accumulated_step(plain, popt, _micro(s))
        aud.train_step(micro_batches=_micro(s))
    sampled = {"bit_equal": _same(pm, am), "failures": _failures(aud), "last_clean": aud.last_clean_audit}
    m = _model()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        replay_micro_batches=1,
        sink=MemorySink(),
        injector_faults=[Fault(kind="forward", rank=1, step=13, persistent=True)],
    )
    for s in range(1, 31):
        try:
            aud.train_step(micro_batches=_micro(s))
        except FaultDetectedError as e:
            sampled["fault"] = (e.event.step, e.event.kind, e.event.suspect_ranks)
            break
    out["sampled"] = sampled
    # 5. a one-time non-finite on rank 2 in its second micro-batch's step: named, contained
    m = _model()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        on_nonfinite="skip",
        sink=MemorySink(),
        injector_faults=[Fault(kind="non-finite", rank=2, step=4)],
    )
    applied = []
    for s in range(1, 7):
        aud.train_step(micro_batches=_micro(s))
        applied.append(aud.last.applied)
    out["nonfinite"] = {"failures": _failures(aud), "suspects": _suspects(aud), "applied": applied}
    return out


def _treats_bare_module_differently(model, batch):
    """A loss_fn whose replay (on the bare module) cannot reproduce training (on the DDP model)."""
    return _loss(model, batch) * (1.0 if isinstance(model, DDP) else 1.001)


class _PyRandomDrop(torch.nn.Module):
    """LayerDrop with Python's random: not restored by a replay, so not deterministic to the auditor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x) if random.random() < 0.5 else x
        return self.b(torch.tanh(h))


def collective_refusals(args):
    """Each refusal is raised on every rank with the same message; then the ranks go on together."""
    rank = dist.get_rank()
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # the type is part of the result
            out[name] = [type(e).__name__, str(e)]
        dist.barrier()  # every rank got here: nobody was left waiting in a collective

    m = _model()
    # rank 1 alone passes a bad option; the others would go on to the next collective
    attempt(
        "bad_option_on_one_rank",
        lambda: Auditor(
            DDP(m),
            torch.optim.SGD(m.parameters(), lr=0.1),
            loss_fn=_loss,
            mode="bogus" if rank == 1 else "deterministic",
        ),
    )
    m2 = _model()
    d2 = DDP(m2)  # a collective itself: every rank builds it, rank 2 then passes the bare module
    attempt(
        "not_ddp_on_one_rank",
        lambda: Auditor(m2 if rank == 2 else d2, torch.optim.SGD(m2.parameters(), lr=0.1), loss_fn=_loss),
    )
    m3 = _model()
    attempt(
        "settings_differ",
        lambda: Auditor(
            DDP(m3), torch.optim.SGD(m3.parameters(), lr=0.1), loss_fn=_loss, clip_grad_norm=1.0 if rank == 0 else None
        ),
    )
    # Python randomness inside the model: each rank's determinism check may pass or fail by chance;
    # seeded so that rank 0 passes its own check and ranks 1 and 2 fail theirs
    pm = _PyRandomDrop()
    aud = Auditor(DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.1), loss_fn=_loss, sink=MemorySink())
    random.seed({0: 0, 1: 1, 2: 1}[rank])  # seed 0 draws two values on one side of 0.5, seed 1 on both
    attempt("python_random", lambda: aud.train_step(_mb(1, 0)))
    m5 = _model()
    aud = Auditor(
        DDP(m5), torch.optim.SGD(m5.parameters(), lr=0.1), loss_fn=_treats_bare_module_differently, sink=MemorySink()
    )
    attempt("replay_path_differs", lambda: aud.train_step(_mb(1, 0)))
    m4 = _model()
    aud = Auditor(DDP(m4), torch.optim.SGD(m4.parameters(), lr=0.1), loss_fn=_loss, sink=MemorySink())
    attempt(
        "unshippable_on_one_rank",
        lambda: aud.train_step(micro_batches=[_mb(1, 0), {"x": object()} if rank == 1 else _mb(1, 1)]),
    )
    return out


def compiled_models(args):
    """``torch.compile(DDP(m))`` and ``DDP(torch.compile(m))`` train like plain DDP and are audited.

    The tests compile with ``backend="aot_eager"`` (dynamo, DDP's graph splitting and AOT autograd,
    without inductor's minutes of C++ compilation on these CPUs).
    """
    out = {}
    for order in ("compile(DDP)", "DDP(compile)"):
        pm, am = _model(), _model()
        # the reference: plain DDP compiled the same way (AOT autograd's decompositions round
        # differently from eager; around DDP, aot_eager happens to match eager here too)
        plain = (
            torch.compile(DDP(pm), backend="aot_eager")
            if order == "compile(DDP)"
            else DDP(torch.compile(pm, backend="aot_eager"))
        )
        popt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
        aopt = torch.optim.SGD(am.parameters(), lr=0.05, momentum=0.9)
        if order == "compile(DDP)":
            wrapped = torch.compile(DDP(am), backend="aot_eager")
        else:
            wrapped = DDP(torch.compile(am, backend="aot_eager"))
        aud = Auditor(
            wrapped,
            aopt,
            loss_fn=_loss,
            audit_every=5,
            sink=MemorySink(),
            injector_faults=[Fault(kind="backward", rank=2, step=12, persistent=True)],
        )
        caught = None
        for s in range(1, 16):
            if s <= 10:
                _plain_accumulated_step(plain, popt, _micro(s))
            try:
                aud.train_step(micro_batches=_micro(s))
            except FaultDetectedError as e:
                caught = (e.event.step, e.event.kind, e.event.suspect_ranks)
                break
            if s == 10:
                out[order] = {"bit_equal_at_10": _same(pm, am), "failures_to_10": _failures(aud)}
        out[order]["caught"] = caught
    return out


def _fp16_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch[0])
    return F.mse_loss(out.float(), batch[1])


def _bf16_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch[0])
    return F.mse_loss(out.float(), batch[1])


def _plain_amp_step(ddp, opt, scaler, mbs) -> bool:
    """Plain DDP + GradScaler accumulation; returns whether the scaler skipped the step."""
    opt.zero_grad(set_to_none=True)
    n = len(mbs)
    for k, mb in enumerate(mbs):
        with ddp.no_sync() if k < n - 1 else contextlib.nullcontext():
            scaler.scale(_fp16_loss(ddp, mb) / n).backward()
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale() < before


def amp_loops(args):
    """fp16 autocast + GradScaler: overflows are the scaler's business, faults are still detections."""
    out = {}
    init = 2.0**24  # overflows fp16 gradients for the first few steps, as a real run's start does
    pm, am = _model(), _model()
    plain, popt = DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    pscaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=10)
    ascaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=10)
    aud = Auditor(
        DDP(am),
        torch.optim.SGD(am.parameters(), lr=0.05, momentum=0.9),
        loss_fn=_fp16_loss,
        grad_scaler=ascaler,
        clip_grad_norm=1.0 if args.get("clip") else None,
        on_nonfinite="skip",
        sink=MemorySink(),
        injector_faults=[
            Fault(kind="non-finite", rank=1, step=35),
            Fault(kind="backward", rank=2, step=42, persistent=True),
        ],
    )
    skipped_plain, applied, caught = [], [], None
    for s in range(1, 56):
        mbs = _micro(s)[:2]
        if s < 35 and _plain_amp_step(plain, popt, pscaler, mbs):
            skipped_plain.append(s)
        try:
            aud.train_step(micro_batches=mbs)
        except FaultDetectedError as e:
            caught = (e.event.step, e.event.kind, e.event.suspect_ranks)
            break
        applied.append(aud.last.applied)
        if s == 34:
            out["bit_equal_at_34"] = _same(pm, am)
            out["scales_at_34"] = [pscaler.get_scale(), ascaler.get_scale()]
            out["overflow_steps"] = [st for st, k, _ in aud.state.lineage if k == "overflow"]
            out["skipped_plain"] = skipped_plain
            out["failures_to_34"] = _failures(aud)
            scale_before_fault = ascaler.get_scale()
        if s == 35:
            out["scale_kept_at_fault"] = ascaler.get_scale() == scale_before_fault
    out["failures"] = _failures(aud)
    out["suspects"] = _suspects(aud)
    out["overflow_events"] = [
        (e.step, e.details["pre_ranks"], e.details["scale"] > e.details["new_scale"])
        for e in aud.sink.events
        if e.kind == "overflow"
    ]
    out["caught"] = caught
    # bf16 autocast without a scaler keeps working: 20 clean steps, no alarm
    m = _model()
    aud = Auditor(
        DDP(m), torch.optim.SGD(m.parameters(), lr=0.05), loss_fn=_bf16_loss, audit_every=5, sink=MemorySink()
    )
    for s in range(1, 21):
        aud.train_step(_mb(s, 0))
    out["bf16"] = {"failures": _failures(aud), "last_clean_audit": aud.last_clean_audit}
    return out


class _WithBuffers(torch.nn.Module):
    """A BatchNorm (running statistics) and a constant buffer the forward reads."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 4)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 16))

    def forward(self, x):
        return self.out(torch.tanh(self.bn(self.inp(x)) + self.shift))


def buffers(args):
    """Floating-point buffers join the consensus and the checkpoint fingerprints."""
    import certckpt

    out = {}
    # broadcast_buffers=True (DDP's default): accumulation trains like plain DDP, 100 clean steps
    pm, am = _WithBuffers(), _WithBuffers()
    plain, popt = DDP(pm), torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    aud = Auditor(DDP(am), torch.optim.SGD(am.parameters(), lr=0.05, momentum=0.9), loss_fn=_loss, sink=MemorySink())
    for s in range(1, 101):
        if s <= 20:
            _plain_accumulated_step(plain, popt, _micro(s))
        aud.train_step(micro_batches=_micro(s))
        if s == 20:
            # weights on every rank; buffers on rank 0, whose copy DDP broadcasts and checkpoints
            out["bit_equal_at_20"] = _same(pm, am) and (
                dist.get_rank() != 0 or all(torch.equal(a, b) for a, b in zip(pm.buffers(), am.buffers()))
            )
            path = f"{args['dir']}/bn-{s}.safetensors"
            aud.save({"model": am.state_dict()}, path)
    out["clean_100"] = {"failures": _failures(aud), "buffers": aud.buffer_names, "last_clean": aud.last_clean_audit}
    if dist.get_rank() == 0:
        rec = certckpt.inspect(path).record
        out["ckpt"] = {
            "verifies": certckpt.verify(path, deep=True).ok,
            "consensus_tensors": sorted(rec.lineage["consensus"]["tensors"]),
        }
    # a running statistic corrupted x1000 on rank 0 at step 25, broadcast by DDP from step 26 on
    m = _WithBuffers()
    aud = Auditor(
        DDP(m),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        sink=MemorySink(),
        injector_faults=[Fault(kind="buffer", rank=0, step=25, scale=999.0, target="bn.running_var")],
    )
    caught = None
    for s in range(1, 41):
        try:
            aud.train_step(_mb(s, 0))
        except FaultDetectedError as e:
            caught = (e.event.step, e.event.kind, e.event.suspect_ranks, e.event.details["tensors"])
            break
    out["bn_fault"] = caught
    # broadcast_buffers=False: each rank's BatchNorm statistics are its own (left out, no false
    # alarm); the constant buffer must agree, and a corrupted copy on rank 2 is named
    m = _WithBuffers()
    aud = Auditor(
        DDP(m, broadcast_buffers=False),
        torch.optim.SGD(m.parameters(), lr=0.05),
        loss_fn=_loss,
        sink=MemorySink(),
        injector_faults=[Fault(kind="buffer", rank=2, step=17, target="shift")],
    )
    caught = None
    for s in range(1, 31):
        try:
            aud.train_step(_mb(s, 0))
        except FaultDetectedError as e:
            caught = (e.event.step, e.event.kind, e.event.suspect_ranks, e.event.details["tensors"])
            break
    out["no_broadcast"] = {"buffers": aud.buffer_names, "caught": caught}
    return out
