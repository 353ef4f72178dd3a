"""A tiny DeepSpeed ZeRO set-up for the DeepSpeed integration tests, and its per-rank functions (run
through certckpt.detect.launch: gloo ranks on 127.0.0.1, CPU accelerator, results as JSON)."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

from typing import Any

import torch
import torch.nn.functional as F

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 4


def build(stage: int, *, seed: int = 0, clip: float = 1.0, gas: int = 1):
    """A deepspeed engine around a 3-layer MLP (AdamW, warm-up scheduler, clipping) on every rank."""
    import deepspeed
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()) if dist.is_initialized() else "0")
    # The CPU accelerator's shared-memory all-reduce is a C++ op compiled at first use (80 s of CPU
    # here, on every fresh CI machine): these ranks use plain gloo, as DeepSpeed does off Linux.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def batch_for(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_fn(module: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch[0]), batch[1])


def full_weights(engine: Any) -> dict[str, list[float]]:
    """The full weights (gathered under ZeRO-3), as lists, for comparisons across runs."""
    import deepspeed

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=int(engine.zero_optimization_stage()) == 3):
        return {n: p.detach().clone().reshape(-1).tolist() for n, p in params}


def train(args: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps, saving every ``save_every`` into ``out`` (certified unless ``plain``);
    with ``resume``, load first (``tag``, or latest-good). With ``audit``, a ZeroAudit runs."""
    import torch.distributed as dist

    from certckpt.errors import FaultDetectedError

    engine = build(args["stage"], gas=args.get("gas", 1))
    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank}
    ce = None
    if not args.get("plain"):
        from certckpt.integrations.deepspeed import certify_engine

        ce = certify_engine(engine, run="ds")
    if args.get("resume"):
        path, _ = engine.load_checkpoint(args["out"], tag=args.get("tag"))
        result["loaded"] = path
        if ce is not None and ce.resumed is not None:
            result.update(branch=ce.branch, parent=ce.parent, start=ce.resumed.step)
    audit = None
    if args.get("audit"):
        from certckpt.detect.inject import Fault
        from certckpt.integrations.deepspeed import ZeroAudit

        faults = [Fault(**f) for f in args.get("faults", [])]
        audit = ZeroAudit(
            engine,
            loss_fn=loss_fn,
            audit_every=args["audit"],
            consensus_every=args.get("consensus_every"),
            injector_faults=faults or None,
        )
    gas = args.get("gas", 1)
    try:
        while engine.global_steps < args["steps"]:
            s = engine.global_steps + 1
            for m in range(gas):
                b = batch_for(s, m, rank)
                if audit is not None:
                    audit.begin_micro_batch(b)
                engine.backward(loss_fn(engine, b))
                if m == gas - 1 and audit is not None:
                    audit.before_update()
                engine.step()
            if audit is not None:
                audit.after_update()
            if args.get("save_every") and engine.global_steps % args["save_every"] == 0:
                engine.save_checkpoint(args["out"], tag=f"step{engine.global_steps}")
    except FaultDetectedError as e:
        result.update(detected=e.event.to_dict(), message=str(e), incident=e.incident_id)
    result["global_step"] = int(engine.global_steps)
    result["weights"] = full_weights(engine)
    if audit is not None:
        result["passed"] = audit.passed
        audit.close()
    return result


def try_load(args: dict[str, Any]) -> dict[str, Any]:
    """Load ``out`` (tag ``tag``) with a certified engine; the error's type and message, if any."""
    from certckpt.integrations.deepspeed import certify_engine

    engine = build(args["stage"])
    certify_engine(engine, run="ds")
    try:
        path, _ = engine.load_checkpoint(args["out"], tag=args.get("tag"))
    except Exception as e:  # the test asserts which error, on every rank
        return {"error": type(e).__name__, "message": str(e)}
    return {"loaded": path, "global_step": int(engine.global_steps)}


def refusals(args: dict[str, Any]) -> dict[str, Any]:
    """On one engine: a plain DeepSpeed checkpoint written to ``plain``, then (certified) loads of it
    and of each directory in ``bad``, and ZeroAudit's set-up; each outcome's error and message."""
    import shutil

    import torch.distributed as dist

    from certckpt.integrations.deepspeed import ZeroAudit, certify_engine

    engine = build(args["stage"])
    b = batch_for(1, 0, 0)
    engine.backward(loss_fn(engine, b))
    engine.step()
    engine.save_checkpoint(args["plain"], tag="plain")  # DeepSpeed's own engine: pickles
    certify_engine(engine, run="ds")
    engine.save_checkpoint(args["out"], tag="step1")
    edited, missing = os.path.join(args["tmp"], "edited"), os.path.join(args["tmp"], "missing")
    if dist.get_rank() == 0:  # two damaged copies of the certified checkpoint
        shutil.copytree(os.path.join(args["out"], "step1"), os.path.join(edited, "step1"))
        shutil.copytree(os.path.join(args["out"], "step1"), os.path.join(missing, "step1"))
        with open(os.path.join(edited, "step1", "zero_pp_rank_1_mp_rank_00_model_states.pt"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 1]))
        os.remove(os.path.join(missing, "step1", "zero_pp_rank_2_mp_rank_00_optim_states.pt"))
    dist.barrier()
    bad = {
        "plain": (args["plain"], "plain"),
        "edited": (edited, "step1"),
        "missing": (missing, "step1"),
        "nothing": (os.path.join(args["tmp"], "none"), None),
    }
    out: dict[str, Any] = {}
    for name, (directory, tag) in bad.items():
        try:
            engine.load_checkpoint(directory, tag=tag)
            out[name] = {"error": None}
        except Exception as e:  # the test asserts which error, on every rank
            out[name] = {"error": type(e).__name__, "message": str(e)}
    # saves into tag directories that exist: plain DeepSpeed's is refused and kept whole; what a save of
    # this run at this step left (its files, no manifest: a crash) is removed and written again
    redo = os.path.join(args["out"], "redo")
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(args["out"], "step1"), redo, ignore=shutil.ignore_patterns("certckpt-*"))
    dist.barrier()
    plain_before = sorted(os.listdir(os.path.join(args["plain"], "plain")))
    for name, (directory, tag) in {"over_plain": (args["plain"], "plain"), "redo": (args["out"], "redo")}.items():
        try:
            engine.save_checkpoint(directory, tag=tag)
            out[name] = {"error": None}
        except Exception as e:  # the test asserts which error, on every rank
            out[name] = {"error": type(e).__name__, "message": str(e)}
    out["plain_kept"] = sorted(os.listdir(os.path.join(args["plain"], "plain"))) == plain_before
    out["redo_files"] = sorted(os.listdir(redo))
    try:
        ZeroAudit(engine, loss_fn=loss_fn)
        out["audit"] = {"error": None}
    except Exception as e:
        out["audit"] = {"error": type(e).__name__, "message": str(e)}
    return out


