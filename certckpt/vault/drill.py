"""Restore drills: prove that latest-good comes back from the vault as an undamaged, usable model.

A restart that succeeds is not proof of an undamaged model, so a drill reports four stages apart:

* ``bytes``: latest-good copied out of the vault and every digest verified;
* ``fingerprints``: every tensor's device fingerprint recomputed and matched;
* ``load``: the state loads into a freshly built model with no missing or unexpected keys (a sharded
  checkpoint is put together from its shards in this process, without torch.distributed; a file with
  companions gives its ``model.safetensors`` companion when it has one);
* ``metrics``: the model's evaluation agrees with a clean reference run within a tolerance.

The drill is recorded in the vault's ledger (incidents close on a passing drill).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from certckpt.errors import CertckptError, ConfigurationError
from certckpt.format.sharded.check import verify_checkpoint
from certckpt.format.verify import verify
from certckpt.storage import join
from certckpt.trust.ledger import Ledger

from .bundles import Bundle, bundle_of
from .restoration import restore

__all__ = ["DrillResult", "drill_restore", "load_callable", "pick_reference", "compare_metrics", "STAGES"]

STAGES = ("bytes", "fingerprints", "load", "metrics")
_MODEL_FILE = "model.safetensors"  # a companion holding the model's own state (Hugging Face's name)


@dataclass(kw_only=True, slots=True)
class DrillResult:
    """What a restore drill found.

    Attributes:
        outcome: ``pass`` (all four stages passed), ``fail``, or ``incomplete`` (no reference
            metrics to compare with: the model loads, but nothing says it is undamaged).
        stages: per stage ``{"ok": bool | None, "detail": str, ...}`` (None: not run).
        time_to_model_s: from the start of the restore to a loaded model.
    """

    vault: str
    ckpt_id: str | None
    step: int | None
    outcome: str
    stages: dict[str, dict[str, Any]]
    seconds: float
    time_to_model_s: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    reference: dict[str, float] | None = None
    restored: str | None = None
    recorded: bool = False
    drill_id: str | None = None  # its record in the vault's ledger (cite it to close an incident)

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "restore-drill",
            "vault": self.vault,
            "ckpt_id": self.ckpt_id,
            "step": self.step,
            "outcome": self.outcome,
            "passed": self.passed,
            "stages": self.stages,
            "seconds": round(self.seconds, 3),
            "time_to_model_s": None if self.time_to_model_s is None else round(self.time_to_model_s, 3),
            "metrics": self.metrics,
            "reference": self.reference,
            "restored": self.restored,
            "drill_id": self.drill_id,
        }


def load_callable(spec: str) -> Callable[..., Any]:
    """``module:attr`` (dots allowed in attr) → the object.

    The current directory is importable, as with ``python -m``.
    """
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigurationError(f"{spec!r}: expected module:callable, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ConfigurationError(f"{spec!r}: cannot import {module} ({e})") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(f"{spec!r}: {module} has no attribute {attr}") from None
    if not callable(obj):
        raise ConfigurationError(f"{spec!r}: not callable")
    return obj


def pick_reference(reference: Mapping[str, Any], *, ckpt_id: str | None, step: int | None) -> dict[str, float] | None:
    """The reference metrics for this checkpoint: a flat ``{metric: value}``, or one keyed by
    checkpoint id or step (as ``--save-metrics`` writes). None when it has none for this step."""
    for k in (ckpt_id, None if step is None else str(step)):
        if k is not None and isinstance(reference.get(k), Mapping):
            return {m: float(v) for m, v in reference[k].items()}
    if reference and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in reference.values()):
        return {m: float(v) for m, v in reference.items()}
    return None


def compare_metrics(
    values: Mapping[str, float], reference: Mapping[str, float], *, rtol: float, atol: float
) -> tuple[bool, list[str]]:
    """Every reference metric must be present and within ``atol + rtol * |ref|``; returns (ok, problems)."""
    problems = []
    for name, ref in sorted(reference.items()):
        if name not in values:
            problems.append(f"{name}: missing from the evaluation")
            continue
        v = values[name]
        if not (math.isfinite(v) and abs(v - ref) <= atol + rtol * abs(ref)):
            problems.append(f"{name}: {v:.6g} vs reference {ref:.6g} (tolerance {atol:g} + {rtol:g}·|ref|)")
    return not problems, problems


def _as_metrics(out: Any) -> dict[str, float]:
    if isinstance(out, Mapping):
        return {str(k): float(v) for k, v in out.items()}
    return {"metric": float(out)}


def _model_state(obj: Any, key: str | None) -> Any:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            keys = ", ".join(map(str, obj)) if isinstance(obj, Mapping) else type(obj).__name__
            raise ConfigurationError(f"the checkpoint has no {key!r} entry (top-level keys: {keys})")
        return obj[key]
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        return obj["model"]
    return obj


@dataclass(slots=True)
class _Deep:
    ok: bool
    step: int | None
    tensors: int
    problems: list[str]
    what: str = ""


def _deep_check(dest: str, bundle: Bundle) -> _Deep:
    """Recompute every fingerprint of the restored checkpoint: the file; a sharded directory's every
    chunk and their composition into the manifest's whole-tensor fingerprints; a file's certified
    companions too."""
    if bundle.kind == "sharded":
        sharded = verify_checkpoint(dest, deep=True)
        return _Deep(
            ok=sharded.ok,
            step=sharded.record.step if sharded.record else None,
            tensors=sharded.tensors,
            problems=[p.message for p in sharded.problems],
            what=f"{sharded.files} shard files, composed into the manifest's",
        )
    rep = verify(dest, deep=True)
    out = _Deep(
        ok=rep.ok,
        step=rep.info.record.step if rep.info else None,
        tensors=rep.tensors,
        problems=[p.message for p in rep.problems],
    )
    certified = [m for m in bundle.members if m.header_digest is not None]
    for m in certified:
        mrep = verify(join(bundle.directory, m.name), deep=True)
        out.ok, out.tensors = out.ok and mrep.ok, out.tensors + mrep.tensors
        out.problems += [p.message for p in mrep.problems]
    if certified:
        out.what = f"the file and {len(certified)} certified companion(s)"
    return out


def _restored_state(dest: str, bundle: Bundle, key: str | None) -> tuple[Any, str]:
    """The model's state from the restored checkpoint, and where it came from (for the report).

    A sharded checkpoint is put together in this process (no torch.distributed); a file with
    companions gives its ``model.safetensors`` companion (the Hugging Face Trainer's layout) unless
    ``key`` names an entry of the file itself.
    """
    # Imported here, not at the top: they import torch, and importing ``certckpt.vault`` must not.
    from certckpt.format.reader import load

    if bundle.kind == "sharded":
        from .assemble import assemble_sharded, model_entries

        state = model_entries(assemble_sharded(dest), key)
        if not state:
            raise ConfigurationError(f"the sharded checkpoint has no {key!r} entries")
        return state, " (assembled from its shards)"
    names = {m.name for m in bundle.members if m.header_digest is not None}
    if key is None and _MODEL_FILE in names:
        return load(join(bundle.directory, _MODEL_FILE), map_location="cpu"), f" (from {_MODEL_FILE})"
    return _model_state(load(dest, map_location="cpu"), key), ""


def drill_restore(
    vault: str,
    *,
    model_factory: Callable[[], Any],
    eval_fn: Callable[[Any], Any],
    reference: Mapping[str, Any] | str | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    key: str | None = None,
    scratch: str | None = None,
    record: bool = True,
    progress: Callable[[int, int], None] | None = None,
    accept: str = "trusted",
) -> DrillResult:
    """Restore latest-good from ``vault`` into scratch space and check it stage by stage.

    Args:
        model_factory: builds a fresh model (``torch.nn.Module``).
        eval_fn: ``eval_fn(model)`` → a number or ``{metric: number}``.
        reference: metrics of a clean reference run (a dict or a JSON file path).
        key: the checkpoint entry holding the model's state dict (default ``"model"`` when present,
            else the whole object).
        scratch: directory to restore into (kept); default a temporary one, removed afterwards.
        record: write the result to the vault's ledger.
        progress: ``progress(done, total)`` while the checkpoint is copied out of the vault.
        accept: ``"trusted"`` (default) or ``"verified"``: drill the newest verified checkpoint when
            no trusted one is held (a run without the auditor).
    """
    t0 = time.perf_counter()
    metrics_ref: Mapping[str, Any] | None  # the reference, read from its file when given a path
    if isinstance(reference, str):
        with open(reference, encoding="utf-8") as f:
            metrics_ref = json.load(f)
    else:
        metrics_ref = reference
    stages: dict[str, dict[str, Any]] = {s: {"ok": None, "detail": "not run"} for s in STAGES}
    result = DrillResult(
        vault=vault, ckpt_id=None, step=None, outcome="fail", stages=stages, seconds=0.0, time_to_model_s=None
    )
    where = scratch or tempfile.mkdtemp(prefix="certckpt-drill-")
    tmp = None if scratch else where  # made here: removed afterwards
    try:
        try:
            os.makedirs(where, exist_ok=True)
            r = restore(vault, "latest-good", where + "/", progress=progress, accept=accept)
            result.ckpt_id, result.restored = r.ckpt_id, r.dest
            stages["bytes"] = {
                "ok": True,
                "detail": f"{r.nbytes} bytes restored and verified at {r.bytes_per_s / 1e6:.1f} MB/s",
                "bytes": r.nbytes,
                "bytes_per_s": round(r.bytes_per_s),
            }
        except CertckptError as e:
            stages["bytes"] = {"ok": False, "detail": str(e)}
            return result
        try:
            bundle = bundle_of(r.dest, header_digest=None)  # restore matched it against the holding already
            deep = _deep_check(r.dest, bundle)
        except CertckptError as e:
            stages["fingerprints"] = {"ok": False, "detail": str(e)}
            return result
        result.step = deep.step
        stages["fingerprints"] = {
            "ok": deep.ok,
            "detail": f"{deep.tensors} tensor fingerprints recomputed and matched"
            + (f" ({deep.what})" if deep.what else "")
            if deep.ok
            else "; ".join(deep.problems[:3]),
        }
        if not deep.ok:
            return result
        try:
            model = model_factory()
            state, source = _restored_state(r.dest, bundle, key)
            model.load_state_dict(state, strict=True)
            model.eval()
            result.time_to_model_s = time.perf_counter() - t0
            stages["load"] = {
                "ok": True,
                "detail": f"{len(state)} entries{source} loaded strictly into {type(model).__name__}",
            }
        except Exception as e:  # the user's factory and torch's loader raise what they raise
            stages["load"] = {"ok": False, "detail": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            return result
        try:
            import torch

            with torch.no_grad():
                result.metrics = _as_metrics(eval_fn(model))
        except Exception as e:
            stages["metrics"] = {"ok": False, "detail": f"evaluation raised {type(e).__name__}: {e}"}
            return result
        ref = pick_reference(metrics_ref, ckpt_id=result.ckpt_id, step=result.step) if metrics_ref else None
        result.reference = ref
        if ref is None:
            stages["metrics"] = {
                "ok": None,
                "detail": "no reference metrics for this step: pass --reference to compare with a clean run",
            }
            result.outcome = "incomplete"
            return result
        ok, problems = compare_metrics(result.metrics, ref, rtol=rtol, atol=atol)
        stages["metrics"] = {
            "ok": ok,
            "detail": f"{len(ref)} metric(s) within tolerance of the clean reference" if ok else "; ".join(problems),
        }
        result.outcome = "pass" if ok else "fail"
        return result
    finally:
        result.seconds = time.perf_counter() - t0
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            result.restored = None
        if record:
            doc = result.to_dict()
            doc.update(at=time.time(), host=socket.gethostname())
            try:
                result.drill_id = Ledger(vault).record_drill(doc).removesuffix(".json")
                result.recorded = True
            except (CertckptError, OSError):
                pass  # a vault that cannot be written still gets its drill reported; ``recorded`` says so
