"""``load_from_checkpoint``: ``LightningModule.load_from_checkpoint`` for certified files.

Lightning's classmethod reads the file with ``torch.load`` itself, never through the Trainer's
``CheckpointIO``, so a certified checkpoint needs this function instead, or the ``CertifiedLoading``
mixin, which makes ``LitModel.load_from_checkpoint(path)`` itself take certified files. It reads the file with
``certckpt.load`` (digests checked, nothing unpickled) and then does what Lightning's own loader
does with the dictionary: migrate it to the installed Lightning's layout, apply ``hparams_file``
and keyword overrides, build the object from the saved hyper-parameters and load its state.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from certckpt.errors import ArgumentTypeError, CertckptError, NotACheckpointError
from certckpt.format.reader import load
from certckpt.format.verify import inspect

from .compat import package_of

__all__ = ["load_from_checkpoint", "CertifiedLoading"]


def _default_map_location(tensor: torch.Tensor, saved: str) -> torch.Tensor | None:
    """Lightning's default: each tensor where it was saved, or the CPU when that device is absent."""
    if saved.startswith("cuda") and not torch.cuda.is_available():
        return tensor
    if saved.startswith("mps") and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return tensor
    return None


def load_from_checkpoint(
    cls: type[Any],
    checkpoint_path: Any,
    *,
    map_location: Any = None,
    hparams_file: Any = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a certified checkpoint.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) class to build.
        checkpoint_path: the certified file's path or URL.
        map_location: as Lightning's (a device, a dict or a callable ``fn(tensor, saved_location)``);
            default: where each tensor was saved, the CPU when that device is absent.
        hparams_file: a ``.yaml`` or ``.csv`` file whose hyper-parameters replace the saved ones.
        strict: ``load_state_dict``'s strictness (default: the module's ``strict_loading``).
        **kwargs: hyper-parameters overriding the saved ones (as with Lightning's).

    Returns:
        The object, its weights loaded (moved to the device of the loaded state, as Lightning does).

    Raises:
        NotACheckpointError: not a certified file; CorruptCheckpointError: it does not verify.

    Example:
        >>> model = load_from_checkpoint(LitModel, "ckpt/epoch=3-step=400.ckpt", map_location="cpu")
    """
    pkg = package_of(cls)
    saving = pkg.sub("core.saving")
    migration = pkg.sub("utilities.migration.utils")
    path = _location_text(checkpoint_path)
    checkpoint = load(path, map_location if map_location is not None else _default_map_location)
    # The same steps as Lightning's own ``_load_from_checkpoint`` after its torch.load.
    checkpoint = migration._pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            hparams = saving.load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            hparams = saving.load_hparams_from_yaml(hparams_file)
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = hparams
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pkg.module.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint.get("state_dict") or {}
    tensor = next((t for t in state_dict.values() if isinstance(t, torch.Tensor)), None)
    return model.to(tensor.device) if tensor is not None else model


def _location_text(path: Any) -> str:
    path = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(path, str):
        raise ArgumentTypeError(f"checkpoint_path must be a str or os.PathLike, got {type(path).__name__}")
    return path


class CertifiedLoading:
    """Mix into a ``LightningModule`` (or ``LightningDataModule``), before it, so that the class's own
    ``load_from_checkpoint`` reads certified files.

    A certified file goes through ``load_from_checkpoint`` above (digests checked, nothing
    unpickled); anything else (a ``torch.save`` checkpoint) goes to Lightning's own loader, with its
    own ``weights_only`` rules.

    Example:
        >>> class LitModel(CertifiedLoading, L.LightningModule): ...
        >>> model = LitModel.load_from_checkpoint(certckpt_latest_good, map_location="cpu")
    """

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        if _is_certified(checkpoint_path):
            return load_from_checkpoint(
                cls, checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, **kwargs
            )
        plain = super().load_from_checkpoint  # type: ignore[misc]  # Lightning's, next in the MRO
        return plain(
            checkpoint_path,
            map_location=map_location,
            hparams_file=hparams_file,
            strict=strict,
            weights_only=weights_only,
            **kwargs,
        )


def _is_certified(path: Any) -> bool:
    """Whether ``path`` is a certified file (its header and record parse); damage is reported by the
    certified loader, so only "not certckpt at all" goes to Lightning's."""
    if not isinstance(path, (str, os.PathLike)):
        return False  # a file object: Lightning's loader takes those
    try:
        inspect(_location_text(path))
    except NotACheckpointError:
        return False
    except CertckptError:
        return True
    return True
