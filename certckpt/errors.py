"""One shallow exception tree.

Every error certckpt raises on purpose derives from :class:`CertckptError` and also from the built-in
exception a caller would naturally catch (``ValueError`` for bad bytes, ``FileExistsError`` for a
refused overwrite, ...), so ``except CertckptError`` and ``except ValueError`` both work. Every
class lives here, whichever layer raises it: the bottom of the import graph, importing nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CertckptError",
    "CorruptCheckpointError",
    "TruncatedCheckpointError",
    "NotACheckpointError",
    "UnsupportedObjectError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "StorageError",
    "AsyncSaveError",
    "MissingDependencyError",
    "DeviceUnavailableError",
    "UntrustedCheckpointError",
    "ReleaseVerificationError",
    "ConfigurationError",
    "ArgumentTypeError",
    "PlatformError",
    "IncidentError",
    "AuditSetupError",
    "DeviceConvictedError",
    "FleetError",
    "FaultDetectedError",
    "RanksFailedError",
    "ProtectedCheckpointError",
]


class CertckptError(Exception):
    """Root of every error certckpt raises on purpose."""


# --- the file -------------------------------------------------------------------------------------


class CorruptCheckpointError(CertckptError, ValueError):
    """The file claims to be a certckpt checkpoint but its bytes do not verify.

    Raised for truncated files, malformed or hostile headers, digest and fingerprint mismatches.
    """


class TruncatedCheckpointError(CorruptCheckpointError):
    """The file ends before the bytes its header declares (a copy cut short, a disk full)."""


class NotACheckpointError(CertckptError, ValueError):
    """The file is something else: a ``torch.save`` archive, a raw pickle, a plain safetensors file."""


class UnsupportedObjectError(CertckptError, TypeError):
    """``save`` was given an object it cannot store without pickling; nothing was written."""


class CheckpointExistsError(CertckptError, FileExistsError):
    """The target name already holds a checkpoint and overwriting was not asked for."""


class CheckpointNotFoundError(CertckptError, FileNotFoundError):
    """No checkpoint at the given path or URL."""


class StorageError(CertckptError, OSError):
    """The store could not be read or written (permissions, full disk, unreachable endpoint)."""


class AsyncSaveError(StorageError):
    """An asynchronous save failed in the background and nobody had asked its future; raised by the
    saver's next save, ``wait`` or ``close`` (the cause is chained)."""


class MissingDependencyError(CertckptError, ImportError):
    """An optional backend is not installed; the message names the pip command that fixes it."""


class DeviceUnavailableError(CertckptError, RuntimeError):
    """A tensor was saved on a device this process does not have; pass ``map_location``."""


# --- arguments and the platform ----------------------------------------------------------------------


class ConfigurationError(CertckptError, ValueError):
    """An option or argument is invalid; the message names it and what is accepted."""


class ArgumentTypeError(CertckptError, TypeError):
    """An argument has the wrong type (a path where a file object was expected, a str step...)."""


class PlatformError(CertckptError, RuntimeError):
    """This torch build does not compute what certckpt relies on (integer wrap-around, a compiled
    kernel that disagrees with the eager one), or an internal invariant failed: report it."""


# --- trust and incidents ------------------------------------------------------------------------------


class UntrustedCheckpointError(CertckptError, ValueError):
    """An operation that needs a trusted checkpoint (promotion to the vault) was given a suspect one."""


class ReleaseVerificationError(UntrustedCheckpointError):
    """A release directory does not verify: a file changed, its certificate belongs to another
    release, a signature is not by the trusted key, or its verdict is below what was accepted."""


class IncidentError(CertckptError, ValueError):
    """A decision on an incident breaks its rules (approval by the proposer, closing without a drill...)."""


class FleetError(CertckptError, ValueError):
    """A decision in a fleet registry breaks its rules (a clearance approved by its own proposer or
    key, an appeal of a device with no conviction, a device name that is not one)."""


# --- detection ------------------------------------------------------------------------------------------


class AuditSetupError(CertckptError, ValueError):
    """The training set-up cannot be audited as configured (found at start, not at step 10,000)."""


class DeviceConvictedError(AuditSetupError):
    """A run configured with a fleet registry was refused at its start: a rank's device is convicted
    there (every rank raises the same message; ``certckpt fleet show DEVICE`` has the evidence).

    Attributes:
        devices: ``(rank, device, host)`` of every convicted device the run would have used; empty
            when the registry itself could not vouch for its convictions (missing, unreadable,
            tampered) or the run's placement could not be recorded.
    """

    def __init__(self, message: str, *, devices: Sequence[tuple[str, str, str]] = ()):
        super().__init__(message)
        self.devices = [tuple(d) for d in devices]


class FaultDetectedError(CertckptError, RuntimeError):
    """A check failed and the auditor was told to stop.

    Attributes:
        event: the failed check's ``AuditEvent`` (the evidence).
        incident_id: the incident this detection opened (the same id on every rank); None when
            the detection was contained (the bad update never reached the weights).
        convicted: the devices of the blamed ranks that rank 0 convicts in the fleet registry
            ``fleet`` (empty: no fleet, a contained detection, or no device identity).
    """

    def __init__(
        self,
        message: str,
        event: Any,
        *,
        incident_id: str | None = None,
        convicted: Sequence[str] = (),
        fleet: str | None = None,
    ):
        super().__init__(message)
        self.event = event
        self.incident_id = incident_id
        self.convicted = list(convicted)  # the devices rank 0 convicts in ``fleet`` for this detection
        self.fleet = fleet


class RanksFailedError(CertckptError, RuntimeError):
    """A rank exited with an error or the group timed out; the message carries each rank's stderr tail."""


class ProtectedCheckpointError(CheckpointExistsError):
    """A plain ``save`` would replace a certified file (a vault copy, a file a ledger's commit record
    names) or a read-only one; these are never replaced, whatever ``overwrite`` says."""
