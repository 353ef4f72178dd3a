"""Per-rank functions for the Lightning DDP tests (run through certckpt.detect.launch.run_ranks).

The ranks are started outside Lightning (as torchrun or a cluster would start them): ``LOCAL_RANK``
tells Lightning's environment that the processes exist already, and the process group the launcher
initialised is the one ``Trainer(strategy="ddp", devices=3)`` uses.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

TRAIN = 120  # samples: 40 per rank, 10 batches of 4 per rank and epoch


def _lightning():
    import pytorch_lightning as pl

    return pl


def _env() -> None:
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    os.environ["NODE_RANK"] = "0"
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    warnings.filterwarnings("ignore")  # Lightning's tips and deprecation notes, on every rank


def _data():
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(TRAIN, 6, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].sin()), batch_size=4, shuffle=False)


def _module():
    pl = _lightning()

    class Lit(pl.LightningModule):
        def __init__(self, lr: float = 0.05):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    torch.manual_seed(0)
    return Lit()


def _trainer(*, max_steps: int, callbacks=(), plugins=(), **kw):
    pl = _lightning()
    return pl.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy="ddp",
        max_steps=max_steps,
        callbacks=list(callbacks),
        plugins=list(plugins),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(type(c).__name__ == "ModelCheckpoint" for c in callbacks),
        num_sanity_val_steps=0,
        **kw,
    )


def _weights(module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in module.parameters()]


def _status(store: str) -> dict:
    from certckpt.trust.runstore import find_latest_good

    status, latest = find_latest_good(store, write_certificates=False)
    verdicts = {cid: [v.label, list(v.reasons)] for cid, v in status.certification.verdicts.items()}
    return {
        "verdicts": verdicts,
        "latest_good": latest,
        "latest_url": status.entry(latest).url if latest else None,
        "detections": [
            [d.branch, d.step, d.kind, list(d.suspect_ranks), d.contained] for d in status.certification.detections
        ],
        "incidents": status.snapshot.open_incidents(),
        "retired": sorted(status.snapshot.retired),
    }


def clean(args):
    """The same accumulated, clipped run twice: plain Lightning DDP, then with certckpt's plugin and
    audits (every 10 steps, checkpoints every 5, only the newest kept); the weights must be the same
    bits, every checkpoint trusted, and the latest-good never rotated out."""
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.plugins.io import AsyncCheckpointIO

    from certckpt.integrations.lightning import AuditCallback, CertifiedCheckpointIO

    _env()
    config = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
    plain = _module()
    _trainer(max_steps=20, **config).fit(plain, _data())
    audited = _module()
    audit = AuditCallback(audit_every=10)
    ckpt = ModelCheckpoint(dirpath=args["dir"], every_n_train_steps=5, save_top_k=1, save_last=True)
    # Saved through Lightning's AsyncCheckpointIO: the evidence of each step reaches the file written
    # on the saver thread, and the commits, rotation and kept copy end as a synchronous run's do.
    io = AsyncCheckpointIO(CertifiedCheckpointIO()) if args.get("async_io") else CertifiedCheckpointIO()
    trainer = _trainer(max_steps=20, callbacks=[ckpt, audit], plugins=[io], **config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(audited, _data())
    out = {
        "bit_equal": _weights(plain) == _weights(audited),
        "step": audit.session.step,
        "last_clean_audit": audit.session.last_clean_audit,
    }
    # bf16 autocast: replays run in the precision plugin's context, so they reproduce training
    plain, audited, audit = _module(), _module(), AuditCallback(audit_every=5, ledger=args["dir"] + "-bf16")
    _trainer(max_steps=10, precision="bf16-mixed").fit(plain, _data())
    _trainer(max_steps=10, precision="bf16-mixed", callbacks=[audit]).fit(audited, _data())
    out["bf16"] = [_weights(plain) == _weights(audited), audit.session.last_clean_audit]
    dist.barrier()
    if dist.get_rank() == 0:
        out["status"] = _status(args["dir"])
        out["files"] = sorted(os.listdir(args["dir"]))
        out["kept_warning"] = [str(w.message) for w in caught if "latest-good" in str(w.message)]
    return out


def session_plain_loop(args):
    """The driver under AuditCallback, called from a plain torch loop at the same hook points: it
    trains like plain DDP (bit-equal) and catches a persistent fault on rank 1, naming it."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from certckpt.detect import AuditSession, Fault, FaultDetectedError

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def batch(step):
        g = torch.Generator().manual_seed(dist.get_rank() * 1000 + step)
        x = torch.randn(4, 8, generator=g)
        return x, x[:, :4].cos()

    m = model()
    ddp, opt = DDP(m), torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(1, 21):
        b = batch(s)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(b[0]), b[1]).backward()
        opt.step()
    reference = [p.detach().clone() for p in m.parameters()]
    out = {}
    for name, faults in (("clean", None), ("fault", [Fault(kind="backward", rank=1, step=7, persistent=True)])):
        m = model()
        ddp, opt = DDP(m), torch.optim.AdamW(m.parameters(), lr=1e-2)
        session = AuditSession(
            ddp,
            opt,
            loss_fn=lambda module, u: F.mse_loss(module(u[0]), u[1]),
            ledger=os.path.join(args["dir"], name),
            hand_over_grads=False,
            audit_every=5,
            injector_faults=faults,
        )
        try:
            for s in range(1, 21):
                b = batch(s)
                session.begin_micro_batch(b)
                opt.zero_grad(set_to_none=True)
                F.mse_loss(ddp(b[0]), b[1]).backward()
                if session.before_update():
                    opt.step()
                session.after_update()
            same = all(torch.equal(a, p) for a, p in zip(reference, m.parameters()))
            out[name] = {"bit_equal": same, "last_clean_audit": session.last_clean_audit}
        except FaultDetectedError as e:
            out[name] = [e.event.step, e.event.kind, e.event.suspect_ranks]
        session.close()
    return out


