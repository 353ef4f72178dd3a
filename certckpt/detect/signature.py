"""Gradient signatures for the replay audit, and how two of them are compared.

Deterministic mode: the 32-bit audit digest of each gradient (``digest.py``; bit-exact comparison:
a difference confined to one word always changes it, others collide with probability 2**-32).
Tolerance mode, for kernels that are not deterministic: per gradient its norm and a fixed random
projection of a strided sample, compared within a relative tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .digest import digests

__all__ = ["Probes", "signature", "matches"]

_PROBE_SAMPLES = 1024


class Probes:
    """Fixed random projections, one per parameter, built once from a seed (identical on every rank)."""

    def __init__(self, params: Sequence[torch.Tensor], *, seed: int = 0x5EED):
        self.index: list[torch.Tensor] = []
        self.weight: list[torch.Tensor] = []
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(seed + i)
            n = p.numel()
            stride = max(1, n // _PROBE_SAMPLES)
            idx = torch.arange(0, n, stride)[:_PROBE_SAMPLES]
            self.index.append(idx.to(p.device))
            self.weight.append(torch.randn(idx.numel(), generator=g, dtype=torch.float64).to(p.device))

    def subset(self, idx: Sequence[int]) -> Probes:
        """The probes of the parameters at these indices (a DDP bucket holds some, in its own order)."""
        sub = Probes([])
        sub.index = [self.index[i] for i in idx]
        sub.weight = [self.weight[i] for i in idx]
        return sub


def signature(grads: Sequence[torch.Tensor], *, mode: str, probes: Probes | None = None) -> torch.Tensor:
    """Per-gradient signature rows, stacked, on the gradients' device; no host synchronisation.

    Returns:
        deterministic: int64 ``[P]``; tolerance: float64 ``[P, 3]`` (norm, projection, projection scale).
    """
    if mode == "deterministic":
        return digests(grads)
    if probes is None:
        raise ValueError("signature(mode='tolerance') needs the parameters' probes")
    rows = []
    for g, idx, w in zip(grads, probes.index, probes.weight):
        flat = g.detach().reshape(-1).to(torch.float64)
        sample = flat[idx]
        rows.append(torch.stack([flat.norm(), (sample * w).sum(), sample.norm() * w.norm()]))
    return torch.stack(rows)


def matches(a: torch.Tensor, b: torch.Tensor, *, mode: str, rtol: float) -> list[bool]:
    """Per parameter: do two signatures agree? (Host tensors.)"""
    if mode == "deterministic":
        return (a == b).tolist()
    norm_ok = (a[:, 0] - b[:, 0]).abs() <= rtol * torch.maximum(a[:, 0].abs(), b[:, 0].abs()) + 1e-30
    scale = torch.maximum(a[:, 2], b[:, 2])
    proj_ok = (a[:, 1] - b[:, 1]).abs() <= rtol * scale + 1e-30
    finite = torch.isfinite(a).all(1) & torch.isfinite(b).all(1)
    return (norm_ok & proj_ok & finite).tolist()
