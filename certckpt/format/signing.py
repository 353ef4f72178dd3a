"""Ed25519 signatures over ledger records and checkpoint files, so that write access to a store is not
enough to forge trust.

Without keys, anyone who can write the store can write records (and recompute unkeyed digests). With
a signing key, every record a writer puts in the ledger carries ``"sig": {"key": KEY_ID, "ed25519":
BASE64}`` over the record's canonical bytes (``signed_bytes``: the record without ``sig``, as sorted,
compact, ASCII JSON). A reader given trusted public keys drops every record that could move a verdict
toward trusted unless a trusted key signed it (``certckpt.trust.ledger`` decides which kinds those
are); records that can only count against trust are kept, signed or not.

A checkpoint file is signed in its header (``docs/format.md``, "Signed files"); the byte rules live in
``certckpt.format.record``, the keys here. This module sits in the format layer so ``certckpt verify
--trusted-keys`` needs nothing above it.

Keys: ``generate_key(path)`` writes the private key (PEM, mode 0600) and ``path.pub`` (PEM). The
environment variables ``CERTCKPT_SIGNING_KEY`` (a private key file) and ``CERTCKPT_TRUSTED_KEYS``
(public key files, separated by ``,`` or ``os.pathsep``) configure every ledger without code changes.

Needs the ``cryptography`` package (``pip install 'certckpt[sign]'``), imported only when keys are used.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from certckpt.errors import ConfigurationError, MissingDependencyError

__all__ = [
    "SIGNING_KEY_ENV",
    "TRUSTED_KEYS_ENV",
    "SigningKey",
    "TrustedKeys",
    "generate_key",
    "write_key_pair",
    "signed_bytes",
    "signing_key_for",
    "signing_key_from_env",
    "trusted_keys_from_env",
    "trusted_keys_from_spec",
    "trusted_keys_for",
    "KEYS_FROM_ENV",
]

SIGNING_KEY_ENV = "CERTCKPT_SIGNING_KEY"
TRUSTED_KEYS_ENV = "CERTCKPT_TRUSTED_KEYS"


def _crypto() -> tuple[ModuleType, ModuleType, type[Exception]]:
    """cryptography's ``ed25519`` and ``serialization`` modules and its ``InvalidSignature``."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise MissingDependencyError(
            f"signatures need the cryptography package: pip install 'certckpt[sign]' ({e})"
        ) from e
    return ed25519, serialization, InvalidSignature


