"""Object <-> (named tensors + JSON skeleton), without pickle.

``flatten`` walks what ``torch.save`` takes in practice and refuses everything else before a byte is
written; ``rebuild`` turns a skeleton and the loaded tensors back into the same structure. Tensors
that share storage are stored once and come back sharing it: identical views become one entry;
different views of one storage are stored as one base (a covering tensor, or the raw byte range) and
rebuilt as views of it.

Skeleton nodes (JSON): ``null``, ``true``/``false``, a JSON string for ``str``, and tagged lists:
``["i", "0x7b"]`` int (hex), ``["f", "0x1.8p+1"]`` float (``float.hex``, so nan/inf/-0.0 survive),
``["d", [[key, value], ...]]`` dict, ``["od", ...]`` OrderedDict, ``["l", [...]]`` list,
``["t", [...]]`` tuple, ``["dtype", "float32"]``, ``["size", [2, 3]]``, ``["dev", "cuda:0"]``,
``["T", {"e": entry, "v": [dtype, offset, size, stride], "d": device, "p": 1, "g": 1}]`` tensor.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from certckpt.errors import (
    ArgumentTypeError,
    CertckptError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    UnsupportedObjectError,
)

from .tensors import ST_TO_TORCH, TORCH_TO_ST

__all__ = ["Flattened", "StoredTensor", "flatten", "rebuild"]

MAX_DEPTH = 200
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@dataclass(slots=True)
class StoredTensor:
    """One tensor as it goes into the file: contiguous, possibly still on its device."""

    name: str
    tensor: torch.Tensor

    @property
    def dtype_code(self) -> str:
        return TORCH_TO_ST[self.tensor.dtype]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(slots=True)
class Flattened:
    skeleton: Any
    stored: list[StoredTensor] = field(default_factory=list)


def _fmt_path(path: tuple) -> str:
    return "obj" + "".join(f"[{k!r}]" for k in path)


def _refuse(path: tuple, what: str, fix: str) -> UnsupportedObjectError:
    return UnsupportedObjectError(f"{_fmt_path(path)}: {what}; {fix}. Nothing was written.")


def _check_tensor(t: torch.Tensor, path: tuple) -> None:
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise _refuse(
            path,
            f"tensor subclass {type(t).__name__} cannot be stored without pickle",
            "convert it with .as_subclass(torch.Tensor)",
        )
    if t.layout != torch.strided:
        raise _refuse(
            path,
            f"{t.layout} tensors are not supported",
            "convert with .to_dense() (or store indices and values as separate tensors)",
        )
    if t.is_quantized:
        raise _refuse(
            path,
            "quantized tensors are not supported",
            "store .int_repr() with its scale and zero_point, or .dequantize()",
        )
    if t.device.type == "meta":
        raise _refuse(path, "meta tensors have no data to save", "materialize the tensor first")
    if getattr(t, "is_nested", False):
        raise _refuse(path, "nested tensors are not supported", "unbind it into a list of tensors")
    if t.dtype not in TORCH_TO_ST:
        raise _refuse(
            path, f"dtype {t.dtype} cannot be stored in safetensors", "cast it (e.g. complex128 to two float64 tensors)"
        )


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[tuple[tuple, torch.Tensor, dict]] = []  # (path, tensor, leaf dict to fill)
        self._active: set[int] = set()

    def walk(self, obj: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH:
            raise _refuse(path, f"nesting deeper than {MAX_DEPTH} levels", "flatten the structure")
        tp = type(obj)
        if obj is None or tp is bool:
            return obj
        if tp is str:
            return obj
        if tp is int:
            return ["i", hex(obj)]  # hex: no digit limit (str() of a >4300-digit int raises)
        if tp is float:
            return ["f", obj.hex() if math.isfinite(obj) else repr(obj)]
        if tp is torch.dtype:
            return ["dtype", str(obj).removeprefix("torch.")]
        if tp is torch.Size:
            return ["size", list(obj)]
        if tp is torch.device:
            return ["dev", str(obj)]
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, path)
            leaf: dict[str, Any] = {}
            self.tensors.append((path, obj, leaf))
            return ["T", leaf]
        if tp in (dict, collections.OrderedDict, list, tuple):
            if id(obj) in self._active:
                raise _refuse(path, "the object contains itself", "break the reference cycle")
            self._active.add(id(obj))
            try:
                if tp in (list, tuple):
                    return ["l" if tp is list else "t", [self.walk(v, path + (i,)) for i, v in enumerate(obj)]]
                items = []
                for k, v in obj.items():
                    if type(k) is str:
                        key: Any = k
                    elif type(k) is int:
                        key = ["i", hex(k)]
                    else:
                        raise _refuse(
                            path,
                            f"dict key {k!r:.60} of type {type(k).__name__} is not supported",
                            "use str or int keys",
                        )
                    items.append([key, self.walk(v, path + (k,))])
                return ["d" if tp is dict else "od", items]
            finally:
                self._active.discard(id(obj))
        if isinstance(obj, (int, float, str)):
            raise _refuse(
                path,
                f"{tp.__name__} (a subclass of {tp.__mro__[1].__name__}) cannot be stored without pickle",
                f"convert it with {tp.__mro__[1].__name__}(...)",
            )
        what = "a function" if callable(obj) else f"an object of type {tp.__module__}.{tp.__qualname__}"
        raise _refuse(
            path,
            f"{what} cannot be stored without pickle",
            "store its state (tensors, numbers, strings) instead, e.g. its state_dict()",
        )


def _unique_name(path: tuple, taken: set[str]) -> str:
    base = ".".join(str(k) for k in path) or "tensor"
    if base == "__metadata__":
        base = "_" + base
    name, n = base, 1
    while name in taken:
        name = f"{base}~{n}"
        n += 1
    taken.add(name)
    return name


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    es = t.element_size()
    start = t.storage_offset() * es
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * es


def flatten(obj: Any) -> Flattened:
    """Split ``obj`` into a JSON skeleton and the tensors to store; refuse anything unsupported.

    Raises:
        UnsupportedObjectError: names where in ``obj`` the offending value sits.
    """
    fl = _Flattener()
    skeleton = fl.walk(obj, ())
    out = Flattened(skeleton=skeleton)
    taken: set[str] = set()

    groups: dict[tuple, list[int]] = {}
    for i, (_, t, _) in enumerate(fl.tensors):
        storage = t.untyped_storage()
        # Empty tensors own no bytes to share (their storages may all report address 0).
        key = (t.device, storage.data_ptr()) if t.numel() and storage.nbytes() else ("solo", i)
        groups.setdefault(key, []).append(i)

    for idxs in groups.values():
        views: dict[tuple, list[int]] = {}
        for i in idxs:
            t = fl.tensors[i][1]
            views.setdefault((t.dtype, t.storage_offset(), tuple(t.shape), t.stride()), []).append(i)
        first_path, first, _ = fl.tensors[idxs[0]]
        if len(views) == 1:
            name = _unique_name(first_path, taken)
            out.stored.append(StoredTensor(name, _plain(first)))
            for i in idxs:
                _fill_leaf(fl.tensors[i][2], fl.tensors[i][1], name, view=None)
            continue
        lo = min(_byte_extent(fl.tensors[i][1])[0] for i in idxs)
        hi = max(_byte_extent(fl.tensors[i][1])[1] for i in idxs)
        base_i = next(
            (i for i in idxs if fl.tensors[i][1].is_contiguous() and _byte_extent(fl.tensors[i][1]) == (lo, hi)),
            None,
        )
        if base_i is not None:
            base = _plain(fl.tensors[base_i][1])
            name = _unique_name(fl.tensors[base_i][0], taken)
        else:
            base = torch.empty(0, dtype=torch.uint8, device=first.device).set_(
                first.untyped_storage(), lo, (hi - lo,), (1,)
            )
            name = _unique_name(first_path + ("storage",), taken)
        out.stored.append(StoredTensor(name, base))
        for i in idxs:
            path, t, leaf = fl.tensors[i]
            start = _byte_extent(t)[0] - lo
            es = t.element_size()
            if base_i is not None and (t.dtype, t.storage_offset(), tuple(t.shape), t.stride()) == (
                base.dtype,
                base.storage_offset(),
                tuple(base.shape),
                base.stride(),
            ):
                _fill_leaf(leaf, t, name, view=None)
            elif start % es == 0:
                _fill_leaf(leaf, t, name, view=[TORCH_TO_ST[t.dtype], start // es, list(t.shape), list(t.stride())])
            else:
                # A view at a byte offset its dtype cannot address: store a copy (sharing is lost).
                own = _unique_name(path, taken)
                out.stored.append(StoredTensor(own, _plain(t)))
                _fill_leaf(leaf, t, own, view=None)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _fill_leaf(leaf: dict, t: torch.Tensor, entry: str, *, view: list | None) -> None:
    leaf["e"] = entry
    if view is not None:
        leaf["v"] = view
    if t.device.type != "cpu":
        leaf["d"] = str(t.device)
    if type(t) is torch.nn.Parameter:
        leaf["p"] = 1
    if t.requires_grad:
        leaf["g"] = 1


# --- rebuild --------------------------------------------------------------------------------------


def _bad(msg: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"malformed skeleton: {msg}")


def check_map_location(map_location: Any) -> None:
    if map_location is not None and not isinstance(map_location, (str, torch.device, dict)):
        raise ArgumentTypeError(
            "map_location must be None, a str, a torch.device or a dict of device strings (callables are not supported)"
        )


def resolve_device(recorded: str, map_location: Any) -> torch.device:
    """Where a tensor saved on ``recorded`` goes, following ``torch.load``'s map_location forms."""
    if map_location is None:
        return torch.device(recorded)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(recorded, recorded))
    raise ArgumentTypeError(
        "map_location must be None, a str, a torch.device or a dict of device strings (callables are not supported)"
    )


