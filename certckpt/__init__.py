"""certckpt: certified, pickle-free PyTorch checkpoints.

Public names only, each imported on first use: ``import certckpt`` costs the error classes and
nothing else, so ``certckpt verify``, ``inspect`` and ``latest-good`` never pay torch's import time.
The layers behind this door are described in ``docs/architecture.md``.

Example::

    import certckpt
    certckpt.save({"model": model.state_dict(), "step": 100}, "step100.safetensors", step=100)
    state = certckpt.load("step100.safetensors", map_location="cpu")
    assert certckpt.verify("step100.safetensors").ok
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentTypeError,
    AsyncSaveError,
    AuditSetupError,
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    DeviceConvictedError,
    DeviceUnavailableError,
    FaultDetectedError,
    FleetError,
    IncidentError,
    MissingDependencyError,
    NotACheckpointError,
    PlatformError,
    ProtectedCheckpointError,
    RanksFailedError,
    ReleaseVerificationError,
    StorageError,
    UnsupportedObjectError,
    UntrustedCheckpointError,
)
from .version import __version__

# name -> module (relative to this package) that defines it
_LAZY = {
    "save": "trust.commit",
    "async_save": "trust.commit",
    "AsyncSaver": "format.asyncsave",
    "SaveFuture": "format.asyncsave",
    "SaveResult": "format.writer",
    "load": "format.reader",
    "register_type": "format.registry",
    "unregister_type": "format.registry",
    "verify": "format.verify",
    "TrustConfig": "format.trustconfig",
    "inspect": "format.verify",
    "VerifyReport": "format.verify",
    "Problem": "format.verify",
    "CheckpointInfo": "format.verify",
    "fingerprint": "format.fingerprinting",
    "fingerprint_many": "format.fingerprinting",
    "fingerprint_hex": "format.fingerprinting",
    "fingerprint_state": "format.fingerprinting",
    "enable_compile": "format.fingerprinting",
    "certify": "trust.certify",
    "Ledger": "trust.ledger",
    "certify_store": "trust.runstore",
    "find_latest_good": "trust.runstore",
    "plan_resume": "trust.resume",
    "ResumePoint": "trust.resume",
    "Auditor": "detect.auditor",
}

__all__ = [
    "__version__",
    "save",
    "async_save",
    "AsyncSaver",
    "SaveFuture",
    "load",
    "register_type",
    "unregister_type",
    "verify",
    "TrustConfig",
    "inspect",
    "fingerprint",
    "fingerprint_many",
    "fingerprint_hex",
    "fingerprint_state",
    "enable_compile",
    "SaveResult",
    "VerifyReport",
    "Problem",
    "CheckpointInfo",
    "certify",
    "Ledger",
    "certify_store",
    "find_latest_good",
    "plan_resume",
    "ResumePoint",
    "Auditor",
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
    "ReleaseVerificationError",
    "ConfigurationError",
    "ArgumentTypeError",
    "PlatformError",
    "IncidentError",
    "FleetError",
    "AuditSetupError",
    "DeviceConvictedError",
    "FaultDetectedError",
    "RanksFailedError",
    "ProtectedCheckpointError",
    "AsyncSaveError",
]

if TYPE_CHECKING:  # pragma: no cover
    from .detect.auditor import Auditor
    from .format.asyncsave import AsyncSaver, SaveFuture
    from .format.fingerprinting import (
        enable_compile,
        fingerprint,
        fingerprint_hex,
        fingerprint_many,
        fingerprint_state,
    )
    from .format.reader import load
    from .format.registry import register_type, unregister_type
    from .format.trustconfig import TrustConfig
    from .format.verify import CheckpointInfo, Problem, VerifyReport, inspect, verify
    from .format.writer import SaveResult
    from .trust.certify import certify
    from .trust.commit import async_save, save
    from .trust.ledger import Ledger
    from .trust.resume import ResumePoint, plan_resume
    from .trust.runstore import certify_store, find_latest_good


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
