"""certckpt: certified, pickle-free PyTorch checkpoints.

Public names only. Torch-dependent names (``save``, ``load``, ``fingerprint``, ``Auditor``...) are
imported on first use, so ``certckpt verify``, ``inspect`` and ``latest-good`` never pay torch's
import time. The pure certifier is ``certckpt.certify.certify`` (the module keeps that name).
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
from .verify import CheckpointInfo, Problem, VerifyReport, inspect, verify

__version__ = "0.1.0"

_LAZY = {
    "save": "writer",
    "SaveResult": "writer",
    "load": "reader",
    "fingerprint": "fingerprinting",
    "fingerprint_many": "fingerprinting",
    "fingerprint_hex": "fingerprinting",
    "fingerprint_state": "fingerprinting",
    "enable_compile": "fingerprinting",
    "Ledger": "ledger",
    "certify_store": "runstore",
    "find_latest_good": "runstore",
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
    from .detect.auditor import AuditSetupError, Auditor, FaultDetectedError
    from .fingerprinting import enable_compile, fingerprint, fingerprint_hex, fingerprint_many, fingerprint_state
    from .ledger import Ledger
    from .runstore import certify_store, find_latest_good
    from .reader import load
    from .writer import SaveResult, save


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
