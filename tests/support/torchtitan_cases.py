"""Per-rank functions for the TorchTitan tests and benchmark (run through certckpt.detect.launch.run_ranks).

TorchTitan's ``Trainer`` needs an accelerator (``torchtitan.tools.utils`` picks "cuda" when none is
found and ``Trainer.__init__`` calls ``torch.cuda.set_device``), so these ranks build what the
trainer builds, from TorchTitan's own classes, on CPU: the llama3 ``debugmodel`` config (cut to two
layers and a short RoPE table for time), its transformer blocks fully sharded as TorchTitan's FSDP2
path does, TorchTitan's ``OptimizersContainer`` and ``LRSchedulersContainer``, and the checkpoint
manager. Its attention is TorchTitan's ``ScaledDotProductAttention`` (the one its Flux model uses):
on CPU FlexAttention has no backward and varlen attention calls a CUDA-only flash kernel.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

SEQ, BATCH, VOCAB = 16, 2, 2048


def one_gpu() -> None:
    """Make this single rank's default group one that drives a GPU: NCCL for CUDA tensors (FSDP2's
    collectives), gloo for the rest (DCP's object exchanges, TorchTitan's async checkpoint group). A
    world of one: NCCL allows one rank per GPU, and the machine these run on has one."""
    assert dist.get_world_size() == 1, "one_gpu is for a world of one rank"
    torch.cuda.set_device(0)
    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)


def build(*, seed: int = 0, layers: int = 2, hsdp: bool = False, device: str = "cpu"):
    """The debug model, sharded over every rank, with TorchTitan's optimizer and LR scheduler.

    ``hsdp``: 2 replica groups x (world / 2) shards, by TorchTitan's own ``apply_fsdp_to_decoder`` (its
    trainer's FSDP2 / HSDP path, here on a CPU mesh with the trainer's dimension names: ``ParallelDims``
    builds its meshes on "cuda"), with gradients summed, not averaged, as TorchTitan's are."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    cfg = model_registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope.max_seq_len = 64
    torch.manual_seed(seed)
    with torch.device(device):
        model = cfg.build()
    model.init_states(buffer_device=torch.device(device))
    if hsdp:
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        shape = (2, dist.get_world_size() // 2)
        mesh = init_device_mesh(device, shape, mesh_dim_names=("dp_replicate", "fsdp"))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        # TorchTitan turns FSDP's gradient division off (factor 1.0; its loop divides by the global token
        # count), which FSDP reduces with ReduceOp.PREMUL_SUM: gloo has none ("Cannot use
        # ReduceOp.PREMUL_SUM with Gloo"). Plain SUM instead, the same sums (FSDP's own switch).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    else:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
    opt_cfg = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
    )
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=100)
    return model, optimizers, schedulers


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every rank its own batch, as data parallelism does
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def loss_of(model, tokens: torch.Tensor) -> torch.Tensor:
    tokens = tokens.to(next(model.parameters()).device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=tokens.device).expand(inputs.shape[0], -1)
    logits = model(inputs, positions, None)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def manager(cls, folder: str, model, optimizers, schedulers, **config):
    cfg = cls.Config(enable=True, folder=folder, interval=1, **config)
    return cfg.build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=None,
    )


def train_step(model, optimizers, schedulers, step: int, *, session=None) -> float:
    tokens = batch(step, dist.get_rank())
    if session is not None and session.loss_fn is not None:
        session.begin_micro_batch(tokens)
    loss = loss_of(model, tokens)
    loss.backward()
    applied = session.before_update() if session is not None else True
    if applied:
        optimizers.step()
        schedulers.step()
    if session is not None:
        session.after_update()
    optimizers.zero_grad()
    return float(loss.detach())


def _fingerprint(model) -> str:
    from certckpt.dcp import state_fingerprints

    return state_fingerprints({"model": model.state_dict()}).state_fp


