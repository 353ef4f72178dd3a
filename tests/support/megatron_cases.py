"""Per-rank functions for the Megatron-Core tests (run through certckpt.detect.launch.run_ranks).

Hand-built sharded state dicts of Megatron's own API (``ShardedTensor.from_rank_offsets``, replica
ids, ``ShardedObject``), the shapes Megatron's dist_checkpointing tests use: its GPT model needs CUDA
(Transformer Engine or Apex kernels) to be built, these do not.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors every layout splits (the test compares against them)."""
    g = torch.Generator().manual_seed(7)
    return {
        "decoder.qkv.weight": torch.randn(12, 10, generator=g),  # split along dim 0 (TP rows)
        "decoder.proj.weight": torch.randn(6, 12, generator=g).to(torch.bfloat16),  # split along dim 1 (TP cols)
        "embedding.weight": torch.randn(7, 4, generator=g),  # replicated (DP)
    }


def _sharded(sd_tensors: dict[str, torch.Tensor], rank: int, world: int, *, split: int):
    """A sharded state dict: qkv rows split ``split`` ways, proj columns split ``split`` ways (ranks
    beyond ``split`` hold replicas of the first ``split`` ranks' pieces), the embedding replicated."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    piece = rank % split
    replica = rank // split
    qkv, proj, emb = (sd_tensors[k] for k in ("decoder.qkv.weight", "decoder.proj.weight", "embedding.weight"))
    rows, cols = qkv.shape[0] // split, proj.shape[1] // split
    return {
        "model": {
            "qkv": ShardedTensor.from_rank_offsets(
                "decoder.qkv.weight",
                qkv[piece * rows : (piece + 1) * rows].clone(),
                (0, piece, split),
                replica_id=replica,
            ),
            "proj": ShardedTensor.from_rank_offsets(
                "decoder.proj.weight",
                proj[:, piece * cols : (piece + 1) * cols].clone(),
                (1, piece, split),
                replica_id=replica,
            ),
            "emb": ShardedTensor.from_rank_offsets("embedding.weight", emb.clone(), replica_id=rank),
        },
        "rng": ShardedObject(
            "rng_state", {"seed": 100 + rank, "torch": torch.arange(4) + rank}, (world,), (rank,), replica_id=0
        ),
        "iteration": 5,
        "args": {"lr": 3e-4, "tp": split, "names": ["a", "b"]},
        "scale": torch.tensor([2.0, 4.0]),
    }


def plain_torch_dist_save(sharded_state_dict, directory: str) -> None:
    """What Megatron's ``torch_dist`` save writes (``common.pt``, DCP's ``.metadata`` and ``.distcp``
    files, ``metadata.json``), from Megatron's own pieces: its strategy's save path calls
    ``torch.cuda.synchronize()`` and puts a flag tensor on ``torch.cuda.current_device()``
    (``filesystem_async.preload_tensors``, ``state_dict_saver``), so on a CPU-only torch it fails, and
    this is the same translation and planner written with DCP's ``FileSystemWriter``."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict

    common = {k: v for k, v in sharded_state_dict.items() if not isinstance(v, (dict, ShardedBase))}
    TorchCommonSaveStrategy("torch", 1).save_common(common, directory)
    grouped = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            grouped.setdefault(sh.key, []).append(sh)
    dcp.save(
        mcore_to_pyt_state_dict(grouped, False),
        storage_writer=dcp.FileSystemWriter(directory),
        planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
    )
    if dist.get_rank() == 0:
        save_config(CheckpointingConfig("torch_dist", 1), directory)
    dist.barrier()


_manifest_opens: list[str] = []


def _count_manifest_opens() -> None:
    """Record every open of a ``manifest.safetensors`` in this rank (an audit hook: it observes the real
    opens, by whatever route, and replaces nothing; it lives as long as the rank's process)."""

    def hook(event, args):
        path = args[0] if event == "open" else None
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).endswith("manifest.safetensors"):
            _manifest_opens.append(os.fsdecode(path))

    sys.addaudithook(hook)


def _opens_during(fn):
    """``(fn(), how many times fn opened a manifest)``."""
    _manifest_opens.clear()
    result = fn()
    return result, len(_manifest_opens)


