"""Per-rank functions for the sharded-checkpoint tests (run through certckpt.detect.launch.run_ranks).

FSDP2 (``fully_shard``) on a CPU DeviceMesh over gloo: 4 ranks as 2 x 2 HSDP (replicate x shard) to
save, 2 ranks as plain FSDP to load onto another sharding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import certckpt
from certckpt.dcp import CertifiedReader, CertifiedWriter, state_fingerprints
from certckpt.format.leaves import plain_tensor


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd sizes: FSDP shards dim 0 unevenly (and one bf16 buffer-like parameter for 2-byte words)
    m = torch.nn.Sequential(torch.nn.Linear(12, 34), torch.nn.GELU(), torch.nn.Linear(34, 5))
    m.register_buffer("scale", torch.linspace(0, 1, 7).to(torch.bfloat16))
    # 4 x 65536 float32: FSDP's 2-way dim-0 shards start on a fingerprint-chunk boundary (the
    # writer's one-pass path for a shard that does not start the tensor)
    m.register_parameter("big", torch.nn.Parameter(torch.randn(4, 65536), requires_grad=False))
    return m


def _shard(m: torch.nn.Module, mesh) -> torch.nn.Module:
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _full_fps(state: dict) -> dict[str, str]:
    """Fingerprints of the full tensors of a (DTensor-sharded) flat state, gathered on every rank."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            full = v.full_tensor() if isinstance(v, DTensor) else v
            out[k] = certckpt.fingerprint_hex(full)
    return out


def _flat(msd: dict, osd: dict) -> dict:
    flat = {f"model.{k}": v for k, v in msd.items()}
    for p, st in osd["state"].items():
        for k, v in st.items():
            flat[f"optim.state.{p}.{k}"] = v
    return flat


def hsdp_save(args):
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = _shard(_model(0), mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + mesh.get_local_rank("shard"))
    x = torch.randn(4, 12, generator=g)
    F.mse_loss(m(x), x[:, :5].sin()).backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 3, "tag": "hsdp"}}
    placements = {k: [str(p) for p in v.placements] for k, v in msd.items() if isinstance(v, DTensor)}
    dcp.save(state, storage_writer=CertifiedWriter(args["dir"], run="t", step=1))
    fut = dcp.async_save(state, storage_writer=CertifiedWriter(args["async_dir"], run="t", step=1))
    fut.result()
    live = state_fingerprints({"model": msd, "optim": osd})
    return {
        "rank": rank,
        "fps": _full_fps(_flat(msd, osd)),
        "placements": placements,
        "live": {"state_fp": live.state_fp, "disagreements": list(live.disagreements)},
        "dtensor": _dtensor_in_save(mesh, args["plain"]),
    }


def _dtensor_in_save(mesh, path: str) -> dict:
    """certckpt.save of DTensors: a replicated one on rank 0 alone (no collective), a sharded one refused."""
    rep = distribute_tensor(torch.arange(6.0), mesh, [Replicate(), Replicate()])
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Replicate(), Shard(0)])
    plain, problem = plain_tensor(rep)
    out = {
        "replicated_plain": problem is None and type(plain) is torch.Tensor and torch.equal(plain, torch.arange(6.0)),
        "sharded_problem": "; ".join(plain_tensor(sharded)[1]),
    }
    if dist.get_rank() == 0:
        for key, obj, where in (("save_replicated", rep, path), ("save_sharded", sharded, path + ".2")):
            try:
                certckpt.save({"w": obj}, where)
                out[key] = "ok"
            except certckpt.UnsupportedObjectError as e:
                out[key] = str(e)
    return out


def fsdp_load(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _shard(_model(1), mesh)  # other initial values: the load must replace them
    opt = torch.optim.AdamW(m.parameters(), lr=0.5)
    x = torch.randn(2, 12)
    m(x).sum().backward()
    opt.step()
    opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 0, "tag": ""}}
    reader = CertifiedReader(args["dir"], check_fingerprints=True)
    dcp.load(state, storage_reader=reader)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(m, opt)
    return {
        "fps": _full_fps(_flat(msd, osd)),
        "meta": state["meta"],
        "lr": osd["param_groups"][0]["lr"],
        "checked": reader.checked_tensors,
        "local_shape": list(msd["0.weight"].to_local().shape),
    }


def fsdp_load_error(args):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _shard(_model(1), mesh)
    state = {"model": get_state_dict(m, [])[0]}
    try:
        dcp.load(state, storage_reader=CertifiedReader(args["dir"], check_fingerprints=True))
    except dcp.CheckpointException as e:  # DCP wraps every rank's failure in one CheckpointException
        return {"error": str(e)}
    return {"error": None}
