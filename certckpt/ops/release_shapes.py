"""What a release takes from each shape of checkpoint certckpt writes.

A committed checkpoint is one of three shapes, told apart by what its commit record names:

- **a file** (``certckpt.save``, a Lightning ``.ckpt``): its model tensors are an entry of the
  object (``--part``; default ``model``, else ``state_dict``, else the object when it is a flat
  mapping of tensors);
- **a file listing its directory** (a Trainer ``checkpoint-N/``, an Accelerate ``checkpoint_<i>/``, a
  DeepSpeed tag: the record's table of companion files): the weights are the listed
  ``model.safetensors`` (or the shards its ``model.safetensors.index.json`` names), and the plain
  files ``from_pretrained`` reads beside them (``config.json``, the tokenizer's) are carried into the
  release; the training state (``trainer_state.json``, ``training_args.json``, optimizer, RNG) is
  not. ``--part FILE`` takes another listed weight file (Accelerate's ``model_1.safetensors``);
- **a sharded DCP directory**: consolidated into one tensor per name from the shards its manifest
  lists (``--part`` a prefix of the flattened names; default ``model``, else every tensor).

``private_copy`` reads the checkpoint's bytes once into a private directory, where the caller verifies
them as the very checkpoint committed; ``released_model`` then takes everything from that copy only,
so nothing swapped in the store after the check can reach a release. See docs/release.md.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, ConfigurationError, CorruptCheckpointError
from certckpt.format.companions import companions_of
from certckpt.format.sharded.layout import is_directory, list_directory
from certckpt.format.verify import inspect
from certckpt.storage import join, open_read, resolve

__all__ = ["Shape", "PrivateCopy", "ReleasedModel", "private_copy", "released_model", "TRAINING_STATE_FILES"]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Plain files of a checkpoint directory that hold the training's state, not the model's: never released.
TRAINING_STATE_FILES = frozenset({"trainer_state.json", "training_args.json", WEIGHTS_INDEX})
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._=-]{0,254}$")
_MAX_INDEX_BYTES = 64 << 20


class Shape:
    """The three shapes (plain strings: they appear in messages)."""

    FILE = "file"
    DIRECTORY = "directory"  # a file whose record lists the other files of its directory
    SHARDED = "sharded"  # a DCP directory: shard files and a manifest


@dataclass(frozen=True, kw_only=True, slots=True)
class PrivateCopy:
    """A private copy of one committed checkpoint (verified by the caller before anything is taken).

    Attributes:
        shape: ``Shape.FILE``, ``Shape.DIRECTORY`` or ``Shape.SHARDED``.
        path: the copy of the committed file (or of the DCP directory).
        url: where the checkpoint lives in the store (for messages).
        companions: for ``Shape.DIRECTORY``, the files the record lists (name -> entry).
    """

    shape: str
    path: str
    url: str
    companions: dict[str, dict[str, Any]] = field(default_factory=dict)

    def shown(self, message: str) -> str:
        """A message about the copy, naming the store's files instead."""
        shown = message.replace(self.path, self.url)
        return shown.replace(os.path.dirname(self.path), _base(self.url)) if self.shape == Shape.DIRECTORY else shown


@dataclass(frozen=True, kw_only=True, slots=True)
class ReleasedModel:
    """What goes into a release: the model's tensors, and plain files carried beside them.

    Attributes:
        tensors: name -> CPU tensor, written as the release's ``model.safetensors``.
        carried: release name -> path of a verified copy (``config.json``, tokenizer files).
        source: what the tensors came from, in words (``checkpoint-50/model.safetensors``).
    """

    tensors: dict[str, Any]
    carried: dict[str, str]
    source: str


def _copy(url: str, dest: str) -> None:
    """The bytes at ``url`` into the new file ``dest``, no more than the size the store reports (a
    file that grows meanwhile fails the check that follows)."""
    with open_read(resolve(url)) as (fh, size), open(dest, "xb") as out:
        left = size
        while left is None or left > 0:
            chunk = fh.read(1 << 20 if left is None else min(left, 1 << 20))
            if not chunk:
                break
            out.write(chunk)
            left = None if left is None else left - len(chunk)


