"""Certified checkpoints and audits for Hugging Face Accelerate (``pip install 'certckpt[accelerate]'``).

The lines to change in an existing Accelerate script::

    from certckpt.integrations.accelerate import AcceleratorAudit, CertifiedAccelerator   # +
    accelerator = CertifiedAccelerator(project_config=config)     # was: Accelerator(project_config=config)
    accelerator.load_state()                                      # + resume from latest-good (optional)
    audit = AcceleratorAudit(accelerator, model, optimizer, loss_fn=loss_fn, audit_every=10)  # + (DDP)
    loss = audit.loss(batch)                                      # was: loss = loss_fn(model, batch)

and ``with stop_on_fault(audit):`` around the loop for exit 86 on a detection. Every
``accelerator.save_state()`` then writes certified, pickle-free files committed to the run store
(``certckpt status``, ``certckpt latest-good --dir``), ``total_limit`` never deletes latest-good, and
``accelerator.load_state()`` verifies the whole directory before loading and continues on a new branch.

Why a subclass of ``Accelerator`` rather than functions or a wrapper: ``save_state`` and
``load_state`` are public methods the user's script already calls, often in several places (and
``ProjectConfiguration``'s automatic naming and ``total_limit`` live inside them); overriding them
keeps every call site as it is, so the change is the constructor's name, as
``CertifiedTrainer`` is for the Trainer. The audits need what no ``Accelerator`` method sees (the
batch, and a loss the replay can recompute on the bare module), so they are one object more whose
``loss(batch)`` replaces the line that computes the loss; the optimizer's step hooks give the rest.

Modules: ``layout`` (the directory and its check), ``accelerator`` (``CertifiedAccelerator``),
``audit`` (``AcceleratorAudit``), ``together`` (failing on every process at once).
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

try:
    import accelerate  # noqa: F401
except ImportError as e:  # pragma: no cover - the test environment has it
    raise MissingDependencyError(
        f"certckpt.integrations.accelerate needs accelerate ({e}): pip install 'certckpt[accelerate]'"
    ) from None  # one error, in one frame: the ImportError is named in the message

from .accelerator import CertifiedAccelerator, CertifiedRun
from .audit import AcceleratorAudit
from .layout import MANIFEST_NAME, StateDirReport, require_intact, verify_state_dir

__all__ = [
    "CertifiedAccelerator",
    "CertifiedRun",
    "AcceleratorAudit",
    "verify_state_dir",
    "require_intact",
    "StateDirReport",
    "MANIFEST_NAME",
]
