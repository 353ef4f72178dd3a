"""Detection hooks for DDP training: non-finite checks, ring replay audit, weight consensus."""

from .attribution import ConsensusVerdict, ReplayVerdict, attribute_replay, consensus_verdict
from .auditor import AuditSetupError, Auditor, FaultDetectedError, StepOutcome
from .events import AuditEvent, EventSink, JsonlSink, MemorySink
from .inject import FAULT_KINDS, Fault, Injector

__all__ = [
    "Auditor",
    "AuditEvent",
    "AuditSetupError",
    "FaultDetectedError",
    "StepOutcome",
    "EventSink",
    "MemorySink",
    "JsonlSink",
    "Fault",
    "Injector",
    "FAULT_KINDS",
    "attribute_replay",
    "consensus_verdict",
    "ReplayVerdict",
    "ConsensusVerdict",
]
