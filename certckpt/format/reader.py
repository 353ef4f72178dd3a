"""``certckpt.load``: a drop-in for ``torch.load`` that cannot execute code.

The header is validated before any allocation it sizes; each tensor is read straight into its own
freshly allocated memory and (by default) checked against its xxh3-128 digest before the object is
rebuilt. Nothing is unpickled, whatever the file holds.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from certckpt.errors import CorruptCheckpointError

from .record import check_header
from .skeleton import check_map_location, rebuild
from .storage import open_read, resolve
from .verify import digest_problem, read_checkpoint_header, read_tensor

__all__ = ["load"]


def load(f: Any, *, map_location: Any = None, verify: bool = True, weights_only: bool = True) -> Any:
    """Load an object saved with ``certckpt.save``.

    Args:
        f: a path, ``os.PathLike``, fsspec URL or readable binary file object.
        map_location: as in ``torch.load``: None (each tensor to the device it was saved from),
            a device string or ``torch.device``, or a dict mapping saved to target device strings.
        verify: check the header digest and every tensor's xxh3-128 digest while reading (cheap:
            xxh3 runs at tens of GB/s). Device fingerprints are checked by ``verify(deep=True)``.
        weights_only: accepted for ``torch.load`` compatibility; certckpt never unpickles, so it is
            always weights-only.

    Returns:
        The saved object: same containers, key types, values; shared tensors shared again.

    Raises:
        CorruptCheckpointError: truncated, malformed or tampered bytes (nothing is returned).
        NotACheckpointError: a ``torch.save`` archive, a pickle or plain safetensors.
        CheckpointNotFoundError, StorageError

    Example:
        >>> state = certckpt.load("ckpt/step100.safetensors", map_location="cpu")
        >>> model.load_state_dict(state["model"])
    """
    del weights_only  # always true: there is no pickle path to enable
    check_map_location(map_location)
    target = resolve(f)
    with open_read(target) as (fh, size):
        info = read_checkpoint_header(fh, size, target.display)
        if verify:
            problem = check_header(info.header, info.record)
            if problem:
                raise CorruptCheckpointError(f"{target.display}: {problem}")
        tensors: dict[str, torch.Tensor] = {}
        for e in info.header.entries:
            t, view = read_tensor(fh, e, target.display)
            if verify:
                expected = info.record.tensors[e.name]["xxh3"]
                found = xxhash.xxh3_128_hexdigest(view)
                if found != expected:
                    raise CorruptCheckpointError(f"{target.display}: {digest_problem(e, expected, found)}")
            del view
            tensors[e.name] = t
    try:
        return rebuild(info.record.skeleton, tensors, map_location=map_location)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{target.display}: {e}") from e