def _raised(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # the test asserts the type's name and the words
        return f"{type(e).__name__}: {e}"
    return None


def checkpoints(args):
    """One world, several checks: certified sync and async saves with audit evidence, rotation that keeps
    latest-good, resume from latest-good on a new branch, a plain TorchTitan checkpoint refused."""
    from torchtitan.components.checkpoint import CheckpointManager

    from certckpt.detect.sharded import ShardedAuditSession
    from certckpt.integrations.torchtitan import CertifiedCheckpointManager

    rank, root = dist.get_rank(), args["root"]
    folder = os.path.join(root, "ckpt")
    out: dict = {"rank": rank}
    model, optimizers, schedulers = build()
    session = ShardedAuditSession(
        model, optimizers.optimizers[0], run="titan", ledger=folder, loss_fn=loss_of, audit_every=2
    )
    ckpt = manager(
        CertifiedCheckpointManager,
        folder,
        model,
        optimizers,
        schedulers,
        keep_latest_k=2,
        accept="trusted",
        run="titan",
    )
    fps = {}
    for step in range(1, 9):
        train_step(model, optimizers, schedulers, step, session=session)
        if step == 2:
            ckpt.attach(session)  # step 2 carries the agreed fingerprint; the audit at 2 passes: trusted
        elif step == 3:
            ckpt.audit = None  # later ones only verified: latest-good stays step 2
        if step in (2, 4, 6, 8):
            fps[step] = _fingerprint(model)
            ckpt.save(step)
    session.close()
    ckpt.close()
    out["fps"] = fps
    out["dirs"] = sorted(os.listdir(folder))
    out["last_ckpt_id"] = ckpt.last_ckpt_id
    # an async save (TorchTitan's "async" mode: staged, then written on a thread) commits the same way
    late = manager(
        CertifiedCheckpointManager,
        folder,
        model,
        optimizers,
        schedulers,
        keep_latest_k=0,
        async_mode="async",
        run="titan",
    )
    train_step(model, optimizers, schedulers, 9)
    late.save(9)
    late.maybe_wait_for_saving()
    late.close()
    out["async_ckpt_id"] = late.last_ckpt_id
    dist.barrier()

    # resume: a fresh manager on the same folder loads latest-good (step 2), every byte checked
    model2, opt2, sched2 = build(seed=1)
    again = manager(
        CertifiedCheckpointManager, folder, model2, opt2, sched2, keep_latest_k=0, accept="trusted", run="titan"
    )
    out["loaded"] = again.load()
    out["resumed"] = {
        "fp": _fingerprint(model2),
        "branch": again.branch,
        "parent": again.parent,
        "step": again.resumed_step,
    }
    train_step(model2, opt2, sched2, 3)
    again.save(3)
    again.close()
    out["dirs_after_resume"] = sorted(os.listdir(folder))
    dist.barrier()

    # a checkpoint written by plain TorchTitan: refused in one line on every rank, never unpickled
    plain = os.path.join(root, "plain")
    stock = manager(CheckpointManager, plain, model, optimizers, schedulers, keep_latest_k=0)
    stock.save(1)
    stock.close()
    dist.barrier()
    certified = manager(CertifiedCheckpointManager, plain, model, optimizers, schedulers, keep_latest_k=0)
    out["plain_refused"] = _raised(certified.load)
    certified.close()
    return out


def hsdp_checkpoints(args):
    """HSDP (2 replica groups x 2 shards on 4 ranks): certified saves carrying the audits' evidence, and
    a resume from latest-good onto a fresh HSDP model."""
    from certckpt.detect.sharded import ShardedAuditSession
    from certckpt.integrations.torchtitan import CertifiedCheckpointManager

    folder = os.path.join(args["root"], "ckpt")
    model, optimizers, schedulers = build(hsdp=True)
    placements = {str(p.placements) for p in model.parameters()}
    session = ShardedAuditSession(
        model, optimizers.optimizers[0], run="titan-hsdp", ledger=folder, loss_fn=loss_of, audit_every=2
    )
    ckpt = manager(
        CertifiedCheckpointManager,
        folder,
        model,
        optimizers,
        schedulers,
        keep_latest_k=0,
        accept="trusted",
        run="titan-hsdp",
    )
    fps = {}
    for step in range(1, 5):
        train_step(model, optimizers, schedulers, step, session=session)
        if step == 2:
            ckpt.attach(session)  # from here every checkpoint carries the fingerprint the replicas agreed on
        if step in (2, 4):
            fps[step] = _fingerprint(model)
            ckpt.save(step)
    audited = session.step
    session.close()
    ckpt.close()
    dist.barrier()
    model2, opt2, sched2 = build(seed=1, hsdp=True)
    again = manager(
        CertifiedCheckpointManager, folder, model2, opt2, sched2, keep_latest_k=0, accept="trusted", run="titan-hsdp"
    )
    loaded = again.load()
    out = {
        "placements": sorted(placements),
        "fps": fps,
        "steps": audited,
        "loaded": loaded,
        "resumed": {"fp": _fingerprint(model2), "parent": again.parent, "step": again.resumed_step},
    }

    def resumed_session():
        # what docs/integrations.md tells a resumed TorchTitan loop to build: the manager's branch,
        # parent, step and the parent's agreed fingerprint, which the session proves before the first step
        return ShardedAuditSession(
            model2,
            opt2.optimizers[0],
            run="titan-hsdp",
            ledger=folder,
            loss_fn=loss_of,
            audit_every=2,
            branch=again.branch,
            parent=again.parent,
            start_step=again.resumed_step,
            expect_consensus_fp=again.resumed_consensus_fp,
            resume_state=again.resumed_state(),
        )

    out["resumed_fp_known"] = again.resumed_consensus_fp is not None
    resumed_session().close()  # the loaded state is the parent's: the proof passes
    with torch.no_grad():  # one shard of rank 0 changed after the load: the proof refuses on every rank
        if dist.get_rank() == 0:
            next(iter(model2.parameters())).to_local().add_(1.0)
    try:
        resumed_session().close()
        out["altered"] = None
    except Exception as e:  # the test compares what every rank raised
        out["altered"] = type(e).__name__
    again.close()
    return out


def gpu_checkpoints(args):
    """One rank on one GPU (NCCL): every async mode of the checkpoint manager (``async_with_pinned_mem``
    stages into pinned shared memory and writes from another process: it needs an accelerator, "Non-blocking
    copy requires that the current accelerator is available" on CPU) writes a certified checkpoint that
    verifies whole, and a fresh model on the GPU loads it back bit for bit."""
    from certckpt.format.sharded.check import verify_checkpoint
    from certckpt.integrations.torchtitan import CertifiedCheckpointManager

    device = args.get("device", "cuda")  # "cpu": the same checks without the GPU and the pinned mode
    if device == "cuda":
        one_gpu()
    out: dict = {}
    model, optimizers, schedulers = build(device=device)
    modes = ("disabled", "async", *(("async_with_pinned_mem",) if device == "cuda" else ()))
    for step, mode in enumerate(modes, start=1):
        folder = os.path.join(args["root"], mode)
        train_step(model, optimizers, schedulers, step)
        saved = _fingerprint(model)
        cls = CertifiedCheckpointManager
        ckpt = manager(cls, folder, model, optimizers, schedulers, keep_latest_k=0, async_mode=mode)
        ckpt.save(step)
        ckpt.maybe_wait_for_saving()
        ckpt.close()
        report = verify_checkpoint(os.path.join(folder, f"step-{step}"))
        model2, opt2, sched2 = build(seed=step, device=device)
        again = manager(CertifiedCheckpointManager, folder, model2, opt2, sched2, keep_latest_k=0)
        out[mode] = {
            "verified": report.ok,
            "problems": [p.message for p in report.problems[:2]],
            "loaded": again.load(),
            "same": _fingerprint(model2) == saved,
            "device": str(next(model2.parameters()).device),
        }
        again.close()
    return out


def bench(args):
    """Certified save / load against TorchTitan's own, same model and disk, interleaved."""
    import time

    from torchtitan.components.checkpoint import CheckpointManager

    from certckpt.integrations.torchtitan import CertifiedCheckpointManager

    device = args.get("device", "cpu")
    if device == "cuda":
        one_gpu()
    rank, root = dist.get_rank(), args["root"]
    model, optimizers, schedulers = build(layers=args["layers"], device=device)
    train_step(model, optimizers, schedulers, 1)  # optimizer state exists, as in a real checkpoint
    kinds = {"titan": CheckpointManager, "certified": CertifiedCheckpointManager}
    # the pinned-memory mode needs an accelerator (its stager's non-blocking copies)
    asyncs = {"async": "async", **({"pinned": "async_with_pinned_mem"} if device == "cuda" else {})}
    measures = ("sync", "load", *(f"{a}-{w}" for a in asyncs for w in ("block", "total")))
    times: dict = {f"{k}-{m}": [] for k in kinds for m in measures}
    for trial in range(args["trials"]):
        for name, cls in kinds.items() if trial % 2 == 0 else reversed(kinds.items()):
            for mode in ("disabled", *asyncs.values()):
                folder = os.path.join(root, f"{name}-{mode}-{trial}")
                m = manager(cls, folder, model, optimizers, schedulers, keep_latest_k=0, async_mode=mode)
                dist.barrier()
                t0 = time.perf_counter()
                m.save(1)
                t1 = time.perf_counter()
                m.maybe_wait_for_saving()
                dist.barrier()
                t2 = time.perf_counter()
                if mode == "disabled":
                    times[f"{name}-sync"].append(t2 - t0)
                    t0 = time.perf_counter()
                    m.load(step=1)
                    dist.barrier()
                    times[f"{name}-load"].append(time.perf_counter() - t0)
                else:
                    short = next(k for k, v in asyncs.items() if v == mode)
                    times[f"{name}-{short}-block"].append(t1 - t0)
                    times[f"{name}-{short}-total"].append(t2 - t0)
                m.close()
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)
    nbytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) * 3  # + AdamW's two moments
    return {"times": times, "local_bytes": nbytes}


