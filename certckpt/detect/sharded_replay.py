"""The ring replay audit under FSDP2 / HSDP: local gradients signed at each layer's reduce-scatter.

Under FSDP a layer's local (unsharded, unreduced) gradient exists only between its backward and its
reduce-scatter. FSDP2 lets a user replace that collective (``FSDPModule.set_custom_reduce_scatter``);
its input is exactly the rank's local gradient of the layer's parameters, flattened, padded and laid
out by destination shard, the same layout on every rank of the mesh. ``GradientRecorder`` installs a
pass-through replacement that, when armed, takes the 32-bit audit digest (``digest.py``) of that input
first: one digest per layer per reduce-scatter, in backward order. With the sentinels on
(``sharded_trigger.py``) it also takes every training input's sum of squares, and a triggered replay
signs each layer with that instead of a digest.

The replay is collective, because every layer's weights are all-gathered for it: on an audit step
every rank replays its predecessor's micro-batches (they travel around the ring, as under DDP)
through the same sharded model, with the step's weights (before the optimizer step). During the
replay the recorder signs each layer's local gradient and *skips* the reduce-scatter (its output is
zeros): no gradient moves, and the replay's sharded gradients, written into ``.grad`` slots emptied
for it, are dropped afterwards, so the step's real gradients come back untouched and the update is
bit-for-bit the one plain FSDP applies. A replayed layer digest equals the origin's training digest
when both ranks computed correctly: same all-gathered weights, same data, same RNG state, same
kernels (deterministic ones; the first step checks that). Comparison, attribution and arbitration
then follow the DDP ring (``attribution.py``); an arbitration is one more collective replay, two
hops round the ring, where the rank after each replayer recomputes the origin's micro-batches.

Gradient accumulation: a step's micro-batches may reduce-scatter on every backward (FSDP2's default)
or only on the last one (``set_requires_gradient_sync(False)`` before the others); the recorder
notes which layers reduced after which micro-batch and the replay syncs the same way, so the
accumulated input it signs is the one training reduced.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .attribution import arbitration_plan, ring_pairs
from .digest import digest
from .hook import sum_of_squares
from .inject import Injector
from .timing import span

try:  # the interface set_custom_reduce_scatter takes (documented there, defined in a private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - a torch that moved it: duck typing is all FSDP needs
    _ReduceScatterBase = object  # type: ignore[assignment,misc]

__all__ = [
    "GradientRecorder",
    "LayerDigest",
    "ReplayComparison",
    "arbitrate",
    "compare_ring",
    "signed",
    "shard_group_size",
    "sync_pattern",
    "update_inputs",
    "recompute_update",
    "update_digests",
    "update_labels",
]


@dataclass(frozen=True, slots=True)
class LayerDigest:
    """One reduce-scatter's input, signed: the micro-batch it followed, the layer, the digest."""

    micro: int
    layer: str
    value: int

    def as_list(self) -> list:
        return [self.micro, self.layer, self.value]