def accelerate_save(args: dict[str, Any]) -> dict[str, Any]:
    """Accelerate's DeepSpeed plugin (ZeRO-2) on 1 CPU rank: ``certify_engine`` on the engine that
    ``accelerator.prepare`` returns, then ``accelerator.save_state``; what it wrote."""
    import deepspeed
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from certckpt.integrations.deepspeed import certify_engine

    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK="0")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1))
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT)
    opt = torch.optim.AdamW(model.parameters())
    loader = torch.utils.data.DataLoader(torch.randn(8, IN), batch_size=2)
    model, opt, loader = acc.prepare(model, opt, loader)
    certify_engine(model, run="acc")
    for x in loader:
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    acc.save_state(args["out"])
    return {"engine": type(model).__name__, "files": sorted(os.listdir(args["out"])), "step": int(model.global_steps)}


def resume_proof(args: dict[str, Any]) -> dict[str, Any]:
    """In one launch: an audited run of ``steps`` steps saving every ``save_every`` into ``out``, then
    three resumes from ``tag``. ``altered``: its audit (built before the load) sees rank 1's loaded
    weights changed after the load; ``all``: every rank's changed alike, a new audit built after the
    load; ``clean``: a new audit after the load, trained to ``steps`` again; ``drifted``: that run on
    for 2 steps, rank 2's weights changed before the second (an audit step). Each outcome's error,
    event and the step the engine stood at; the clean one's weights, against the first run's."""
    import torch.distributed as dist

    from certckpt.errors import FaultDetectedError
    from certckpt.integrations.deepspeed import ZeroAudit, certify_engine

    engine = build(args["stage"])
    rank = dist.get_rank()
    certify_engine(engine, run="ds")

    def audit() -> ZeroAudit:
        return ZeroAudit(engine, loss_fn=loss_fn, audit_every=args["audit"])

    def train_to(a: ZeroAudit, steps: int, save_every: int | None = None) -> None:
        while engine.global_steps < steps:
            b = batch_for(engine.global_steps + 1, 0, rank)
            a.begin_micro_batch(b)
            engine.backward(loss_fn(engine, b))
            a.before_update()
            engine.step()
            a.after_update()
            if save_every and engine.global_steps % save_every == 0:
                engine.save_checkpoint(args["out"], tag=f"step{engine.global_steps}")

    def change_weights() -> None:
        with torch.no_grad():
            next(engine.module.parameters()).view(-1)[0] += 0.5

    def outcome(fn: Any) -> dict[str, Any]:
        try:
            fn()
        except FaultDetectedError as e:
            ev = e.event.to_dict()
            got = {"kind": ev["kind"], "found_by": ev["details"].get("found_by"), "suspects": ev["suspect_ranks"]}
            return {"error": "FaultDetectedError", "message": str(e), **got, "at": int(engine.global_steps)}
        except Exception as e:  # the test asserts which error, on every rank
            return {"error": type(e).__name__, "message": str(e), "at": int(engine.global_steps)}
        return {"error": None, "at": int(engine.global_steps)}

    first = audit()
    train_to(first, args["steps"], args["save_every"])
    result: dict[str, Any] = {"weights": full_weights(engine), "passed": first.passed}

    def altered() -> None:
        engine.load_checkpoint(args["out"], tag=args["tag"])  # the audit built before: proven at its next step
        if rank == 1:
            change_weights()
        train_to(first, args["steps"])

    result["altered"] = outcome(altered)
    engine.load_checkpoint(args["out"], tag=args["tag"])
    change_weights()
    result["all"] = outcome(audit)  # built after the load: proven at its construction
    engine.load_checkpoint(args["out"], tag=args["tag"])
    clean = audit()
    result["clean"] = outcome(lambda: train_to(clean, args["steps"]))
    result["clean"].update(weights=full_weights(engine), passed=clean.passed)

    def drifted() -> None:  # rank 2's weights changed before the forward of an audit step (6)
        train_to(clean, args["steps"] + 1)
        if rank == 2:
            change_weights()
        train_to(clean, args["steps"] + 2)

    result["drifted"] = outcome(drifted)
    first.close()
    clean.close()
    return result
