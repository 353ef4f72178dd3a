"""A tiny Accelerate training script for the integration tests: run per rank through
certckpt.detect.launch (``train(args)``, gloo on 127.0.0.1, results as JSON), or whole under
``accelerate launch`` (``python accelerate_cases.py --project DIR [--fault-at STEP]``).

The loop is the one docs/integrations.md shows: ``accelerator.accumulate`` (2 micro-batches),
``accelerator.clip_grad_norm_``, a scheduler, ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=...)``, dropout (the RNG states matter on resume). Each micro-batch is a function of
(rank, step, micro-batch), so a resumed run sees the batches an uninterrupted one sees.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.nn.functional as F

ACCUMULATION = 2


def tiny_model(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Dropout(dropout), torch.nn.GELU(), torch.nn.Linear(32, 2)
    )


def loss_fn(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def batch_for(rank: int, step: int, micro: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * rank + 100 * step + micro)
    x = torch.randn(4, 8, generator=g)
    return [x, x[:, :2].sin()]


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _as_torchrun() -> None:
    """The environment torchrun would give this rank: accelerate reads it to pick DDP over gloo."""
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(w))


def build(
    project: str,
    *,
    total_limit: int | None,
    faults=(),
    audit_every: int = 10,
    resume: bool = False,
    triggers=None,
    async_save: bool = False,
):
    from accelerate.utils import ProjectConfiguration

    from certckpt.detect import Fault
    from certckpt.integrations.accelerate import AcceleratorAudit, CertifiedAccelerator

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=total_limit)
    accelerator = CertifiedAccelerator(
        cpu=True, project_config=config, gradient_accumulation_steps=ACCUMULATION, async_save=async_save
    )
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    if resume:
        accelerator.load_state()  # latest-good, on a new branch
    audit = None
    if accelerator.num_processes > 1:
        audit = AcceleratorAudit(
            accelerator,
            model,
            opt,
            loss_fn=loss_fn,
            audit_every=audit_every,
            injector_faults=[Fault(**f) for f in faults] or None,
            **({"triggers": triggers} if triggers is not None else {}),
        )
    return accelerator, model, opt, sched, audit


def loop(accelerator, model, opt, sched, audit, *, max_steps: int, save_every: int, losses: list[float]) -> None:
    rank = accelerator.process_index
    while accelerator.certified_step < max_steps:
        step = accelerator.certified_step + 1
        for micro in range(ACCUMULATION):
            batch = batch_for(rank, step, micro)
            with accelerator.accumulate(model):
                loss = audit.loss(batch) if audit is not None else loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # as Accelerate documents it: the reduced gradients
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                sched.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
        if accelerator.certified_step % save_every == 0:
            accelerator.save_state()


def train(args):
    """One rank of a 3-rank run; returns what it saw (the fault, if one was detected)."""
    _as_torchrun()
    from certckpt.errors import FaultDetectedError

    accelerator, model, opt, sched, audit = build(
        args["project"],
        total_limit=args.get("total_limit", 1),
        faults=args.get("faults", []),
        audit_every=args.get("audit_every", 10),
        resume=args.get("resume", False),
        async_save=args.get("async_save", False),
    )
    out = {"rank": accelerator.process_index, "start": accelerator.certified_step}
    losses: list[float] = []
    try:
        loop(
            accelerator,
            model,
            opt,
            sched,
            audit,
            max_steps=args.get("max_steps", 20),
            save_every=args.get("save_every", 5),
            losses=losses,
        )
    except FaultDetectedError as e:
        ev = e.event
        out.update(kind=ev.kind, step=ev.step, suspects=list(ev.suspect_ranks), incident=e.incident_id)
    finally:
        if audit is not None:
            audit.close()
        accelerator.certckpt_wait()  # async_save: the checkpoint in flight is committed first
    out.update(
        step=out.get("step", accelerator.certified_step),
        branch=accelerator.certckpt.branch,
        parent=accelerator.certckpt.parent,
        weights=weights_digest(accelerator.unwrap_model(model)),
        losses=losses,
    )
    return out


def triggered(args):
    """One rank of the triggered-replay world (``sentinel_cases.integrations_world``): the loop above
    without checkpoints, with ``args["faults"]`` and ``args["triggers"]``."""
    from tests.support.sentinel_cases import outcome

    _as_torchrun()
    from certckpt.detect import Triggers
    from certckpt.errors import FaultDetectedError

    triggers = Triggers(**args["triggers"]) if args.get("triggers") else None
    accelerator, model, opt, sched, audit = build(
        args["project"], total_limit=None, faults=args.get("faults", []), audit_every=10, triggers=triggers
    )
    error = None
    try:
        loop(accelerator, model, opt, sched, audit, max_steps=args["max_steps"], save_every=10**6, losses=[])
    except FaultDetectedError as e:
        error = e
    finally:
        audit.close()
    return outcome(audit.session, error)


def averaging(args):
    """One rank: 3 steps (2 micro-batches, no clipping) without the audit, then the same 3 steps
    (same weights, batches and RNG) with ``AcceleratorAudit(audit_every=1)``; each step's reduced
    gradients as the optimizer receives them, and what the audit concluded."""
    _as_torchrun()
    from certckpt.integrations.accelerate import AcceleratorAudit, CertifiedAccelerator

    grads: dict[str, list[list[torch.Tensor]]] = {}
    out: dict = {}
    for name in ("plain", "audited"):
        accelerator = CertifiedAccelerator(
            cpu=True, gradient_accumulation_steps=ACCUMULATION, ledger=os.path.join(args["project"], name)
        )
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        audit = AcceleratorAudit(accelerator, model, opt, loss_fn=loss_fn, audit_every=1) if name == "audited" else None
        seen = grads.setdefault(name, [])
        inner = getattr(opt, "optimizer", opt)
        params = list(model.parameters())
        inner.register_step_pre_hook(lambda *_, seen=seen, params=params: seen.append([p.grad.clone() for p in params]))
        torch.manual_seed(1234)  # the same dropout masks in both runs
        for step in range(1, 4):  # unclipped: clipping would hide a gradient's scale
            for micro in range(ACCUMULATION):
                batch = batch_for(accelerator.process_index, step, micro)
                with accelerator.accumulate(model):
                    accelerator.backward(audit.loss(batch) if audit is not None else loss_fn(model, batch))
                    opt.step()
                    opt.zero_grad()
        if audit is not None:
            out["last_clean_audit"] = audit.session.state.last_clean_audit
            out["hook_average"] = audit.session.ctx.hook.average
            audit.close()
    out["max_rel"] = max(
        float((a - p).abs().max() / p.abs().max())
        for step_a, step_p in zip(grads["audited"], grads["plain"])
        for a, p in zip(step_a, step_p)
    )
    out["steps"] = len(grads["audited"])
    return out


def main(argv: list[str]) -> None:
    """Under ``accelerate launch``: train with the audits, exit 86 on a detection."""
    import argparse

    from certckpt.detect import stop_on_fault

    p = argparse.ArgumentParser()
    p.add_argument("--project", required=True)
    p.add_argument("--fault-at", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=20)
    a = p.parse_args(argv)
    faults = [{"kind": "backward", "rank": 1, "step": a.fault_at, "persistent": True}] if a.fault_at else []
    accelerator, model, opt, sched, audit = build(a.project, total_limit=1, faults=faults, audit_every=5)
    with stop_on_fault(audit, hard_exit=True):
        loop(accelerator, model, opt, sched, audit, max_steps=a.max_steps, save_every=5, losses=[])
    audit.close()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1:])
