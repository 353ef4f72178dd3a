"""A checkpoint directory saved in the background: its large files by ``AsyncSaver``s, then its commit.

The certified Trainer (``async_save=True``) and ``CertifiedAccelerator(async_save=True)`` use it. The
files the caller hands to the pipeline (the Trainer: its weight shards; Accelerate: every file of the
main process) are snapshotted into staging memory and written by background savers
(``certckpt.AsyncSaver``, one per file name, so each keeps and reuses its staging memory from one
checkpoint to the next); the caller writes the other files at once and copies to host memory what the
manifest will hold. A background thread then waits for the saves, writes the manifest over every file
of the directory (last, as the synchronous path does), commits it to the ledger and applies the
rotation.

``latest-good`` never names a checkpoint in flight: its commit record is written after its manifest
is durable, and the manifest after every file. A failure in the background is raised by ``wait()``,
which the integrations call (on every rank) at the next checkpoint, at a load and at the end of training.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from certckpt.errors import AsyncSaveError
from certckpt.format.asyncsave import AsyncSaver, SaveFuture

__all__ = ["CheckpointPipeline", "host_copy"]


class CheckpointPipeline:
    """Background savers for a checkpoint's files, and the commit of the checkpoint in flight."""

    def __init__(self) -> None:
        self._savers: dict[str, AsyncSaver] = {}
        self._pending: Future[None] | None = None
        self._label = ""

    def saver_for(self, name: str) -> AsyncSaver:
        """The saver of one file name (``model.safetensors``...): one save in flight, staging reused."""
        saver = self._savers.get(name)
        if saver is None:
            saver = self._savers[name] = AsyncSaver()
        return saver

    @property
    def staging_bytes(self) -> int:
        """Host memory held for the files' snapshots (kept between checkpoints)."""
        return sum(s.staging_bytes for s in self._savers.values())

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(self, label: str, shards: list[SaveFuture], finish: Callable[[], None]) -> None:
        """Run ``finish`` in the background once every shard is durable (``label`` names it in errors).
        The previous checkpoint must be waited for first (``wait``)."""
        if self._pending is not None:
            raise AsyncSaveError(f"{label}: {self._label} is still in flight; wait() for it first")
        future: Future[None] = Future()
        self._pending, self._label = future, label

        def run() -> None:
            try:
                for shard in shards:
                    shard.result()
                finish()
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(None)

        # Not a daemon: an interpreter that exits with a checkpoint in flight finishes it first.
        threading.Thread(target=run, name="certckpt-checkpoint-commit", daemon=False).start()

    def wait(self) -> None:
        """Wait for the checkpoint in flight; raise ``AsyncSaveError`` if it failed (once)."""
        future, self._pending = self._pending, None
        if future is None:
            return
        error = future.exception()
        if error is not None:
            raise AsyncSaveError(
                f"{self._label}: the asynchronous checkpoint failed ({error}); it was not committed, and "
                "latest-good still names the checkpoint before it"
            ) from error

    def close(self) -> None:
        """``wait()``, then free the staging memory."""
        try:
            self.wait()
        finally:
            for saver in self._savers.values():
                saver.close()
            self._savers.clear()


def host_copy(value: Any) -> Any:
    """``value`` with every tensor copied to host memory (dicts, lists and tuples rebuilt): what the
    background manifest writer holds while training moves the originals on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(host_copy(v) for v in value)
    return value
