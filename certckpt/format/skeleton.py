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
numpy and everyday Python values (sets, paths, datetimes, namedtuples, dataclasses...) have their own
tags, encoded and decoded by ``leaves``; every refusal of one ``flatten`` is reported in one error.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from certckpt.errors import (
    ArgumentTypeError,
    CertckptError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    UnsupportedObjectError,
)

from . import leaves
from .header import MAX_DIM  # torch sizes, strides, offsets and byte counts are int64
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


def _fmt_path(path: leaves.KeyPath) -> str:
    return "obj" + "".join(f"[{k!r}]" for k in path)


def _tensor_problem(t: torch.Tensor) -> tuple[str, str] | None:
    """``(what, fix)`` when ``t`` cannot be stored, else None."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return (
            f"tensor subclass {type(t).__name__} cannot be stored without pickle",
            "convert it with .as_subclass(torch.Tensor)",
        )
    if t.layout != torch.strided:
        return (
            f"{t.layout} tensors are not supported",
            "convert with .to_dense() (or store indices and values as separate tensors)",
        )
    if t.is_quantized:
        return (
            "quantized tensors are not supported",
            "store .int_repr() with its scale and zero_point, or .dequantize()",
        )
    if t.device.type == "meta":
        return ("meta tensors have no data to save", "materialize the tensor first")
    if getattr(t, "is_nested", False):
        return ("nested tensors are not supported", "unbind it into a list of tensors")
    if t.dtype not in TORCH_TO_ST:
        return (
            f"dtype {t.dtype} cannot be stored in safetensors",
            "cast it (e.g. complex128 to two float64 tensors, or store it as a numpy array)",
        )
    return None


MAX_LISTED = 25  # refusals spelled out in one error; the rest are counted


class _Flattener:
    """Walks the object once, collecting every refusal so that one error lists them all."""

    def __init__(self) -> None:
        self.tensors: list[tuple[leaves.KeyPath, torch.Tensor, dict[str, Any]]] = []  # (path, tensor, leaf to fill)
        self._active: set[int] = set()
        self.problems: list[str] = []

    def refuse(self, path: leaves.KeyPath, what: str, fix: str) -> None:
        self.problems.append(f"{_fmt_path(path)}: {what}; {fix}")
        return None

    def add_tensor(self, t: torch.Tensor, path: leaves.KeyPath) -> Any:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            plain, refused = leaves.plain_tensor(t)  # a replicated DTensor is stored as its full tensor
            if refused is not None or plain is None:
                return self.refuse(path, *(refused or ("an unknown tensor subclass", "convert it to a tensor")))
            t = plain
        problem = _tensor_problem(t)
        if problem is not None:
            return self.refuse(path, *problem)
        leaf: dict[str, Any] = {}
        self.tensors.append((path, t, leaf))
        return leaf

    def dict_items(self, obj: Any, path: leaves.KeyPath) -> list[list[Any]]:
        items = []
        for k, v in obj.items():
            if type(k) is str:
                key: Any = k
            elif type(k) is int:
                key = ["i", hex(k)]
            elif isinstance(k, (torch.Tensor, np.ndarray)):
                self.refuse(path, f"dict key {k!r:.60} is a tensor", "use str, int, float, bool, None or tuple keys")
                continue
            else:
                before = len(self.tensors)
                key = self.walk(k, path + (k,))
                if len(self.tensors) != before:
                    del self.tensors[before:]
                    self.refuse(path, f"dict key {k!r:.60} holds a tensor", "use keys without tensors")
                    continue
            items.append([key, self.walk(v, path + (k,))])
        return items

    def walk(self, obj: Any, path: leaves.KeyPath) -> Any:
        if len(path) > MAX_DEPTH:
            return self.refuse(path, f"nesting deeper than {MAX_DEPTH} levels", "flatten the structure")
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
            leaf = self.add_tensor(obj, path)
            return None if leaf is None else ["T", leaf]
        if id(obj) in self._active:
            return self.refuse(path, "the object contains itself", "break the reference cycle")
        self._active.add(id(obj))
        try:
            if tp in (list, tuple):
                return ["l" if tp is list else "t", [self.walk(v, path + (i,)) for i, v in enumerate(obj)]]
            if tp in (dict, collections.OrderedDict):
                return ["d" if tp is dict else "od", self.dict_items(obj, path)]
            node = leaves.encode(obj, path, self)
            if node is not leaves.NOT_A_LEAF:
                return node
        finally:
            self._active.discard(id(obj))
        what, fix = leaves.refusal_advice(obj)
        return self.refuse(path, f"{what} cannot be stored without pickle", fix)


def _refusal(problems: list[str]) -> UnsupportedObjectError:
    if len(problems) == 1:
        err = UnsupportedObjectError(f"{problems[0]}. Nothing was written.")
    else:
        listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        err = UnsupportedObjectError(
            f"{len(problems)} values cannot be stored without pickle. Nothing was written.\n{listed}{more}"
        )
    # errors.py does not declare the attribute (dcp/values.py sets it too); declaring it there removes the ignore
    err.problems = list(problems)  # type: ignore[attr-defined]  # every refusal, for callers that fix them programmatically
    return err


def _unique_name(path: leaves.KeyPath, taken: set[str]) -> str:
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
    start = int(t.storage_offset()) * es  # (a SymInt only while tracing, which saving never is)
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * es


def flatten(obj: Any) -> Flattened:
    """Split ``obj`` into a JSON skeleton and the tensors to store; refuse anything unsupported.

    Raises:
        UnsupportedObjectError: names where in ``obj`` every offending value sits (all of them, in
            one error; ``.problems`` lists them), with a fix for each.
    """
    fl = _Flattener()
    skeleton = fl.walk(obj, ())
    if fl.problems:
        raise _refusal(fl.problems)
    out = Flattened(skeleton=skeleton)
    taken: set[str] = set()

    groups: dict[tuple[torch.device | str, int], list[int]] = {}
    for i, (_, t, _) in enumerate(fl.tensors):
        storage = t.untyped_storage()
        # Empty tensors own no bytes to share (their storages may all report address 0).
        key = (t.device, storage.data_ptr()) if t.numel() and storage.nbytes() else ("solo", i)
        groups.setdefault(key, []).append(i)

    for idxs in groups.values():
        views: dict[tuple[object, ...], list[int]] = {}
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


def _fill_leaf(leaf: dict[str, Any], t: torch.Tensor, entry: str, *, view: list[object] | None) -> None:
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


_MAP_LOCATION_FORMS = (
    "map_location must be None, a str, a torch.device, a dict of device strings, or a callable"
    " fn(tensor, location) -> tensor (as torch.load calls it)"
)


def check_map_location(map_location: Any) -> None:
    if map_location is not None and not (isinstance(map_location, (str, torch.device, dict)) or callable(map_location)):
        raise ArgumentTypeError(_MAP_LOCATION_FORMS)


def resolve_device(recorded: str, map_location: Any) -> torch.device:
    """Where a tensor saved on ``recorded`` goes, for the non-callable ``torch.load`` map_location forms."""
    if map_location is None:
        return torch.device(recorded)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(recorded, recorded))
    raise ArgumentTypeError(_MAP_LOCATION_FORMS)


def _unavailable(entry: str, where: Any, e: BaseException) -> DeviceUnavailableError:
    why = str(e).splitlines()[0][:100] if str(e) else repr(e)
    return DeviceUnavailableError(
        f"tensor `{entry}` goes to {where}, which is not available here ({why});"
        " pass map_location='cpu' (or a dict mapping devices)"
    )


def _view_problem(offset: int, size: list[int], stride: list[int], element_size: int, nbytes: int) -> str | None:
    """Why a view ``(offset, size, stride)`` (in elements of ``element_size`` bytes) of a storage of
    ``nbytes`` bytes read from a file cannot be made (None when it can). Untrusted numbers, bounded
    here in Python before torch multiplies them in int64: every value in int64; the element count
    (torch multiplies every size, zeros last included) and its bytes in int64; the last element's
    offset ``offset + sum((size - 1) * stride)`` and its end in int64 (a zero-sized dimension
    included: a view of no element has no business with strides past what a tensor can address);
    and the view inside its storage: every element of a non-empty view, the offset of an empty one."""
    if offset < 0 or min([*size, *stride, 0]) < 0:
        return "has a negative offset, size or stride"
    if max([offset, *size, *stride]) > MAX_DIM:
        return "has an offset, size or stride above 2**63 - 1"
    count = 1
    for s in size:
        count *= max(s, 1)  # at most 64 factors below 2**63: bounded
    if count * element_size > MAX_DIM:
        return "has more elements than a tensor can hold (their bytes would pass 2**63 - 1)"
    last = offset + sum(max(s - 1, 0) * st for s, st in zip(size, stride))
    if (last + 1) * element_size > MAX_DIM:
        return "has strides that overflow (its last element lies past 2**63 - 1 bytes)"
    if all(size) and (last + 1) * element_size > nbytes:
        return "reaches outside its storage"
    if not all(size) and offset * element_size > nbytes:
        return "starts outside its storage"
    return None


class _Rebuilder:
    def __init__(self, tensors: dict[str, torch.Tensor], map_location: Any):
        self.tensors = tensors
        self.map_location = map_location
        self._moved: dict[tuple[str, str], torch.Tensor] = {}
        self._copies: dict[int, torch.Tensor] = {}

    def _source(self, entry: str) -> torch.Tensor:
        if entry not in self.tensors:
            raise _bad(f"refers to missing tensor {entry!r:.80}")
        return self.tensors[entry]

    def _place(self, entry: str, recorded: str) -> torch.Tensor:
        src = self._source(entry)
        fn = self.map_location
        if callable(fn) and not isinstance(fn, (str, torch.device, dict)):
            # torch.load's callable form: fn(storage on the CPU, saved location) -> storage, None
            # meaning "where it was saved"; here the storage is the loaded CPU tensor, once per entry.
            try:
                out = fn(src, recorded)
                if out is None:
                    return src.to(torch.device(recorded))
                if isinstance(out, (torch.UntypedStorage, torch.TypedStorage)):
                    return src.to(out.device)
            except (RuntimeError, AssertionError) as e:
                raise _unavailable(entry, f"the device map_location({recorded!r}) chose", e) from e
            if not isinstance(out, torch.Tensor) or out.dtype != src.dtype or out.shape != src.shape:
                raise ArgumentTypeError(
                    f"map_location returned {type(out).__name__} for tensor `{entry}`; it must return the tensor it"
                    " was given (moved to a device), a storage, or None"
                )
            return out
        device = resolve_device(recorded, fn)
        try:
            return src.to(device)
        except (RuntimeError, AssertionError) as e:  # torch raises AssertionError when CUDA is absent
            raise _unavailable(entry, device, e) from e

    def base(self, entry: str, recorded: str) -> torch.Tensor:
        key = (entry, recorded)
        t = self._moved.get(key)
        if t is None:
            t = self._moved[key] = self._place(entry, recorded)
        return t

    def _view(self, leaf: dict[str, Any], base: torch.Tensor) -> torch.Tensor:
        view = leaf.get("v")
        if view is None:
            return base
        if not (isinstance(view, list) and len(view) == 4 and view[0] in ST_TO_TORCH):
            raise _bad(f"bad view of {leaf['e']!r:.80}")
        dtype = ST_TO_TORCH[view[0]]
        offset, size, stride = view[1], view[2], view[3]
        probe = torch.empty(0, dtype=dtype, device=base.device)
        if not (
            type(offset) is int
            and isinstance(size, list)
            and isinstance(stride, list)
            and len(size) == len(stride) <= 64
            and all(type(x) is int for x in size + stride)
        ):
            raise _bad(f"bad view of {leaf['e']!r:.80}")
        # The view's offset counts from the entry's first byte, and it must stay within the entry's
        # bytes: a mapped load's entries all share one storage, the whole file (header included).
        base = self._own_region(base, probe.element_size())
        start = base.storage_offset() * base.element_size()
        problem = _view_problem(offset, size, stride, probe.element_size(), base.numel() * base.element_size())
        if problem is not None:
            raise _bad(f"view of {leaf['e']!r:.80} {problem}")
        try:
            return probe.set_(base.untyped_storage(), start // probe.element_size() + offset, size, stride)
        except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # (bounds above: not expected)
            raise _bad(f"view of {leaf['e']!r:.80} is refused by torch ({str(e).splitlines()[0][:80]})") from e

    def _own_region(self, base: torch.Tensor, element_size: int) -> torch.Tensor:
        """``base`` when a view of ``element_size`` can address it in its storage (contiguous, starting at
        a multiple of that size), else a copy of it in storage of its own (made once per entry: its views
        still share it). A mapped entry may sit at any offset of the file."""
        if base.is_contiguous() and (base.storage_offset() * base.element_size()) % element_size == 0:
            return base
        key = id(base)  # (every base lives in self._moved or self.tensors until the rebuild ends)
        own = self._copies.get(key)
        if own is None:
            own = self._copies[key] = base.clone(memory_format=torch.contiguous_format)
        return own

    def tensor(self, leaf: Any) -> torch.Tensor:
        if not isinstance(leaf, dict) or not isinstance(leaf.get("e"), str):
            raise _bad("tensor leaf without an entry name")
        recorded = leaf.get("d", "cpu")
        if not isinstance(recorded, str):
            raise _bad(f"bad device for {leaf['e']!r:.80}")
        try:
            base = self.base(leaf["e"], recorded)
        except RuntimeError as e:
            if isinstance(e, CertckptError):
                raise
            raise _bad(f"bad device {recorded!r:.40} for {leaf['e']!r:.80}") from e
        t = self._view(leaf, base)
        if leaf.get("g") and not (t.is_floating_point() or t.is_complex()):  # torch raises RuntimeError
            raise _bad(f"tensor {leaf['e']!r:.80} of {t.dtype} requires grad (only float and complex tensors can)")
        if leaf.get("p"):
            return torch.nn.Parameter(t, requires_grad=bool(leaf.get("g")))
        if leaf.get("g"):
            t = t.detach().requires_grad_(True)
        return t

    def cpu_tensor(self, leaf: Any) -> torch.Tensor:
        """A numpy array's tensor: always on the CPU, whatever map_location says (a loader that read
        every entry straight to a device hands it back here)."""
        if not isinstance(leaf, dict) or not isinstance(leaf.get("e"), str):
            raise _bad("tensor leaf without an entry name")
        src = self._source(leaf["e"])
        if src.device.type != "cpu":
            key = (leaf["e"], "numpy:cpu")
            if key not in self._moved:
                self._moved[key] = src.cpu()
            src = self._moved[key]
        return self._view(leaf, src)

    def items(self, val: Any, depth: int) -> list[tuple[Any, Any]]:
        # A key is a JSON string, or a node (int, float, bool, None, tuple...: files before the
        # numpy/everyday-values tags only ever wrote ["i", hex] here).
        return [(k if isinstance(k, str) else self.node(k, depth + 1), self.node(v, depth + 1)) for k, v in val]

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
            return self._tagged(tag, val, depth)
        except CertckptError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError) as e:
            raise _bad(f"bad {tag!r} node ({e.__class__.__name__}: {str(e)[:80]})") from e

    def _tagged(self, tag: str, val: Any, depth: int) -> Any:
        """The value of a tagged node other than a tensor. A malformed ``val`` raises a built-in error,
        which ``node`` words as a malformed skeleton; an unknown tag raises that error itself."""
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
            out: dict[Any, Any] = {} if tag == "d" else collections.OrderedDict()
            out.update(self.items(val, depth))
            return out
        if tag in leaves.DECODERS:
            return leaves.decode(tag, val, self, depth)
        raise _bad(f"unknown node tag {tag!r:.20} (written by a newer certckpt? pip install -U certckpt)")


def rebuild(skeleton: Any, tensors: dict[str, torch.Tensor], *, map_location: Any = None) -> Any:
    """Rebuild the saved object from its skeleton and the loaded (CPU) tensors.

    Args:
        map_location: any ``torch.load`` form; a callable is called once per stored tensor as
            ``fn(cpu_tensor, saved_location)`` and returns the tensor moved, a storage, or None.
    """
    return _Rebuilder(tensors, map_location).node(skeleton)