def _base(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


def private_copy(url: str, directory: str) -> PrivateCopy:
    """Copy the checkpoint committed at ``url`` into ``directory`` (new, private): the file, and the
    files its record lists beside it, or every file of a DCP directory. The copy is not checked yet:
    the caller verifies it (``check_file(copy.path, ...)``) before taking anything from it, and
    ``copy.shown`` turns the check's message back into the store's names."""
    local_dir = os.path.join(directory, "checkpoint")
    os.mkdir(local_dir, 0o700)
    companions: dict[str, dict[str, Any]] = {}
    if not url.endswith(".safetensors") and is_directory(url):
        for name in sorted(list_directory(url).files):  # the check refuses a file the manifest does not list
            if _PLAIN_NAME.match(name):
                _copy(join(url, name), os.path.join(local_dir, name))
        return PrivateCopy(shape=Shape.SHARDED, path=local_dir, url=url)
    name = url.rsplit("/", 1)[-1]
    local = os.path.join(local_dir, name if _PLAIN_NAME.match(name) else "checkpoint.safetensors")
    _copy(url, local)
    try:
        companions = companions_of(inspect(local).record) or {}
    except (CertckptError, ValueError, RecursionError):
        companions = {}  # the check says what is wrong with it
    for member in sorted(companions):  # plain names only (companions_of checks them)
        if member != os.path.basename(local):
            try:
                _copy(join(_base(url), member), os.path.join(local_dir, member))
            except (CertckptError, OSError):
                pass  # missing: the check names it
    return PrivateCopy(shape=Shape.DIRECTORY if companions else Shape.FILE, path=local, url=url, companions=companions)


def _flat_tensors(obj: Any, part: str | None, *, what: str) -> dict[str, Any]:
    """The mapping of tensors at ``part`` of a loaded object (default ``model``, else ``state_dict``,
    else the object itself when it is a flat mapping of tensors)."""
    import torch

    if part is None:
        part = next((k for k in ("model", "state_dict") if isinstance(obj, dict) and isinstance(obj.get(k), dict)), "")
    if part:
        if not isinstance(obj, dict) or not isinstance(obj.get(part), dict):
            keys = sorted(map(str, obj))[:8] if isinstance(obj, dict) else type(obj).__name__
            raise ConfigurationError(
                f"{what}: no mapping of tensors at {part!r} (found {keys}); choose one with --part"
            )
        obj = obj[part]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigurationError(f"{what}: {part or 'the checkpoint'} is not a flat mapping of tensors; choose --part")
    return {str(k): v.detach().contiguous().clone() for k, v in obj.items()}


def _load(path: str) -> Any:
    from certckpt.format.reader import load

    # verified already, as part of the copy's check; loading checks the tensors' digests again
    return load(path, "cpu", trusted_keys=None)


def released_model(copy: PrivateCopy, part: str | None) -> ReleasedModel:
    """The model's tensors (and, from a checkpoint directory, the plain files to carry) from a
    verified copy.

    Raises:
        ConfigurationError: no model tensors where ``part`` (or the default) says; the message says
            what to pass.
    """
    if copy.shape == Shape.FILE:
        return ReleasedModel(tensors=_flat_tensors(_load(copy.path), part, what=copy.url), carried={}, source=copy.url)
    if copy.shape == Shape.SHARDED:
        return ReleasedModel(tensors=_consolidated(copy, part), carried={}, source=copy.url)
    return _from_directory(copy, part)


def _from_directory(copy: PrivateCopy, part: str | None) -> ReleasedModel:
    local_dir, listed = os.path.dirname(copy.path), copy.companions
    where = _base(copy.url)
    weights = [n for n, e in sorted(listed.items()) if "header_digest" in e]
    if part is not None:
        name = part if part.endswith(".safetensors") else f"{part}.safetensors"
        if name not in weights:
            raise ConfigurationError(
                f"{where}: --part {part}: not a weight file of this checkpoint (its certified files: {weights});"
                " in a checkpoint directory --part names the file holding the model's tensors"
            )
        files = [name]
    elif WEIGHTS_NAME in listed:
        files = [WEIGHTS_NAME]
    elif WEIGHTS_INDEX in listed:
        files = _index_shards(os.path.join(local_dir, WEIGHTS_INDEX), listed, where=where)
    else:
        raise ConfigurationError(
            f"{where}: no {WEIGHTS_NAME} in this checkpoint directory (its certified files: {weights});"
            " name the file holding the model's tensors with --part FILE"
        )
    tensors: dict[str, Any] = {}
    for name in files:
        got = _flat_tensors(_load(os.path.join(local_dir, name)), None, what=f"{where}/{name}")
        clash = sorted(set(got) & set(tensors))
        if clash:
            raise CorruptCheckpointError(f"{where}/{name}: tensor {clash[0]!r} is in another shard of the model too")
        tensors.update(got)
    carried = {
        n: os.path.join(local_dir, n)
        for n, e in sorted(listed.items())
        if "header_digest" not in e and n not in TRAINING_STATE_FILES and n != os.path.basename(copy.path)
    }
    source = f"{where}/{files[0]}" if len(files) == 1 else f"{where}/{WEIGHTS_INDEX} ({len(files)} shards)"
    return ReleasedModel(tensors=tensors, carried=carried, source=source)


def _index_shards(path: str, listed: dict[str, dict[str, Any]], *, where: str) -> list[str]:
    """The weight shards a (verified) ``model.safetensors.index.json`` names, each a certified file
    of the checkpoint."""
    with open(path, encoding="utf-8") as f:
        text = f.read(_MAX_INDEX_BYTES + 1)
    try:
        if len(text) > _MAX_INDEX_BYTES:
            raise ValueError("too large")
        weight_map = json.loads(text)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}/{WEIGHTS_INDEX}: not a weight index ({str(e)[:80]})") from e
    bad = [s for s in shards if not isinstance(s, str) or "header_digest" not in listed.get(s, {})]
    if bad or not shards:
        raise CorruptCheckpointError(
            f"{where}/{WEIGHTS_INDEX}: names {bad[:3] or 'no shard'}, not certified files of this checkpoint"
        )
    return shards


