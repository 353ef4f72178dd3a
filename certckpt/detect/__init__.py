"""Detection hooks for DDP training: non-finite checks, ring replay audit, weight consensus.

Names are imported on first use: the event types (``AuditEvent``, the sinks) are needed by the
ledger and ``certckpt latest-good`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Auditor": "auditor",
    "AuditSession": "session",
    "CheckpointEvidence": "session",
    "ShardedAuditSession": "sharded",
    "ShardConsensus": "sharded",
    "AuditSetupError": "auditor",
    "FaultDetectedError": "auditor",
    "StepOutcome": "auditor",
    "AuditEvent": "events",
    "EventSink": "events",
    "MemorySink": "events",
    "JsonlSink": "events",
    "Fault": "inject",
    "Injector": "inject",
    "FAULT_KINDS": "inject",
    "FaultKind": "inject",
    "AuditOptions": "options",
    "Triggers": "sentinel",
    "attribute_replay": "attribution",
    "consensus_verdict": "attribution",
    "ReplayVerdict": "attribution",
    "ConsensusVerdict": "attribution",
    "stop_on_fault": "stop",
    "EXIT_FAULT_DETECTED": "stop",
    "EXIT_DEVICE_REFUSED": "stop",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'certckpt.detect' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
