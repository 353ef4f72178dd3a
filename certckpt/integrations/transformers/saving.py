"""Certified weights from ``save_pretrained``: ``save_function`` and ``save_pretrained``.

``save_function(state_dict, filename, metadata=None)`` has the signature of safetensors'
``save_file``, which is what transformers 4.x's ``save_pretrained(save_function=...)`` calls for each
shard. transformers 5 dropped that argument: ``save_pretrained(..., save_function=f)`` is accepted
into ``**kwargs`` and ignored, and a plain, uncertified file is written. ``save_pretrained(model,
directory, ...)`` here works with both: on 5.x it routes the shards through the one seam the
method has, the ``safe_save_file`` name it calls in ``transformers.modeling_utils``, for the
duration of the call and for the calling thread only; then it checks that every weight file the
call wrote is certified, so that a transformers release that writes shards another way fails loudly
instead of writing plain files. The files are standard safetensors files: ``from_pretrained`` loads
them as it loads any other.
"""

from __future__ import annotations

import inspect as pyinspect
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

import transformers.modeling_utils as modeling_utils

from certckpt.errors import ConfigurationError, MissingDependencyError, UnsupportedObjectError
from certckpt.format.asyncsave import SaveFuture
from certckpt.format.pipeline import CheckpointPipeline
from certckpt.format.writer import SaveResult, save_certified

__all__ = ["save_function", "save_pretrained", "ShardWriter"]

_SEAM = "safe_save_file"  # the name save_pretrained (transformers 5.x) writes every shard through
_seam_lock = threading.Lock()


class ShardWriter:
    """A ``save_function`` that also stamps each shard's record and remembers what it wrote.

    Args:
        step: the optimizer step recorded in each shard's record (None outside training).
        run: the run name recorded there.
        overwrite: replace an existing file (as safetensors' ``save_file`` does; a committed or
            read-only file is never replaced whatever this says).
        pipeline: save each shard in the background through this pipeline's savers (the shard is
            snapshotted before the call returns); its future goes into ``pending``.
    """

    def __init__(
        self,
        *,
        step: int | None = None,
        run: str | None = None,
        overwrite: bool = True,
        pipeline: CheckpointPipeline | None = None,
    ):
        self.step, self.run, self.overwrite, self.pipeline = step, run, overwrite, pipeline
        self.written: dict[str, SaveResult] = {}
        self.pending: dict[str, SaveFuture] = {}

    def __call__(self, state_dict: Mapping[str, Any], filename: Any, metadata: Mapping[str, str] | None = None):
        meta = dict(metadata or {})
        fmt = meta.pop("format", "pt")
        if fmt != "pt":
            raise UnsupportedObjectError(
                f"{filename}: safetensors format {fmt!r}; certckpt writes PyTorch ('pt') files"
            )
        if meta:
            # certckpt's __metadata__ holds "format" and its own record only; a reader looking for
            # these keys at the top level (a quantizer's) would not find them there.
            raise UnsupportedObjectError(
                f"{filename}: metadata keys {sorted(meta)} cannot be kept where safetensors readers look for them; "
                "save this model (a quantized one?) with the plain save_pretrained"
            )
        path = os.fspath(filename)
        if self.pipeline is not None:
            saver = self.pipeline.saver_for(os.path.basename(path))
            future = saver.save(dict(state_dict), path, step=self.step, run=self.run, overwrite=self.overwrite)
            self.pending[os.path.abspath(path)] = future
            return future
        result = save_certified(dict(state_dict), path, step=self.step, run=self.run, overwrite=self.overwrite)
        self.written[os.path.abspath(path)] = result
        return result


def save_function(
    state_dict: Mapping[str, Any], filename: Any, metadata: Mapping[str, str] | None = None
) -> SaveResult:
    """Write one shard of a model as a certified safetensors file (safetensors' ``save_file`` signature).

    Example (transformers 4.x; on 5.x use ``save_pretrained`` below)::

        model.save_pretrained("out", save_function=certckpt.integrations.transformers.save_function)
    """
    return ShardWriter()(state_dict, filename, metadata)


