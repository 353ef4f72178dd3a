"""Certified checkpoints for TorchTitan (``pip install 'certckpt[torchtitan]'``).

TorchTitan's ``CheckpointManager`` hands ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` a checkpoint
directory and no storage writer, so DCP writes a pickled ``.metadata`` and a step counts as valid
when that file exists. ``CertifiedCheckpointManager`` is the same manager with the DCP calls going
through ``certckpt.dcp.CertifiedWriter`` / ``CertifiedReader``: every checkpoint is certified and
committed to a run store, resuming takes the run's latest-good (every byte read checked), and
``keep_latest_k`` never deletes it. The one line that changes in a trainer config::

    from certckpt.integrations.torchtitan import CertifiedCheckpointManager
    config.checkpoint = CertifiedCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

Audits: build a ``certckpt.detect.ShardedAuditSession`` on the FSDP2 model and ``attach`` it; every
checkpoint then carries the replicas' agreed fingerprint and becomes ``trusted`` once the next audit
passes (docs/integrations.md, "TorchTitan").

Modules: ``manager`` (the subclass and its config), ``layout`` (TorchTitan's step directories: which
are certified, which are plain DCP and refused, what a rotation may delete).
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # pragma: no cover - the test environment has it where these tests run
    raise MissingDependencyError(
        f"certckpt.integrations.torchtitan needs torchtitan ({e}): pip install 'certckpt[torchtitan]'"
        " (scripts/install.sh installs it without letting pip replace torch)"
    ) from None

from .layout import IMPORT_HINT, is_plain_dcp, refuse_plain, step_directories
from .manager import CertifiedCheckpointManager

__all__ = [
    "CertifiedCheckpointManager",
    "IMPORT_HINT",
    "is_plain_dcp",
    "refuse_plain",
    "step_directories",
]
