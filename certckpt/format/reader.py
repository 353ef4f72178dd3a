"""``certckpt.load``: a drop-in for ``torch.load`` that cannot execute code.

The header is validated before any allocation it sizes; each tensor is read straight into its own
freshly allocated memory and (by default) checked against its xxh3-128 digest before the object is
rebuilt. Nothing is unpickled, whatever the file holds.
"""

from __future__ import annotations

import os
import warnings
from typing import IO, Any, cast

import torch
import xxhash

from certckpt.errors import ConfigurationError, CorruptCheckpointError, UntrustedCheckpointError
from certckpt.storage import Target, open_read, resolve

from .datahash import BackgroundDigest, digest_name, hash_pieces
from .header import TensorEntry, gc_paused
from .record import check_header, signature_problem
from .signing import KEYS_FROM_ENV, TrustedKeys, trusted_keys_for
from .skeleton import check_map_location, rebuild
from .staging import read_to_device
from .tensors import ST_TO_TORCH, host_bytes
from .trustconfig import TrustConfig
from .verify import CheckpointInfo, digest_problem, fill_view, read_checkpoint_header

__all__ = ["load", "warn_ignored"]

_warned: set[str] = set()


def warn_ignored(names: list[str], *, function: str) -> None:
    """One warning per process and argument: torch's pickle options mean nothing to certckpt."""
    fresh = [n for n in names if n not in _warned]
    if fresh:
        _warned.update(fresh)
        warnings.warn(
            f"certckpt.{function}: {', '.join(fresh)} accepted for torch.{function} compatibility and ignored"
            " (certckpt never pickles)",
            UserWarning,
            stacklevel=3,
        )


