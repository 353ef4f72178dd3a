"""Whether PyTorch Lightning is installed, asked without importing it (the package's first check)."""

from __future__ import annotations

import importlib.util

__all__ = ["installed", "lightning_installed"]


def installed(name: str) -> bool:
    """Whether module ``name`` can be found (a missing or broken parent package: False)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def lightning_installed() -> bool:
    """``lightning.pytorch`` or ``pytorch_lightning``."""
    return installed("lightning.pytorch") or installed("pytorch_lightning")
