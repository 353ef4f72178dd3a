"""The certckpt release certificate: an in-toto statement in a DSSE envelope, signed with ECDSA.

The statement's subjects are the released files with their SHA-256 (the digests the OpenSSF
``model_signing`` signature lists too); its predicate (``PREDICATE_TYPE``) says what certckpt knows
about those bytes: the verdict and its reasons, the lineage, the audit coverage, the consensus
fingerprint, the ledger position it was read at, and the model signature it travels with. The
envelope follows DSSE v1 (pre-authentication encoding ``PAE``), signed with the same elliptic-curve
key as the model signature (P-256, P-384 or P-521: the keys ``model_signing``'s key-based method
accepts), so one public key checks both.

Pure except for ``sign_envelope``/``open_envelope``, which only compute signatures.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from certckpt.errors import ConfigurationError, MissingDependencyError, ReleaseVerificationError
from certckpt.format.signing import write_key_pair

__all__ = [
    "PREDICATE_TYPE",
    "STATEMENT_TYPE",
    "PAYLOAD_TYPE",
    "CERTIFICATE_NAME",
    "SIGNATURE_NAME",
    "pae",
    "key_hint",
    "generate_release_key",
    "load_private_key",
    "load_public_key",
    "sign_envelope",
    "open_envelope",
    "statement",
    "check_statement",
]

PREDICATE_TYPE = "https://certckpt.dev/release-certificate/v1"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
CERTIFICATE_NAME = "certckpt-certificate.dsse.json"  # beside the model files; not one of them
SIGNATURE_NAME = "model.sig"  # the model_signing bundle
_CURVES = ("secp256r1", "secp384r1", "secp521r1")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature covers."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def _crypto() -> tuple[Any, Any, Any, type[Exception]]:
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as e:
        hint = "pip install 'certckpt[release]'"
        raise MissingDependencyError(f"releases need the cryptography package: {hint} ({e})") from e
    return ec, hashes, serialization, InvalidSignature


def _hash_for(key: Any) -> Any:
    _, hashes, _, _ = _crypto()
    return {256: hashes.SHA256(), 384: hashes.SHA384(), 521: hashes.SHA512()}[key.curve.key_size]


def _checked_curve(key: Any, what: str) -> Any:
    ec, _, _, _ = _crypto()
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    if not isinstance(public, ec.EllipticCurvePublicKey) or public.curve.name not in _CURVES:
        kind = getattr(getattr(public, "curve", None), "name", type(public).__name__)
        raise ConfigurationError(
            f"{what}: a {kind} key; a release is signed with an elliptic-curve key (P-256, P-384 or P-521, PEM),"
            " the kind OpenSSF model_signing verifies: `certckpt keygen --release PATH` writes one"
        )
    return key


def generate_release_key(path: str) -> tuple[str, str]:
    """A new ECDSA P-256 key pair for releases: ``path`` (PKCS#8 PEM, mode 0600) and ``path.pub``."""
    ec, _, serialization, _ = _crypto()
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return write_key_pair(path, private=private, public=public)


def load_private_key(path: str) -> Any:
    """The PEM private key at ``path`` (unencrypted), checked to be one model_signing accepts.

    Raises:
        ConfigurationError: unreadable, encrypted, or not a P-256/P-384/P-521 key.
    """
    _, _, serialization, _ = _crypto()
    try:
        with open(path, "rb") as f:
            key = serialization.load_pem_private_key(f.read(), None)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigurationError(f"{path}: not a readable unencrypted PEM private key ({e})") from e
    return _checked_curve(key, path)


def load_public_key(path: str) -> Any:
    """The PEM public key at ``path``, checked like ``load_private_key``."""
    _, _, serialization, _ = _crypto()
    try:
        with open(path, "rb") as f:
            key = serialization.load_pem_public_key(f.read())
    except (OSError, ValueError, TypeError) as e:
        raise ConfigurationError(f"{path}: not a readable PEM public key ({e})") from e
    return _checked_curve(key, path)


def key_hint(public_key: Any) -> str:
    """SHA-256 of the public key's PEM (SubjectPublicKeyInfo): the key id both signatures carry."""
    _, _, serialization, _ = _crypto()
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def sign_envelope(doc: Mapping[str, Any], private_key: Any) -> dict[str, Any]:
    """``doc`` (an in-toto statement) in a DSSE envelope signed with ``private_key``."""
    ec, _, _, _ = _crypto()
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8")
    sig = private_key.sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(_hash_for(private_key.public_key())))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": key_hint(private_key.public_key()), "sig": base64.b64encode(sig).decode("ascii")}],
    }


