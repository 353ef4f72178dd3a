"""Ship a micro-batch (and the RNG state it used) between ranks without pickle.

The payload is flattened by the checkpoint skeleton code: a JSON description (sent as a uint8 tensor
behind its length) plus the tensors themselves, sent point to point. Anything the skeleton refuses
(an arbitrary object in the batch) is refused here too, at set-up, with its location.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..fingerprinting import ST_TO_TORCH, TORCH_TO_ST
from ..skeleton import flatten, rebuild
from ..writer import host_bytes

__all__ = ["encode_payload", "ring_shift", "send_payload", "recv_payload", "check_shippable"]


def check_shippable(batch: Any) -> None:
    """Raise ``UnsupportedObjectError`` (naming where) when the batch cannot be shipped."""
    flatten({"batch": batch})


def encode_payload(obj: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = flatten(obj)
    specs = [[s.name, TORCH_TO_ST[s.tensor.dtype], list(s.tensor.shape)] for s in flat.stored]
    meta = json.dumps({"skeleton": flat.skeleton, "tensors": specs}, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(meta), dtype=torch.uint8), [s.tensor.detach().contiguous() for s in flat.stored]


def _meta_doc(meta: torch.Tensor) -> dict:
    return json.loads(bytes(host_bytes(meta.cpu().contiguous())).decode("utf-8"))


def _decode(doc: dict, tensors: list[torch.Tensor], device: torch.device) -> Any:
    named = {spec[0]: t for spec, t in zip(doc["tensors"], tensors)}
    return rebuild(doc["skeleton"], named, map_location=str(device))


def _empty_for(doc: dict, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=ST_TO_TORCH[code], device=device) for _, code, shape in doc["tensors"]]


def _to_wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def ring_shift(obj: Any, *, group: Any, wire_device: torch.device, out_device: torch.device) -> Any:
    """Send ``obj`` to the next rank and return the previous rank's object (all ranks call this).

    ``wire_device`` is where tensors travel (CPU for gloo, CUDA for NCCL); ``out_device`` is where
    the received object's tensors end up.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return obj  # a single rank replays its own micro-batch (same-device replay)
    rank = dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)
    meta, tensors = encode_payload(obj)

    def swap(out: torch.Tensor, inp: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, out, nxt, group), dist.P2POp(dist.irecv, inp, prv, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    n_out = torch.tensor([meta.numel()], dtype=torch.int64, device=wire_device)
    n_in = torch.empty(1, dtype=torch.int64, device=wire_device)
    swap(n_out, n_in)
    meta_in = torch.empty(int(n_in.item()), dtype=torch.uint8, device=wire_device)
    swap(_to_wire(meta, wire_device), meta_in)
    doc = _meta_doc(meta_in)
    incoming = _empty_for(doc, wire_device)
    ops = [dist.P2POp(dist.isend, _to_wire(t, wire_device), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in incoming]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return _decode(doc, incoming, out_device)


def send_payload(obj: Any, dst: int, *, group: Any, wire_device: torch.device) -> None:
    """Blocking send to one rank (its counterpart calls ``recv_payload``)."""
    meta, tensors = encode_payload(obj)
    dist.send(torch.tensor([meta.numel()], dtype=torch.int64, device=wire_device), dst, group=group)
    dist.send(_to_wire(meta, wire_device), dst, group=group)
    for t in tensors:
        dist.send(_to_wire(t, wire_device), dst, group=group)


def recv_payload(src: int, *, group: Any, wire_device: torch.device, out_device: torch.device) -> Any:
    n = torch.empty(1, dtype=torch.int64, device=wire_device)
    dist.recv(n, src, group=group)
    meta = torch.empty(int(n.item()), dtype=torch.uint8, device=wire_device)
    dist.recv(meta, src, group=group)
    doc = _meta_doc(meta)
    tensors = _empty_for(doc, wire_device)
    for t in tensors:
        dist.recv(t, src, group=group)
    return _decode(doc, tensors, out_device)
