"""A tiny Hugging Face training set-up for the Trainer integration tests, and its per-rank functions
(run through certckpt.detect.launch: gloo ranks on 127.0.0.1, results as JSON).

Everything is built from a config: no download (HF_HUB_OFFLINE=1), no tokenizer.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

VOCAB, SEQ = 64, 16


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT2 with hidden size 32 (dropout on: the RNG states matter on resume)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertForMaskedLM(cfg)


class TokenData(torch.utils.data.Dataset):
    """Deterministic random token sequences (labels = inputs: causal LM)."""

    def __init__(self, n: int = 96):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids}


def training_args(out: str, **overrides):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=out,
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        logging_steps=1,
        save_strategy="steps",
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def stop_at(step: int | None):
    """A callback that stops training after ``step`` (an interrupted run)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if step is not None and state.global_step >= step:
                control.should_training_stop = True
            return control

    return StopAt()


def certified_trainer(out: str, *, stop: int | None = None, callbacks=(), trainer_kwargs=None, **overrides):
    from certckpt.integrations.transformers import CertifiedTrainer

    return CertifiedTrainer(
        model=tiny_gpt2(),
        args=training_args(out, **overrides),
        train_dataset=TokenData(),
        callbacks=[stop_at(stop), *callbacks],
        **(trainer_kwargs or {}),
    )


# --- per-rank functions (3 gloo ranks; certckpt.detect.launch initialised the process group) ----


def _as_torchrun() -> None:
    """The environment torchrun would give this rank: accelerate reads it to pick DDP over gloo."""
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(w))


def audited_run(args):
    """Train with AuditCallback; returns what this rank saw (the fault, if one was detected; the
    consensus the session agreed on at the start, ``proof``). ``alter``: rank 0's weights change
    once the checkpoint is loaded, before DDP hands rank 0's copy to every replica."""
    _as_torchrun()
    import torch.distributed as dist
    from transformers import TrainerCallback

    from certckpt.detect import Fault, FaultDetectedError
    from certckpt.errors import AuditSetupError
    from certckpt.integrations.transformers import AuditCallback

    faults = [Fault(**f) for f in args.get("faults", [])]
    audit = AuditCallback(
        audit_every=args.get("audit_every", 2), consensus_every=args.get("consensus_every"), injector_faults=faults
    )
    out: dict = {"rank": int(os.environ["RANK"])}

    class Probe(TrainerCallback):  # after AuditCallback: what its session proved before the first step
        def on_train_begin(self, targs, state, control, **kwargs):
            agreed = audit.session.state.agreed
            out["proof"] = None if agreed is None else [agreed[0], agreed[2]]

    trainer = certified_trainer(
        args["out"],
        callbacks=[audit, Probe()],
        max_steps=args.get("max_steps", 8),
        save_steps=args.get("save_steps", 2),
        ddp_backend="gloo",
        gradient_accumulation_steps=args.get("ga", 1),
        logging_steps=100,
        save_total_limit=args.get("save_total_limit"),
        trainer_kwargs=({"eval_dataset": TokenData(24)} if args.get("best") else {})
        | ({"async_save": True} if args.get("async_save") else {}),
        **(
            dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss")
            | {"greater_is_better": args["best"] == "highest-loss"}
            if args.get("best")
            else {}
        ),
    )
    if args.get("alter"):
        load = trainer._load_from_checkpoint

        def load_then_alter(*a, **kw):
            load(*a, **kw)
            if dist.get_rank() == 0:
                with torch.no_grad():
                    next(trainer.model.parameters()).view(-1)[0] += 1e-3

        trainer._load_from_checkpoint = load_then_alter
    try:
        trainer.train(resume_from_checkpoint=args.get("resume"))
    except AuditSetupError as e:
        out["refused"] = str(e)
    except FaultDetectedError as e:
        out.update(
            fault=str(e),
            kind=e.event.kind,
            step=e.event.step,
            suspects=list(e.event.suspect_ranks),
            incident=e.incident_id,
            contained=e.event.contained,
        )
    out["global_step"] = trainer.state.global_step
    out["branch"] = trainer.certckpt.branch
    out["parent"] = trainer.certckpt.parent
    return out


def triggered(args):
    """One rank of the triggered-replay world (``sentinel_cases.integrations_world``): the tiny GPT2
    under the Trainer's DDP, 2 micro-batches a step, audits every 10 steps, no checkpoint,
    ``args["faults"]`` and ``args["triggers"]``."""
    _as_torchrun()
    from certckpt.detect import Fault, FaultDetectedError, Triggers
    from certckpt.integrations.transformers import AuditCallback
    from tests.support.sentinel_cases import outcome

    extra = {"triggers": Triggers(**args["triggers"])} if args.get("triggers") else {}
    audit = AuditCallback(audit_every=10, injector_faults=[Fault(**f) for f in args.get("faults", [])], **extra)
    trainer = certified_trainer(
        args["out"],
        callbacks=[audit],
        max_steps=args["max_steps"],
        save_steps=10**6,
        ddp_backend="gloo",
        gradient_accumulation_steps=2,
        logging_steps=100,
    )
    error = None
    try:
        trainer.train()
    except FaultDetectedError as e:
        error = e
    return outcome(audit.session, error)


class _BatchNormRegressor(torch.nn.Module):
    """A Trainer-compatible model with BatchNorm statistics (buffers every forward updates)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        y = self.out(torch.relu(self.bn(self.lin(x)))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}


def batchnorm_run(args):
    """AuditCallback on a BatchNorm model under the Trainer's DDP (broadcast_buffers, its default)."""
    _as_torchrun()
    from transformers import TrainingArguments

    from certckpt.detect import Fault, FaultDetectedError
    from certckpt.integrations.transformers import AuditCallback, CertifiedTrainer

    audit = AuditCallback(
        audit_every=2, consensus_every=1, injector_faults=[Fault(**f) for f in args.get("faults", [])]
    )
    targs = TrainingArguments(
        output_dir=args["out"],
        max_steps=6,
        save_steps=3,
        save_strategy="steps",
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo",
        logging_steps=100,
    )
    trainer = CertifiedTrainer(model=_BatchNormRegressor(), args=targs, train_dataset=_Rows(), callbacks=[audit])
    out = {"rank": int(os.environ["RANK"]), "buffers": None}
    try:
        trainer.train()
    except FaultDetectedError as e:
        out.update(kind=e.event.kind, step=e.event.step, suspects=list(e.event.suspect_ranks))
    out["buffers"] = list(audit.session.buffer_names)
    return out