def _consolidated(copy: PrivateCopy, part: str | None) -> dict[str, Any]:
    """Every tensor of a (verified) DCP directory under ``part`` (a prefix of the flattened names),
    whole: each assembled from the chunks the manifest lists."""
    import torch
    from safetensors import safe_open

    from certckpt.format.sharded.manifest import read_manifest
    from certckpt.format.tensors import ST_TO_TORCH

    manifest, _ = read_manifest(copy.path)
    names = [t.fqn for t in manifest.tensors]
    if part is None:
        part = next((p for p in ("model", "state_dict") if any(n.startswith(p + ".") for n in names)), "")
    prefix = f"{part}." if part else ""
    chosen = [t for t in manifest.tensors if t.fqn.startswith(prefix)]
    if not chosen:
        tops = sorted({n.split(".", 1)[0] for n in names})[:8]
        raise ConfigurationError(f"{copy.url}: no tensor under {part!r} (found {tops}); choose one with --part")
    out: dict[str, Any] = {}
    handles: dict[int, Any] = {}
    try:
        for t in chosen:
            if t.dtype not in ST_TO_TORCH:
                raise ConfigurationError(f"{copy.url}: tensor {t.fqn!r} has dtype {t.dtype}, which torch cannot hold")
            full = torch.empty(t.shape, dtype=ST_TO_TORCH[t.dtype])
            for c in t.chunks:
                if c.file not in handles:
                    shard = os.path.join(copy.path, manifest.files[c.file].name)
                    handles[c.file] = safe_open(shard, framework="pt").__enter__()
                piece = handles[c.file].get_tensor(c.entry).reshape(c.sizes)
                full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = piece
            out[t.fqn[len(prefix) :]] = full
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out