def _mapped(storage: torch.UntypedStorage, info: CheckpointInfo, e: TensorEntry) -> torch.Tensor | None:
    """A tensor backed by the mapped file, or None when its offset is not a multiple of its element size."""
    dtype = ST_TO_TORCH[e.dtype]
    probe = torch.empty(0, dtype=dtype)
    start = info.header.data_start + e.begin
    if start % probe.element_size():
        return None
    stride, acc = [], 1
    for d in reversed(e.shape):
        stride.append(acc)
        acc *= d
    return probe.set_(storage, start // probe.element_size(), list(e.shape), stride[::-1])


def load(
    f: Any,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = True,
    mmap: bool | None = None,
    verify: bool = True,
    trusted_keys: TrustedKeys | str | os.PathLike[str] | None = KEYS_FROM_ENV,
    trust: TrustConfig | None = None,
    **pickle_load_args: Any,
) -> Any:
    """Load an object saved with ``certckpt.save``; ``torch.load``'s signature, without pickle.

    Args:
        f: a path, ``os.PathLike``, fsspec URL or readable binary file object.
        map_location: as in ``torch.load``: None (each tensor to the device it was saved from), a
            device string or ``torch.device``, a dict mapping saved to target device strings, or a
            callable ``fn(tensor, saved_location)`` called once per stored tensor with the tensor
            on the CPU; it returns the tensor moved, a storage (its device is used), or None (the
            saved device). numpy arrays always stay on the CPU.
        pickle_module: accepted for ``torch.load`` compatibility and ignored (with one warning).
        weights_only: accepted for ``torch.load`` compatibility; certckpt never unpickles, so it is
            always weights-only.
        mmap: map a local file instead of reading it: CPU tensors are backed by the file's pages
            (copy-on-write: changing a tensor never changes the file). With ``verify=True`` every
            digest is still checked here, by reading the mapped pages once (they stay file-backed, so
            the kernel may drop them again); ``verify=False`` skips that and leaves the check to
            ``certckpt.verify``. Bytes changed on disk after loading may show through. With trusted
            keys nothing is mapped: every tensor is read into memory the load owns and checked there
            (a keyed read never returns bytes it did not check), as with ``mmap=False``.
        verify: check the header digest and every tensor's xxh3-128 digest while reading (cheap:
            xxh3 runs at tens of GB/s). Device fingerprints are checked by ``verify(deep=True)``.
        trusted_keys: public keys (``TrustedKeys``, or key files ``PUB[,PUB...]``; default
            ``$CERTCKPT_TRUSTED_KEYS``; None: no keys); ``certckpt.verify`` takes the same forms. With
            keys, the file must be signed by one of them and every byte returned is checked against
            the signed digest of the data (BLAKE3, SHA-256 in older files), in the same pass, in
            memory the load owns (``mmap=True`` reads instead of mapping): xxh3 stops accidents, not
            someone who can write the file (docs/signing.md).
        trust: a ``TrustConfig`` whose keys stand where ``trusted_keys`` is left at its default.
        **pickle_load_args: ``torch.load``'s unpickler options (``encoding=``...): ignored, with one
            warning.

    Returns:
        The saved object: same containers, key types, values; shared tensors shared again.

    Raises:
        CorruptCheckpointError: truncated, malformed or tampered bytes (nothing is returned).
        UntrustedCheckpointError: with trusted keys, the file is unsigned or signed by another key.
        NotACheckpointError: a ``torch.save`` archive, a pickle or plain safetensors.
        ConfigurationError: ``mmap=True`` for something that is not a local file.
        CheckpointNotFoundError, StorageError

    Example:
        >>> state = certckpt.load("ckpt/step100.safetensors", "cpu")
        >>> model.load_state_dict(state["model"])
    """
    del weights_only  # always true: there is no pickle path to enable
    ignored = (["pickle_module"] if pickle_module is not None else []) + sorted(pickle_load_args)
    if ignored:
        warn_ignored(ignored, function="load")
    check_map_location(map_location)
    if trust is not None and trusted_keys == KEYS_FROM_ENV:
        trusted_keys = trust.trusted_keys
    keys = trusted_keys_for(trusted_keys)
    if keys is not None and not verify:
        raise ConfigurationError(
            "verify=False with trusted keys: a keyed load always verifies (pass trusted_keys=None)"
        )
    target = resolve(f)
    if mmap and target.local is None:
        raise ConfigurationError(
            f"{target.display}: mmap=True needs a local file path (not a URL or a file object); drop mmap"
        )
    # (no cyclic collection while 100,000 tensors and their containers are made)
    with open_read(target) as (fh, size), gc_paused():
        info = read_checkpoint_header(fh, size, target.display)
        signed = _check_header(info, keys, verify=verify, display=target.display)
        # The signed digest gets each 1 MiB piece as soon as it is read, and hashes it on one worker
        # thread while this one reads (and xxh3 hashes) the next: the piece is still in the shared
        # cache, and memory is read once.
        data_hash = BackgroundDigest(signed[0], threads=False) if signed is not None else None
        # a keyed load reads through the host (the GPU staging path checks xxh3 only)
        device = staging_device(map_location, mmap=bool(mmap)) if data_hash is None else None
        if device is not None:  # straight to the GPU through pinned buffers, every digest checked
            tensors = _read_to_device(fh, info, device, verify=verify, display=target.display)
            return _rebuild(info, tensors, map_location, target.display)
        # Keyed: never mapped. A mapped tensor is the file's page, so bytes written to the file after
        # this check would show through a keyed read; each tensor is read into memory of its own and
        # checked there instead (one read, the same cost as mmap=False).
        storage = _file_mapping(target, size, info) if mmap and keys is None else None
        try:
            tensors = _read_on_host(fh, info, storage, verify=verify, data_hash=data_hash, display=target.display)
        finally:
            found = data_hash.finish() if data_hash is not None else None  # nothing left hashing tensors
        if signed is not None and found != signed[1]:
            raise CorruptCheckpointError(
                f"{target.display}: the data's {digest_name(signed[0])} differs from the one signed: the tensors"
                " changed after signing (their xxh3 digests were forged or collide); restore the file from a good copy"
            )
        return _rebuild(info, tensors, map_location, target.display)


def _check_header(
    info: CheckpointInfo, keys: TrustedKeys | None, *, verify: bool, display: str
) -> tuple[str, str] | None:
    """Refuse a header that changed or (with keys) is not signed by one of them; returns the signed
    ``(digest field, data digest)`` the data must still match, or None without keys."""
    if verify:
        problem = check_header(info.header, info.record)
        if problem:
            raise CorruptCheckpointError(f"{display}: {problem}")
    if keys is None:
        return None
    problem, signed = signature_problem(info.header, keys)
    if problem:
        raise UntrustedCheckpointError(f"{display}: {problem}; not loaded")
    return signed


def _read_to_device(
    fh: IO[bytes], info: CheckpointInfo, device: torch.device, *, verify: bool, display: str
) -> dict[str, torch.Tensor]:
    expected = {e.name: info.record.tensors[e.name]["xxh3"] for e in info.header.entries} if verify else None
    return read_to_device(fh, info.header.entries, device, expected=expected, source=display)


def _file_mapping(target: Target, size: int | None, info: CheckpointInfo) -> torch.UntypedStorage | None:
    """The local file mapped copy-on-write (None when it holds no data to map)."""
    if target.local is None or not info.header.data_length:  # (load refused mmap for anything but a local file)
        return None
    # torch's stub types from_file as returning either storage kind; UntypedStorage's makes an untyped one
    return cast(torch.UntypedStorage, torch.UntypedStorage.from_file(os.path.abspath(target.local), False, size))


class _Feed:
    """Pieces of one tensor for the data region's background digest: ``update`` queues a piece and
    keeps the tensor that owns its memory alive until it is hashed."""

    __slots__ = ("digest", "owner")

    def __init__(self, digest: BackgroundDigest, owner: torch.Tensor) -> None:
        self.digest, self.owner = digest, owner

    def update(self, piece: memoryview) -> None:
        self.digest.update(piece, keep=self.owner)


def _read_on_host(
    fh: IO[bytes],
    info: CheckpointInfo,
    storage: torch.UntypedStorage | None,
    *,
    verify: bool,
    data_hash: BackgroundDigest | None,
    display: str,
) -> dict[str, torch.Tensor]:
    """Every tensor in host memory (backed by ``storage``, the mapped file, where it can be), each
    checked against its digest when ``verify`` and its pieces fed to ``data_hash`` (the whole data
    region's digest: entries come in file order) when given."""
    tensors: dict[str, torch.Tensor] = {}
    for e in info.header.entries:
        x = xxhash.xxh3_128() if verify else None
        t = _mapped(storage, info, e) if storage is not None else None
        mapped = t is not None
        if t is None:
            if storage is not None:
                fh.seek(info.header.data_start + e.begin)
            t = torch.empty(e.shape, dtype=ST_TO_TORCH[e.dtype])
        view = host_bytes(t)
        hashes = tuple(h for h in (x, _Feed(data_hash, t) if data_hash is not None else None) if h is not None)
        if mapped:
            hash_pieces(view, *hashes)
        else:
            fill_view(fh, view, e, display, hashes=hashes)
        del view
        if x is not None:
            expected = info.record.tensors[e.name]["xxh3"]
            if x.hexdigest() != expected:
                raise CorruptCheckpointError(f"{display}: {digest_problem(e, expected, x.hexdigest())}")
        tensors[e.name] = t
    return tensors


def staging_device(map_location: Any, *, mmap: bool) -> torch.device | None:
    """The CUDA device every tensor goes to when ``map_location`` names one (str or torch.device) and
    the file is read rather than mapped: those loads take ``staging.read_to_device``."""
    if mmap or not isinstance(map_location, (str, torch.device)):
        return None
    device = torch.device(map_location)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None  # (a missing device gets the regular path's DeviceUnavailableError)
    return device if device.index is None or device.index < torch.cuda.device_count() else None


def _rebuild(info: CheckpointInfo, tensors: dict[str, torch.Tensor], map_location: Any, display: str) -> Any:
    try:
        return rebuild(info.record.skeleton, tensors, map_location=map_location)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{display}: {e}") from e