def triggered(args):
    """One rank of the triggered-replay world (``sentinel_cases.integrations_world``): accumulated
    (2 micro-batches a step), clipped, audits every 10 steps, ``args["faults"]`` and
    ``args["triggers"]``."""
    from certckpt.detect import Fault, FaultDetectedError, Triggers
    from certckpt.integrations.lightning import AuditCallback
    from tests.support.sentinel_cases import outcome

    _env()
    extra = {"triggers": Triggers(**args["triggers"])} if args.get("triggers") else {}
    faults = [Fault(**f) for f in args.get("faults", [])]
    audit = AuditCallback(audit_every=10, ledger=args["dir"], injector_faults=faults, **extra)
    trainer = _trainer(max_steps=args["max_steps"], callbacks=[audit], accumulate_grad_batches=2, gradient_clip_val=0.5)
    error = None
    try:
        trainer.fit(_module(), _data())
    except FaultDetectedError as e:
        error = e
    audit.close()
    return outcome(audit.session, error)


# --- a user's script: `python lightning_cases.py DIR OUT [--fault] [--ckpt-path P]` -----------------
# Lightning's own launcher starts ranks 1 and 2 by running this file again (devices=3); every rank
# writes OUT/rank{r}.json before it leaves, and a detected fault leaves with status 86.


