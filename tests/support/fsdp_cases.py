"""Per-rank functions for the FSDP2 / HSDP detection tests (run through certckpt.detect.launch.run_ranks).

One run of ``fully_shard`` on a CPU DeviceMesh over gloo (4 ranks; 2 x 2 HSDP, replicate x shard, or
4 x 1) audited by ``ShardedAuditSession``: clean steps with the consensus compared against
``certckpt.dcp.state_fingerprints`` and a certified DCP checkpoint carrying the agreed fingerprint,
then a NaN planted in one rank's reduced gradient and a value flipped in one rank's weight shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import certckpt
from certckpt.dcp import CertifiedWriter, state_fingerprints
from certckpt.detect import Fault, Triggers
from certckpt.detect.sharded import ShardedAuditSession
from certckpt.errors import AuditSetupError, ConfigurationError, FaultDetectedError


def _model(seed: int, *, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    act = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Dropout(dropout)) if dropout else torch.nn.GELU()
    m = torch.nn.Sequential(torch.nn.Linear(12, 34), act, torch.nn.Linear(34, 5))
    m.register_buffer("scale", torch.linspace(0, 1, 7))
    return m


def _shard(m: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _outcome(session, applied: bool, agreed: bool, m) -> dict:
    c = session.last_consensus
    return {
        "step": session.step,
        "applied": applied,
        "agreed": agreed,
        "state_fp": c.state_fp,
        "live": state_fingerprints({"model": m.state_dict()}).state_fp,
        "suspects": list(c.suspect_ranks),
        "candidates": list(c.candidates),
        "disputed": sorted(c.disputed),
    }


def hsdp_audit(args):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", tuple(args["mesh"]), mesh_dim_names=("replicate", "shard"))
    m = _shard(_model(0), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    on_fault = args.get("on_fault", "continue")
    session = ShardedAuditSession(
        m, opt, run="t", ledger=args["store"], on_nonfinite="skip", on_fault=on_fault, consensus_every=1
    )
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own batch, as data parallelism does
    out: dict = {"rank": rank, "steps": [], "placements": [str(p) for p in m[0].weight.placements]}
    for step in range(1, args["steps"] + 1):
        x = torch.randn(4, 12, generator=g)
        F.mse_loss(m(x), x[:, :5].sin()).backward()
        if step == args.get("nan_step") and rank == args["nan_rank"]:
            m[2].weight.grad.to_local().view(-1)[3] = float("nan")  # after FSDP's reduce-scatter
        applied = session.before_update()
        if applied:
            opt.step()
        if step == args.get("flip_step") and rank == args["flip_rank"]:
            with torch.no_grad():  # a planted fault in this replica's weight shard, after the update
                local = m[0].weight.to_local().view(-1)
                local.view(torch.int32)[5] ^= 1 << 20
        try:
            agreed = session.after_update()
        except FaultDetectedError as e:  # on_fault="raise": every rank raises together
            out["raised"] = {"message": str(e), "suspects": e.event.suspect_ranks, "incident": e.incident_id}
            break
        opt.zero_grad(set_to_none=True)
        out["steps"].append(_outcome(session, applied, agreed, m))
        if step == args.get("ckpt_step"):
            out["ckpt"] = _checkpoint(session, m, opt, args)
    session.close()
    return out


def _checkpoint(session, m, opt, args) -> dict:
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    ev = session.checkpoint_evidence(state)
    writer = CertifiedWriter(args["dir"], evidence=ev, ledger=args["store"])
    dcp.save(state, storage_writer=writer)
    full = {
        f"model.{k}": certckpt.fingerprint_hex(v.full_tensor() if hasattr(v, "full_tensor") else v)
        for k, v in msd.items()
    }
    refused = None
    try:  # the same evidence for another state (the optimizer's left out): refused, nothing committed
        dcp.save({"model": msd}, storage_writer=CertifiedWriter(args["dir"] + "-other", evidence=ev))
    except dcp.api.CheckpointException as e:
        refused = str(e)
    return {
        "consensus_fp": ev.consensus_fp,
        "step": ev.step,
        "step_range": ev.step_range,
        "tensor_fps": ev.tensor_fps,
        "full": full,
        "live": state_fingerprints(state).state_fp,
        "ckpt_id": writer.ckpt_id,
        "refused": refused,
    }


def cheap_default_and_resume_check(args):
    """Without consensus_every the weights are compared at checkpoints (and audits) only; a resumed
    session with expect_consensus_fp accepts the checkpoint's state and refuses any other."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = _shard(_model(0), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    session = ShardedAuditSession(m, opt, run="t")
    g = torch.Generator().manual_seed(100 + rank)

    def train(s, steps):
        for _ in range(steps):
            x = torch.randn(4, 12, generator=g)
            F.mse_loss(m(x), x[:, :5].sin()).backward()
            if s.before_update():
                opt.step()
            s.after_update()
            opt.zero_grad(set_to_none=True)

    train(session, 3)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd}
    ev = session.checkpoint_evidence(state)
    consensus_steps = [e.step for e in session.sink.events if e.kind == "consensus"]
    session.close()

    def resume(branch, state):
        return ShardedAuditSession(
            m,
            opt,
            run="t",
            branch=branch,
            parent="main@3",
            start_step=3,
            expect_consensus_fp=ev.consensus_fp,
            resume_state=state,
        )

    resumed = resume("main-r1", state)  # the checkpoint's own state: accepted
    resumed.close()
    train(resumed, 1)  # the weights move on: they are not the checkpoint's any more
    msd, osd = get_state_dict(m, opt)
    refused = None
    try:
        resume("main-r2", {"model": msd, "optim": osd})
    except AuditSetupError as e:
        refused = str(e)
    return {"consensus_steps": consensus_steps, "refused": refused}


