"""Sharded checkpoints on disk: a directory of per-rank certified shard files and a certified manifest
written last (``docs/format.md``, "Sharded checkpoints (DCP)"). The layout, the manifest, the
sharding-independent fingerprint rule and the checker live here, in the format layer, so that
``certckpt verify DIR``, the certifier (``latest-good``) and the vault check a sharded checkpoint the
way they check a file; ``certckpt.dcp`` writes and reads them through ``torch.distributed.checkpoint``.
Only ``shardfp`` and ``regions`` import torch.
"""
