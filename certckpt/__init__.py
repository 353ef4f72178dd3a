"""certckpt: certified, pickle-free PyTorch checkpoints.

Public names only. Torch-dependent names (``save``, ``load``, ``fingerprint``, ``Auditor``...) are
imported on first use, so ``certckpt verify``, ``inspect`` and ``latest-good`` never pay torch's
import time. The pure certifier is ``certckpt.trust.certify.certify`` (the module keeps that name).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    MissingDependencyError,
    NotACheckpointError,
    StorageError,
    UnsupportedObjectError,
    UntrustedCheckpointError,
)
from certckpt.format.verify import CheckpointInfo, Problem, VerifyReport, inspect, verify

__version__ = "0.1.0"

_LAZY = {
    "save": "format.writer",
    "SaveResult": "format.writer",
    "load": "format.reader",
    "fingerprint": "format.fingerprinting",
    "fingerprint_many": "format.fingerprinting",
    "fingerprint_hex": "format.fingerprinting",
    "fingerprint_state": "format.fingerprinting",
    "enable_compile": "format.fingerprinting",
    "Ledger": "trust.ledger",
    "certify_store": "trust.runstore",
    "find_latest_good": "trust.runstore",
    "Auditor": "detect.auditor",
    "FaultDetectedError": "detect.auditor",
    "AuditSetupError": "detect.auditor",
}

__all__ = [
    "__version__",
    "save",
    "load",
    "verify",
    "inspect",
    "fingerprint",
    "fingerprint_many",
    "fingerprint_hex",
    "fingerprint_state",
    "enable_compile",
    "SaveResult",
    "Ledger",
    "certify_store",
    "find_latest_good",
    "Auditor",
    "FaultDetectedError",
    "AuditSetupError",
    "VerifyReport",
    "Problem",
    "CheckpointInfo",
    "CertckptError",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "UnsupportedObjectError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "StorageError",
    "MissingDependencyError",
    "DeviceUnavailableError",
    "UntrustedCheckpointError",
]

if TYPE_CHECKING:  # pragma: no cover
    from certckpt.detect.auditor import AuditSetupError, Auditor, FaultDetectedError
    from certckpt.format.fingerprinting import enable_compile, fingerprint, fingerprint_hex, fingerprint_many, fingerprint_state
    from certckpt.trust.ledger import Ledger
    from certckpt.trust.runstore import certify_store, find_latest_good
    from certckpt.format.reader import load
    from certckpt.format.writer import SaveResult, save


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
