"""Megatron's common state (what is not a ShardedTensor or ShardedObject), certified instead of pickled.

``dist_checkpointing.save`` hands the common state to the registered common strategy (backend
``torch``) before the sharded strategy runs, and refuses any other common strategy as an argument;
``dist_checkpointing.load`` reads it through the common strategy registered for the backend
``metadata.json`` names (``torch``, always). So certckpt registers, under ``torch``:

- ``CommonSaveStrategy``: Megatron's own (``common.pt``, so a plain save is unchanged), which also
  keeps the state it was handed for the directory; ``CertifiedSaveStrategy`` then writes that state
  certified (``common.safetensors``) and deletes the ``common.pt`` just written, unread;
- ``CommonLoadStrategy``: for a directory with a certified manifest, the certified common state
  (checked against the manifest, every tensor's digest checked, nothing unpickled); for any other,
  Megatron's own. The manifest it read is kept for the sharded strategy (``handoff``).

Registration happens once, when ``certckpt.integrations.megatron`` is imported.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy

from certckpt.format.reader import load as certified_load

from .handoff import read_and_keep
from .layout import COMMON_NAME

__all__ = ["CommonSaveStrategy", "CommonLoadStrategy", "take_common_state", "register_common_strategies"]

_lock = threading.Lock()
_handed: dict[str, Any] = {}  # one slot: the directory of the last save and the common state for it


def _key(checkpoint_dir: str | Path) -> str:
    return os.path.abspath(os.fspath(checkpoint_dir))


def take_common_state(checkpoint_dir: str | Path) -> tuple[bool, Any]:
    """``(True, state)`` for the common state Megatron handed over for this directory in this save
    (forgotten once taken), else ``(False, None)``."""
    with _lock:
        key = _key(checkpoint_dir)
        if key not in _handed:
            return False, None
        state = _handed.pop(key)
        return True, state


class CommonSaveStrategy(TorchCommonSaveStrategy):
    """Megatron's common save strategy, keeping the state for ``CertifiedSaveStrategy`` (rank 0)."""

    def save_common(self, common_state_dict: Any, checkpoint_dir: str | Path) -> None:
        with _lock:
            _handed.clear()  # only the save in progress: a plain save's state is not held past the next
            _handed[_key(checkpoint_dir)] = common_state_dict
        super().save_common(common_state_dict, checkpoint_dir)


class CommonLoadStrategy(TorchCommonLoadStrategy):
    """The certified common state of a certified directory; Megatron's own reading for any other."""

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        # kept for the sharded strategy, which runs next in the same load (handoff: one manifest read)
        companions = read_and_keep(os.fspath(checkpoint_dir), check=True)
        if companions is None:
            return super().load_common(checkpoint_dir)
        return certified_load(companions.certified(COMMON_NAME), map_location="cpu")


def register_common_strategies() -> None:
    """Register the two under Megatron's ``torch`` common backend (idempotent)."""
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, CommonSaveStrategy("torch", 1))
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, CommonLoadStrategy())