def shard_group_size(model: torch.nn.Module) -> int:
    """How many ranks shard each parameter (the size of FSDP's reduce-scatter group); 0 without DTensors."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return math.prod(mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())
    return 0


class _SigningReduceScatter(_ReduceScatterBase):
    """FSDP's reduce-scatter of one module, with the recorder's digest taken first when armed."""

    def __init__(self, layer: str, recorder: GradientRecorder, inner: Any):
        self.layer, self.recorder, self.inner = layer, recorder, inner

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.inner is not None:
            return self.inner.allocate(size, dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        rec = self.recorder
        if rec.injector is not None:  # drills: a fault in this layer's local gradient, before anything reads it
            rec.injector.on_local_grads([self.layer], [input_tensor])
        if rec.mode == "replay":
            with span("replay_signature"):
                value = sum_of_squares(input_tensor) if rec.measure == "squares" else digest(input_tensor)
                rec.calls.append((rec.micro, self.layer, value))
            output_tensor.zero_()  # nothing moves: the replay's gradients are dropped
            return None
        if rec.mode == "train":
            with span("train_signature"):
                rec.calls.append((rec.micro, self.layer, digest(input_tensor)))
        # Every training reduce-scatter: is this rank's local gradient finite? (one sum on the device,
        # no synchronisation: NaN and Inf survive it). Read at before_update, with the reduced flags.
        with span("nonfinite_flags"):
            rec.pre_flags.append(input_tensor.sum(dtype=torch.float32))
        if rec.sentinels:
            # The sentinels' scalar of this layer (one dot product on the device, no synchronisation),
            # and the step's trained signature should a trigger replay it: FSDP frees this input
            # after the collective, but a replay recomputes it bit for bit, and its sum of squares.
            with span("sentinels"):
                rec.squares.append((rec.micro, self.layer, sum_of_squares(input_tensor)))
        if self.inner is not None:
            return self.inner(output_tensor, input_tensor, group, op, async_op)
        return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def _current_reduce_scatter(module: Any) -> Any:
    # A reduce-scatter the user installed before us keeps doing the communication. FSDP2 has no public
    # getter; without one (or with several param groups) we fall back to the default collective.
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
    except AttributeError:
        return None
    comm = getattr(groups[0], "_reduce_scatter_comm", None) if len(groups) == 1 else None
    return None if type(comm).__name__ == "DefaultReduceScatter" else comm


class GradientRecorder:
    """Signs the input of every FSDP module's reduce-scatter while armed (see the module docstring).

    ``mode``: ``"off"`` (pass through), ``"train"`` (sign, then reduce as usual) or ``"replay"`` (sign,
    and skip the collective). ``micro`` is the index of the micro-batch whose backward runs.
    """

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        # One entry per FSDP state, not per FSDPModule: fully_shard([a, b]) (TorchTitan groups its final
        # norm and output projection so) makes a and b one unit with one reduce-scatter; wrapping it once
        # per module would sign that collective twice in training and once in a replay.
        units: dict[int, tuple[list[str], Any]] = {}
        for name, m in model.named_modules():
            if isinstance(m, FSDPModule):
                try:
                    key = id(m._get_fsdp_state())
                except AttributeError:  # pragma: no cover - a torch without it: one unit per module
                    key = id(m)
                units.setdefault(key, ([], m))[0].append(name or "<root>")
        self.modules = [("+".join(names), m) for names, m in units.values()]
        unit_of = {member: "+".join(names) for names, _ in units.values() for member in names}
        self.layers = _owning_layers(model, unit_of)
        self.mode = "off"
        self.measure = "digest"  # what a replay signs each layer with: "digest", or "squares" (a triggered one)
        self.micro = 0
        self.calls: list[tuple[int, str, torch.Tensor]] = []
        self.pre_flags: list[torch.Tensor] = []  # one sum per training reduce-scatter since new_step
        self.sentinels = False  # take each training reduce-scatter's sum of squares (the session's sentinels)
        self.squares: list[tuple[int, str, torch.Tensor]] = []  # (micro-batch, layer, sum of squares)
        self.injector: Injector | None = None  # drills: faults planted in the local gradients
        for name, m in self.modules:
            m.set_custom_reduce_scatter(_SigningReduceScatter(name, self, _current_reduce_scatter(m)))

    def arm(self, mode: str) -> None:
        self.mode, self.micro, self.calls = mode, 0, []

    def new_step(self) -> None:
        """Forget the previous step's pre-reduce sums and squares (a step that failed before reading them)."""
        self.pre_flags, self.squares, self.micro = [], [], 0

    def take_squares(self) -> list[tuple[int, str, torch.Tensor]]:
        """This step's ``(micro-batch, layer, sum of squares)`` per training reduce-scatter, in call
        order (on the device; no synchronisation)."""
        squares, self.squares = self.squares, []
        return squares

    def take_pre_sums(self) -> torch.Tensor | None:
        """The sums of this step's local gradients, one per reduce-scatter, stacked (None: none ran)."""
        sums, self.pre_flags = self.pre_flags, []
        return torch.stack(sums) if sums else None

    def take(self) -> list[LayerDigest]:
        """The digests signed since ``arm``, in call order (one host synchronisation), and disarm."""
        calls, self.calls, self.mode = self.calls, [], "off"
        if not calls:
            return []
        return signed(calls)

    def replay(
        self,
        model: torch.nn.Module,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        units: Sequence[Any],
        rngs: Sequence[dict[str, torch.Tensor]],
        *,
        divisor: int,
        pattern: dict[int, set[str]],
        restore_rng: Callable[[dict[str, torch.Tensor]], None],
        measure: str = "digest",
    ) -> list[LayerDigest]:
        """Recompute ``units`` through the sharded model, signing every layer's local gradient (collective).

        ``.grad`` and the buffers are left as they were; no gradient is reduced. ``pattern``: per
        micro-batch, the layers that reduce-scattered after it in training (the others accumulated
        without sync), reproduced here so that the signed inputs are the ones training reduced.
        ``measure``: ``"digest"`` (an audit) or ``"squares"`` (a triggered replay: each input's sum of
        squares, compared by its bits with the one training took).
        """
        params = list(model.parameters())
        saved_grads = [p.grad for p in params]
        saved_buffers = [b.detach().clone() for b in model.buffers()]
        layers = {name for names in pattern.values() for name in names}
        toggled = any(pattern.get(k, set()) != layers for k in range(len(units)))
        by_name = dict(self.modules)
        devices = [p.device for p in params[:1] if p.device.type == "cuda"]
        for p in params:
            p.grad = None
        self.arm("replay")
        self.measure = measure
        if self.injector is not None:  # a persistent fault corrupts the replays its rank computes too
            self.injector.begin(self.injector.step, "replay")
        try:
            with torch.random.fork_rng(devices=devices):
                for k, unit in enumerate(units):
                    restore_rng(rngs[k])
                    if toggled:
                        for name in layers:
                            by_name[name].set_requires_gradient_sync(name in pattern.get(k, set()), recurse=False)
                    self.micro = k
                    loss = loss_fn(model, unit)
                    (loss / divisor if divisor > 1 else loss).backward()
                    del loss
            return self.take()
        finally:
            self.mode, self.measure = "off", "digest"
            if self.injector is not None:
                self.injector.begin(self.injector.step, "train")
            if toggled:  # as the step's last micro-batch left them
                last = pattern.get(len(units) - 1, set())
                for name in layers:
                    by_name[name].set_requires_gradient_sync(name in last, recurse=False)
            for p, g in zip(params, saved_grads):
                p.grad = g
            with torch.no_grad():
                for b, v in zip(model.buffers(), saved_buffers):
                    b.copy_(v)