def _with_fault(model, rank: int, fault: dict, active: dict) -> None:
    # a rank whose arithmetic in one block went wrong: the same wrong value every time it computes it
    if rank == fault["rank"]:
        block = list(model.layers.values())[0]
        block.register_forward_hook(lambda mod, inp, out: out * (1 + 1e-3) if active["on"] else None)


def _same_rank_replayer(model):
    """TorchTitan's SDC replay: the released ``torchtitan.observability.sdc_replayer.SDCReplayer`` when
    the installed TorchTitan ships it; else the stand-in below."""
    try:
        from torchtitan.observability.sdc_replayer import SDCReplayer, SDCReplayMismatch
    except ImportError:
        return _StandIn(model), "stand-in (torchtitan 0.3.0 ships no SDC replayer)", _StandInMismatch
    replayer = SDCReplayer(SDCReplayer.Config(num_steps=-1, num_replays=1), modules=[model], device=torch.device("cpu"))
    return replayer, "torchtitan SDCReplayer", SDCReplayMismatch


class _StandInMismatch(RuntimeError):
    pass


class _StandIn:
    """What TorchTitan's same-rank SDC replay compares (its design, torchtitan#4333/#4334): run a step's
    forward/backward, take ``torch.hash_tensor`` of the loss and of every local gradient, restore the
    RNG and zero the gradients, run it again on the same rank, and fail when any rank's digests differ
    (an all-reduce of the local mismatch)."""

    def __init__(self, model) -> None:
        self.model = model

    def _signature(self, loss) -> list[torch.Tensor]:
        digests = [torch.hash_tensor(loss.detach())]
        for p in self.model.parameters():
            g = p.grad.to_local() if p.grad is not None else torch.zeros(())
            digests.append(torch.hash_tensor(g.detach()))
        return digests

    def run_fwd_bwd(self, execute, *, step: int):
        rng = torch.get_rng_state()
        reference = self._signature(execute())
        torch.set_rng_state(rng)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        loss = execute()
        same = all(torch.equal(a, b) for a, b in zip(self._signature(loss), reference))
        mismatch = torch.tensor([0 if same else 1])
        dist.all_reduce(mismatch, op=dist.ReduceOp.MAX)
        if int(mismatch):
            raise _StandInMismatch(f"SDC replay mismatch at step {step}")
        return loss