def last_ckpt_keeps_latest_good(args):
    """Only ``last.ckpt``, rewritten every 10 steps, audits every 20 and a persistent fault from step
    32 on rank 1: the file holding the latest-good (main@20) would be written over at step 30, before
    the audit at 40 catches the fault. certckpt keeps it aside; after the detection latest-good is
    main@20 and its kept file verifies."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from certckpt.detect import Fault, FaultDetectedError
    from certckpt.integrations.lightning import AuditCallback, CertifiedCheckpointIO

    _env()
    faults = [Fault(kind="backward", rank=1, step=32, persistent=True)]
    audit = AuditCallback(audit_every=20, injector_faults=faults)
    ckpt = ModelCheckpoint(dirpath=args["dir"], every_n_train_steps=10, save_top_k=0, save_last=True)
    trainer = _trainer(max_steps=50, callbacks=[ckpt, audit], plugins=[CertifiedCheckpointIO()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(_module(), _data())  # epochs repeat until max_steps
            caught_at = None
        except FaultDetectedError as e:
            caught_at = e.event.step
    dist.barrier()
    out: dict = {"caught_at": caught_at}
    if dist.get_rank() == 0:
        from certckpt.format.verify import verify

        out["status"] = _status(args["dir"])
        out["files"] = sorted(os.listdir(args["dir"]))
        url = out["status"]["latest_url"]
        out["latest_verifies"] = bool(url) and verify(url).ok
        out["kept_warning"] = [str(w.message) for w in caught if "kept main@" in str(w.message)]
    return out


def altered_resume(args):
    """Resume from ``args["ckpt"]`` (audits every 5) with rank 0's weights changed once loaded,
    before DDP hands rank 0's copy to every replica: what every rank was told at the start."""
    from pytorch_lightning.callbacks import Callback

    from certckpt.errors import AuditSetupError
    from certckpt.integrations.lightning import AuditCallback, CertifiedCheckpointIO

    class Alter(Callback):
        def on_load_checkpoint(self, trainer, pl_module, checkpoint):  # after the weights are loaded
            if trainer.global_rank == 0:
                with torch.no_grad():
                    next(pl_module.parameters())[0, 0] += 1e-3

    _env()
    io = CertifiedCheckpointIO()
    trainer = _trainer(
        max_steps=20, callbacks=[AuditCallback(audit_every=5, ledger=args["dir"]), Alter()], plugins=[io]
    )
    out: dict = {"refused": None}
    try:
        trainer.fit(_module(), _data(), ckpt_path=args["ckpt"])
    except AuditSetupError as e:
        out["refused"] = str(e)
    point = io.resume_point
    out.update(global_step=trainer.global_step, resume=None if point is None else [point.branch, point.parent])
    return out


def _script(argv: list[str]) -> None:
    import argparse
    import json
    import sys

    from pytorch_lightning.callbacks import Callback, ModelCheckpoint

    from certckpt.detect import Fault, stop_on_fault
    from certckpt.integrations.lightning import AuditCallback, CertifiedCheckpointIO

    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--fault", action="store_true")
    p.add_argument("--ckpt-path")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    faults = [Fault(kind="backward", rank=1, step=8, persistent=True)] if args.fault else None
    audit = AuditCallback(audit_every=5, injector_faults=faults)
    io = CertifiedCheckpointIO()
    result: dict = {"exit": None}

    class Probe(Callback):
        """After AuditCallback set its session up: the consensus the session agreed on at the start."""

        def on_train_start(self, trainer, pl_module):
            agreed = audit.session.state.agreed
            result["proof"] = None if agreed is None else [agreed[0], agreed[2]]

    pl = _lightning()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=3,
        strategy="ddp",
        max_steps=20,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=args.dir, every_n_train_steps=5, save_top_k=-1), audit, Probe()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )

    def report(code: int) -> None:
        result["exit"] = code
        result["global_step"] = trainer.global_step
        point = io.resume_point
        result["resume"] = None if point is None else [point.branch, point.parent, point.level, point.consensus_fp]
        with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w", encoding="utf-8") as f:
            json.dump(result, f)

    try:
        with stop_on_fault(audit, hard_exit=False):
            trainer.fit(_module(), _data(), ckpt_path=args.ckpt_path)
    except SystemExit as e:
        report(int(e.code))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(e.code))  # gloo's transport may abort in interpreter teardown: leave now
    report(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    import sys

    _script(sys.argv[1:])
