"""Write-once off-node copies of trusted checkpoints, retention policies (pure) and restore drills.
Imports ``certckpt.trust`` and ``certckpt.format``; no torch import (``drill`` imports it when it runs).

A vault is a store at any fsspec URL holding one run's known-good checkpoints. Its ledger mirrors the
run's evidence (commit records, branches, audit events, revocations, incidents, certificates), so the
certifier re-derives every verdict there without the training nodes, and adds a *holding* record per
checkpoint it keeps. A checkpoint exists in the vault once its holding exists, and that is written
only after the copy was read back and verified.

Write-once everywhere: local and mounted file systems get a temp file verified *before* it is
published with ``os.link`` (which fails when the name exists) and a read-only mode; S3 gets
create-only PUTs (``If-None-Match: *``) and, when the bucket has Object Lock, retention on every
object. Deleting is left to ``prune``, which only does what a retention plan says.

A checkpoint of several files (a sharded DCP directory, or a file certifying its companions) is held
as the directory ``<ckpt_id>/``: copied member by member with the manifest or listing file last,
checked whole, deleted manifest first (``bundles``).

The modules: ``site`` (the location and its Object Lock), ``bundles`` (what a checkpoint's files are
and where they are held), ``transfer`` (write-once copies), ``promotion`` (``promote``, ``holdings``),
``pruning``, ``restoration``, ``retention``, ``drill`` (``assemble``: a sharded checkpoint's whole
tensors for the drill, in one process).
The names below are the API; import them from here.
"""

from __future__ import annotations

from .bundles import Bundle, Member, bundle_of
from .drill import STAGES, DrillResult, compare_metrics, drill_restore, load_callable, pick_reference
from .promotion import Promotion, holdings, promote
from .pruning import PruneResult, prune
from .restoration import Restore, restore
from .retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepFor,
    KeepLatest,
    PrunePlan,
    RetentionEntry,
    RetentionPolicy,
    plan_prune,
    protected_checkpoints,
)
from .site import LOCK_MODES, VaultSite, open_vault
from .transfer import copy_bundle, copy_once

__all__ = [
    "LOCK_MODES",
    "STAGES",
    "AnyOf",
    "Bundle",
    "DrillResult",
    "KeepBest",
    "KeepEvery",
    "KeepFor",
    "KeepLatest",
    "Member",
    "Promotion",
    "PrunePlan",
    "PruneResult",
    "Restore",
    "RetentionEntry",
    "RetentionPolicy",
    "VaultSite",
    "bundle_of",
    "compare_metrics",
    "copy_bundle",
    "copy_once",
    "drill_restore",
    "holdings",
    "load_callable",
    "open_vault",
    "pick_reference",
    "plan_prune",
    "promote",
    "protected_checkpoints",
    "prune",
    "restore",
]
