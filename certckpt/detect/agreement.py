"""Collective set-up decisions: every rank refuses together, with the same message, or none does.

A refusal raised on some ranks only leaves the others waiting in the next collective (gloo then
fails them with "Connection closed by peer", NCCL waits for its timeout) with no word of the cause.
So each set-up check computes its verdict locally, the ranks exchange the verdicts in one small
all-gather, and, when any rank objects, every rank raises the same error naming the objecting ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from certckpt.errors import AuditSetupError, CertckptError

from .letgo import released

__all__ = ["all_gather_bytes", "refuse_together", "wire_device_for"]


def wire_device_for(group, device: torch.device) -> torch.device:
    """Where collective tensors travel: the model's device under NCCL, the CPU under gloo."""
    if dist.get_backend(group) == "nccl":
        return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, *, group, wire_device: torch.device) -> list[bytes]:
    """Every rank's ``data``, in rank order (a collective: every rank of ``group`` calls it)."""
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=wire_device)
    sizes = [torch.empty_like(n) for _ in range(world)]
    with released(n, *sizes):  # the process may end right after these collectives (letgo)
        dist.all_gather(sizes, n, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=wire_device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    with released(buf, *out):
        dist.all_gather(out, buf, group=group)
    return [bytes(o[: int(s)].cpu().tolist()) for o, s in zip(out, sizes)]


def refuse_together(
    reason: str | None,
    *,
    group,
    wire_device: torch.device,
    what: str,
    error: type[CertckptError] = AuditSetupError,
    advice: str = "",
) -> None:
    """Raise ``error`` on every rank when any rank's ``reason`` is not None; else return.

    One all-gather of a flag on the clean path; a second one (of the reasons' text) only when some
    rank objects, so that every rank raises the same message.

    Args:
        reason: this rank's objection (None: no objection).
        group: the process group whose ranks decide together.
        wire_device: where the flags travel (``wire_device_for``).
        what: the check, for the message (``"set-up"``, ``"determinism check"``, ...).
        advice: what to do about it, appended once to the message.
        error: the class raised (an ``AuditSetupError`` unless the check has a better one).

    Example::

        refuse_together(None if ok else "the batch is not shippable", group=g, wire_device=w, what="set-up")
    """
    world = dist.get_world_size(group)
    flag = torch.tensor([0 if reason is None else 1], dtype=torch.int64, device=wire_device)
    flags = [torch.empty_like(flag) for _ in range(world)]
    with released(flag, *flags):  # often a save's last collective, which a script may end right after (letgo)
        dist.all_gather(flags, flag, group=group)
    objecting = [r for r, f in enumerate(flags) if int(f)]
    if not objecting:
        return
    texts = all_gather_bytes((reason or "").encode("utf-8"), group=group, wire_device=wire_device)
    distinct: dict[str, list[int]] = {}
    for r in objecting:
        distinct.setdefault(texts[r].decode("utf-8", "replace"), []).append(r)
    parts = [f"rank(s) {ranks}: {text}" for text, ranks in distinct.items()]
    raise error(f"{what} refused on every rank; " + " | ".join(parts) + (f"; {advice}" if advice else ""))