def plain_model_refused(args):
    """A model that fully_shard never touched: every rank refuses together, naming every rank."""
    m = _model(0)
    try:
        ShardedAuditSession(m, torch.optim.SGD(m.parameters(), lr=0.1))
    except AuditSetupError as e:
        return {"error": str(e)}
    return {"error": None}


def _loss(m, u):
    return F.mse_loss(m(u), u[:, :5].sin())


def replay_audit(args):
    """An FSDP2 / HSDP run with the ring replay audit, beside a plain FSDP copy of the same model fed
    the same micro-batches: per step whether the update was applied, whether the weights equal the
    plain run's; DCP checkpoints with consensus evidence at ``ckpt_steps``; planted faults."""
    rank = dist.get_rank()
    names = ("replicate", "shard")[-len(args["mesh"]) :]
    mesh = init_device_mesh("cpu", tuple(args["mesh"]), mesh_dim_names=names)
    dropout = args.get("dropout", 0.0)
    m, plain = _shard(_model(0, dropout=dropout), mesh), _shard(_model(0, dropout=dropout), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    fault = args.get("fault") or {}
    active = {"on": False}
    if fault.get("kind") == "persistent" and rank == fault["rank"]:
        # a rank whose arithmetic in layer 2 went wrong: every forward it computes, replays included
        m[2].register_forward_hook(lambda mod, inp, out: out * (1 + 1e-3) if active["on"] else None)
    out: dict = {"rank": rank, "steps": []}
    try:
        session = ShardedAuditSession(
            m,
            opt,
            run="t",
            ledger=args["store"],
            loss_fn=args.get("replay_loss", _loss) if "replay_scale" not in args else _scaled_loss(args),
            audit_every=args["audit_every"],
            on_fault=args.get("on_fault", "continue"),
            audit_updates=args.get("audit_updates"),
            triggers=Triggers(**args.get("triggers", {})),
        )
    except AuditSetupError as e:
        return {"setup_error": str(e)}
    if args.get("faults"):
        session.inject_faults([Fault(**f) for f in args["faults"]])
    g = torch.Generator().manual_seed(100 + rank)
    micro, nosync = args.get("micro", 1), args.get("nosync", False)
    for step in range(1, args["steps"] + 1):
        active["on"] = fault.get("kind") == "persistent" and step >= fault["step"]
        units = [torch.randn(4, 12, generator=g) for _ in range(micro)]
        for k, u in enumerate(units):
            if nosync:  # accumulate without communication until the last micro-batch
                m.set_requires_gradient_sync(k == micro - 1)
                plain.set_requires_gradient_sync(k == micro - 1)
            session.begin_micro_batch(u)
            rng = torch.get_rng_state()  # the plain copy draws the same dropout masks
            loss = _loss(m, u)
            if fault.get("kind") == "transient" and step == fault["step"] and rank == fault["rank"]:
                loss = loss * (1 + 1e-3)  # one wrong computation in training only
            if fault.get("kind") == "nan" and step == fault["step"] and rank == fault["rank"]:
                loss = loss * float("nan")  # this rank's local gradients go non-finite
            (loss / micro if micro > 1 else loss).backward()
            with torch.random.fork_rng():
                torch.set_rng_state(rng)
                plain_loss = _loss(plain, u)
            (plain_loss / micro if micro > 1 else plain_loss).backward()
        try:
            applied = session.before_update()
        except (FaultDetectedError, AuditSetupError) as e:
            out["raised"] = {
                "type": type(e).__name__,
                "message": str(e),
                "suspects": list(e.event.suspect_ranks) if hasattr(e, "event") else None,
                "incident": getattr(e, "incident_id", None),
            }
            break
        if applied:
            opt.step()
        if fault.get("kind") == "update" and step == fault["step"] and rank == fault["rank"]:
            with torch.no_grad():  # this rank's optimizer step went wrong on one value of its shard
                m[0].weight.to_local().view(-1).view(torch.int32)[2] ^= 1 << 12
        plain_opt.step()
        agreed = session.after_update()
        opt.zero_grad(set_to_none=True)
        plain_opt.zero_grad(set_to_none=True)
        same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(m.parameters(), plain.parameters()))
        out["steps"].append({"step": session.step, "applied": applied, "agreed": agreed, "as_plain": same})
        if step in args.get("ckpt_steps", ()):
            msd, osd = get_state_dict(m, opt)
            state = {"model": msd, "optim": osd}
            ev = session.checkpoint_evidence(state)
            dcp.save(
                state, storage_writer=CertifiedWriter(f"{args['store']}/step{step}", evidence=ev, ledger=args["store"])
            )
    session.close()
    out["sentinels"] = {
        "off": session.sentinels.off,
        "triggered": session.state.triggered_replays,
        "suppressed": session.state.triggers_suppressed,
        "names": list(session.sentinels.names),
    }
    return out


