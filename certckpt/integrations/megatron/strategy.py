"""Megatron-Core ``dist_checkpointing`` strategies that write and read certified checkpoints.

Megatron's ``torch_dist`` strategy turns ShardedTensors into DCP's sharded tensors and writes them with
DCP (pickling DCP's metadata and every ShardedObject). These strategies keep that translation (Megatron's
own ``mcore_to_pyt_state_dict`` and planners) and swap the storage layer for certckpt's
(``CertifiedWriter`` / ``CertifiedReader``): every rank's chunks in a certified file, the manifest with
each global tensor's fingerprint, independent of how the tensor was split (TP, DP, PP: only the global
tensor and its values count), committed to a run store. ShardedObjects and the common state go into
certified companion files (``layout``). Loading reads any split of the saved tensors, checks every byte
it reads and, by default, the loaded state against the saved fingerprints.

Example::

    from megatron.core import dist_checkpointing
    from certckpt.integrations.megatron import CertifiedSaveStrategy, CertifiedLoadStrategy
    strategy = CertifiedSaveStrategy(ledger="ckpt", step=100)
    dist_checkpointing.save(sharded_sd, "ckpt/iter_100", sharded_strategy=strategy)
    state = dist_checkpointing.load(sharded_sd, "ckpt/iter_100", sharded_strategy=CertifiedLoadStrategy())
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy, SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    mcore_to_pyt_state_dict,
)

from certckpt.dcp import CertifiedReader, CertifiedWriter
from certckpt.dcp.statecheck import exchange
from certckpt.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    ConfigurationError,
    CorruptCheckpointError,
    UnsupportedObjectError,
)
from certckpt.format.companions import FILES_KEY, LAYOUT_KEY, plain_entry
from certckpt.format.header import canonical_json, printable
from certckpt.format.reader import load as certified_load
from certckpt.format.sharded.layout import MANIFEST_NAME, exists, join, remove
from certckpt.format.sharded.manifest import Manifest, read_manifest
from certckpt.format.tensors import ST_TO_TORCH
from certckpt.format.writer import save_certified

from .common import take_common_state
from .handoff import kept
from .layout import (
    BACKEND,
    COMMON_NAME,
    CONFIG_NAME,
    LAYOUT,
    OBJECTS_KEY,
    VERSION,
    objects_name,
    plain_megatron_refusal,
    read_companions,
)

__all__ = ["CertifiedSaveStrategy", "CertifiedLoadStrategy"]

_COMMON_PT = "common.pt"  # where Megatron's common strategy has just written the common state


def _group() -> Any:
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _tensors_by_key(sharded_state_dict: Any, *, main_only: bool) -> dict[str, list[ShardedTensor]]:
    out: dict[str, list[ShardedTensor]] = {}
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor) or (main_only and not is_main_replica(sh.replica_id)):
            continue
        if sh.flattened_range is not None:
            raise UnsupportedObjectError(
                f"ShardedTensor `{printable(sh.key)}` has a flattened_range (the pre-0.14 distributed-optimizer"
                " layout), which certckpt neither stores nor reads; build the optimizer's sharded state dict with a"
                " model-space layout (sharding_type='fully_sharded_model_space' or 'dp_reshardable')"
            )
        out.setdefault(sh.key, []).append(sh)
    return out


def _objects(sharded_state_dict: Any, *, main_only: bool) -> list[ShardedObject]:
    return [
        sh
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedObject) and (not main_only or is_main_replica(sh.replica_id))
    ]


class CertifiedSaveStrategy(SaveShardedStrategy):
    """Save Megatron's sharded state dict as a certified checkpoint (pass as ``sharded_strategy=``).

    Args:
        ledger: a run store (path or URL) whose ledger records the checkpoint once its manifest is
            written (``branch@step``; needs ``step``): ``certckpt status STORE`` lists it.
        step: the iteration, recorded in every file (and the checkpoint id with a ledger).
        run: the training run's name, recorded in every file.
        branch: the line of training of a ledger commit (default ``main``).
        parent: the checkpoint id this branch resumed from.

    The directory holds no pickle: ``common.pt``, which Megatron writes before the sharded save, is
    replaced by ``common.safetensors``. A committed directory is never written over.

    Example:
        >>> strategy = CertifiedSaveStrategy(ledger="ckpt", step=100)
        >>> dist_checkpointing.save(sd, "ckpt/iter_100", sharded_strategy=strategy)
    """

    def __init__(
        self,
        *,
        ledger: str | os.PathLike | None = None,
        step: int | None = None,
        run: str | None = None,
        branch: str | None = None,
        parent: str | None = None,
    ) -> None:
        super().__init__(BACKEND, VERSION)
        if step is not None and (type(step) is not int or step < 0):
            raise ArgumentTypeError(f"step must be a non-negative int, got {step!r}")
        self.ledger = None if ledger is None else os.fspath(ledger)
        self.step = step
        self.run = run
        self.branch = branch
        self.parent = parent
        self.ckpt_id: str | None = None  # the ledger's id of the last checkpoint saved (rank 0)
        # the writer is built here once, so that a bad option is refused before Megatron writes anything
        self._writer("<not yet>", {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _writer(self, path: str, metadata: dict[str, str]) -> CertifiedWriter:
        return CertifiedWriter(
            path,
            ledger=self.ledger,
            step=self.step,
            run=self.run,
            branch=self.branch,
            parent=self.parent,
            metadata=metadata,
        )

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        path = os.fspath(checkpoint_dir)
        rank = _rank()
        error: BaseException | None = None
        mine: dict[str, Any] = {}
        tensors: dict[str, list[ShardedTensor]] = {}
        try:
            # what certckpt cannot store is refused before a file is written
            tensors = _tensors_by_key(sharded_state_dict, main_only=True)
            mine = self._write_companions(sharded_state_dict, path, rank)
        except Exception as e:  # every rank hears of it before anyone enters DCP's collectives
            error = e
        everyone = exchange({"error": None if error is None else f"{type(error).__name__}: {error}", **mine}, _group())
        if error is not None:
            raise error
        failed = [(r, p["error"]) for r, p in enumerate(everyone) if p["error"]]
        if failed:
            raise ConfigurationError(f"{path}: rank {failed[0][0]} failed ({failed[0][1]}); nothing was committed")
        files: dict[str, Any] = {}
        objects: dict[str, str] = {}
        for p in everyone:
            files.update(p["files"])
            objects.update(p["objects"])
        metadata = {FILES_KEY: canonical_json(files), LAYOUT_KEY: LAYOUT, OBJECTS_KEY: canonical_json(objects)}
        writer = self._writer(path, metadata)
        # Megatron's own translation: ShardedTensor -> DCP's checkpointable sharded tensor, and its
        # planner that plans every rank's chunks (without DCP's replica deduplication: Megatron's
        # replica ids already chose one writer per chunk)
        dcp.save(
            mcore_to_pyt_state_dict(tensors, False),
            storage_writer=writer,
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )
        self.ckpt_id = writer.ckpt_id

    def _write_companions(self, sharded_state_dict: Any, path: str, rank: int) -> dict[str, Any]:
        """This rank's files beside the shards (rank 0: the common state and metadata.json; every
        rank: its ShardedObjects), and what the manifest lists of them."""
        if exists(join(path, MANIFEST_NAME)):
            raise CheckpointExistsError(
                f"{path}: holds a committed certified checkpoint already; save to a new directory"
            )
        files: dict[str, Any] = {}
        objects = _objects(sharded_state_dict, main_only=True)
        index = {}
        if objects:
            name = objects_name(rank)
            saved = save_certified(
                {o.unique_key: o.data for o in objects}, join(path, name), step=self.step, run=self.run, overwrite=True
            )
            files[name] = {"bytes": saved.nbytes, "header_digest": saved.header_digest}
            index = {o.unique_key: name for o in objects}
        if rank == 0:
            seen, common = take_common_state(path)
            if not seen:
                raise ConfigurationError(
                    f"{path}: Megatron's common state never reached certckpt (import"
                    " certckpt.integrations.megatron before dist_checkpointing.save; another library may have"
                    " registered its own common strategy)"
                )
            remove(join(path, _COMMON_PT))  # Megatron's pickle of the same state, written a moment ago
            saved = save_certified(common, join(path, COMMON_NAME), step=self.step, run=self.run, overwrite=True)
            files[COMMON_NAME] = {"bytes": saved.nbytes, "header_digest": saved.header_digest}
            # Megatron writes metadata.json after this strategy returns, with these very bytes (its
            # own save_config): written first here, the manifest can bind it like any other file
            save_config(CheckpointingConfig(self.backend, self.version), path)
            files[CONFIG_NAME] = plain_entry(join(path, CONFIG_NAME))
        return {"files": files, "objects": index}


class CertifiedLoadStrategy(LoadShardedStrategy):
    """Load a certified Megatron checkpoint (pass as ``sharded_strategy=``, or let ``metadata.json``
    choose it: importing ``certckpt.integrations.megatron`` registers it for its backend).

    Passing it explicitly refuses anything not certified, in one line (a plain ``torch_dist``
    directory is never unpickled). Any TP/DP/PP split of the saved tensors can be loaded: every
    chunk read is checked against its digest before it is used.

    Args:
        check_fingerprints: after loading, compare the loaded tensors (on whatever split this run
            uses) with the fingerprints saved, collectively over every rank. One fingerprint pass
            over the loaded data, on a second thread beside the reads (``certckpt.dcp.loadfp``).

    Example:
        >>> state = dist_checkpointing.load(sd, "ckpt/iter_100", sharded_strategy=CertifiedLoadStrategy())
    """

    def __init__(self, *, check_fingerprints: bool = True) -> None:
        super().__init__()
        if type(check_fingerprints) is not bool:
            raise ArgumentTypeError(f"check_fingerprints must be True or False, got {check_fingerprints!r}")
        self.check_fingerprints = check_fingerprints
        self.checked_tensors = 0  # tensors compared with their saved fingerprint by the last load

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        # Megatron asks this before it reads a byte of the directory (common.pt included)
        if loaded_backend != BACKEND:
            raise plain_megatron_refusal("the checkpoint", loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise ConfigurationError(
                f"a certified Megatron checkpoint of format version {loaded_version}; this certckpt reads"
                f" version {VERSION}: upgrade certckpt"
            )

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        path = os.fspath(checkpoint_dir)
        tensors = _tensors_by_key(sharded_state_dict, main_only=False)  # refused before a byte is read
        # what the common strategy read and checked whole just before, in this load (handoff); read
        # again only when the strategy is called on its own or the manifest changed since
        companions = kept(path, take=True) or read_companions(path, check=False)
        if companions is None:
            raise plain_megatron_refusal(path, "none certified: no manifest.safetensors")
        objects = _objects(sharded_state_dict, main_only=False)
        loaded = self._load_objects(companions, objects)
        for group in tensors.values():
            for sh in group:
                if sh.data is None:
                    sh.init_data("cpu", init_fn=torch.zeros if sh.allow_shape_mismatch else torch.empty)
        everything = [sh for group in tensors.values() for sh in group]
        reader = CertifiedReader(path, check_fingerprints=self.check_fingerprints, manifest=companions.manifest)
        dcp.load(
            mcore_to_pyt_state_dict(tensors, True),
            storage_reader=reader,
            planner=MCoreLoadPlanner(
                shapes_validation_sharded_tensors=[sh for sh in everything if not sh.allow_shape_mismatch],
                allow_shape_mismatch_sharded_tensors={sh.key: sh for sh in everything if sh.allow_shape_mismatch},
            ),
        )
        self.checked_tensors = reader.checked_tensors

        def value(sh: Any) -> Any:
            if isinstance(sh, ShardedObject):
                return loaded[sh.unique_key]
            if isinstance(sh, ShardedTensor):
                # a tensor translated with prepended axes was loaded through a view with them
                return sh.data.reshape(sh.local_shape)
            return sh

        return dict_list_map_inplace(value, sharded_state_dict)

    def _load_objects(self, companions: Any, objects: list[ShardedObject]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        by_file: dict[str, list[str]] = {}
        for o in objects:
            name = companions.objects.get(o.unique_key)
            if name is None:
                raise CorruptCheckpointError(
                    f"{companions.location}: holds no ShardedObject `{printable(o.unique_key)}`; load with the"
                    " layout it was saved with for this object"
                )
            by_file.setdefault(name, []).append(o.unique_key)
        for name, keys in sorted(by_file.items()):
            held = certified_load(companions.certified(name), map_location="cpu")
            for k in keys:
                out[k] = held[k]
        return out

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, ShardedTensor]:
        path = os.fspath(checkpoint_dir)
        companions = kept(path, take=False)  # within a load (strict modes), the manifest already read
        return _tensors_metadata(companions.manifest if companions is not None else read_manifest(path)[0])

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        path = os.fspath(checkpoint_dir)
        companions = kept(path, take=False) or read_companions(path, check=False)
        if companions is None:
            raise plain_megatron_refusal(path, "none certified: no manifest.safetensors")
        out: dict[str, Any] = dict(_tensors_metadata(companions.manifest))
        for key in companions.objects:
            out[key] = ShardedObject.empty_from_unique_key(key)
        return out


def _tensors_metadata(manifest: Manifest) -> dict[str, ShardedTensor]:
    """Megatron's metadata of every saved tensor: its key, global shape and dtype, no data."""
    return {
        t.fqn: ShardedTensor.from_rank_offsets(
            t.fqn, torch.empty(t.shape, dtype=ST_TO_TORCH[t.dtype], device="meta")
        ).without_data()
        for t in manifest.tensors
    }
