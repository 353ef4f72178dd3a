"""Ship a micro-batch (and the RNG state it used) between ranks without pickle.

The payload is flattened by the checkpoint skeleton code: a JSON description plus the tensors
themselves, sent point to point (the ring shift packs both into one message behind a small header of
sizes, so that it can overlap the training step). Anything the skeleton refuses (an arbitrary object
in the batch) is refused here too, at set-up, with its location.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from certckpt.errors import UnsupportedObjectError
from certckpt.format.skeleton import flatten, rebuild
from certckpt.format.tensors import ST_TO_TORCH, TORCH_TO_ST, host_bytes

from .timing import timed

__all__ = ["encode_payload", "RingShift", "send_payload", "recv_payload", "check_shippable", "refuse_unshippable"]


def check_shippable(batch: Any) -> None:
    """Raise ``UnsupportedObjectError`` (naming where) when the batch cannot be shipped."""
    flatten({"batch": batch})


def refuse_unshippable(batch: Any, *, group: Any, wire_device: torch.device) -> None:
    """``check_shippable`` on every rank, decided together: one rank's batch that cannot travel raises
    ``UnsupportedObjectError`` on every rank (a refusal on some ranks only would hang the others)."""
    from .agreement import refuse_together

    reason = None
    try:
        check_shippable(batch)
    except UnsupportedObjectError as e:
        reason = str(e)
    refuse_together(
        reason, group=group, wire_device=wire_device, what="the first step's batch", error=UnsupportedObjectError
    )


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


_TAG_HEADER, _TAG_PAYLOAD = 0x5348, 0x5350  # p2p tags (gloo matches on them; NCCL matches in order)


def _pack(meta: torch.Tensor, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``meta`` then every tensor's bytes, each piece starting on an 8-byte boundary, as one uint8 tensor."""
    pieces, offset = [], 0
    for t in [meta, *tensors]:
        raw = _to_wire(t, device).reshape(-1).view(torch.uint8)
        pad = -offset % 8
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        pieces.append(raw)
        offset += pad + raw.numel()
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def _unpack(buf: torch.Tensor, meta_len: int) -> tuple[dict, list[torch.Tensor]]:
    doc = _meta_doc(buf[:meta_len])
    tensors, offset = [], meta_len
    for _, code, shape in doc["tensors"]:
        dtype = ST_TO_TORCH[code]
        offset += -offset % 8
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        # a copy with its own storage: some consumers (torch.set_rng_state) ignore a view's offset
        tensors.append(buf[offset : offset + n].view(dtype).reshape(shape).clone())
        offset += n
    return doc, tensors


class RingShift:
    """Send ``obj`` to the next rank and receive the previous rank's, overlapped with other work.

    Every rank creates one (a collective), then calls ``advance()`` once it has other work to do
    (between the forward and the backward pass) and ``finish()`` when it needs the result. The
    sizes travel first, so the receive of the payload can be posted early and the payload moves
    while the rank computes; only one message pair per rank is left for ``finish()`` to wait on.
    The same two phases work on gloo and NCCL (NCCL matches a pair's messages in posting order).

    ``wire_device`` is where tensors travel (CPU for gloo, CUDA for NCCL); ``out_device`` is where
    the received object's tensors end up.
    """

    @timed("ring_shift")
    def __init__(self, obj: Any, *, group: Any, wire_device: torch.device, out_device: torch.device):
        self.group, self.wire_device, self.out_device = group, wire_device, out_device
        world = dist.get_world_size(group)
        self._result: Any = obj if world == 1 else None  # a single rank replays its own micro-batch
        self._done = world == 1
        if self._done:
            return
        rank = dist.get_rank(group)
        self._next = dist.get_global_rank(group, (rank + 1) % world)
        self._prev = dist.get_global_rank(group, (rank - 1) % world)
        meta, tensors = encode_payload(obj)
        out = _pack(meta, tensors, wire_device)
        self._out: torch.Tensor | None = out  # (both dropped once the payload is in)
        self._out_header = torch.tensor([meta.numel(), out.numel()], dtype=torch.int64, device=wire_device)
        self._in_header = torch.empty(2, dtype=torch.int64, device=wire_device)
        self._in: torch.Tensor | None = None
        self._header_works = self._swap(self._out_header, self._in_header, _TAG_HEADER)
        self._payload_works: list[Any] | None = None

    def _swap(self, out: torch.Tensor, inp: torch.Tensor, tag: int) -> list:
        ops = [
            dist.P2POp(dist.isend, out, self._next, self.group, tag),
            dist.P2POp(dist.irecv, inp, self._prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)

    @timed("ring_shift")
    def advance(self) -> None:
        """Wait for the sizes (normally in already) and post the payload's send and receive."""
        if self._done or self._payload_works is not None:
            return
        for work in self._header_works:
            work.wait()
        self._in = torch.empty(int(self._in_header[1].item()), dtype=torch.uint8, device=self.wire_device)
        assert self._out is not None  # until finish() has the payload
        self._payload_works = self._swap(self._out, self._in, _TAG_PAYLOAD)

    @timed("ring_shift")
    def finish(self) -> Any:
        """The previous rank's object (waits for the payload if it is still on its way)."""
        if self._done:
            return self._result
        self.advance()
        assert self._payload_works is not None and self._in is not None  # posted by advance()
        for work in self._payload_works:
            work.wait()
        doc, tensors = _unpack(self._in, int(self._in_header[0].item()))
        self._result = _decode(doc, tensors, self.out_device)
        self._done = True
        self._out = self._in = None
        return self._result


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