def signed(calls: Sequence[tuple[int, str, torch.Tensor]]) -> list[LayerDigest]:
    """``(micro-batch, layer, value)`` records as ``LayerDigest``s (one host synchronisation): a digest
    as it is, a float32 sum of squares as its 32 raw bits, so that equality is exact and a NaN
    equals a NaN with the same bits."""
    if not calls:
        return []
    values = torch.stack([v for _, _, v in calls])
    if values.dtype == torch.float32:
        values = values.view(torch.int32)
    return [LayerDigest(m, layer, int(v)) for (m, layer, _), v in zip(calls, values.tolist())]


def _owning_layers(model: torch.nn.Module, unit_of: dict[str, str]) -> list[str]:
    """The FSDP units (by recorder name, in module order) that own a trained parameter: each
    parameter belongs to the innermost ``fully_shard``-ed module around it, whose unit's reduce-scatter
    carries its gradient; a unit that owns none never reduce-scatters. ``unit_of``: each FSDP module's
    name, in module order, to the name of its unit."""
    prefixes = sorted(((n, "" if n == "<root>" else n + ".") for n in unit_of), key=lambda it: -len(it[1]))
    owners = set()
    for pname, p in model.named_parameters():
        if p.requires_grad:
            owners.add(unit_of.get(next((n for n, pre in prefixes if pname.startswith(pre)), "<root>"), "<root>"))
    return list(dict.fromkeys(u for u in unit_of.values() if u in owners))


def sync_pattern(calls: Sequence[LayerDigest]) -> dict[int, set[str]]:
    """Per micro-batch, the layers that reduce-scattered after it."""
    out: dict[int, set[str]] = {}
    for c in calls:
        out.setdefault(c.micro, set()).add(c.layer)
    return out


@dataclass(frozen=True, slots=True)
class ReplayComparison:
    """The ring comparison of one audit: failed ``(origin, replayer)`` pairs and, per pair, the
    layers whose digests differ (``"*"``: the sequences do not even line up)."""

    failed: tuple[tuple[int, int], ...]
    mismatched: dict[str, list[str]]

    @property
    def passed(self) -> bool:
        return not self.failed


def _differing(a: Sequence[Sequence], b: Sequence[Sequence]) -> list[str]:
    if [x[:2] for x in a] != [y[:2] for y in b]:
        return ["*"]
    return list(dict.fromkeys(x[1] for x, y in zip(a, b) if x[2] != y[2]))


def compare_ring(trained: Sequence[Sequence[Sequence]], replayed: Sequence[Sequence[Sequence]]) -> ReplayComparison:
    """Compare every replayer's replay with its origin's training digests (pure: lists per rank)."""
    failed, mismatched = [], {}
    for origin, replayer in ring_pairs(len(trained)):
        diff = _differing(replayed[replayer], trained[origin])
        if diff:
            failed.append((origin, replayer))
            mismatched[f"{origin}->{replayer}"] = diff[:10]
    return ReplayComparison(tuple(failed), mismatched)