def save_and_reload(args):
    """Save split 3 ways (TP=3), re-load split 2 ways with a replica (TP=2, DP over rank 2), the
    default strategy chosen by metadata.json, and a plain torch_dist checkpoint refused."""
    from megatron.core import dist_checkpointing

    from certckpt.integrations.megatron import CertifiedLoadStrategy, CertifiedSaveStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:  # Megatron saves into an existing directory (Megatron-LM creates it first too)
        os.makedirs(args["ckpt"])
        os.makedirs(args["plain"])
    dist.barrier()
    full = full_tensors()
    strategy = CertifiedSaveStrategy(ledger=args["store"], step=5, run="mg")
    dist_checkpointing.save(_sharded(full, rank, world, split=3), args["ckpt"], sharded_strategy=strategy)
    out = {"ckpt_id": strategy.ckpt_id}

    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    template = _sharded(zeros, rank, world, split=2)
    template["rng"] = _sharded(zeros, rank, world, split=2)["rng"]
    loader = CertifiedLoadStrategy(check_fingerprints=True)
    _count_manifest_opens()
    state, out["manifest_opens"] = _opens_during(
        lambda: dist_checkpointing.load(template, args["ckpt"], sharded_strategy=loader)
    )
    expect = _sharded(full, rank, world, split=2)
    out["equal"] = {k: torch.equal(state["model"][k], expect["model"][k].data) for k in ("qkv", "proj", "emb")} | {
        "rng_torch": torch.equal(state["rng"]["torch"], torch.arange(4) + rank),
        "scale": torch.equal(state["scale"], torch.tensor([2.0, 4.0])),
    }
    out["rng_seed"], out["iteration"], out["args"] = state["rng"]["seed"], state["iteration"], state["args"]
    out["checked"] = loader.checked_tensors

    # no strategy given: metadata.json names certckpt's backend, registered on import
    again, out["manifest_opens_default"] = _opens_during(
        lambda: dist_checkpointing.load(_sharded(zeros, rank, world, split=3), args["ckpt"])
    )
    out["default_equal"] = torch.equal(again["model"]["qkv"], _sharded(full, rank, world, split=3)["model"]["qkv"].data)

    # plain Megatron's torch_dist: Megatron reads it, the certified strategy refuses it before a byte is read
    def tensors_only(sd):  # (torch_dist would pickle the ShardedObject too; the tensors show enough)
        return {"model": sd["model"], "iteration": sd["iteration"]}

    plain_torch_dist_save(tensors_only(_sharded(full, rank, world, split=3)), args["plain"])
    back = dist_checkpointing.load(tensors_only(_sharded(zeros, rank, world, split=3)), args["plain"])
    out["plain_megatron_reads"] = torch.equal(
        back["model"]["qkv"], _sharded(full, rank, world, split=3)["model"]["qkv"].data
    )
    try:
        dist_checkpointing.load(
            tensors_only(_sharded(zeros, rank, world, split=3)), args["plain"], sharded_strategy=loader
        )
        out["plain"] = None
    except Exception as e:
        out["plain"] = f"{type(e).__name__}: {e}"
    out.update(_flattened_refused(args, full, zeros, rank, world))
    return out


def _flattened_refused(args, full, zeros, rank, world):
    """A ShardedTensor with a ``flattened_range`` (the pre-0.14 distributed optimizer's layout) handed
    to the strategies directly, as a wrapping strategy does: megatron-core 0.16.1's constructors and
    ``dist_checkpointing.save/load`` refuse one themselves, so it is set after construction."""
    from certckpt.integrations.megatron import CertifiedLoadStrategy, CertifiedSaveStrategy

    def flattened(sd):
        sh = sd["model"]["qkv"]
        sh.flattened_range = slice(0, sh.data.numel())
        return sd

    where = args["plain"] + "-flat"
    if rank == 0:
        os.makedirs(where)
    dist.barrier()
    out = {}
    try:
        CertifiedSaveStrategy(step=6).save(flattened(_sharded(full, rank, world, split=3)), where)
        out["flat_save"] = None
    except Exception as e:
        out["flat_save"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    out["flat_written"] = sorted(os.listdir(where))
    try:
        CertifiedLoadStrategy().load(flattened(_sharded(zeros, rank, world, split=2)), args["ckpt"])
        out["flat_load"] = None
    except Exception as e:
        out["flat_load"] = f"{type(e).__name__}: {e}"
    return out


def gpu_round_trip(args):
    """One rank on one GPU (NCCL for CUDA tensors, gloo for the rest): ShardedTensors on the GPU saved
    certified, loaded back onto the GPU with the fingerprint check; the fingerprints saved from the GPU
    are those of the same tensors on the CPU. ``device="cpu"``: the same steps on the CPU."""
    from megatron.core import dist_checkpointing

    import certckpt
    from certckpt.dcp import inspect_checkpoint
    from certckpt.integrations.megatron import CertifiedLoadStrategy, CertifiedSaveStrategy

    device = args.get("device", "cuda")
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.destroy_process_group()
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    full = {k: v.to(device) for k, v in full_tensors().items()}
    os.makedirs(args["ckpt"])
    strategy = CertifiedSaveStrategy(ledger=args["store"], step=7, run="mg-gpu")
    dist_checkpointing.save(_sharded(full, 0, 1, split=1), args["ckpt"], sharded_strategy=strategy)
    loader = CertifiedLoadStrategy(check_fingerprints=True)
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    state = dist_checkpointing.load(_sharded(zeros, 0, 1, split=1), args["ckpt"], sharded_strategy=loader)
    manifest, _ = inspect_checkpoint(args["ckpt"])
    expect = _sharded(full, 0, 1, split=1)["model"]
    return {
        "ckpt_id": strategy.ckpt_id,
        "equal": all(torch.equal(state["model"][k], expect[k].data) for k in ("qkv", "proj", "emb")),
        "device": str(state["model"]["qkv"].device),
        "checked": loader.checked_tensors,
        "fps_as_on_cpu": {t.fqn: t.fp for t in manifest.tensors}
        == {k: certckpt.fingerprint_hex(v) for k, v in full_tensors().items()},
    }
