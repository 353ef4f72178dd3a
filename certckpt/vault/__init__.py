"""Write-once off-node copies of trusted checkpoints, retention policies (pure) and restore drills.
Imports ``certckpt.trust`` and ``certckpt.format``.
"""
