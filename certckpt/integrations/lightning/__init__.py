"""certckpt for PyTorch Lightning (``pip install 'certckpt[lightning]'``).

Add to an existing Lightning script::

    from certckpt.integrations.lightning import AuditCallback, CertifiedCheckpointIO

    audit = AuditCallback(audit_every=10)
    trainer = L.Trainer(strategy="ddp", plugins=[CertifiedCheckpointIO()], callbacks=[checkpointing, audit])

- ``CertifiedCheckpointIO``: every checkpoint a certified, pickle-free file committed to the run
  store's ledger (``certckpt status``, ``certckpt latest-good``); resuming reads through it too.
- ``AuditCallback``: the non-finite checks, the ring replay audit (with the module's own
  ``training_step``) and the weight consensus in a DDP run; checkpoints become ``trusted``.
- ``load_from_checkpoint(cls, path)``: ``LightningModule.load_from_checkpoint`` for certified files;
  ``CertifiedLoading``, a mixin that makes ``LitModel.load_from_checkpoint(path)`` itself take them.

Works with ``lightning.pytorch`` and ``pytorch_lightning`` alike (the classes derive from those of
every installed package). Importing this package imports Lightning.
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

from .presence import lightning_installed

if not lightning_installed():  # said here, in one frame, rather than deep inside the imports below
    raise MissingDependencyError(
        "certckpt.integrations.lightning needs PyTorch Lightning: pip install 'certckpt[lightning]'"
    ) from None

from .audit import AuditCallback
from .checkpoint_io import CertifiedCheckpointIO
from .loading import CertifiedLoading, load_from_checkpoint

__all__ = ["AuditCallback", "CertifiedCheckpointIO", "CertifiedLoading", "load_from_checkpoint"]
