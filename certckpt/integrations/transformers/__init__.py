"""Certified checkpoints and audits for the Hugging Face ``Trainer`` (``pip install 'certckpt[transformers]'``).

Three lines in an existing Trainer script::

    from certckpt.integrations.transformers import CertifiedTrainer
    trainer = CertifiedTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train(resume_from_checkpoint=True)                            # resumes from latest-good

Every ``checkpoint-N/`` then holds certified safetensors files and JSON only (no ``optimizer.pt``,
``scheduler.pt``, ``rng_state*.pth`` or ``training_args.bin``), committed to the ledger in the output
directory: ``certckpt status OUTPUT_DIR`` gives each one's verdict, ``certckpt latest-good OUTPUT_DIR
--accept verified`` the one to resume from. Under DDP, ``callbacks=[AuditCallback(audit_every=10)]``
adds the replay audit, the non-finite checks and the weight consensus, and checkpoints can become
``trusted``. ``save_pretrained(model, dir)`` writes certified weights ``from_pretrained`` loads.

Modules: ``checkpoint`` (the directory's layout and its check), ``saving`` (certified shards),
``trainer`` (the mixin), ``audit`` (the callback). docs/integrations.md says which of the Trainer's
private methods are overridden, which checks run, and the limits.
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

try:
    import accelerate  # noqa: F401  (the Trainer needs it; say so here rather than deep inside transformers)
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - the test environment has both
    raise MissingDependencyError(
        f"certckpt.integrations.transformers needs transformers and accelerate ({e}): "
        "pip install 'certckpt[transformers]'"
    ) from None  # one error, in one frame: the ImportError is named in the message

from .audit import AuditCallback
from .checkpoint import MANIFEST_NAME, CheckpointReport, require_intact, verify_checkpoint
from .saving import ShardWriter, save_function, save_pretrained
from .trainer import CertifiedRun, CertifiedTrainer, CertifiedTrainerMixin

__all__ = [
    "CertifiedTrainer",
    "CertifiedTrainerMixin",
    "CertifiedRun",
    "AuditCallback",
    "save_function",
    "save_pretrained",
    "ShardWriter",
    "verify_checkpoint",
    "require_intact",
    "CheckpointReport",
    "MANIFEST_NAME",
]
