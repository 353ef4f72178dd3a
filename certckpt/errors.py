"""One shallow exception tree.

Every error certckpt raises derives from :class:`CertckptError` and also from the built-in
exception a caller would naturally catch (``ValueError`` for bad bytes, ``FileExistsError`` for a
refused overwrite, ...), so ``except CertckptError`` and ``except ValueError`` both work.
"""

from __future__ import annotations

__all__ = [
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


class CertckptError(Exception):
    """Root of every error certckpt raises on purpose."""


class CorruptCheckpointError(CertckptError, ValueError):
    """The file claims to be a certckpt checkpoint but its bytes do not verify.

    Raised for truncated files, malformed or hostile headers, digest and fingerprint mismatches.
    """


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


class MissingDependencyError(CertckptError, ImportError):
    """An optional backend is not installed; the message names the pip command that fixes it."""


class DeviceUnavailableError(CertckptError, RuntimeError):
    """A tensor was saved on a device this process does not have; pass ``map_location``."""


class UntrustedCheckpointError(CertckptError, ValueError):
    """An operation that needs a trusted checkpoint (promotion to the vault) was given a suspect one."""