def triggered_world(args):
    """``replay_audit`` once per scenario of ``args["scenarios"]`` (each with its own store), in one
    launched world: the sentinels' tests pay for one start of torch.distributed."""
    return {name: replay_audit({**args, **scenario}) for name, scenario in args["scenarios"].items()}


def _scaled_loss(args):
    scale = args["replay_scale"]
    return lambda m, u: _loss(m, u) * scale


def forgotten_begin(args):
    """A loop that never calls begin_micro_batch with a replaying session: refused at before_update."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _shard(_model(0), mesh)
    session = ShardedAuditSession(m, torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=_loss, audit_every=1)
    x = torch.randn(4, 12)
    _loss(m, x).backward()
    try:
        session.before_update()
    except ConfigurationError as e:
        return {"error": str(e)}
    return {"error": None}


class _PassThroughReduceScatter:
    """What a user's own reduce-scatter looks like to FSDP: allocate and call (counted)."""

    calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        _PassThroughReduceScatter.calls += 1
        return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def _install_own_reduce_scatter(m):
    from torch.distributed.fsdp import FSDPModule

    for mod in m.modules():
        if isinstance(mod, FSDPModule):
            mod.set_custom_reduce_scatter(_PassThroughReduceScatter())


def replaced_reduce_scatter(args):
    """The user's own reduce-scatter, installed before the session (it keeps communicating, and the
    audits pass) or after it (the next audit refuses instead of comparing two empty lists)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _shard(_model(0), mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if args["when"] == "before":
        _install_own_reduce_scatter(m)
    session = ShardedAuditSession(m, opt, loss_fn=_loss, audit_every=2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in (1, 2):
        if step == 2 and args["when"] == "after":
            _install_own_reduce_scatter(m)
        x = torch.randn(4, 12, generator=g)
        session.begin_micro_batch(x)
        _loss(m, x).backward()
        try:
            session.before_update()
        except AuditSetupError as e:
            return {"step": step, "error": str(e)}
        opt.step()
        session.after_update()
        opt.zero_grad(set_to_none=True)
    replays = [[e.details.get("phase", "gradients"), e.outcome] for e in session.sink.events if e.kind == "replay"]
    return {"step": None, "error": None, "own_calls": _PassThroughReduceScatter.calls, "replays": replays}


def deferred_read(args):
    """``nonfinite_read="deferred"`` on a 2 x 2 HSDP mesh: clean steps train bit-equal to immediate reads;
    a NaN in rank 3's reduced gradient at step 6 is applied and raised at step 7, naming rank 3 and step 6
    (not contained); a checkpoint right after a non-finite step is refused before any evidence."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def run(read, *, nan_step=None, ckpt_step=None):
        m = _shard(_model(0), mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        session = ShardedAuditSession(m, opt, run="t", consensus_every=4, nonfinite_read=read)
        g = torch.Generator().manual_seed(100 + rank)
        raised = None
        for step in range(1, 9):
            x = torch.randn(4, 12, generator=g)
            F.mse_loss(m(x), x[:, :5].sin()).backward()
            if step == nan_step and rank == 3:
                m[2].weight.grad.to_local().view(-1)[3] = float("nan")  # after FSDP's reduce-scatter
            try:
                if session.before_update():
                    opt.step()
                session.after_update()
                opt.zero_grad(set_to_none=True)
                if step == ckpt_step:
                    msd, osd = get_state_dict(m, opt)
                    session.checkpoint_evidence({"model": msd, "optim": osd})
            except FaultDetectedError as e:
                d = e.event.details
                raised = [step, e.event.step, e.event.kind, e.event.suspect_ranks, d.get("read"), d.get("detected_at")]
                raised += [e.event.contained, "resume from the latest good checkpoint" in str(e)]
                break
        if raised is None:
            session.close()
        return [p.to_local().clone() for p in m.parameters()], raised

    immediate, _ = run("immediate")
    deferred, _ = run("deferred")
    _, late = run("deferred", nan_step=6)
    _, at_ckpt = run("deferred", nan_step=3, ckpt_step=3)
    try:
        m = _shard(_model(0), mesh)
        ShardedAuditSession(m, torch.optim.AdamW(m.parameters()), nonfinite_read="deferred", on_nonfinite="skip")
        refused = None
    except (AuditSetupError, ConfigurationError) as e:
        refused = str(e)
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(immediate, deferred)),
        "late": late,
        "at_ckpt": at_ckpt,
        "refused": refused,
    }
