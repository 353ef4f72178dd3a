"""One rank of a sweep: build the plain and audited copies, warm up, time the blocks, return rank 0's figures."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# torch at the top: only the rank processes import this module (sweep.RANK_TARGET names it), never the driver.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from certckpt.detect.auditor import Auditor
from certckpt.detect.events import MemorySink
from certckpt.detect.launch import ProgressLog

from .models import load_factory
from .stats import describe, se_text, shape_figures, step_samples, trimmed_mean

__all__ = ["Rig", "measure_shape", "rank_main", "result", "setup", "timed_trials", "warm_up"]


@dataclass(kw_only=True)
class Rig:
    """What every step of a rank's sweep works on: the device, the model's copies and the data source."""

    rank: int
    device: torch.device
    log: ProgressLog
    plain: DDP
    plain_opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]  # the bare module's trainable ones: what ``fb`` differentiates
    auditors: dict[int, Auditor]
    batch_fn: Callable[[int, int, int, int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    t_start: float
    data_step: int = 0  # runs on across shapes, so that no two trials see the same batches

    @property
    def names(self) -> list[str]:
        """Every measurement of a trial, in the order of trial 0 (later trials rotate it)."""
        return ["plain", "fb"] + [f"{kind}/{k}" for k in self.auditors for kind in ("nonaudit", "cycle", "consensus")]


def rank_main(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of the sweep (``args``: see :func:`certckpt.tools.envelope.sweep.rank_args`).

    Returns:
        This rank's result (see :func:`result`); rank 0's timings are the ones reported.
    """
    rig = setup(args)
    shapes = [measure_shape(rig, args, index=i, seq_len=s, micro_batch=b) for i, (s, b) in enumerate(args["shapes"])]
    rig.log.close()
    return result(rig, shapes)


# --- set-up ------------------------------------------------------------------------------------------


def _device(kind: str, rank: int) -> torch.device:
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _ddp_copy(model: torch.nn.Module, *, group: Any, device: torch.device) -> tuple[DDP, torch.optim.Optimizer]:
    # A deep copy per wrapper: every copy starts from the same weights with the same structure.
    kw: dict[str, Any] = {"process_group": group}
    if device.type == "cuda":
        kw["device_ids"] = [device.index]
    m = copy.deepcopy(model)
    return DDP(m, **kw), torch.optim.AdamW(m.parameters(), lr=1e-4)


def setup(args: Mapping[str, Any]) -> Rig:
    """Set the algorithms and the device, build the model, one plain DDP copy and one audited copy per K."""
    rank, mode, backend = dist.get_rank(), args["mode"], args["backend"]
    if mode == "deterministic":
        torch.use_deterministic_algorithms(True)
    device = _device(args["device"], rank)
    group = dist.new_group(backend=backend) if backend != "gloo" else None  # gloo: the launcher's default group
    t_start = time.perf_counter()
    log = ProgressLog(args.get("progress"), rank=rank)
    model, batch_fn, loss_fn = load_factory(args["model"])()
    model = model.to(device)
    plain, plain_opt = _ddp_copy(model, group=group, device=device)
    auditors = {
        k: Auditor(
            *_ddp_copy(model, group=group, device=device),
            loss_fn=loss_fn,
            run="envelope",
            audit_every=k,
            mode=mode,
            nonfinite_read=args.get("nonfinite_read", "immediate"),
            sink=MemorySink(),
        )
        for k in args["audit_every"]
    }
    params = [p for p in plain.module.parameters() if p.requires_grad]
    rig = Rig(
        rank=rank,
        device=device,
        log=log,
        plain=plain,
        plain_opt=plain_opt,
        params=params,
        auditors=auditors,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        t_start=t_start,
    )
    n_params = sum(p.numel() for p in rig.params)
    log(
        f"built {1 + len(auditors)} DDP copies of {n_params:,} parameters on {dist.get_world_size()} rank(s) "
        f"({backend}, {device})"
    )
    return rig


