"""Non-tensor values of a DCP state (learning rates, step counts, lists of names): data, never pickle.

DCP hands a storage layer such values as ``BytesIO`` holding ``torch.save`` output (a pickle), and on
load gives the bytes back to ``planner.load_bytes``, which unpickles them. certckpt does neither:

- on save it asks the planner for the value itself (``planner.lookup_object(index)``, which DCP's
  ``DefaultSavePlanner`` has) and stores it as a certckpt skeleton node (``docs/format.md`` section 6:
  ints, floats, strings, lists, tuples, dicts, dataclasses...), inside the certified manifest. A
  value that certckpt cannot store without pickle, or one holding tensors, is refused before the
  manifest is written, naming it;
- on load it rebuilds the value from that node (plain data only; classes come back only when
  registered with ``certckpt.register_type``) and places it where ``DefaultLoadPlanner.load_bytes``
  would have, without calling it. A planner with its own ``load_value(read_item, value)`` gets the
  value there; a planner that overrides ``load_bytes`` (it would unpickle) is refused.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem, SavePlanner, WriteItem

from certckpt.errors import ConfigurationError, CorruptCheckpointError, UnsupportedObjectError
from certckpt.format.header import printable
from certckpt.format.skeleton import flatten, rebuild

__all__ = ["encode_value", "value_of", "decode_value", "deliver_value"]


def value_of(planner: SavePlanner, item: WriteItem) -> Any:
    """The value behind a bytes item, asked of the planner (never its pickled bytes)."""
    lookup = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise ConfigurationError(
            f"`{printable(item.index.fqn)}` is a non-tensor value and the planner {type(planner).__name__} only"
            " gives it as pickled bytes; CertifiedWriter stores values as data: use DefaultSavePlanner (or a"
            " subclass, which has lookup_object)"
        )
    return lookup(item.index)


def encode_value(value: Any, fqn: str) -> Any:
    """The skeleton node for a non-tensor value.

    Raises:
        UnsupportedObjectError: certckpt cannot store it without pickle, or it holds tensors.
    """
    try:
        flat = flatten(value)
    except UnsupportedObjectError as e:
        problems = [p.replace("obj", f"`{printable(fqn)}`", 1) for p in getattr(e, "problems", [str(e)])]
        err = UnsupportedObjectError(
            "; ".join(problems)
            + ". CertifiedWriter stores non-tensor values as data, never pickled; nothing was committed"
        )
        # every refusal, for callers that fix them programmatically (as format.skeleton attaches them);
        # errors.py declares no such attribute, and errors.py is outside this change
        err.problems = problems  # type: ignore[attr-defined]
        raise err from e
    if flat.stored:
        raise UnsupportedObjectError(
            f"`{printable(fqn)}`: a non-tensor value that holds tensors cannot be stored by CertifiedWriter;"
            " put the tensors in the state dict as their own entries"
        )
    return flat.skeleton


def decode_value(node: Any, fqn: str, source: str) -> Any:
    """Rebuild a value from its node (untrusted: plain data only)."""
    try:
        return rebuild(node, {})
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{source}: value `{printable(fqn)}`: {e}") from e


def deliver_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """Put a loaded value where the planner wants it, without going through ``load_bytes``."""
    custom = getattr(planner, "load_value", None)
    if callable(custom):
        custom(item, value)
        return
    if isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        fqn = item.dest_index.fqn
        if planner.flatten_state_dict:
            _set_element(planner.original_state_dict, planner.mappings[fqn], value)
        else:
            planner.state_dict[fqn] = value
        return
    raise ConfigurationError(
        f"the load planner {type(planner).__name__} overrides load_bytes, which unpickles; CertifiedReader"
        f" never hands out pickled bytes (value `{printable(item.dest_index.fqn)}`): give the planner a"
        " load_value(read_item, value) method instead"
    )


def _set_element(root: dict, path: tuple, value: Any) -> None:
    # DCP's own rule for placing a flattened value back into the nested state dict (the one
    # DefaultLoadPlanner.load_bytes applies through torch's private _traverse.set_element).
    cur: Any = root
    for prev, key in zip(path[:-1], path[1:]):
        default: Any = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        else:
            while len(cur) <= prev:
                cur.append(None)
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    key = path[-1]
    if type(key) is int:
        while len(cur) <= key:
            cur.append(None)
    cur[key] = value
