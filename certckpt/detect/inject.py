"""Synthetic silent-data-corruption faults, for drills and tests of the detection hooks.

A ``Fault`` hits one rank at one step (``persistent=False``) or at every step from then on
(``persistent=True``, as a damaged unit would). Kinds:

- ``forward``: perturbs one activation (the output of a module) during the forward pass;
- ``backward``: perturbs one local gradient before the all-reduce;
- ``post-optimizer``: perturbs one stored weight after the optimizer step;
- ``non-finite``: writes NaN (or Inf) into one local gradient before the all-reduce;
- ``reduction``: writes NaN (or Inf) into the reduced gradients one rank receives (a faulty
  interconnect or reduction), to exercise the post-reduce check;
- ``buffer``: perturbs one stored floating-point buffer (a BatchNorm running statistic) after the
  optimizer step, as a memory fault in state outside the parameters would.

The perturbation is a relative scale of the largest-magnitude element (``scale``), one flipped bit
of it (``bit``), that element set to a value (``set_to``), the whole tensor multiplied by a factor
(``factor``), or zeros (``zero``: a backward fault zeroes every local gradient of the DDP bucket that
holds its target, a forward fault the module's whole output). A persistent fault also corrupts the
replays its rank computes; a one-time fault hits the training computation only, as a transient
error would.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from certckpt.errors import ConfigurationError

__all__ = ["Fault", "Injector", "FaultKind", "FAULT_KINDS"]


@dataclass(frozen=True, slots=True)
class FaultKind:
    """One kind of planted fault: what it corrupts and which check is designed to catch it.

    Attributes:
        corrupts: what the fault changes, in words.
        caught_by: the check designed to catch it (an event kind): ``replay`` at the next audit
            (a one-time fault between audits escapes it), ``consensus`` at the next consensus step,
            ``nonfinite-pre`` / ``nonfinite-post`` at once.
        drilled: part of ``certckpt drill faults``'s matrix.
    """

    corrupts: str
    caught_by: str
    drilled: bool = True


# The one table of fault kinds: the injector validates against it, the drill builds its matrix and
# its expectations from it. A new kind is a row here and its hook in Injector.
FAULT_KINDS: dict[str, FaultKind] = {
    "forward": FaultKind("a weight's effect in the forward pass (the loss is wrong)", "replay"),
    "backward": FaultKind("a local gradient after the backward pass", "replay"),
    "post-optimizer": FaultKind("a weight after the optimizer step, on one replica", "consensus"),
    "non-finite": FaultKind("a local gradient becomes NaN", "nonfinite-pre"),
    "reduction": FaultKind("the all-reduced gradient becomes NaN", "nonfinite-post", drilled=False),
    "buffer": FaultKind("a floating-point buffer (BatchNorm statistics) on one replica", "consensus", drilled=False),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One synthetic fault.

    Attributes:
        kind: one of ``FAULT_KINDS``.
        rank: the rank whose computation goes wrong (-1: every rank, for a reduction fault that
            delivers the same bad values to all).
        step: the first (or only) optimizer step it hits.
        persistent: hit every step from ``step`` on, replays included.
        scale: relative perturbation of the largest-magnitude element (the default perturbation:
            used when none of ``bit``, ``set_to``, ``factor`` and ``zero`` is set).
        bit: flip this bit of that element's raw bits instead.
        set_to: set that element to this value instead.
        factor: multiply the whole target tensor by this factor instead.
        zero: zero the target instead (backward: every gradient of its DDP bucket).
        target: module name (forward), buffer name (buffer) or parameter name (others); default:
            the first one (for buffer: the first floating-point buffer).
        value: for ``non-finite``: ``"nan"`` or ``"inf"``.
    """

    kind: str
    rank: int
    step: int
    persistent: bool = False
    scale: float = 1e-2
    bit: int | None = None
    set_to: float | None = None
    factor: float | None = None
    zero: bool = False
    target: str | None = None
    value: str = "nan"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigurationError(f"fault kind must be one of {tuple(FAULT_KINDS)}, got {self.kind!r}")
        if self.step < 1 or self.rank < -1 or (self.rank == -1 and self.kind != "reduction"):
            raise ConfigurationError(
                "fault step must be >= 1 and rank >= 0 (-1, every rank, only for reduction faults)"
            )
        if self.value not in ("nan", "inf"):
            raise ConfigurationError("value must be 'nan' or 'inf'")
        chosen = [n for n in ("bit", "set_to", "factor") if getattr(self, n) is not None] + (
            ["zero"] if self.zero else []
        )
        if len(chosen) > 1:
            raise ConfigurationError(f"a fault perturbs one way: choose one of {', '.join(chosen)}")
        if chosen and self.kind in ("non-finite", "reduction"):
            raise ConfigurationError(f"a {self.kind} fault writes {self.value}: {chosen[0]} does not apply")

    def active(self, step: int, phase: str) -> bool:
        if self.persistent:
            return step >= self.step
        return phase == "train" and step == self.step