def open_envelope(envelope: object, public_key: Any) -> dict[str, Any]:
    """The statement inside a DSSE envelope whose signature ``public_key`` verifies.

    Raises:
        ReleaseVerificationError: malformed, or not signed by this key.
    """
    ec, _, _, invalid = _crypto()
    if not isinstance(envelope, dict) or envelope.get("payloadType") != PAYLOAD_TYPE:
        raise ReleaseVerificationError(f"certificate: not a DSSE envelope of an in-toto statement ({PAYLOAD_TYPE})")
    sigs = envelope.get("signatures")
    try:
        payload = base64.b64decode(str(envelope.get("payload")), validate=True)
        raw = [base64.b64decode(str(s.get("sig")), validate=True) for s in sigs] if isinstance(sigs, list) else []
    except (binascii.Error, AttributeError) as e:
        raise ReleaseVerificationError(f"certificate: unreadable envelope ({e})") from e
    for sig in raw:
        try:
            public_key.verify(sig, pae(PAYLOAD_TYPE, payload), ec.ECDSA(_hash_for(public_key)))
        except invalid:
            continue
        try:
            doc = json.loads(payload)
        except ValueError as e:
            raise ReleaseVerificationError(f"certificate: signed payload is not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise ReleaseVerificationError("certificate: signed payload is not an in-toto statement")
        return doc
    raise ReleaseVerificationError(
        f"certificate: not signed by the trusted key {key_hint(public_key)[:16]}"
        " (signed by another key, or changed after signing)"
    )


def statement(*, files: Mapping[str, str], predicate: Mapping[str, Any]) -> dict[str, Any]:
    """The in-toto statement: one subject per released file (name -> SHA-256 hex), the predicate."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": n, "digest": {"sha256": d}} for n, d in sorted(files.items())],
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(predicate),
    }


def check_statement(
    doc: Mapping[str, Any], *, files: Mapping[str, str], signature_sha256: str, accept_rank: Mapping[str, int]
) -> dict[str, Any]:
    """Check a verified statement against the release it sits in; returns its predicate.

    Args:
        files: the release's model files as found now (name -> SHA-256).
        signature_sha256: SHA-256 of the model signature file found now.
        accept_rank: verdict levels taken (``{"trusted": 2}``, or with ``"verified": 1``).

    Raises:
        ReleaseVerificationError: another statement type, other files, another model signature, or
            a verdict below what is accepted.
    """
    if doc.get("_type") != STATEMENT_TYPE or doc.get("predicateType") != PREDICATE_TYPE:
        raise ReleaseVerificationError(
            f"certificate: predicate type {str(doc.get('predicateType'))[:80]!r}, expected {PREDICATE_TYPE}"
        )
    subjects = doc.get("subject")
    named: dict[str, object] = {}
    if isinstance(subjects, list):
        named = {str(s.get("name")): (s.get("digest") or {}).get("sha256") for s in subjects if isinstance(s, dict)}
    if named != dict(files):
        other = sorted(set(named) ^ set(files)) or sorted(n for n in files if named.get(n) != files[n])
        raise ReleaseVerificationError(
            f"certificate: its files differ from this release's ({', '.join(other[:3])}): a certificate of another"
            " release, or files changed"
        )
    predicate = doc.get("predicate")
    if not isinstance(predicate, dict):
        raise ReleaseVerificationError("certificate: no predicate")
    ms = predicate.get("model_signature")
    if not isinstance(ms, dict) or ms.get("sha256") != signature_sha256:
        raise ReleaseVerificationError(
            f"certificate: made for another model signature than this release's {SIGNATURE_NAME}"
            " (a certificate of another release)"
        )
    verdict = predicate.get("verdict")
    level = verdict.get("level") if isinstance(verdict, dict) else None
    if not isinstance(level, str) or level not in accept_rank:
        accepted = " or ".join(sorted(accept_rank))
        raise ReleaseVerificationError(
            f"certificate: the checkpoint's verdict is {level!r}, not {accepted}"
            + (" (no audit evidence: `--accept verified` takes it)" if level == "verified" else "")
        )
    return predicate