def _accepts_save_function(model: Any) -> bool:
    try:
        return "save_function" in pyinspect.signature(model.save_pretrained).parameters
    except (TypeError, ValueError):
        return False


def save_pretrained(model: Any, save_directory: Any, *, writer: ShardWriter | None = None, **kwargs: Any) -> dict:
    """``model.save_pretrained(save_directory, **kwargs)`` with every weight shard certified.

    Args:
        model: a ``transformers.PreTrainedModel``.
        save_directory: where ``save_pretrained`` writes.
        writer: the shard writer (default: a plain ``ShardWriter``); the Trainer passes one carrying
            the step and run.
        **kwargs: ``save_pretrained``'s own arguments (``state_dict=``, ``max_shard_size=``...).

    Returns:
        ``{absolute path: SaveResult}`` of the shards written.

    Raises:
        MissingDependencyError: this transformers release writes its shards some other way.

    Example:
        >>> save_pretrained(model, "final")                     # then: from_pretrained("final")
    """
    if "save_function" in kwargs:
        raise ConfigurationError("save_pretrained(...) here writes certified shards itself; drop save_function=")
    if kwargs.get("distributed_checkpoint"):
        raise ConfigurationError(
            "distributed_checkpoint=True writes DCP shards, not safetensors; certckpt cannot certify them here"
        )
    writer = writer or ShardWriter()
    directory = os.path.abspath(os.fspath(save_directory))
    if _accepts_save_function(model):  # transformers 4.x
        model.save_pretrained(save_directory, save_function=writer, safe_serialization=True, **kwargs)
    else:
        if not callable(getattr(modeling_utils, _SEAM, None)):
            raise MissingDependencyError(
                f"transformers {_version()}: save_pretrained no longer writes through modeling_utils.{_SEAM}, so "
                "certckpt cannot certify its shards; use the transformers version certckpt was tested with (5.23)"
            )
        with _certified_shards(writer):
            model.save_pretrained(save_directory, **kwargs)
    if kwargs.get("is_main_process", True):
        _check_all_certified(directory, writer)
    return dict(writer.written)


class _certified_shards:
    """Route ``modeling_utils.safe_save_file`` to ``writer`` for the calling thread, for one call.

    Another thread saving at the same moment keeps the plain writer: the substitute hands its calls
    to the original. Saves from several threads at once are serialised by a lock (the substitute is
    one module attribute).
    """

    def __init__(self, writer: ShardWriter):
        self.writer = writer
        self.thread = threading.get_ident()
        self.original: Any = None

    def __enter__(self) -> None:
        _seam_lock.acquire()
        self.original = getattr(modeling_utils, _SEAM)
        original, writer, thread = self.original, self.writer, self.thread

        def routed(tensors, filename, metadata=None):
            if threading.get_ident() != thread:
                return original(tensors, filename, metadata=metadata)
            return writer(tensors, filename, metadata)

        setattr(modeling_utils, _SEAM, routed)

    def __exit__(self, *exc: Any) -> None:
        try:
            setattr(modeling_utils, _SEAM, self.original)
        finally:
            _seam_lock.release()


def _check_all_certified(directory: str, writer: ShardWriter) -> None:
    """Every weight file the index (or the single-file name) points at was written by ``writer``."""
    names = set()
    for index in [n for n in os.listdir(directory) if n.endswith(".safetensors.index.json")]:
        with open(os.path.join(directory, index), encoding="utf-8") as f:
            names |= set(json.load(f).get("weight_map", {}).values())
    if not names:
        names = {
            n for n in os.listdir(directory) if n.endswith(".safetensors") and n.startswith(("model", "adapter_model"))
        }
    made = writer.written.keys() | writer.pending.keys()
    missing = sorted(n for n in names if os.path.join(directory, n) not in made)
    if missing or not made:
        raise MissingDependencyError(
            f"transformers {_version()}: save_pretrained wrote {missing or 'its weights'} in {directory} without "
            "the certified writer; these files are plain safetensors. certckpt was tested with transformers 5.23"
        )


def _version() -> str:
    import transformers

    return transformers.__version__
