"""Which Lightning is installed, and the classes certckpt's plugin and callback derive from.

Lightning ships under two names: ``lightning.pytorch`` (the ``lightning`` package) and
``pytorch_lightning``. Each has its own ``CheckpointIO`` and ``Callback`` classes, and a Trainer
accepts only instances of its own package's classes. certckpt's classes derive from the classes of
every installed package, so that they work with whichever Trainer the user's script imports.

Lightning's ``AttributeDict`` (a ``dict`` subclass in checkpoints' hyper-parameters) is registered
with certckpt's type registry here, so that it comes back as an ``AttributeDict``, never pickled.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any

from certckpt.errors import ArgumentTypeError, MissingDependencyError
from certckpt.format.registry import lookup_class, register_type

from .presence import installed

__all__ = [
    "LightningPackage",
    "PACKAGES",
    "CHECKPOINT_IO_BASES",
    "CALLBACK_BASES",
    "package_of",
    "version_text",
    "warn_outside",
]


@dataclass(frozen=True, slots=True)
class LightningPackage:
    """One installed Lightning: its trainer package (``name``) and its fabric package."""

    name: str
    fabric: str
    module: ModuleType

    def sub(self, path: str) -> ModuleType:
        """A submodule of the trainer package, e.g. ``sub("core.saving")``."""
        return importlib.import_module(f"{self.name}.{path}")


def _find() -> tuple[LightningPackage, ...]:
    found = []
    for name, fabric in (("lightning.pytorch", "lightning.fabric"), ("pytorch_lightning", "lightning_fabric")):
        if installed(name):
            found.append(LightningPackage(name=name, fabric=fabric, module=importlib.import_module(name)))
    if not found:
        raise MissingDependencyError(
            "certckpt.integrations.lightning needs PyTorch Lightning: pip install 'certckpt[lightning]'"
        )
    return tuple(found)


def _bases(path: str, attr: str) -> tuple[type, ...]:
    out: list[type] = []
    for pkg in PACKAGES:
        cls = getattr(pkg.sub(path), attr)
        if cls not in out:
            out.append(cls)
    return tuple(out)


def _register_attribute_dicts() -> None:
    for pkg in PACKAGES:
        cls = importlib.import_module(f"{pkg.fabric}.utilities.data").AttributeDict
        if lookup_class(cls) is None:
            register_type(cls, encode=dict, decode=cls)


PACKAGES = _find()
CHECKPOINT_IO_BASES = _bases("plugins.io", "CheckpointIO")
CALLBACK_BASES = _bases("callbacks", "Callback")
_register_attribute_dicts()


def package_of(obj: Any) -> LightningPackage:
    """The installed Lightning whose ``LightningModule`` / ``LightningDataModule`` / ``Trainer`` ``obj`` is
    (an instance or a class)."""
    cls = obj if isinstance(obj, type) else type(obj)
    for pkg in PACKAGES:
        kinds = tuple(getattr(pkg.module, n) for n in ("LightningModule", "LightningDataModule", "Trainer"))
        if issubclass(cls, kinds):
            return pkg
    names = " or ".join(p.name for p in PACKAGES)
    raise ArgumentTypeError(f"{cls.__qualname__} is not a LightningModule, LightningDataModule or Trainer of {names}")


def version_text() -> str:
    """``"pytorch_lightning 2.6.6"``: recorded in each checkpoint's metadata."""
    return ", ".join(f"{p.name} {getattr(p.module, '__version__', '?')}" for p in PACKAGES)


def _internal_prefixes() -> tuple[str, ...]:
    """Where the frames a warning must not be attributed to live: certckpt, every installed
    Lightning (its trainer and fabric packages), and the thread machinery a saver thread starts in."""
    import concurrent.futures

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # certckpt/integrations/: below certckpt/
    for pkg in PACKAGES:
        roots.append(pkg.module.__file__ or "")
        fabric = sys.modules.get(pkg.fabric)
        roots.append(getattr(fabric, "__file__", None) or "")
    dirs = tuple(os.path.dirname(os.path.abspath(r)) + os.sep for r in roots if r)  # certckpt/ and each package
    return (*dirs, os.path.abspath(threading.__file__), os.path.dirname(os.path.abspath(concurrent.futures.__file__)))


_INTERNAL = _internal_prefixes()


def warn_outside(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the user's call: the first frame outside certckpt and Lightning (Lightning
    calls a ``CheckpointIO`` through its own layers, ``AsyncCheckpointIO``'s ``wrapper.py`` among them,
    so a fixed ``stacklevel`` lands in Lightning); at certckpt's own line when no frame of this thread
    is the user's (a saver thread). The frame is computed rather than left to Python 3.12's
    ``skip_file_prefixes`` so that 3.10 and 3.11 attribute it alike, and the saver-thread case falls
    back to certckpt rather than to ``threading.py``."""
    frame: FrameType | None = sys._getframe(1)  # the certckpt line that warns: stacklevel 2
    level, found = 2, 2
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_INTERNAL) and not frame.f_code.co_filename.startswith("<"):
            found = level
            break
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=found)