class _Rebuilder:
    def __init__(self, tensors: dict[str, torch.Tensor], map_location: Any):
        self.tensors = tensors
        self.map_location = map_location
        self._moved: dict[tuple[str, torch.device], torch.Tensor] = {}

    def base(self, entry: str, device: torch.device) -> torch.Tensor:
        key = (entry, device)
        t = self._moved.get(key)
        if t is None:
            if entry not in self.tensors:
                raise _bad(f"refers to missing tensor {entry!r:.80}")
            try:
                t = self._moved[key] = self.tensors[entry].to(device)
            except (RuntimeError, AssertionError) as e:  # torch raises AssertionError when CUDA is absent
                raise DeviceUnavailableError(
                    f"tensor `{entry}` goes to {device}, which is not available here ({str(e).splitlines()[0][:100]});"
                    " pass map_location='cpu' (or a dict mapping devices)"
                ) from e
        return t

    def tensor(self, leaf: Any) -> torch.Tensor:
        if not isinstance(leaf, dict) or not isinstance(leaf.get("e"), str):
            raise _bad("tensor leaf without an entry name")
        recorded = leaf.get("d", "cpu")
        try:
            device = resolve_device(recorded if isinstance(recorded, str) else "?", self.map_location)
        except RuntimeError as e:
            raise _bad(f"bad device {recorded!r:.40} for {leaf['e']!r:.80}") from e
        base = self.base(leaf["e"], device)
        view = leaf.get("v")
        if view is None:
            t = base
        else:
            if not (isinstance(view, list) and len(view) == 4 and view[0] in ST_TO_TORCH):
                raise _bad(f"bad view of {leaf['e']!r:.80}")
            dtype = ST_TO_TORCH[view[0]]
            offset, size, stride = view[1], view[2], view[3]
            probe = torch.empty(0, dtype=dtype, device=device)
            if not (
                type(offset) is int
                and isinstance(size, list)
                and isinstance(stride, list)
                and len(size) == len(stride) <= 64
                and all(type(x) is int for x in size + stride)
            ):
                raise _bad(f"bad view of {leaf['e']!r:.80}")
            need = (offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1) * probe.element_size()
            if offset < 0 or min(size + stride + [0]) < 0 or (all(size) and need > base.untyped_storage().nbytes()):
                raise _bad(f"view of {leaf['e']!r:.80} reaches outside its storage")
            t = probe.set_(base.untyped_storage(), offset, size, stride)
        if leaf.get("p"):
            return torch.nn.Parameter(t, requires_grad=bool(leaf.get("g")))
        if leaf.get("g"):
            t = t.detach().requires_grad_(True)
        return t

    def node(self, n: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH + 2:
            raise _bad("nested too deeply")
        if n is None or isinstance(n, (bool, str)):
            return n
        if not isinstance(n, list) or not n or not isinstance(n[0], str) or len(n) != 2:
            raise _bad(f"unknown node {str(n)[:60]}")
        tag, val = n
        if tag == "T":
            return self.tensor(val)
        try:
            if tag == "i":
                if not isinstance(val, str) or len(val) > 1_000_000:
                    raise ValueError("int node must be a hex string")
                return int(val, 16)
            if tag == "f":
                return float.fromhex(val) if val not in ("nan", "inf", "-inf") else float(val)
            if tag == "dtype":
                return _DTYPE_BY_NAME[val]
            if tag == "size":
                return torch.Size([int(v) for v in val])
            if tag == "dev":
                return torch.device(val)
            if tag in ("l", "t"):
                items = [self.node(v, depth + 1) for v in val]
                return items if tag == "l" else tuple(items)
            if tag in ("d", "od"):
                out = {} if tag == "d" else collections.OrderedDict()
                for k, v in val:
                    out[self.node(k, depth + 1) if isinstance(k, list) else k] = self.node(v, depth + 1)
                return out
        except CertckptError:
            raise
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError) as e:
            raise _bad(f"bad {tag!r} node ({e.__class__.__name__}: {str(e)[:80]})") from e
        raise _bad(f"unknown node tag {tag!r:.20}")


def rebuild(skeleton: Any, tensors: dict[str, torch.Tensor], *, map_location: Any = None) -> Any:
    """Rebuild the saved object from its skeleton and the loaded (CPU) tensors."""
    return _Rebuilder(tensors, map_location).node(skeleton)