def signed_bytes(doc: Mapping[str, Any]) -> bytes:
    """The bytes a record's signature covers: the record without ``sig``, canonical JSON."""
    body = {k: v for k, v in doc.items() if k != "sig"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _key_id(raw_public: bytes) -> str:
    import hashlib  # OpenSSL costs ~3 ms to load: only where keys are used, off `certckpt verify`'s light path

    return hashlib.sha256(raw_public).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A private Ed25519 key and its id (the first 16 hex digits of SHA-256 of the raw public key)."""

    key_id: str
    _private: Any

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SigningKey:
        ed25519, serialization, _ = _crypto()
        try:
            with open(path, "rb") as fh:
                key = serialization.load_pem_private_key(fh.read(), password=None)
        except (OSError, ValueError, TypeError) as e:
            raise ConfigurationError(f"{os.fspath(path)}: not a readable Ed25519 private key ({e})") from e
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigurationError(f"{os.fspath(path)}: not an Ed25519 private key")
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key_id=_key_id(raw), _private=key)

    def sign_bytes(self, data: bytes) -> str:
        """The base64 Ed25519 signature of ``data`` (88 characters)."""
        return base64.b64encode(self._private.sign(data)).decode("ascii")

    def sign(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of the record with its signature."""
        sig = self.sign_bytes(signed_bytes(doc))
        return {**{k: v for k, v in doc.items() if k != "sig"}, "sig": {"key": self.key_id, "ed25519": sig}}

    def trusted(self) -> TrustedKeys:
        """This key's public half, as the only trusted key (a writer given no trusted keys trusts itself)."""
        return TrustedKeys(keys={self.key_id: self._private.public_key()})


@dataclass(frozen=True, slots=True)
class TrustedKeys:
    """Public keys whose signatures count, by key id."""

    keys: Mapping[str, Any]

    @classmethod
    def load(cls, paths: Iterable[str | os.PathLike[str]]) -> TrustedKeys:
        ed25519, serialization, _ = _crypto()
        keys = {}
        for path in paths:
            try:
                with open(path, "rb") as fh:
                    key = serialization.load_pem_public_key(fh.read())
            except (OSError, ValueError, TypeError) as e:
                raise ConfigurationError(f"{os.fspath(path)}: not a readable Ed25519 public key ({e})") from e
            if not isinstance(key, ed25519.Ed25519PublicKey):
                raise ConfigurationError(f"{os.fspath(path)}: not an Ed25519 public key")
            raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            keys[_key_id(raw)] = key
        if not keys:
            raise ConfigurationError("no trusted public key given")
        return cls(keys=keys)

    def problem(self, doc: Mapping[str, Any]) -> str | None:
        """Why the record's signature does not count (None when a trusted key signed these bytes)."""
        sig = doc.get("sig")
        if not isinstance(sig, dict):
            return "unsigned"
        return self.bytes_problem(sig, signed_bytes(doc), what="the record")

    def bytes_problem(self, sig: Mapping[str, Any], data: bytes, *, what: str) -> str | None:
        """Why ``sig`` (``{"key": KEY_ID, "ed25519": BASE64}``) is not a trusted signature of ``data``."""
        _, _, invalid_signature = _crypto()
        key_id = sig.get("key")
        key = self.keys.get(key_id) if isinstance(key_id, str) else None
        if key is None:
            return f"signed by key {str(sig.get('key'))[:32]!r}, which is not trusted"
        text = str(sig.get("ed25519"))
        try:
            raw = base64.b64decode(text, validate=True)
            if base64.b64encode(raw).decode("ascii") != text:  # padding bits are not free: one text per signature
                raise ValueError("non-canonical base64")
            key.verify(raw, data)
        except (invalid_signature, ValueError):
            return f"bad signature (key {sig['key']}): {what} changed after it was signed"
        return None


def generate_key(path: str | os.PathLike[str]) -> tuple[str, str]:
    """Write a new private key to ``path`` (mode 0600, never replacing a file; a missing directory is
    created with mode 0700) and its public key to ``path.pub``; returns ``(private path, public path)``."""
    ed25519, serialization, _ = _crypto()
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return write_key_pair(path, private=private, public=public)


def write_key_pair(path: str | os.PathLike[str], *, private: bytes, public: bytes) -> tuple[str, str]:
    """Write a PEM key pair as ``generate_key`` does (any key type: a release's is elliptic-curve)."""
    path = os.fspath(path)
    pub = path + ".pub"
    for p in (path, pub):
        if os.path.exists(p):
            raise ConfigurationError(f"{p} exists; keys are never replaced (choose another path)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700)  # a new directory for a private key: its owner's only
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)
    with open(pub, "xb") as fh:
        fh.write(public)
    return path, pub


def signing_key_from_env() -> SigningKey | None:
    path = os.environ.get(SIGNING_KEY_ENV)
    return SigningKey.load(path) if path else None


def signing_key_for(value: SigningKey | str | os.PathLike[str] | None) -> SigningKey | None:
    """A writer's ``signing_key=`` argument: a key, a private key file, or None for the environment's."""
    if value is None:
        return signing_key_from_env()
    if isinstance(value, SigningKey):
        return value
    if isinstance(value, (str, os.PathLike)):
        return SigningKey.load(value)
    raise ConfigurationError(f"signing_key must be a SigningKey or a private key file, got {type(value).__name__}")


def trusted_keys_from_spec(spec: str) -> TrustedKeys | None:
    """Public key files named in ``spec``, separated by ``,`` or ``os.pathsep`` (None when empty).

    Raises:
        ConfigurationError: ``spec`` is not empty but names no file (``","``): keys were asked for,
            and switching every check off instead would be the worst reading of a typo.
    """
    paths = [p.strip() for chunk in spec.split(",") for p in chunk.split(os.pathsep) if p.strip()]
    if not paths and spec.strip():
        raise ConfigurationError(
            f"trusted keys {spec!r} name no public key file; give PUB[,PUB...] (or unset {TRUSTED_KEYS_ENV})"
        )
    return TrustedKeys.load(paths) if paths else None


def trusted_keys_from_env() -> TrustedKeys | None:
    return trusted_keys_from_spec(os.environ.get(TRUSTED_KEYS_ENV, ""))


KEYS_FROM_ENV = "from-env"  # a reader's default: the trusted keys of $CERTCKPT_TRUSTED_KEYS, if any


def trusted_keys_for(value: TrustedKeys | str | os.PathLike[str] | None) -> TrustedKeys | None:
    """A reader's ``trusted_keys=`` argument: keys, public key files (``PUB[,PUB...]``), None for no
    keys, or ``KEYS_FROM_ENV`` (the default) for the environment's."""
    if value == KEYS_FROM_ENV:
        return trusted_keys_from_env()
    if value is None or isinstance(value, TrustedKeys):
        return value
    if isinstance(value, (str, os.PathLike)):
        keys = trusted_keys_from_spec(os.fspath(value))
        if keys is None:
            raise ConfigurationError("trusted_keys names no public key file; give PUB[,PUB...] or None")
        return keys
    raise ConfigurationError(f"trusted_keys must be TrustedKeys, public key files or None, got {type(value).__name__}")
