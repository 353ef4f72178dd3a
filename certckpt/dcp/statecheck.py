"""Check a loaded (possibly resharded) state against the manifest's sharding-independent fingerprints.

After a load every rank holds some regions of the global tensors (its new shards; replicas hold the
same regions). Each rank computes the contribution of every region it received (``shardfp``), the
ranks exchange them (as JSON in uint8 tensors: no pickle), identical regions held by replicas are
counted once (and must agree), and where the distinct regions partition a tensor their sum must
compose to the fingerprint the writer recorded. The exchange is collective: every rank of the group
calls it, even one whose reads failed (it sends its error instead, so no rank waits forever).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from certckpt.detect.letgo import released
from certckpt.format.header import printable
from certckpt.format.sharded.composition import compose, hex64, is_partition
from certckpt.format.sharded.manifest import Manifest

__all__ = ["Region", "exchange", "compare"]


@dataclass(frozen=True, slots=True)
class Region:
    """A box of a global tensor that a rank holds after loading, and its contribution."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    raw: str


def _device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(payload: dict, group) -> list[dict]:
    """Every rank's JSON-able ``payload``, in rank order (a collective over ``group``; None: local)."""
    if group is None:
        return [payload]
    data = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    device = _device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    with released(size, *sizes):  # a load's last collectives, which a script may end right after (letgo)
        dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    with released(mine, *bufs):
        dist.all_gather(bufs, mine, group=group)
    return [json.loads(bytes(b[: int(s)].cpu().numpy())) for b, s in zip(bufs, sizes)]


def compare(manifest: Manifest, regions: list[Region]) -> tuple[list[str], int]:
    """Problems found, and how many tensors were checked in full.

    A tensor is checked when the distinct regions loaded anywhere partition it; a tensor loaded only
    in part (``allow_partial_load``, or not requested) is not, and is not a problem.
    """
    by_fqn: dict[str, dict[tuple, set[str]]] = {}
    for r in regions:
        by_fqn.setdefault(r.fqn, {}).setdefault((r.offsets, r.sizes), set()).add(r.raw)
    problems, checked = [], 0
    info = {t.fqn: t for t in manifest.tensors}
    for fqn, boxes in by_fqn.items():
        t = info.get(fqn)
        if t is None:
            continue
        where = f"tensor `{printable(fqn)}`"
        split = [b for b, raws in boxes.items() if len(raws) > 1]
        if split:
            problems.append(f"{where}: ranks holding the same region at {list(split[0][0])} loaded different values")
            continue
        if not is_partition(list(boxes), t.shape):
            continue
        checked += 1
        found = hex64(compose((int(next(iter(raws)), 16) for raws in boxes.values()), t.dtype, t.shape))
        if found != t.fp:
            problems.append(
                f"{where}: the loaded state's fingerprint {found} differs from the saved one {t.fp};"
                " the values in memory are not the values that were saved"
            )
    return problems, checked