# --- the measured work ---------------------------------------------------------------------------------


def _plain_block(rig: Rig, batches: Sequence[Any]) -> None:
    for b in batches:
        rig.plain_opt.zero_grad(set_to_none=True)
        rig.loss_fn(rig.plain, b).backward()
        rig.plain_opt.step()


def _fb_block(rig: Rig, batches: Sequence[Any]) -> None:
    bare, params = rig.plain.module, rig.params
    for b in batches:
        torch.autograd.grad(rig.loss_fn(bare, b), params, allow_unused=True)


def _audited_block(aud: Auditor, batches: Sequence[Any], *, with_audit: bool) -> None:
    # Move the step counter forward (never back) so that the block's len(batches) steps hold no
    # audit step, or exactly one, its last: needs len(batches) <= K - 1, resp. <= K.
    k, m = aud.audit_every, len(batches)
    if with_audit:
        aud.step = -(-(aud.step + m) // k) * k - m  # the block ends on the first multiple of K it can
    else:
        aud.step = -(-aud.step // k) * k  # the block starts right after a multiple of K
    for b in batches:
        aud.train_step(b)
    assert aud.last is not None and aud.last.audited == with_audit


def _consensus_block(aud: Auditor, m: int) -> None:
    for _ in range(m):
        aud.weight_consensus(aud.step)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the queued kernels are part of the block
    dist.barrier()


def _timed(rig: Rig, fn: Callable[[], Any]) -> float:
    """The wall time of ``fn`` between two barriers (rank 0's is the one reported)."""
    _sync(rig.device)
    t0 = time.perf_counter()
    fn()
    _sync(rig.device)
    return time.perf_counter() - t0


def _measure(rig: Rig, name: str, batches: Sequence[Any]) -> float:
    """One measurement of a trial: per step for ``plain``, ``fb``, ``consensus/K``; the whole block otherwise."""
    m = len(batches)
    if name == "plain":
        return _timed(rig, lambda: _plain_block(rig, batches)) / m
    if name == "fb":
        return _timed(rig, lambda: _fb_block(rig, batches)) / m
    kind, k = name.split("/")
    aud = rig.auditors[int(k)]
    if kind == "consensus":
        return _timed(rig, lambda: _consensus_block(aud, m)) / m
    return _timed(rig, lambda: _audited_block(aud, batches, with_audit=kind == "cycle"))


def _trial(rig: Rig, *, seq_len: int, micro_batch: int, block: int, trial: int) -> dict[str, float]:
    """Draw ``block`` batches (untimed) and take every measurement on them, in an order rotated by ``trial``."""
    batches = []
    for _ in range(block):
        rig.data_step += 1
        batches.append(_to_device(rig.batch_fn(rig.rank, rig.data_step, seq_len, micro_batch), rig.device))
    names = rig.names
    shift = trial % len(names)
    return {n: _measure(rig, n, batches) for n in names[shift:] + names[:shift]}


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _rank0_decides(rig: Rig, value: int) -> int:
    """Rank 0's ``value`` on every rank, over the default gloo group: their timings differ, their loops may not."""
    flag = torch.tensor([value if rig.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(flag, 0)
    return int(flag)


# --- the steps of a shape ----------------------------------------------------------------------------


def warm_up(rig: Rig, *, seq_len: int, micro_batch: int, trials: int, block_s: float) -> int:
    """Run the shape's discarded trials; the first, timed in single steps, sizes the block.

    Returns:
        m, the steps per block: about ``block_s`` seconds of plain steps, from 1 to min(K) - 1 (so that
        every K's non-audit block is free of audit steps).
    """
    block = 1
    for trial in range(trials):
        got = _trial(rig, seq_len=seq_len, micro_batch=micro_batch, block=block, trial=trial)
        if trial == 0:
            longest = min(rig.auditors) - 1
            block = _rank0_decides(rig, max(1, min(longest, round(block_s / max(got["plain"], 1e-6)))))
    return block


def timed_trials(
    rig: Rig, args: Mapping[str, Any], *, seq_len: int, micro_batch: int, block: int, first: int, shape_t0: float
) -> dict[str, list[float]]:
    """The kept trials: ``args["steps"]`` at least, more up to ``args["max_trials"]`` while the shape has used
    less than ``args["min_shape_s"]`` seconds since ``shape_t0``.

    Args:
        rig: the rank.
        args: the rank's arguments.
        seq_len: L.
        micro_batch: B.
        block: m, steps per block.
        first: the number of the first kept trial (the warm-up trials came before), for the rotation.
        shape_t0: when the shape's first warm-up trial began.

    Returns:
        Each measurement's timings, one per trial.
    """
    raw: dict[str, list[float]] = {n: [] for n in rig.names}
    trial = first
    while True:
        for n, v in _trial(rig, seq_len=seq_len, micro_batch=micro_batch, block=block, trial=trial).items():
            raw[n].append(v)
        trial += 1
        kept = trial - first
        more = kept < args["steps"] or (
            kept < args["max_trials"] and time.perf_counter() - shape_t0 < args["min_shape_s"]
        )
        if not _rank0_decides(rig, int(more)):
            return raw


def measure_shape(rig: Rig, args: Mapping[str, Any], *, index: int, seq_len: int, micro_batch: int) -> dict[str, Any]:
    """Warm up, time the trials and compute every K's figures for one shape (the ``index``-th).

    The first shape gets one more warm-up trial: DDP rebuilds its buckets after the first step, and
    the auditor's first step runs its one-off determinism check.
    """
    warmup = args["warmup"] + (1 if index == 0 else 0)
    shape_t0 = time.perf_counter()
    block = warm_up(rig, seq_len=seq_len, micro_batch=micro_batch, trials=warmup, block_s=args["block_s"])
    raw = timed_trials(
        rig, args, seq_len=seq_len, micro_batch=micro_batch, block=block, first=warmup, shape_t0=shape_t0
    )
    kept = len(raw["plain"])
    ks = list(rig.auditors)
    samples = step_samples(raw, audit_every=ks, block=block)
    mean = {n: trimmed_mean(v) for n, v in samples.items()}
    combos = shape_figures(samples, mean=mean, seq_len=seq_len, micro_batch=micro_batch, audit_every=ks)
    for j, c in enumerate(combos):
        rig.log(
            f"{index * len(ks) + j + 1}/{len(args['shapes']) * len(ks)}  {describe(c)}: plain "
            f"{c['plain_s'] * 1e3:.2f} ms, audited {c['audited_s'] * 1e3:.2f} ms, premium {c['premium']:+.1%}"
            f"{se_text(c['premium_se'])} ({kept} trials of {block}-step blocks, {warmup} warm-up)"
        )
    return {
        "seq_len": seq_len,
        "micro_batch": micro_batch,
        "trials": kept,
        "warmup": warmup,
        "block": block,
        "seconds": time.perf_counter() - shape_t0,
        "mean_s": mean,
        "untrimmed_mean_s": {n: statistics.fmean(v) for n, v in samples.items()},
        "samples_s": samples,
        "combinations": combos,
    }


def result(rig: Rig, shapes: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank's return value (JSON): the set-up, every shape's measurements and figures, the events."""
    return {
        "rank": rig.rank,
        "params": sum(p.numel() for p in rig.params),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "shapes": shapes,
        "events": {k: _events_kept(a) for k, a in rig.auditors.items()},
        "rank_elapsed_s": time.perf_counter() - rig.t_start,
    }


def _events_kept(aud: Auditor) -> int:
    """How many events an auditor's sink holds (setup gives every auditor a MemorySink)."""
    sink = aud.sink
    assert isinstance(sink, MemorySink)
    return len(sink.events)
