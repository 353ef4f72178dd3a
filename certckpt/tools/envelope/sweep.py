"""The driver's side of a sweep: its configuration, the rank job it launches, and the report it builds."""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from certckpt.detect.launch import follow, run_ranks
from certckpt.errors import ConfigurationError

from .models import BUILTIN_MODEL
from .stats import TRIM, over_budget

__all__ = ["BLOCK_S", "FULL", "MAX_TRIALS", "QUICK", "RANK_TARGET", "EnvelopeConfig", "build_report", "run_envelope"]

FULL: dict[str, Any] = {
    "seq_lens": (128, 512, 2048),
    "micro_batches": (1, 4, 16),
    "audit_every": (10, 100),
    "steps": 5,
    "min_shape_s": 30.0,
}
QUICK: dict[str, Any] = {
    "seq_lens": (64, 256),
    "micro_batches": (1, 4),
    "audit_every": (10, 100),
    "steps": 10,
    "min_shape_s": 15.0,
}
"""Default sweeps. ``steps``: trials per shape at least; more while the shape has used less than
``min_shape_s`` seconds, up to :data:`MAX_TRIALS`."""

MAX_TRIALS = 200
"""Most trials per shape (unless ``steps`` asks for more)."""

BLOCK_S = 0.1
"""Each measurement times a block of consecutive steps of about this many seconds (at least one
step; for each K at most K-1, so that a block can be free of audit steps)."""

RANK_TARGET = "certckpt.tools.envelope.rank:rank_main"
"""What every rank process runs, named for ``run_ranks`` (imported there, so torch stays out of the driver)."""


@dataclass(frozen=True, kw_only=True)
class EnvelopeConfig:
    """One sweep. ``steps``: timed trials per shape, at least; ``warmup``: discarded trials per shape.

    Raises:
        ConfigurationError: a field is out of range (the message names it).
    """

    seq_lens: tuple[int, ...] = FULL["seq_lens"]
    micro_batches: tuple[int, ...] = FULL["micro_batches"]
    audit_every: tuple[int, ...] = FULL["audit_every"]
    ranks: int = 3
    model: str = BUILTIN_MODEL
    max_premium: float = 0.05
    steps: int = FULL["steps"]
    warmup: int = 1
    min_shape_s: float = FULL["min_shape_s"]
    mode: str = "deterministic"
    nonfinite_read: str = "immediate"
    backend: str = "gloo"
    device: str = "cpu"
    timeout_s: float = 4 * 3600
    extra_path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("seq_lens", "micro_batches", "audit_every"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vals):
                raise ConfigurationError(f"{name}: expected positive integers, got {vals!r}")
        if any(k < 2 for k in self.audit_every):
            raise ConfigurationError(
                "audit_every: every K must be >= 2 (with K = 1 every step is an audit step; "
                "there is no non-audit step to separate the non-finite checks' share)"
            )
        if self.ranks < 1:
            raise ConfigurationError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 1:
            raise ConfigurationError("steps and warmup must be >= 1 (the first warm-up trial sizes the blocks)")
        if not math.isfinite(self.max_premium):
            raise ConfigurationError(f"max_premium must be a finite number, got {self.max_premium!r}")
        if self.mode not in ("deterministic", "tolerance"):
            raise ConfigurationError(f"mode must be 'deterministic' or 'tolerance', got {self.mode!r}")
        if self.nonfinite_read not in ("immediate", "deferred"):
            raise ConfigurationError(f"nonfinite_read must be 'immediate' or 'deferred', got {self.nonfinite_read!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigurationError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ConfigurationError("backend nccl needs device cuda")

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (seq_len, micro_batch) pair, sequence length first."""
        return [(s, b) for s in self.seq_lens for b in self.micro_batches]


def rank_args(config: EnvelopeConfig, *, progress_path: str) -> dict[str, Any]:
    """What every rank is told (JSON): the sweep, the trial policy and where to log progress."""
    return {
        "shapes": config.shapes,
        "audit_every": list(config.audit_every),
        "model": config.model,
        "steps": config.steps,
        "warmup": config.warmup,
        "min_shape_s": config.min_shape_s,
        "max_trials": max(config.steps, MAX_TRIALS),
        "block_s": BLOCK_S,
        "mode": config.mode,
        "nonfinite_read": config.nonfinite_read,
        "backend": config.backend,
        "device": config.device,
        "progress": progress_path,
    }


def run_envelope(config: EnvelopeConfig, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sweep on ``config.ranks`` local processes and return the report (the ``--json`` document).

    Args:
        config: the sweep.
        progress: called with each progress line the ranks write, as they write it.

    Raises:
        certckpt.errors.RanksFailedError: a rank failed (its output tail is in the message).
    """
    t0 = time.perf_counter()
    load0 = _loadavg()
    with tempfile.TemporaryDirectory(prefix="certckpt-envelope-") as d:
        prog = os.path.join(d, "progress.log")
        open(prog, "w").close()
        stop = threading.Event()
        tail = threading.Thread(target=follow, args=(prog, stop, progress), daemon=True) if progress else None
        if tail:
            tail.start()
        try:
            per_rank = run_ranks(
                RANK_TARGET,
                config.ranks,
                rank_args(config, progress_path=prog),
                timeout=config.timeout_s,
                extra_path=config.extra_path,
            )
        finally:
            stop.set()
            if tail:
                tail.join(timeout=5)
    report = build_report(config, per_rank[0], elapsed_s=time.perf_counter() - t0)
    report["loadavg_start"], report["loadavg_end"] = load0, _loadavg()
    return report


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def build_report(config: EnvelopeConfig, r0: Mapping[str, Any], *, elapsed_s: float) -> dict[str, Any]:
    """The JSON document from rank 0's result (pure).

    Args:
        config: the sweep that ran.
        r0: rank 0's return value from :func:`certckpt.tools.envelope.rank.rank_main`.
        elapsed_s: the sweep's wall time.
    """
    combos = []
    for shape in r0["shapes"]:
        for c in shape["combinations"]:
            c = dict(c)
            c["over_budget"] = c["premium"] > config.max_premium
            c["trials"] = shape["trials"]
            combos.append(c)
    means = [
        {
            "seq_len": s["seq_len"],
            "micro_batch": s["micro_batch"],
            "trials": s["trials"],
            "warmup": s["warmup"],
            "block": s["block"],
            "mean_s": s["mean_s"],
            "untrimmed_mean_s": s["untrimmed_mean_s"],
        }
        for s in r0["shapes"]
    ]
    return {
        "ranks": config.ranks,
        "model": config.model,
        "max_premium": config.max_premium,
        "combinations": combos,
        "over_budget": over_budget(combos, config.max_premium),
        "params": r0["params"],
        "mode": config.mode,
        "nonfinite_read": config.nonfinite_read,
        "backend": config.backend,
        "device": config.device,
        "deterministic_algorithms": r0["deterministic"],
        "torch": r0["torch"],
        "threads_per_rank": r0["torch_threads"],
        "cpus": os.cpu_count(),
        "steps": config.steps,
        "warmup": config.warmup,
        "trim": TRIM,
        "measurements": means,
        "elapsed_s": elapsed_s,
    }