def arbitrate(
    world: int,
    failed: Sequence[tuple[int, int]],
    trained: Sequence[Sequence[Sequence]],
    replayed: Sequence[Sequence[Sequence]],
    arbiters: Sequence[Sequence[Sequence]],
    *,
    same: Callable[[Any, Any], bool] | None = None,
) -> dict[tuple[int, int], str]:
    """What each arbiter's replay (``arbiters[a]``: rank a's replay of rank a - 2) agreed with.

    ``same(a, b)``: whether two ranks' results agree (default: layer digests line up and match; the
    update replay passes plain equality of its digest lists)."""
    same = same or (lambda a, b: not _differing(a, b))
    results = {}
    for origin, replayer, arbiter in arbitration_plan(world, failed):
        arb = arbiters[arbiter]
        if same(arb, trained[origin]):
            results[(origin, replayer)] = "origin"
        elif same(arb, replayed[replayer]):
            results[(origin, replayer)] = "replayer"
        else:
            results[(origin, replayer)] = "neither"
    return results


# --- the update replay: the optimizer step of a shard, recomputed by the next rank ----------------------
#
# On a 1-D FSDP mesh every shard has one holder: no replica can disagree with a wrong optimizer step.
# At audit steps each rank ships what its step read (its local weights and optimizer state before the
# step, its reduced gradient shard and the group's hyper-parameters) to the next rank, which runs a
# fresh optimizer of the same class over plain copies; the digests of the weights and state it gets
# must be the ones the origin's own step produced.

_SIMPLE = (bool, int, float, str, type(None))


def _plain(x: Any) -> Any:
    """A hyper-parameter as it can travel (numbers, strings, tuples, tensors); None: it cannot."""
    if isinstance(x, _SIMPLE):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)) and all(isinstance(v, _SIMPLE + (torch.Tensor,)) for v in x):
        return type(x)(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in x)
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def update_inputs(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What the coming ``optimizer.step()`` reads, per parameter with a gradient: copies of its weights
    and state taken now, before the step (the caller adds each item's gradient as ``g`` after the step,
    which may clip it first); and those parameters, in the same order."""
    groups, params = [], []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in ((k, _plain(v)) for k, v in g.items() if k != "params") if v is not None}
        items = []
        for p in g["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            tensors = {k: _local(v).clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            params.append(p)
            items.append(
                {
                    "name": names.get(id(p), "?"),
                    "w": _local(p).clone(),
                    "state": tensors,
                    "state_on_cpu": sorted(k for k, v in tensors.items() if state[k].device.type == "cpu"),
                }
            )
        groups.append({"hyper": hyper, "params": items})
    return {"groups": groups}, params


def recompute_update(cls: type, inputs: dict[str, Any], *, device: torch.device) -> list[int]:
    """Run ``cls``'s step over plain copies of ``inputs`` (``update_inputs`` plus each item's ``g``)
    and return ``update_digests`` of the result: what the origin's own step must have produced."""
    groups, params, kwargs = [], [], {}
    # the optimizer class's own __init__ (mypy cannot vouch for __init__ read off a type object)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}  # type: ignore[misc]
    for gi, g in enumerate(inputs["groups"]):
        hyper = dict(g["hyper"])
        if gi == 0:  # the constructor checks its own arguments (SGD: nesterov needs momentum)
            kwargs = {k: v for k, v in hyper.items() if k in accepted}
        ps = []
        for item in g["params"]:
            p = torch.nn.Parameter(item["w"].to(device, copy=True), requires_grad=True)
            p.grad = item["g"].to(device, copy=True)  # never the live gradient: an optimizer may write it
            ps.append((p, item))
        groups.append({**hyper, "params": [p for p, _ in ps]})
        params += ps
    if not params:
        return []
    opt = cls(groups, **kwargs)
    for p, item in params:
        on_cpu = set(item["state_on_cpu"])
        # copies: the step updates its state in place, and the inputs may travel on to an arbiter
        opt.state[p] = {k: v.to("cpu" if k in on_cpu else device, copy=True) for k, v in item["state"].items()}
    opt.step()
    return update_digests(opt, [p for p, _ in params])


def update_digests(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[int]:
    """Digests of each parameter's local weights and state tensors (sorted keys), after the step."""
    out = []
    for p in params:
        out.append(digest(_local(p)))
        state = optimizer.state.get(p, {})
        out += [digest(_local(state[k])) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return torch.stack(out).tolist() if out else []


def update_labels(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], names: dict[int, str]) -> list[str]:
    """What each of ``update_digests``' values is: ``name`` for weights, ``name:key`` for state."""
    out = []
    for p in params:
        name = names.get(id(p), "?")
        state = optimizer.state.get(p, {})
        out += [name] + [f"{name}:{k}" for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out