def replay_comparison(args):
    """The same planted faults under TorchTitan's same-rank replay and certckpt's cross-rank replay.

    ``persistent``: rank ``fault.rank`` computes one block wrongly from ``fault.step`` on, identically
    every time (a defective unit). ``transient``: the same, in one execution only (the first of the
    checked step). Each detector runs on its own copy of the model from the same start."""
    from certckpt.detect.sharded import ShardedAuditSession
    from certckpt.errors import FaultDetectedError

    rank, fault = dist.get_rank(), args["fault"]
    out: dict = {"rank": rank}

    # TorchTitan's check: every step checked (num_steps=-1), one replay
    model, optimizers, schedulers = build()
    active = {"on": False, "left": None}
    _with_fault(model, rank, fault, active)
    replayer, out["titan_impl"], mismatch_type = _same_rank_replayer(model)
    out["titan"] = None
    for step in range(1, args["steps"] + 1):
        tokens = batch(step, rank)

        def execute(tokens=tokens, step=step):
            if fault["kind"] == "persistent":
                active["on"] = step >= fault["step"]
            else:  # one wrong execution: the first one of the fault's step
                active["on"] = step == fault["step"] and active["left"] != step
                active["left"] = step
            loss = loss_of(model, tokens)
            loss.backward()
            return loss

        try:
            replayer.run_fwd_bwd(execute, step=step)
        except mismatch_type as e:
            out["titan"] = {"step": step, "message": str(e)}
            break
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()

    # certckpt's check: the cross-rank ring replay every step
    model, optimizers, schedulers = build()
    active = {"on": False}
    _with_fault(model, rank, fault, active)
    # the session recomputes the update with the optimizer's own class: the container's AdamW (one
    # model part, one optimizer type), which is what TorchTitan's container steps
    session = ShardedAuditSession(
        model, optimizers.optimizers[0], run="titan", loss_fn=loss_of, audit_every=1, on_fault="raise"
    )
    out["certckpt"] = None
    for step in range(1, args["steps"] + 1):
        tokens = batch(step, rank)
        session.begin_micro_batch(tokens)
        active["on"] = step >= fault["step"] if fault["kind"] == "persistent" else step == fault["step"]
        loss = loss_of(model, tokens)
        active["on"] = fault["kind"] == "persistent" and step >= fault["step"]  # the replay runs after
        loss.backward()
        try:
            if session.before_update():
                optimizers.step()
                schedulers.step()
            session.after_update()
        except FaultDetectedError as e:
            out["certckpt"] = {"step": step, "suspects": list(e.event.suspect_ranks), "message": str(e)}
            break
        optimizers.zero_grad()
    if out["certckpt"] is None:
        session.close()
    return out