def perturb_(t: torch.Tensor, fault: Fault) -> tuple[float, float] | None:
    """Perturb ``t`` in place (its largest-magnitude element, or all of it: ``factor``, ``zero``).

    Returns:
        That element's value before and after (what a sweep reports as the fault's effect), or
        None for an empty tensor.
    """
    with torch.no_grad():
        flat = t.view(-1)
        if flat.numel() == 0:
            return None
        i = int(flat.abs().argmax())
        old = flat[i].clone()
        if fault.kind in ("non-finite", "reduction"):
            flat[i] = float(fault.value)
        elif fault.zero:
            flat.zero_()
        elif fault.factor is not None:
            flat.mul_(fault.factor)
        elif fault.set_to is not None:
            flat[i] = fault.set_to
        elif fault.bit is not None:
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            flat.view(ints)[i] ^= 1 << fault.bit if fault.bit < 8 * flat.element_size() - 1 else -(1 << fault.bit)
        else:
            flat[i] = flat[i] * (1 + fault.scale) + fault.scale
            if bool(flat[i] == old):  # lost to rounding (a small scale in bfloat16): flip the lowest bit
                ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
                flat.view(ints)[i] ^= 1
        return float(old), float(flat[i])


class Injector:
    """Applies the faults meant for one rank at the points the auditor calls it from."""

    def __init__(self, faults: Iterable[Fault], *, rank: int):
        self.faults = [f for f in faults if f.rank in (rank, -1)]
        self.rank = rank
        self.step = 0
        self.phase = "train"
        self._handles: list = []
        self.fired: list[tuple[str, int, str]] = []  # (kind, step, phase), for reports
        self.effects: list[tuple[float, float]] = []  # the perturbed element's (before, after), per firing
        self.default_param: str | None = None  # the model's first parameter, set by install()
        self.default_buffer: str | None = None  # its first floating-point buffer

    def install(self, module: torch.nn.Module) -> None:
        """Register forward hooks for this rank's forward faults; learn the default target parameter."""
        self.default_param = next((n for n, p in module.named_parameters() if p.requires_grad), None)
        self.default_buffer = next((n for n, b in module.named_buffers() if b.is_floating_point()), None)
        mods = dict(module.named_modules())
        for f in self.faults:
            if f.kind != "forward":
                continue
            name = f.target or next(n for n, m in mods.items() if n and not list(m.children()))
            if name not in mods:
                raise ConfigurationError(f"forward fault target {name!r} is not a module of the model")
            self._handles.append(mods[name].register_forward_hook(self._forward_hook(f)))

    def _forward_hook(self, fault: Fault):
        def hook(_mod, _inp, out):
            if not fault.active(self.step, self.phase) or not isinstance(out, torch.Tensor):
                return None
            bad = out.detach().clone()
            self._fired(fault, perturb_(bad, fault))
            return out + (bad - out.detach())

        return hook

    def _fired(self, fault: Fault, effect: tuple[float, float] | None) -> None:
        self.fired.append((fault.kind, self.step, self.phase))
        if effect is not None:
            self.effects.append(effect)

    def begin(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def _pick(self, kind: Sequence[str], names: Sequence[str]) -> list[tuple[Fault, int]]:
        out = []
        for f in self.faults:
            if f.kind in kind and f.active(self.step, self.phase):
                # The same parameter whatever subset is passed (a DDP bucket holds some, in reverse order).
                target = f.target or self.default_param or names[0]
                if target in names:
                    out.append((f, names.index(target)))
        return out

    def on_local_grads(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> None:
        """Backward and non-finite faults: local gradients before the all-reduce (or a replay's)."""
        kinds = ("backward", "non-finite") if self.phase == "train" else ("backward",)
        for f, i in self._pick(kinds, names):
            if f.zero:  # a zeroed bucket: every gradient it holds (the target's effect is the one reported)
                for j, g in enumerate(grads):
                    if j != i:
                        perturb_(g, f)
            self._fired(f, perturb_(grads[i], f))

    def on_reduced(self, buffer: torch.Tensor) -> None:
        """Reduction faults: the all-reduced bucket this rank received."""
        for f in self.faults:
            if f.kind == "reduction" and f.active(self.step, self.phase):
                self._fired(f, perturb_(buffer, f))

    def after_optimizer(self, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        names = [n for n, _ in named_params]
        for f, i in self._pick(("post-optimizer",), names):
            self._fired(f, perturb_(named_params[i][1].data, f))

    def after_optimizer_buffers(self, named_buffers: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Buffer faults: one stored buffer, after the optimizer step."""
        names = [n for n, _ in named_buffers]
        for f in self.faults:
            if f.kind == "buffer" and f.active(self.step, self.phase):
                target = f.target or self.default_buffer
                if target in names:
                    self._fired(f, perturb_(named_buffers[names.index(target)][1], f))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
