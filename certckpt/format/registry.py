"""The allow-list of classes a checkpoint may rebuild: ``certckpt.register_type``.

A file names the classes of its namedtuples, dataclasses, enums and custom values by a string; it
never imports anything. ``load`` rebuilds an instance of a class only when this process registered
that name, and falls back to plain data (with a warning) otherwise, so a hostile file can at most
produce dicts, tuples and values, never run a constructor the program did not vouch for.
No torch import.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = ["RegisteredType", "register_type", "unregister_type", "lookup_class", "lookup_name", "type_name", "kind_of"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.<>-]{0,199}$")


@dataclass(frozen=True, slots=True)
class RegisteredType:
    """One allowed class.

    Attributes:
        cls: the class.
        name: the name files record for it.
        kind: ``namedtuple``, ``dataclass``, ``enum`` or ``custom``.
        encode: custom kind: turns an instance into storable plain data.
        decode: custom kind: turns that plain data back into an instance.
    """

    cls: type
    name: str
    kind: str
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None


_lock = threading.Lock()
_by_name: dict[str, RegisteredType] = {}
_by_class: dict[type, RegisteredType] = {}


def type_name(cls: type) -> str:
    """The default name a file records for ``cls``: ``module.QualifiedName``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def kind_of(cls: type) -> str | None:
    """``namedtuple``, ``dataclass`` or ``enum`` when certckpt knows how to take ``cls`` apart, else None."""
    if isinstance(cls, type) and issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return "namedtuple"
    if isinstance(cls, type) and issubclass(cls, enum.Enum):
        return "enum"
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return "dataclass"
    return None


def register_type(
    cls: type | None = None,
    *,
    name: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
) -> Any:
    """Allow ``load`` to rebuild instances of ``cls`` (also usable as a class decorator).

    Namedtuples, dataclasses and enums need no codec: they are taken apart field by field (enums by
    value) and rebuilt without calling ``__init__`` (dataclasses, like ``copy`` does) or by
    ``cls(value)`` (enums). Any other class needs ``encode`` (instance -> plain data certckpt can
    store) and ``decode`` (that data -> instance).

    Args:
        cls: the class to allow.
        name: the name recorded in files (default ``module.QualifiedName``); give one that survives
            moving the class to another module.
        encode: instance -> storable plain data (custom classes only).
        decode: plain data -> instance (custom classes only).

    Returns:
        ``cls`` itself (a decorator when ``cls`` is omitted).

    Raises:
        ConfigurationError: a codec is missing, the name is malformed or taken by another class.

    Example:
        >>> @certckpt.register_type
        ... @dataclasses.dataclass
        ... class TrainConfig:
        ...     lr: float = 1e-3
        >>> certckpt.register_type(Fraction, encode=lambda f: (f.numerator, f.denominator),
        ...                        decode=lambda t: Fraction(*t))
    """
    if cls is None:
        return lambda c: register_type(c, name=name, encode=encode, decode=decode)
    if not isinstance(cls, type):
        raise ConfigurationError(f"register_type takes a class, got {type(cls).__name__}")
    if (encode is None) != (decode is None):
        raise ConfigurationError(f"register_type({cls.__qualname__}): give both encode= and decode=, or neither")
    kind = "custom" if encode is not None else kind_of(cls)
    if kind is None:
        raise ConfigurationError(
            f"register_type({cls.__qualname__}): not a namedtuple, dataclass or Enum; "
            "give encode= (instance -> plain data) and decode= (plain data -> instance)"
        )
    if kind == "custom" and not (callable(encode) and callable(decode)):
        raise ConfigurationError(f"register_type({cls.__qualname__}): encode and decode must be callables")
    name = type_name(cls) if name is None else name
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"register_type({cls.__qualname__}): name {name!r} must be 1-200 letters, digits, '_', '.', '-', '<', '>'"
        )
    with _lock:
        other = _by_name.get(name)
        if other is not None and other.cls is not cls:
            raise ConfigurationError(
                f"register_type({cls.__qualname__}): the name {name!r} is registered for {type_name(other.cls)}"
            )
        old = _by_class.pop(cls, None)
        if old is not None:
            _by_name.pop(old.name, None)
        entry = RegisteredType(cls=cls, name=name, kind=kind, encode=encode, decode=decode)
        _by_name[name] = entry
        _by_class[cls] = entry
    return cls


def unregister_type(cls: type) -> None:
    """Forget ``cls`` (tests, plug-in unloading); unknown classes are ignored."""
    with _lock:
        old = _by_class.pop(cls, None)
        if old is not None:
            _by_name.pop(old.name, None)


def lookup_class(cls: type) -> RegisteredType | None:
    return _by_class.get(cls)


def lookup_name(name: str) -> RegisteredType | None:
    return _by_name.get(name)
