"""Consolidated fp32 weights from a certified ZeRO checkpoint: what DeepSpeed's ``zero_to_fp32.py``
does for its pickles, for certified files, written as one certified safetensors file.

ZeRO keeps the fp32 master weights in the optimizer files, partitioned across the data-parallel
ranks: ZeRO-1/2 as one flat buffer per parameter group cut into equal consecutive pieces (rank order;
parameters may be followed by alignment padding), ZeRO-3 parameter by parameter (each padded to a
multiple of the world size and split evenly). The parameter names and shapes come from the model
states file (``param_shapes``), the buffers from its ``module`` (kept whole there). Every file is
read through ``certckpt.load`` after the tag directory verified whole; nothing is unpickled.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from certckpt.errors import CorruptCheckpointError, UnsupportedObjectError
from certckpt.format.reader import load
from certckpt.format.verify import inspect
from certckpt.format.writer import SaveResult, save_certified

from .codecs import register_deepspeed_types
from .layout import manifest_of, require_intact

__all__ = ["fp32_state_dict", "export_fp32"]

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def _files(directory: str) -> tuple[str, list[str], int]:
    """(model states file, optimizer files in rank order, ZeRO stage)."""
    names = os.listdir(directory)
    optim = sorted((int(m.group(1)), n) for n in names if (m := _OPTIM.match(n)))
    if not optim or [r for r, _ in optim] != list(range(len(optim))):
        raise CorruptCheckpointError(
            f"{directory}: the ZeRO optimizer files are not ranks 0..N-1: {[n for _, n in optim]}"
        )
    if "mp_rank_00_model_states.pt" in names:
        return os.path.join(directory, "mp_rank_00_model_states.pt"), [os.path.join(directory, n) for _, n in optim], 2
    model3 = sorted((int(m.group(1)), n) for n in names if (m := _MODEL3.match(n)))
    if not model3:
        raise CorruptCheckpointError(f"{directory}: no model states file")
    return os.path.join(directory, model3[0][1]), [os.path.join(directory, n) for _, n in optim], 3


def _numel(shape: Any) -> int:
    return int(math.prod(int(d) for d in shape))


def fp32_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights (and buffers) of a certified ZeRO-1/2/3 tag directory, on the CPU.

    Raises:
        CorruptCheckpointError: the directory does not verify, or its partitions do not add up.
        UnsupportedObjectError: frozen parameters (not consolidated here).

    Example:
        >>> weights = fp32_state_dict("ckpt/step10"); model.load_state_dict(weights)
    """
    register_deepspeed_types()
    directory = os.fspath(directory)
    require_intact(directory)
    model_file, optim_files, family = _files(directory)
    model = load(model_file, map_location="cpu")
    if model.get("frozen_param_shapes"):
        raise UnsupportedObjectError(f"{directory}: frozen parameters are not consolidated by export_fp32 yet")
    optims = [load(p, map_location="cpu")["optimizer_state_dict"] for p in optim_files]
    world = len(optims)
    key = "single_partition_of_fp32_groups" if family == 2 else "fp32_flat_groups"
    out: dict[str, torch.Tensor] = {}
    for g, shapes in enumerate(model["param_shapes"]):
        pieces = [o[key][g].reshape(-1) for o in optims]
        if family == 2:
            paddings = optims[0].get("param_alignment_paddings")
            _unflatten_zero2(out, torch.cat(pieces), shapes, paddings[g] if paddings else None, where=directory)
        else:
            _unflatten_zero3(out, pieces, shapes, world, where=directory)
    for name in model.get("buffer_names") or []:
        out[name] = model["module"][name]
    for dst, src in model.get("shared_params") or {}:
        out[dst] = out[src]
    return out


def _unflatten_zero2(
    out: dict[str, torch.Tensor], flat: torch.Tensor, shapes: dict[str, Any], paddings: list[int] | None, *, where: str
) -> None:
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        if offset + n > flat.numel():
            raise CorruptCheckpointError(f"{where}: `{name}` runs past its group's fp32 partitions")
        out[name] = flat.narrow(0, offset, n).view(*[int(d) for d in shape]).clone()
        offset += n + (int(paddings[i]) if paddings else 0)


def _unflatten_zero3(
    out: dict[str, torch.Tensor], pieces: list[torch.Tensor], shapes: dict[str, Any], world: int, *, where: str
) -> None:
    offset = 0
    for name, shape in shapes.items():
        n = _numel(shape)
        part = math.ceil(n / world)
        if any(offset + part > p.numel() for p in pieces):
            raise CorruptCheckpointError(f"{where}: `{name}` runs past a rank's fp32 partition")
        full = torch.cat([p.narrow(0, offset, part) for p in pieces]).narrow(0, 0, n)
        out[name] = full.view(*[int(d) for d in shape]).clone()
        offset += part


def export_fp32(directory: str, path: str, *, overwrite: bool = False) -> SaveResult:
    """Write the consolidated fp32 weights of a certified ZeRO tag directory as one certified
    safetensors file (``safetensors.torch.load_file(path)`` and ``certckpt.load`` read it), carrying
    the checkpoint's run, branch and step in its record.

    Example:
        >>> export_fp32("ckpt/step10", "model-fp32.safetensors")
    """
    weights = fp32_state_dict(directory)
    manifest, _, step = manifest_of(os.fspath(directory))
    record = inspect(manifest).record
    return save_certified(
        weights, os.fspath(path), step=step, run=record.run, branch=record.branch, overwrite=overwrite
    )
