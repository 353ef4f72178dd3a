"""Reading checkpoints certckpt did not write, so that they can be saved certified (``certckpt certify``).

Three sources: a ``torch.save`` file, read only through ``torch.load(weights_only=True)`` (torch's
restricted unpickler: tensors, containers and plain values, no arbitrary classes); a plain
safetensors file (its tensors under the same names, its ``__metadata__`` kept as certckpt metadata);
and a Hugging Face model directory, whose safetensors files are certified under their own names (so
``model.safetensors.index.json`` stays valid) and whose other files are copied as they are. Pickled
weight files inside a directory are refused: convert each with ``certckpt certify FILE DEST`` first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CheckpointNotFoundError, ConfigurationError, NotACheckpointError

from .header import sniff_foreign_format
from .record import RECORD_KEY

__all__ = ["Foreign", "DirectoryPlan", "read_foreign", "plan_directory"]

_PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(kw_only=True, slots=True)
class Foreign:
    """What was read from a source file: the object to save and the metadata worth keeping."""

    source: str
    kind: str  # "torch.save" | "safetensors"
    obj: Any
    metadata: dict[str, str] = field(default_factory=dict)


def _local(src: str) -> str:
    path = os.fspath(src)
    if "://" in path and not path.startswith("file://"):
        raise ConfigurationError(f"{path}: certify reads local files; copy it here first")
    path = path.removeprefix("file://")
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    return path


def read_foreign(src: str) -> Foreign:
    """Read a ``torch.save`` file (``weights_only=True`` only) or a plain safetensors file.

    Raises:
        NotACheckpointError: the file needs pickle to load (names what torch refused), is already
            certified, or is neither format.
    """
    path = _local(src)
    with open(path, "rb") as fh:
        prefix = fh.read(16)
    if sniff_foreign_format(prefix) is not None and not prefix.startswith(b"\x1f\x8b"):
        return _read_torch(path)
    return _read_safetensors(path)


def _read_torch(path: str) -> Foreign:
    import torch

    try:
        # torch's restricted unpickler: tensors, containers and plain values; it refuses any class
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError... by case
        text = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        if type(e).__name__ == "UnpicklingError":
            raise NotACheckpointError(
                f"{path}: loading it needs pickle beyond plain tensors and values ({text[:200]}); certckpt "
                "never unpickles: load it yourself where you trust the file, then certckpt.save the state"
            ) from None
        raise NotACheckpointError(
            f"{path}: not a readable torch.save file ({e.__class__.__name__}: {text[:200]})"
        ) from None
    return Foreign(source=path, kind="torch.save", obj=obj)


def _read_safetensors(path: str) -> Foreign:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            metadata = dict(f.metadata() or {})
            obj = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError, ValueError) as e:
        raise NotACheckpointError(f"{path}: neither a torch.save file nor a safetensors file ({e})") from None
    if RECORD_KEY in metadata:
        raise NotACheckpointError(f"{path}: already a certckpt checkpoint; `certckpt verify` it and copy it")
    return Foreign(source=path, kind="safetensors", obj=obj, metadata=metadata)


@dataclass(kw_only=True, slots=True)
class DirectoryPlan:
    """What certifying a model directory does: which files are certified, copied, or refused."""

    weights: list[str] = field(default_factory=list)  # relative paths of safetensors files
    copies: list[str] = field(default_factory=list)  # everything else (configs, tokenizers, indexes)
    refused: list[str] = field(default_factory=list)  # pickled weight files


def plan_directory(src: str) -> DirectoryPlan:
    """Sort a Hugging Face style model directory's files (hidden files and folders skipped)."""
    root = _local(src)
    plan = DirectoryPlan()
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(d, name), root)
            if name.endswith(".safetensors"):
                plan.weights.append(rel)
            elif name.endswith(_PICKLED):
                plan.refused.append(rel)
            else:
                plan.copies.append(rel)
    return plan
