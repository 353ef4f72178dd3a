"""``certify_engine(engine)``: DeepSpeed's own ``save_checkpoint`` / ``load_checkpoint``, certified.

DeepSpeed writes every checkpoint file through a pluggable ``CheckpointEngine`` (``create`` before
a tag is written, ``save(state_dict, path)`` per file, ``commit`` once every file of the rank is
written, ``load(path)`` per file). ``CertifiedCheckpointEngine`` is one: each file is a certified
safetensors file under DeepSpeed's own name; a rank's files of one tag are made durable together
(``durable.joining``: each file's fsync starts once it is written, and at ``commit`` they are linked
under their names and the directory fsync'd once), and ``commit`` (once every rank's files are
durable: a collective) writes the tag's manifest on rank 0 and commits it to the run store's ledger,
before DeepSpeed writes ``latest``. ``certify_engine`` installs it on a built engine and wraps the
engine's ``load_checkpoint``: the tag directory is verified whole on every rank before DeepSpeed
reads a byte, ``tag=None`` means the store's latest-good (never ``latest``), and a resumed run
records on a new branch. Nothing is pickled or unpickled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from deepspeed.runtime.engine import DeepSpeedEngine

from certckpt.detect.agreement import refuse_together, wire_device_for
from certckpt.detect.evidence import CheckpointEvidence
from certckpt.errors import (
    CertckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from certckpt.format.durable import DurableBatch, joining
from certckpt.format.fingerprinting import fingerprint_many
from certckpt.format.reader import load
from certckpt.format.record import RecordFields
from certckpt.format.verify import inspect
from certckpt.format.writer import save_certified
from certckpt.log import enable as enable_log
from certckpt.trust.commit import commit_saved
from certckpt.trust.ledger import Ledger, ckpt_id_for, is_ckpt_id
from certckpt.trust.resume import branch_after_loading, plan_resume
from certckpt.trust.runstore import snapshot_or_empty as _snapshot
from certckpt.trust.runstore import taken_problem

from .codecs import register_deepspeed_types
from .layout import (
    CONVERT_HINT,
    MANIFEST_NAME,
    is_pickle,
    leftover_problem,
    manifest_of,
    require_intact,
    write_manifest,
)

__all__ = ["CertifiedCheckpointEngine", "certify_engine", "Resumed"]

_MODEL_FILE = "mp_rank_00_model_states.pt"  # ZeRO-1/2's module weights (written by rank 0)

logger = logging.getLogger(__name__)


class CheckpointAudit(Protocol):
    """What the certified engine asks of the run's audit (``audit.ZeroAudit``)."""

    def bind(self, ledger: Ledger, *, run: str) -> None:
        """Its events go to ``ledger`` from now on."""

    def restart(self, step: int, *, branch: str, resumed: Resumed | None = None) -> None:
        """A checkpoint at ``step`` was loaded; new checkpoints go on ``branch``; ``resumed``: what was
        loaded (its consensus fingerprint, which the loaded weights must have)."""

    def checkpoint_evidence(self, s: int) -> CheckpointEvidence:
        """What a checkpoint at step s carries (collective)."""

    def end_lineage(self, s: int) -> None:
        """A checkpoint at step s was committed."""

    def flush(self) -> None:
        """Its events so far to the ledger (rank 0)."""


@dataclass(frozen=True, slots=True)
class Resumed:
    """What a certified ``load_checkpoint`` loaded (``engine.checkpoint_engine.resumed``).

    Attributes:
        directory: the tag directory.
        step: its step.
        parent: the checkpoint id it is committed as (None: not committed in this store).
        branch: the branch new checkpoints go on.
        consensus_fp: the state fingerprint every replica agreed on when it was saved (its record's;
            None: saved without ``ZeroAudit``, or not the committed tag). ``ZeroAudit`` proves the
            loaded weights have it.
    """

    directory: str
    step: int
    parent: str | None
    branch: str
    consensus_fp: str | None = None


class CertifiedCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` writing certified files and committing each tag.

    Build it with ``certify_engine(engine, ...)`` (it needs the engine for the step and the ranks).

    Args:
        engine: the ``DeepSpeedEngine``.
        run: the run name in the ledger (default: the save directory's name).
        branch: the branch of a fresh run (default ``main``).
        ledger: the run store (default: the directory given to ``save_checkpoint``).
        accept: what ``load_checkpoint(dir)`` without a tag resumes from: ``verified`` (default:
            the newest checkpoint that is trusted or verified) or ``trusted``.
    """

    def __init__(
        self,
        engine: Any,
        *,
        run: str | None = None,
        branch: str = "main",
        ledger: str | None = None,
        accept: str = "verified",
    ) -> None:
        super().__init__(None)
        if not is_ckpt_id(ckpt_id_for(branch, 0)):
            raise ConfigurationError(f"branch {branch!r}: use 1-100 letters, digits, '.', '_' or '-'")
        if accept not in ("verified", "trusted"):
            raise ConfigurationError(f"accept must be 'verified' or 'trusted', got {accept!r}")
        self.name = "CertifiedCheckpointEngine"
        self.engine = engine
        self.run, self.branch, self.store, self.accept = run, branch, ledger, accept
        self.parent: str | None = None
        self.last_step: int | None = None
        self.resumed: Resumed | None = None
        self._commit_as: str | None = None  # the id the tag being written commits as (None: not committed)
        self._tag_dir: str | None = None
        self.known_store: str | None = os.fspath(ledger) if ledger is not None else None  # where it commits
        self.audit: CheckpointAudit | None = None  # the run's ZeroAudit (it attaches itself): its evidence is committed
        self._evidence: CheckpointEvidence | None = None  # the tag being written's
        self._weights_problem: str | None = None  # its module weights differ from the agreed ones (rank 0)
        self._batch: DurableBatch | None = None  # this rank's files of the tag being written, made durable at commit

    def attach(self, audit: CheckpointAudit) -> None:
        """``audit``'s events go to the run store this engine commits to, and every checkpoint
        committed carries its evidence (``ZeroAudit`` calls it at its construction)."""
        self.audit = audit
        if self.known_store is not None:
            audit.bind(self.ledger_for(self.known_store), run=self._run_name(self.known_store))

    # --- where ----------------------------------------------------------------------------------

    def ledger_for(self, save_dir: str) -> Ledger:
        return Ledger(os.fspath(self.store or save_dir))

    def _run_name(self, save_dir: str) -> str:
        return self.run or os.path.basename(os.path.abspath(save_dir).rstrip("/")) or "run"

    def _together(self, fn: Any, *, what: str) -> Any:
        """``fn()`` on every rank; when it fails on any, every rank raises (none waits in the next
        collective): the failing rank its own error, the others one naming it."""
        error: BaseException | None = None
        out = None
        try:
            out = fn()
        except Exception as e:  # certckpt's or the file system's: the other ranks must learn of it
            error = e
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            wire = wire_device_for(dist.group.WORLD, torch.device(self.engine.device))
            try:
                refuse_together(
                    None if error is None else str(error), group=dist.group.WORLD, wire_device=wire, what=what
                )
            except CertckptError as together:
                if error is not None:
                    raise error from None
                raise CertckptError(str(together)) from None
        elif error is not None:
            raise error
        return out

    def _rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    # --- saving ---------------------------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """Before a tag is written: never over a committed checkpoint; an uncommitted leftover of an
        interrupted save is removed (rank 0), and every rank learns the outcome."""
        tag_dir = os.path.join(info.save_dir, str(info.tag))
        step = int(self.engine.global_steps)
        cid = ckpt_id_for(self.branch, step)

        def prepare() -> str | None:
            snap = _snapshot(self.ledger_for(info.save_dir))
            commit_as: str | None = cid
            if cid in snap.records:
                url = self.ledger_for(info.save_dir).url_of(snap.records[cid])
                if os.path.abspath(os.path.dirname(url)) == os.path.abspath(tag_dir):
                    raise CheckpointExistsError(f"{tag_dir}: {cid} is committed already; it is never written over")
                # a second tag at a step already committed: certified, not committed (one id per step)
                logger.warning(
                    "certckpt: %s: step %d is committed already as %s (%s): this tag is certified but not committed",
                    tag_dir,
                    step,
                    cid,
                    url,
                )
                commit_as = None
            if self._rank() == 0 and os.path.lexists(tag_dir):
                if os.path.exists(os.path.join(tag_dir, MANIFEST_NAME)):
                    raise CheckpointExistsError(f"{tag_dir}: a certified checkpoint is there already; use another tag")
                # only what a save of this run at this step provably left is removed: a plain DeepSpeed
                # tag, another run's, one whose manifest was deleted, are somebody's (doubt frees no space)
                run = self._run_name(info.save_dir)
                ledger = self.ledger_for(info.save_dir)
                problem = taken_problem(ledger, tag_dir, lambda d: leftover_problem(d, run=run, step=step))
                if problem is not None:
                    raise CheckpointExistsError(
                        f"{tag_dir}: not a leftover of this run's own save at step {step} ({problem}), so certckpt "
                        "neither writes into it nor removes it: use another tag or save directory"
                    )
                logger.warning("certckpt: removing %s, left uncommitted by an earlier save of this run", tag_dir)
                shutil.rmtree(tag_dir)
            return commit_as

        self._commit_as = self._together(prepare, what="checkpoint")
        self._tag_dir = tag_dir
        if self._batch is not None:  # an earlier save that never reached its commit: its temp files go
            self._batch.discard()
        # This rank's files of the tag are fsync'd together (each fsync starts as its file is written,
        # beside the next write) and linked under their names at the commit, each directory fsync'd once.
        self._batch = DurableBatch()
        self._evidence = None
        self._weights_problem = f"{tag_dir}: no model states file written to check the agreed weights against"
        self.known_store = self.known_store or os.fspath(info.save_dir)
        if self.audit is not None and self._commit_as is not None:
            # before any file is written: the replicas agree on the weights at this step (collective;
            # a disagreement raises on every rank and nothing is written)
            self.audit.bind(self.ledger_for(info.save_dir), run=self._run_name(info.save_dir))
            self._evidence = self.audit.checkpoint_evidence(step)

    def save(self, state_dict: Any, path: str) -> None:
        """One file of a rank, certified, create-only, under DeepSpeed's name. With a ``ZeroAudit``,
        the module weights of the model states file are checked against the agreed fingerprints first
        (the commit refuses on every rank when they differ)."""
        if self._evidence is not None and os.path.basename(os.fspath(path)) == _MODEL_FILE:
            module = state_dict.get("module") if isinstance(state_dict, dict) else None
            self._weights_problem = _weights_problem(module, self._evidence.tensor_fps, os.fspath(path))
        together = joining(self._batch) if self._batch is not None else contextlib.nullcontext()
        with together:
            save_certified(
                state_dict,
                os.fspath(path),
                step=int(self.engine.global_steps),
                run=self._run_name(os.path.dirname(os.path.dirname(os.fspath(path)))),
                branch=self.branch,
                parent=self.parent,
            )

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every rank makes its files durable under their names; once every rank has (a collective),
        rank 0 writes the manifest and commits it."""
        batch, self._batch = self._batch, None
        self._together(batch.publish if batch is not None else lambda: None, what="checkpoint")
        tag_dir = os.path.join(info.save_dir, str(info.tag))
        step = int(self.engine.global_steps)
        first = (self.last_step or 0) + 1
        state = {
            "tag": str(info.tag),
            "zero_stage": int(self.engine.zero_optimization_stage()),
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "deepspeed": _ds_version(),
        }

        evidence, self._evidence = self._evidence, None

        def write() -> None:
            if self._rank() != 0:
                return
            if evidence is not None and self._weights_problem is not None:
                raise CorruptCheckpointError(self._weights_problem)
            fields = RecordFields(
                step=step,
                run=self._run_name(info.save_dir),
                branch=self.branch,
                parent=self.parent,
                step_range=[first, step],
                lineage=evidence.lineage if evidence is not None else None,
                consensus_fp=evidence.consensus_fp if evidence is not None else None,
            )
            result = write_manifest(tag_dir, state, fields)
            if self._commit_as is not None:
                # the audit's events reach the ledger before the commit record; the branch was
                # started at the load that resumed it
                flush = self.audit.flush if self.audit is not None else None
                commit_saved(self.ledger_for(info.save_dir), result, fields, flush=flush, branch_started=True)

        self._together(write, what="checkpoint commit")
        if self._commit_as is not None:
            self.last_step = step
            if self.audit is not None and evidence is not None:
                self.audit.end_lineage(step)
        return True

    def preserves_storage_sharing(self) -> bool:
        # Without it DeepSpeed copies every tensor before saving (so that torch.save writes no more than
        # the view): certckpt writes only each view's own bytes already.
        return False

    # --- loading --------------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> Any:
        """One file, read by certckpt (digests checked, nothing unpickled)."""
        path = os.fspath(path)
        if is_pickle(path):
            raise NotACheckpointError(f"{path}: a pickle written by plain DeepSpeed, never unpickled; {CONVERT_HINT}")
        return load(path, map_location=map_location if map_location is not None else "cpu")

    def resolve(self, load_dir: str, tag: Any) -> tuple[str, str | None] | None:
        """``(tag directory, tag)`` to load: the tag given, a checkpoint id (``main@10``), or for None
        the store's latest-good; None when the store has committed nothing (a first run)."""
        load_dir = os.fspath(load_dir)
        ledger = self.ledger_for(load_dir)
        if tag is None:
            snap = _snapshot(ledger)
            if not snap.records:
                logger.info("certckpt: nothing committed in %s yet: nothing to load", ledger.store)
                return None
            point = plan_resume(ledger.store, accept=self.accept)
            tag_dir = os.path.dirname(point.url)
            return tag_dir, os.path.basename(tag_dir)
        tag = str(tag)
        if is_ckpt_id(tag) and not os.path.exists(os.path.join(load_dir, tag)):
            rec = _snapshot(ledger).records.get(tag)
            if rec is None:
                raise CheckpointNotFoundError(f"{ledger.store}: no committed checkpoint {tag!r}")
            tag_dir = os.path.dirname(ledger.url_of(rec))
            return tag_dir, os.path.basename(tag_dir)
        return os.path.join(load_dir, tag), tag

    def decide_branch(self, load_dir: str, tag_dir: str) -> Resumed:
        """The branch new checkpoints go on after loading ``tag_dir`` (the same on every rank)."""
        ledger = self.ledger_for(load_dir)
        snap = _snapshot(ledger)
        path, _, step = manifest_of(tag_dir)
        record = inspect(path).record
        choice = branch_after_loading(ledger, record, step=step, snap=snap)
        if choice.parent is None:
            logger.warning(
                "certckpt: %s is not committed in %s; branch %s starts without a parent",
                tag_dir,
                ledger.store,
                choice.branch,
            )
        return Resumed(
            directory=tag_dir,
            step=choice.step,
            parent=choice.parent,
            branch=choice.branch,
            # as the other integrations: only the committed parent's agreed state is a claim to prove
            consensus_fp=record.consensus_fp if choice.parent is not None else None,
        )


def _weights_problem(module: Any, fingerprints: dict[str, str], path: str) -> str | None:
    """Whether the module weights about to be written (the ``module`` of ZeRO-1/2's model states file)
    are the ones every replica agreed on: each tensor's fingerprint equals the consensus one. The
    writer then digests exactly these bytes. Returns the problem, or None."""
    if not isinstance(module, dict):
        return f"{path}: no module state to compare with the weights every replica agreed on"
    names = [n for n in sorted(fingerprints) if isinstance(module.get(n), torch.Tensor)]
    if not names:
        return f"{path}: none of the weights every replica agreed on is in the module state written"
    for name, fp in zip(names, fingerprint_many([module[n].detach() for n in names])):
        want = fingerprints[name]
        if f"{fp:016x}" != want:
            return (
                f"{path}: tensor `module.{name}` has fingerprint {fp:016x}, every replica agreed on {want}; the"
                " weights changed between the consensus and the write: not committed"
            )
    return None


def _ds_version() -> str:
    import deepspeed  # the package is imported already (this module imports from it)

    return str(deepspeed.__version__)


def _certified_load_checkpoint(engine: Any, original: Any, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
    """``engine.load_checkpoint`` with the tag directory verified whole on every rank first."""
    ce: CertifiedCheckpointEngine = engine.checkpoint_engine
    if not isinstance(ce, CertifiedCheckpointEngine):
        raise ConfigurationError(
            "engine.checkpoint_engine was replaced after certify_engine: call certify_engine again"
        )
    if int(engine.zero_optimization_stage()) == 3 and kwargs.get("load_optimizer_states", True) is False:
        raise ConfigurationError(
            "ZeRO-3 with load_optimizer_states=False: DeepSpeed then rebuilds the weights with zero_to_fp32, "
            "which unpickles; load the optimizer states too, or build the model from "
            "certckpt.integrations.deepspeed.export_fp32(...)"
        )
    found = ce._together(lambda: ce.resolve(load_dir, tag), what="checkpoint load")
    if found is None:
        return None, None
    tag_dir, name = found

    def check() -> Resumed:
        require_intact(tag_dir)
        return ce.decide_branch(os.fspath(load_dir), tag_dir)

    resumed: Resumed = ce._together(check, what="checkpoint load")
    result = original(os.path.dirname(tag_dir), tag=name, **kwargs)
    if int(engine.global_steps) != resumed.step:
        logger.warning("certckpt: %s records step %d, the engine reads %d", tag_dir, resumed.step, engine.global_steps)

    def record() -> None:
        if ce._rank() == 0 and resumed.parent is not None:
            ce.ledger_for(os.fspath(load_dir)).start_branch(resumed.branch, parent=resumed.parent)

    ce._together(record, what="checkpoint load")
    ce.branch, ce.parent, ce.last_step, ce.resumed = resumed.branch, resumed.parent, resumed.step, resumed
    ce.known_store = ce.known_store or os.fspath(load_dir)
    if ce.audit is not None:  # an audit built before the load: it goes on from the loaded step
        ce.audit.restart(resumed.step, branch=resumed.branch, resumed=resumed)
        ce.audit.bind(ce.ledger_for(os.fspath(load_dir)), run=ce._run_name(os.fspath(load_dir)))
    if ce._rank() == 0:
        logger.info(
            "certckpt: resumed from %s: new checkpoints go on branch %s", resumed.parent or tag_dir, resumed.branch
        )
    return result


def certify_engine(
    engine: Any,
    *,
    run: str | None = None,
    branch: str = "main",
    ledger: str | None = None,
    accept: str = "verified",
) -> CertifiedCheckpointEngine:
    """Make ``engine.save_checkpoint`` / ``engine.load_checkpoint`` certified (every rank calls it,
    after ``deepspeed.initialize``).

    Args:
        engine: the ``DeepSpeedEngine`` (ZeRO stage 0-3, data parallel only).
        run, branch, ledger, accept: see ``CertifiedCheckpointEngine``.

    Returns:
        The installed checkpoint engine (``engine.checkpoint_engine``).

    Raises:
        ConfigurationError: a set-up whose files DeepSpeed writes outside its checkpoint engine
            (pipeline or tensor parallelism, MoE, NVMe-offloaded optimizer state).

    Example:
        >>> engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        >>> certify_engine(engine)
        >>> engine.save_checkpoint("ckpt", tag=f"step{engine.global_steps}")   # certified, committed
        >>> engine.load_checkpoint("ckpt")                                     # latest-good, verified
    """
    if not isinstance(engine, DeepSpeedEngine):
        raise ConfigurationError(
            f"certify_engine takes the DeepSpeedEngine deepspeed.initialize returns, got {type(engine).__name__} "
            "(Accelerate wraps the model in DDP, not DeepSpeed, when it runs with cpu=True)"
        )
    register_deepspeed_types()
    problems = []
    if int(getattr(engine, "mp_world_size", 1)) > 1:
        problems.append("tensor/model parallelism")
    if type(engine).__name__ == "PipelineEngine":
        problems.append("pipeline parallelism (its layer files are written outside the checkpoint engine)")
    if getattr(engine, "has_moe_layers", False):
        problems.append("MoE layers (expert files are written outside the checkpoint engine)")
    if engine.zero_nvme_offload_optimizer():
        problems.append("NVMe-offloaded optimizer state (copied into the checkpoint with shutil)")
    if problems:
        raise ConfigurationError("certify_engine cannot certify this set-up: " + "; ".join(problems))
    ce = CertifiedCheckpointEngine(engine, run=run, branch=branch, ledger=ledger, accept=accept)
    engine.checkpoint_engine = ce
    original = type(engine).load_checkpoint.__get__(engine)
    engine.load_checkpoint = functools.partial(_certified_load_checkpoint, engine, original)
    if ce._rank() == 0:
        enable_log()
    return ce
