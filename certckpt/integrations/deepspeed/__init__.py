"""Certified checkpoints for DeepSpeed ZeRO 1, 2 and 3 (``pip install 'certckpt[deepspeed]'``).

One line after ``deepspeed.initialize``::

    from certckpt.integrations.deepspeed import certify_engine
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    certify_engine(engine)                                  # every rank
    engine.save_checkpoint("ckpt", tag=f"step{step}")        # unchanged: certified, committed
    engine.load_checkpoint("ckpt")                           # unchanged: latest-good, verified whole

Every file DeepSpeed writes for a tag (each rank's model and optimizer states) is a certified
safetensors file under DeepSpeed's own name, a manifest over all of them is committed to the ledger
in the save directory, and loading verifies the whole tag directory on every rank first; nothing is
pickled or unpickled. ``export_fp32(tag_dir, path)`` writes the consolidated fp32 weights as one
certified safetensors file (what ``zero_to_fp32.py`` does for pickles). ``ZeroAudit`` runs the weight
consensus, a cross-rank replay and a non-finite check where the ZeRO stage allows (1 and 2), writes
their events to the ledger, and its evidence goes into every checkpoint committed: they become
``trusted`` (docs/detection.md, "DeepSpeed"; ZeRO-3's stay ``verified``).

Modules: ``layout`` (the tag directory and its check), ``codecs`` (DeepSpeed's classes, allowed by
name), ``engine`` (the checkpoint engine and ``certify_engine``), ``fp32`` (consolidated weights),
``audit`` (the checks).
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

try:
    import deepspeed  # noqa: F401
except ImportError as e:  # pragma: no cover - the test environment has it where these tests run
    raise MissingDependencyError(
        f"certckpt.integrations.deepspeed needs deepspeed ({e}): pip install 'certckpt[deepspeed]' "
        "(see scripts/install.sh: DS_BUILD_OPS=0, --no-build-isolation after torch)"
    ) from None

from .audit import ZeroAudit
from .engine import CertifiedCheckpointEngine, Resumed, certify_engine
from .fp32 import export_fp32, fp32_state_dict
from .layout import MANIFEST_NAME, DirectoryReport, require_intact, verify_checkpoint

__all__ = [
    "certify_engine",
    "CertifiedCheckpointEngine",
    "Resumed",
    "ZeroAudit",
    "export_fp32",
    "fp32_state_dict",
    "verify_checkpoint",
    "require_intact",
    "DirectoryReport",
    "MANIFEST_NAME",
]
