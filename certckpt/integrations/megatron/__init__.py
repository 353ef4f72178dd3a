"""Certified Megatron-Core ``dist_checkpointing`` checkpoints (``pip install 'certckpt[megatron]'``).

Megatron's own calls, with certckpt's strategies::

    from megatron.core import dist_checkpointing
    from certckpt.integrations.megatron import CertifiedLoadStrategy, CertifiedSaveStrategy

    strategy = CertifiedSaveStrategy(ledger="ckpt", step=100)
    dist_checkpointing.save(sharded_sd, "ckpt/iter_100", sharded_strategy=strategy)
    state = dist_checkpointing.load(sharded_sd, "ckpt/iter_100", sharded_strategy=CertifiedLoadStrategy())

The ShardedTensors are written through certckpt's DCP layer (``certckpt.dcp``: certified shards, a
manifest with each global tensor's fingerprint, whatever the TP/DP/PP split), the ShardedObjects and
the common state as certified files beside them, nothing pickled; the checkpoint is committed to the
run store's ledger. Importing this package registers the load strategy under the backend that
``metadata.json`` names, and a common strategy that keeps Megatron's common state off ``common.pt``
(``common``: Megatron offers no other seam for it).

Modules: ``layout`` (the directory and its companion files), ``common`` (the common state),
``strategy`` (the save and load strategies).
"""

from __future__ import annotations

from certckpt.errors import MissingDependencyError

try:
    from megatron.core import dist_checkpointing  # noqa: F401
except ImportError as e:  # pragma: no cover - the test environment has it where these tests run
    raise MissingDependencyError(
        f"certckpt.integrations.megatron needs megatron-core ({e}): pip install 'certckpt[megatron]'"
    ) from None

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy

from .common import register_common_strategies
from .layout import BACKEND, VERSION, ShardedReport, verify_checkpoint
from .strategy import CertifiedLoadStrategy, CertifiedSaveStrategy

__all__ = ["CertifiedSaveStrategy", "CertifiedLoadStrategy", "verify_checkpoint", "ShardedReport", "BACKEND"]

# metadata.json names BACKEND: dist_checkpointing.load(sd, dir) without a strategy then finds this one
register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, CertifiedLoadStrategy())
register_common_strategies()
