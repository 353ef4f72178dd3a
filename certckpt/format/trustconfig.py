"""One trust configuration for every reader: which keys count, whether files may be mapped, and where a
reader keeps its memory of the stores it verified.

Library calls (``load``, ``verify``, ``certify_store``, ``find_latest_good``, ``Ledger``, ``Fleet``,
the vault's ``promote`` and ``prune``) take ``trust=TrustConfig(...)``. Without it they use
``TrustConfig.from_env()``: the one place certckpt reads ``$CERTCKPT_TRUSTED_KEYS``,
``$CERTCKPT_NO_MMAP`` and ``$CERTCKPT_STATE_DIR`` (the CLI sets them from its flags and reads them
through here too)::

    from certckpt import TrustConfig, find_latest_good
    trust = TrustConfig(trusted_keys=TrustedKeys.load(["writer.pub"]), state_dir="/var/lib/certckpt")
    status, ckpt = find_latest_good("s3://runs/r1", trust=trust)

No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from certckpt.errors import ConfigurationError

from .signing import TrustedKeys, trusted_keys_for, trusted_keys_from_env

__all__ = [
    "NO_MMAP_ENV",
    "STATE_ENV",
    "TrustConfig",
    "default_state_dir",
    "mmap_from_env",
    "state_dir_from_env",
    "trust_config_for",
]

STATE_ENV = "CERTCKPT_STATE_DIR"
NO_MMAP_ENV = "CERTCKPT_NO_MMAP"


def default_state_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "certckpt", "ledgers")


def mmap_from_env() -> bool:
    """``$CERTCKPT_NO_MMAP``: map files unless it is set to anything but ``0``."""
    return os.environ.get(NO_MMAP_ENV, "").strip() in ("", "0")


def state_dir_from_env() -> str | None:
    return os.environ.get(STATE_ENV) or None


@dataclass(frozen=True, kw_only=True, slots=True)
class TrustConfig:
    """What a reader trusts and how it reads.

    Attributes:
        trusted_keys: public keys whose signatures count; None: no keys (nothing is authenticated,
            every record counts as written, docs/signing.md). With keys, an unchained or re-created
            store is a break, never an "old" one.
        mmap: a keyed verify of a local file may hash it through a read-only map (fast); False reads
            it piece by piece (network mounts, where an I/O error under a map ends the process).
        state_dir: where this reader keeps the chain heads and store identities it verified (the
            rollback check); None: ``~/.cache/certckpt/ledgers``.
    """

    trusted_keys: TrustedKeys | None = None
    mmap: bool = True
    state_dir: str | None = None

    def __post_init__(self) -> None:
        if self.trusted_keys is not None and not isinstance(self.trusted_keys, TrustedKeys):
            raise ConfigurationError(
                f"TrustConfig.trusted_keys must be TrustedKeys or None, got {type(self.trusted_keys).__name__} "
                "(load key files with TrustedKeys.load or TrustConfig.with_keys)"
            )

    @classmethod
    def from_env(cls) -> TrustConfig:
        """The environment's configuration: ``$CERTCKPT_TRUSTED_KEYS`` (``PUB[,PUB...]``),
        ``$CERTCKPT_NO_MMAP=1`` and ``$CERTCKPT_STATE_DIR``.

        Raises:
            ConfigurationError: ``$CERTCKPT_TRUSTED_KEYS`` is set but names no readable key.
        """
        return cls(
            trusted_keys=trusted_keys_from_env(),
            mmap=mmap_from_env(),
            state_dir=state_dir_from_env(),
        )

    def with_keys(self, keys: TrustedKeys | str | os.PathLike[str] | None) -> TrustConfig:
        """This configuration with other trusted keys (any form ``load`` and ``verify`` take)."""
        return replace(self, trusted_keys=trusted_keys_for(keys))

    @property
    def memory_dir(self) -> str:
        """Where this reader's memory lives."""
        return self.state_dir or default_state_dir()


def trust_config_for(value: TrustConfig | None) -> TrustConfig:
    """A call's ``trust=`` argument: the configuration given, else the environment's (read here)."""
    if value is None:
        return TrustConfig.from_env()
    if not isinstance(value, TrustConfig):
        raise ConfigurationError(f"trust must be a TrustConfig or None, got {type(value).__name__}")
    return value
